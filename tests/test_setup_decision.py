"""The install: whether setup.py builds the CUDA extension (build_decision.py), decided on made-up
toolchains (fake nvcc scripts and header directories; nothing compiles), what a failed build prints last,
what lsmini.backend() says when the extension was not built, and that every third-party module the package
and the examples import is declared in pyproject.toml."""
import ast
import os
import shutil
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import build_decision  # noqa: E402
from build_decision import Toolchain, decide, required_headers  # noqa: E402

from lsmini import _backend  # noqa: E402

RUNTIME = {"cuda_runtime.h": "torch's CUDA headers"}


def fake_nvcc(path, release="13.0"):
    """An executable that answers `--version` as nvcc of CUDA `release` does."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                f"echo 'Cuda compilation tools, release {release}, V{release}.88'\n")
    os.chmod(path, 0o755)
    return str(path)


def fake_toolkit(root, release="13.0", headers=("cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h")):
    """root/bin/nvcc and root/include/<headers>: a CUDA toolkit as the build sees it."""
    fake_nvcc(os.path.join(root, "bin", "nvcc"), release)
    os.makedirs(os.path.join(root, "include"), exist_ok=True)
    for h in headers:
        open(os.path.join(root, "include", h), "w").close()
    return str(root)


def cuda_torch(cuda_home, nvcc_version="13.0", torch_cuda="13.0", include_dirs=None):
    return Toolchain(torch_version="2.11.0+cu130", torch_cuda=torch_cuda, cuda_home=cuda_home,
                     nvcc=os.path.join(cuda_home, "bin", "nvcc"), nvcc_version=nvcc_version,
                     include_dirs=include_dirs if include_dirs is not None else [os.path.join(cuda_home, "include")])


# ---- the decision, step by step -----------------------------------------------------------------------
def test_everything_present_builds(tmp_path):
    home = fake_toolkit(tmp_path / "cuda")
    d = decide({}, cuda_torch(home), required_headers([]))
    assert d.build and "all present" in d.reason


@pytest.mark.parametrize("value, build", [("1", False), ("yes", False), ("0", True), ("", True)])
def test_no_extension_env(tmp_path, value, build):
    home = fake_toolkit(tmp_path / "cuda")
    d = decide({"LSMINI_NO_EXTENSION": value}, cuda_torch(home), RUNTIME)
    assert d.build == build
    if not build:
        assert d.reason == f"LSMINI_NO_EXTENSION={value} is set"


def test_without_torch():
    d = decide({}, Toolchain(nvcc_on_path="/usr/local/bin/nvcc"), RUNTIME)
    assert not d.build and "torch is not installed" in d.reason


def test_cpu_torch_with_nvcc_on_path():
    d = decide({}, Toolchain(torch_version="2.13.0+cpu", nvcc_on_path="/usr/local/bin/nvcc"), RUNTIME)
    assert not d.build and d.reason.startswith("torch 2.13.0+cpu is a CPU build")


def test_cuda_torch_without_toolkit():
    d = decide({}, Toolchain(torch_version="2.11.0+cu130", torch_cuda="13.0"), RUNTIME)
    assert not d.build and "no CUDA toolkit was found" in d.reason


def test_nvcc_that_does_not_run(tmp_path):
    home = str(tmp_path / "cuda")
    tc = cuda_torch(home, nvcc_version=None)
    d = decide({"CUDA_HOME": home}, tc, RUNTIME)
    assert not d.build
    assert f"CUDA_HOME={home} (from $CUDA_HOME) has no working nvcc" in d.reason
    assert os.path.join(home, "bin", "nvcc") + " does not exist" in d.reason


def test_major_versions_must_agree_minor_may_differ(tmp_path):
    home = fake_toolkit(tmp_path / "cuda")
    d = decide({}, cuda_torch(home, nvcc_version="12.8", torch_cuda="13.0"), RUNTIME)
    assert not d.build
    assert "is CUDA 12.8 but torch 2.11.0+cu130 was built with CUDA 13.0: the major versions must agree" in d.reason
    assert decide({}, cuda_torch(home, nvcc_version="13.1", torch_cuda="13.0"), RUNTIME).build


def test_nvcc_wrapper_outside_the_toolkit(tmp_path):
    """The issue's machine: `nvcc` on PATH is a link (or wrapper) in <prefix>/bin, so torch takes
    CUDA_HOME=<prefix>, whose include/ has no CUDA headers. The decision names the header, where it looked,
    where CUDA_HOME came from, and the toolkit that has it."""
    toolkit = fake_toolkit(tmp_path / "cuda-13.0")
    prefix = tmp_path / "local"
    (prefix / "bin").mkdir(parents=True)
    os.symlink(os.path.join(toolkit, "bin", "nvcc"), prefix / "bin" / "nvcc")
    tc = cuda_torch(str(prefix))
    tc.nvcc_on_path = str(prefix / "bin" / "nvcc")
    d = decide({}, tc, RUNTIME)
    assert not d.build
    assert d.reason.startswith(f"the CUDA header cuda_runtime.h (needed by torch's CUDA headers) is not in "
                               f"{prefix}/include")
    assert f"CUDA_HOME={prefix}, taken by torch from the nvcc on PATH" in d.reason
    assert d.reason.endswith(f"set CUDA_HOME={toolkit}, which has it")


def test_header_found_in_another_include_dir(tmp_path):
    home = fake_toolkit(tmp_path / "cuda", headers=())
    extra = tmp_path / "inc"
    extra.mkdir()
    (extra / "cuda_runtime.h").touch()
    assert not decide({}, cuda_torch(home), RUNTIME).build
    assert decide({}, cuda_torch(home, include_dirs=[os.path.join(home, "include"), str(extra)]), RUNTIME).build


def test_library_headers_the_sources_include(tmp_path):
    """cuBLAS headers are needed only once a source includes them (or torch's CUDAContext.h, which does)."""
    home = fake_toolkit(tmp_path / "cuda")
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "ops.cpp").write_text("#include <torch/extension.h>\n#include <cuda_fp16.h>\n#include \"local.h\"\n")
    need = required_headers([str(src / "ops.cpp")], str(tmp_path))
    assert need == {"cuda_runtime.h": "torch's CUDA headers", "cuda_fp16.h": "csrc/ops.cpp"}
    assert decide({}, cuda_torch(home), need).build

    (src / "layer.cpp").write_text("#include <ATen/cuda/CUDAContext.h>\n  #  include <cublasLt.h>\n")
    need = required_headers([str(src / "ops.cpp"), str(src / "layer.cpp")], str(tmp_path))
    assert {"cublas_v2.h", "cublasLt.h", "cusparse.h"} <= set(need) and need["cublasLt.h"] == "csrc/layer.cpp"
    d = decide({}, cuda_torch(home), need)
    assert not d.build and "the CUDA header cublas_v2.h (needed by csrc/layer.cpp)" in d.reason
    # the fix it names depends on whether this machine has a real toolkit elsewhere: either way CUDA_HOME
    assert "set CUDA_HOME" in d.reason


