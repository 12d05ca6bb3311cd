"""Build lsmini.

Builds the extension ``lsmini._C`` from csrc/ (ninja, honours MAX_JOBS) only when a CUDA build of torch,
its nvcc and the CUDA headers are all present and agree (build_decision.py says exactly what is checked).
Otherwise installs the pure-Python package, whose ops run their PyTorch references. Either way the decision
and its reason are written to lsmini/_build_info.py, which ``lsmini.backend().reason`` reports: pip hides
what this script prints unless it is run with -v.

When the checks pass but compiling fails anyway, the install fails (whoever has a CUDA toolchain wants the
kernels, not a silent fallback); the last line of the output says so and how to install without them
(LSMINI_NO_EXTENSION=1).

Environment knobs:
  LSMINI_CUDA_ARCHS   semicolon/comma separated compute capabilities, default "80;90a" (90a: Hopper's
                      architecture-specific code, which the attention kernels' wgmma path needs; it runs on
                      compute capability 9.0 devices only, as sm_90 code would)
  LSMINI_NO_EXTENSION=1  skip the extension even where it could be built
"""
import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)  # build_decision.py, next to this file (not part of the installed package)

from build_decision import SOURCE_SUFFIXES, decide, explaining_failures, find_toolchain, required_headers  # noqa: E402

BUILD_INFO = os.path.join(ROOT, "lsmini", "_build_info.py")


def write_build_info(extension, reason):
    """Record the build decision where lsmini._backend finds it at run time."""
    with open(BUILD_INFO, "w", encoding="utf-8") as f:
        f.write("# Written by setup.py at install time (not tracked by git): whether it built the CUDA extension\n"
                "# lsmini._C, and why. lsmini.backend().reason reports it.\n")
        f.write(f"EXTENSION = {extension!r}\nREASON = {reason!r}\n")


def sources():
    # csrc/layers/ holds the one-call encoder/decoder layers; it may not exist yet in every checkout
    return (sorted(glob.glob("csrc/bindings/*.cpp")) + sorted(glob.glob("csrc/kernels/*.cu"))
            + sorted(glob.glob("csrc/layers/*.cpp")))


def extension_and_build_ext():
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    archs = os.environ.get("LSMINI_CUDA_ARCHS", "80;90a").replace(",", ";").split(";")
    archs = [a for a in (x.strip().replace(".", "") for x in archs) if a]
    gencode = [flag for a in archs for flag in ("-gencode", f"arch=compute_{a},code=sm_{a}")]
    if "90a" in archs:  # the Hopper attention kernels (wgmma) exist in this build: the launchers may pick them
        gencode.append("-DLSMINI_SM90A")
    ext = CUDAExtension(
        name="lsmini._C",
        sources=sources(),
        include_dirs=[os.path.join(ROOT, "csrc", d) for d in ("kernels", "bindings", "layers")],
        # Kernels are plain CUDA C++17. The bindings include torch headers, so they take the language
        # standard torch's own build uses (torch.utils.cpp_extension adds it): mixing standards across
        # torch's inline code is an ODR hazard.
        extra_compile_args={
            "cxx": ["-O3"],
            "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"] + gencode,
        },
    )

    def record_failure(error):
        write_build_info(False, f"compiling lsmini._C failed at install time ({type(error).__name__}: {error})")

    return ext, explaining_failures(BuildExtension.with_options(use_ninja=True), record_failure)


def header_scan_files():
    files = []
    for d in ("bindings", "kernels", "layers"):
        files += sorted(f for f in glob.glob(os.path.join(ROOT, "csrc", d, "*")) if f.endswith(SOURCE_SUFFIXES))
    return files


decision = decide(os.environ, find_toolchain(), required_headers(header_scan_files(), ROOT))
write_build_info(decision.build, decision.reason)
if decision.build:
    print(f"lsmini: building the CUDA extension lsmini._C: {decision.reason}", file=sys.stderr)
    ext, build_ext = extension_and_build_ext()
    ext_modules, cmdclass = [ext], {"build_ext": build_ext}
else:
    print(f"lsmini: not building the CUDA extension ({decision.reason}); the reference (PyTorch) path will be used. "
          "`python -c \"import lsmini; print(lsmini.backend().reason)\"` repeats this after the install.",
          file=sys.stderr)
    ext_modules, cmdclass = [], {}

setup(
    packages=find_packages(include=["lsmini", "lsmini.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
