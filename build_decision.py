"""Whether ``pip install`` builds the CUDA extension ``lsmini._C``: decided before anything compiles.

A build that starts and then dies after minutes of compiling helps nobody, so setup.py first checks that
every part the build needs is there and agrees with the others:

1. LSMINI_NO_EXTENSION is not set;
2. torch is installed and is a CUDA build (``torch.version.cuda``);
3. there is a CUDA toolkit where torch's build looks for it (``torch.utils.cpp_extension.CUDA_HOME``:
   $CUDA_HOME or $CUDA_PATH, else the parent of the directory of the ``nvcc`` on PATH, else /usr/local/cuda);
4. the nvcc torch's build runs ($PYTORCH_NVCC, else CUDA_HOME/bin/nvcc) runs and reports a version;
5. that nvcc has the CUDA major version torch was built with. The minor version may differ (CUDA's
   minor-version compatibility; torch's build only warns), the major may not (torch's build refuses it);
6. the CUDA headers the sources include (cuda_runtime.h always; cuBLAS/cuSPARSE ones where a source uses
   them or torch's CUDAContext.h) are in the directories the compiler searches: CUDA_HOME/include,
   $CUDA_INC_PATH, $CPATH, $CPLUS_INCLUDE_PATH and the system ones. An ``nvcc`` wrapper script in
   /usr/local/bin makes torch take CUDA_HOME=/usr/local, where the headers are not: this check catches it.

The first that fails is the reason the package installs without the extension (pure-Python ops); setup.py
prints it and records it in lsmini/_build_info.py, where ``lsmini.backend().reason`` reads it (pip hides
the build's output). ``find_toolchain`` looks at the machine; ``decide`` is pure given what it found (and
the file system), so tests can run it on made-up toolchains.
"""
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import List, Optional

# torch headers that include CUDA library headers of their own: a source including one needs those too
TORCH_HEADER_NEEDS = {
    "ATen/cuda/CUDAContext.h": ("cublas_v2.h", "cublasLt.h", "cusparse.h"),
    "ATen/cuda/CUDAContextLight.h": ("cublas_v2.h", "cublasLt.h", "cusparse.h"),
}
# every CUDA toolkit header is named cu*.h (cuda_runtime.h, cuda_fp16.h, cublasLt.h, curand.h, ...)
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)
_TOOLKIT_HEADER = re.compile(r"^cu[A-Za-z0-9_]*\.h$")
_SYSTEM_INCLUDE_DIRS = ("/usr/local/include", "/usr/include")
SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")


@dataclasses.dataclass
class Toolchain:
    """What the extension's build would use, as found on this machine (None: not there)."""
    torch_version: Optional[str] = None  # None: torch does not import
    torch_cuda: Optional[str] = None  # torch.version.cuda; None for a CPU build of torch
    cuda_home: Optional[str] = None  # torch.utils.cpp_extension.CUDA_HOME
    nvcc: Optional[str] = None  # the nvcc torch's build runs
    nvcc_version: Optional[str] = None  # "13.0", from `nvcc --version`; None when it does not run
    nvcc_error: Optional[str] = None  # why nvcc_version is None
    include_dirs: List[str] = dataclasses.field(default_factory=list)  # where the compiler looks for CUDA headers
    nvcc_on_path: Optional[str] = None  # shutil.which("nvcc"), for the messages


@dataclasses.dataclass
class Decision:
    build: bool
    reason: str  # why (not) — one sentence a user can act on


def required_headers(source_files, root=None):
    """{CUDA toolkit header: the first file that needs it (relative to root)}, from the #include lines of
    source_files (and the torch headers in TORCH_HEADER_NEEDS); cuda_runtime.h is always needed (torch's
    CUDA headers)."""
    need = {"cuda_runtime.h": "torch's CUDA headers"}
    for path in source_files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        for name in _INCLUDE.findall(text):
            for header in TORCH_HEADER_NEEDS.get(name, (name,) if _TOOLKIT_HEADER.match(name) else ()):
                need.setdefault(header, os.path.relpath(path, root) if root else path)
    return need


def nvcc_release(output):
    """"13.0" from the text `nvcc --version` prints, else None."""
    m = re.search(r"release (\d+)\.(\d+)", output)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def run_nvcc_version(nvcc):
    """(version, error): nvcc's "X.Y", or None and why it could not be read. nvcc may be a command line
    ($PYTORCH_NVCC="ccache nvcc")."""
    try:
        out = subprocess.run(shlex.split(nvcc) + ["--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"running `{nvcc} --version` failed: {e}"
    version = nvcc_release(out.stdout + out.stderr)
    if out.returncode != 0 or version is None:
        tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or ["no output"]
        return None, f"`{nvcc} --version` exited with {out.returncode} and no CUDA release ({tail[0]})"
    return version, None


def cuda_include_dirs(cuda_home, environ):
    """The directories a compile of the extension searches for CUDA headers: those torch's build passes
    (CUDA_HOME/include, $CUDA_INC_PATH), the compiler's environment ($CPATH, $CPLUS_INCLUDE_PATH) and its
    system directories."""
    dirs = []
    if cuda_home:
        dirs.append(os.path.join(cuda_home, "include"))
    for var in ("CUDA_INC_PATH", "CPATH", "CPLUS_INCLUDE_PATH"):
        dirs += [d for d in environ.get(var, "").split(os.pathsep) if d]
    dirs += _SYSTEM_INCLUDE_DIRS
    return list(dict.fromkeys(dirs))


def find_toolchain(environ=None):
    """Look at this machine: torch, its CUDA_HOME, the nvcc its build would run, the include directories."""
    environ = os.environ if environ is None else environ
    tc = Toolchain(nvcc_on_path=shutil.which("nvcc"))
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return tc
    tc.torch_version = torch.__version__
    tc.torch_cuda = torch.version.cuda
    if tc.torch_cuda is None:
        return tc
    tc.cuda_home = cpp_extension.CUDA_HOME
    if tc.cuda_home:
        tc.nvcc = environ.get("PYTORCH_NVCC") or os.path.join(tc.cuda_home, "bin", "nvcc")
        tc.nvcc_version, tc.nvcc_error = run_nvcc_version(tc.nvcc)
    tc.include_dirs = cuda_include_dirs(tc.cuda_home, environ)
    return tc


def _toolkit_root_with(header, nvcc_on_path):
    """A directory that looks like the CUDA toolkit's root and has include/<header>: where nvcc really lives
    (through links), or /usr/local/cuda. None when neither has it."""
    candidates = []
    if nvcc_on_path:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc_on_path))))
    candidates.append("/usr/local/cuda")
    for root in candidates:
        if os.path.isfile(os.path.join(root, "include", header)):
            return root
    return None