def test_nvcc_release_parsing():
    assert build_decision.nvcc_release("Cuda compilation tools, release 13.0, V13.0.88") == "13.0"
    assert build_decision.nvcc_release("command not found") is None


# ---- looking at the machine (torch's attributes and nvcc faked) ---------------------------------------
def test_find_toolchain_on_a_fake_cuda_machine(tmp_path, monkeypatch):
    import torch
    from torch.utils import cpp_extension

    prefix = tmp_path / "local"
    fake_nvcc(str(prefix / "bin" / "nvcc"), "13.0")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(prefix))
    monkeypatch.setattr(build_decision, "_SYSTEM_INCLUDE_DIRS", ())
    tc = build_decision.find_toolchain({"CPATH": str(tmp_path / "cpath")})
    assert tc.torch_cuda == "13.0" and tc.cuda_home == str(prefix) and tc.nvcc_version == "13.0"
    assert tc.include_dirs == [str(prefix / "include"), str(tmp_path / "cpath")]
    assert "cuda_runtime.h" in decide({}, tc, RUNTIME).reason
    (tmp_path / "cpath").mkdir()
    (tmp_path / "cpath" / "cuda_runtime.h").touch()
    assert decide({}, tc, RUNTIME).build

    empty = tmp_path / "empty"  # a CUDA_HOME without bin/nvcc
    empty.mkdir()
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(empty))
    reason = decide({"CUDA_HOME": str(empty)}, build_decision.find_toolchain({}), RUNTIME).reason
    assert f"CUDA_HOME={empty} (from $CUDA_HOME) has no working nvcc: running `{empty}/bin/nvcc --version` " \
           "failed" in reason

    monkeypatch.setattr(torch.version, "cuda", None)
    tc = build_decision.find_toolchain({})
    assert tc.torch_cuda is None and "CPU build" in decide({}, tc, RUNTIME).reason


