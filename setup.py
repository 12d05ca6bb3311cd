"""Build lsmini.

With a CUDA build of torch and nvcc present, builds the extension ``lsmini._C`` from csrc/ (ninja,
honours MAX_JOBS). Otherwise installs the pure-Python package, whose ops run their PyTorch references.

Environment knobs:
  LSMINI_CUDA_ARCHS   semicolon/comma separated compute capabilities, default "80;90"
  LSMINI_NO_EXTENSION=1  skip the extension even where it could be built
"""
import glob
import os
import sys

from setuptools import find_packages, setup


def _extension_or_reason():
    if os.environ.get("LSMINI_NO_EXTENSION", "0") not in ("", "0"):
        return None, "LSMINI_NO_EXTENSION is set"
    try:
        import torch
    except ImportError:
        return None, "torch is not installed (install torch first, then lsmini)"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU build"
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    if CUDA_HOME is None:
        return None, "no CUDA toolkit (nvcc) was found"
    archs = os.environ.get("LSMINI_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
    gencode = []
    for a in filter(None, (x.strip().replace(".", "") for x in archs)):
        gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    root = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(glob.glob("csrc/bindings/*.cpp")) + sorted(glob.glob("csrc/kernels/*.cu"))
    ext = CUDAExtension(
        name="lsmini._C",
        sources=sources,
        include_dirs=[os.path.join(root, "csrc", "kernels"), os.path.join(root, "csrc", "bindings")],
        # Kernels are plain CUDA C++17. The bindings include torch headers, so they take the language
        # standard torch's own build uses (torch.utils.cpp_extension adds it): mixing standards across
        # torch's inline code is an ODR hazard.
        extra_compile_args={
            "cxx": ["-O3"],
            "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"] + gencode,
        },
    )
    return (ext, BuildExtension.with_options(use_ninja=True)), None


built, reason = _extension_or_reason()
if built is None:
    print(f"lsmini: not building the CUDA extension ({reason}); the reference (PyTorch) path will be used.",
          file=sys.stderr)

setup(
    packages=find_packages(include=["lsmini", "lsmini.*"]),
    ext_modules=[built[0]] if built else [],
    cmdclass={"build_ext": built[1]} if built else {},
)