def _where_cuda_home_came_from(tc, environ):
    if environ.get("CUDA_HOME"):
        return "from $CUDA_HOME"
    if environ.get("CUDA_PATH"):
        return "from $CUDA_PATH"
    if tc.nvcc_on_path and os.path.dirname(os.path.dirname(tc.nvcc_on_path)) == tc.cuda_home:
        return f"taken by torch from the nvcc on PATH, {tc.nvcc_on_path}"
    return "torch's default"


def decide(environ, tc, headers):
    """The Decision for toolchain tc (a Toolchain), given the environment variables `environ` and the CUDA
    headers the sources need (`required_headers`)."""
    skip = environ.get("LSMINI_NO_EXTENSION", "")
    if skip not in ("", "0"):
        return Decision(False, f"LSMINI_NO_EXTENSION={skip} is set")
    if tc.torch_version is None:
        return Decision(False, "torch is not installed when lsmini is built (install torch first, then lsmini with "
                               "--no-build-isolation)")
    if tc.torch_cuda is None:
        return Decision(False, f"torch {tc.torch_version} is a CPU build (torch.version.cuda is None); the kernels "
                               "need a CUDA build of torch")
    if not tc.cuda_home:
        return Decision(False, f"torch {tc.torch_version} is a CUDA {tc.torch_cuda} build but no CUDA toolkit was "
                               "found (no nvcc on PATH, CUDA_HOME unset, no /usr/local/cuda)")
    origin = _where_cuda_home_came_from(tc, environ)
    if tc.nvcc_version is None:
        why = tc.nvcc_error or f"{tc.nvcc} does not exist"
        return Decision(False, f"the CUDA toolkit at CUDA_HOME={tc.cuda_home} ({origin}) has no working nvcc: "
                               f"{why}; set CUDA_HOME to the toolkit's root")
    torch_major, nvcc_major = tc.torch_cuda.split(".")[0], tc.nvcc_version.split(".")[0]
    if torch_major != nvcc_major:
        return Decision(False, f"nvcc {tc.nvcc} is CUDA {tc.nvcc_version} but torch {tc.torch_version} was built "
                               f"with CUDA {tc.torch_cuda}: the major versions must agree (install the torch build "
                               f"for CUDA {nvcc_major}, or point CUDA_HOME at a CUDA {torch_major} toolkit)")
    for header, needed_by in headers.items():
        if not any(os.path.isfile(os.path.join(d, header)) for d in tc.include_dirs):
            dirs = ", ".join(tc.include_dirs)
            root = _toolkit_root_with(header, tc.nvcc_on_path)
            fix = (f"set CUDA_HOME={root}, which has it" if root and root != tc.cuda_home
                   else "install the CUDA toolkit's development headers or set CUDA_HOME to a toolkit that has them")
            return Decision(False, f"the CUDA header {header} (needed by {needed_by}) is not in {dirs} "
                                   f"(CUDA_HOME={tc.cuda_home}, {origin}); {fix}")
    return Decision(True, f"torch {tc.torch_version} (CUDA {tc.torch_cuda}), nvcc {tc.nvcc} (CUDA {tc.nvcc_version}) "
                          f"and the CUDA headers in {tc.cuda_home}/include are all present")


SKIP_HINT = ("To install lsmini without the CUDA extension (every op then runs its PyTorch reference), set "
             "LSMINI_NO_EXTENSION=1: LSMINI_NO_EXTENSION=1 pip install --no-build-isolation -e .")


def failure_message(error):
    """The last line of a failed extension build: what failed and how to install without the extension."""
    return (f"lsmini: building the CUDA extension lsmini._C failed ({type(error).__name__}: {error}; the compiler's "
            f"messages are above). {SKIP_HINT}")


def explaining_failures(build_ext_class, on_failure):
    """A subclass of the setuptools command build_ext_class whose failures end the build with
    failure_message as its last line (after on_failure(error) ran): SystemExit(str) prints just the
    message, where a traceback would bury it under pip's output."""

    class BuildExtOrExplain(build_ext_class):
        def run(self):
            try:
                super().run()
            except Exception as e:  # compiler errors, torch's own version checks, ...
                on_failure(e)
                sys.stdout.flush()
                sys.stderr.flush()
                raise SystemExit(failure_message(e)) from None

    return BuildExtOrExplain