def test_broken_nvcc_is_reported(tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'cannot find the CUDA runtime' >&2\nexit 3\n")
    nvcc.chmod(0o755)
    version, error = build_decision.run_nvcc_version(str(nvcc))
    assert version is None and "exited with 3" in error and "cannot find the CUDA runtime" in error


# ---- a build that fails anyway ------------------------------------------------------------------------
def test_failed_build_ends_with_the_reason_and_how_to_skip():
    seen = []

    class Compiles:
        def run(self):
            raise RuntimeError("Error compiling objects for extension")

    cmd = build_decision.explaining_failures(Compiles, seen.append)()
    with pytest.raises(SystemExit) as e:
        cmd.run()
    message = str(e.value)
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError)
    assert message.startswith("lsmini: building the CUDA extension lsmini._C failed (RuntimeError: Error compiling")
    assert "LSMINI_NO_EXTENSION=1 pip install --no-build-isolation -e ." in message and "\n" not in message

    class Fine:
        def run(self):
            seen.append("built")

    build_decision.explaining_failures(Fine, seen.append)().run()
    assert seen[-1] == "built"


def test_setup_records_its_decision(tmp_path):
    """setup.py run in a copy of the project writes lsmini/_build_info.py and prints the reason."""
    for name in ("setup.py", "build_decision.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "lsmini").mkdir()
    (tmp_path / "lsmini" / "__init__.py").touch()
    env = dict(os.environ, LSMINI_NO_EXTENSION="1")
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert ("lsmini: not building the CUDA extension (LSMINI_NO_EXTENSION=1 is set); the reference (PyTorch) path "
            "will be used") in out.stderr
    info = {}
    exec((tmp_path / "lsmini" / "_build_info.py").read_text(), info)
    assert info["EXTENSION"] is False and info["REASON"] == "LSMINI_NO_EXTENSION=1 is set"


# ---- what lsmini.backend() says -----------------------------------------------------------------------
def test_backend_reason_repeats_the_install_decision(monkeypatch):
    info = types.SimpleNamespace(EXTENSION=False, REASON="torch 2.13.0+cpu is a CPU build")
    assert _backend.not_built_reason(info) == "not built: torch 2.13.0+cpu is a CPU build"
    info = types.SimpleNamespace(EXTENSION=True, REASON="everything present")
    assert "missing although the install set out to build it (everything present)" in _backend.not_built_reason(info)
    assert "never installed" in _backend.not_built_reason(None)
    if _backend.ext_or_none() is None and _backend._build_info is not None:  # this install, without _C
        import lsmini

        monkeypatch.setattr(lsmini.config, "reference", False)
        assert _backend._build_info.REASON in lsmini.backend().reason


# ---- dependencies -------------------------------------------------------------------------------------
# import name -> distribution name, where they differ
DISTRIBUTIONS = {}
LOCAL = {"lsmini", "training", "builtin_data", "train_lm", "train_translation"}


def third_party_imports():
    """{top-level module: a file importing it} over lsmini/ and examples/, stdlib and local modules left out."""
    found = {}
    for top in ("lsmini", "examples"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        mods = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        mods = [node.module]
                    else:
                        continue
                    for m in mods:
                        top_name = m.split(".")[0]
                        if top_name not in sys.stdlib_module_names and top_name not in LOCAL:
                            found.setdefault(top_name, os.path.relpath(path, ROOT))
    return found


def test_every_runtime_import_is_declared():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]

    def names(requirements):
        return {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
                for r in requirements}

    declared = names(project["dependencies"])
    optional = set().union(*(names(v) for v in project["optional-dependencies"].values()))
    imports = third_party_imports()
    # torch is the one deliberate exception: the user picks its build (CPU or CUDA) before installing lsmini
    assert "torch" in imports
    del imports["torch"]
    assert "numpy" in imports  # the examples' token arrays
    for module, path in imports.items():
        dist = DISTRIBUTIONS.get(module, module).lower()
        assert dist in declared or dist in optional, f"{path} imports {module}, which pyproject.toml does not declare"
    assert "sacrebleu" in optional and "sacrebleu" not in declared  # BLEU is optional: the run says so without it
