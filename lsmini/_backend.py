"""Which implementation lsmini's ops run: the compiled CUDA kernels or their PyTorch references.

The extension ``lsmini._C`` is built at install time where a CUDA build of torch, its nvcc and the CUDA
headers exist (``pip install --no-build-isolation -e .``); setup.py records why it did or did not build
it in the generated ``lsmini/_build_info.py``, which ``backend().reason`` reports. Each op is registered
once as a PyTorch operator (``torch.ops.lsmini.<op>``) whose CUDA implementation calls the extension's
kernels and whose CPU implementation is the op's pure-PyTorch reference; ``has_op_impl`` says whether the
operators have an implementation for a device. Without the extension, CUDA tensors run the references
directly. ``lsmini.config.reference`` makes every op call its reference directly, even when the kernels
are there (``force_reference``).
"""
import importlib.util
import warnings

import torch

from lsmini.config import config

try:  # what setup.py decided at install time, and why (generated; absent in a checkout never installed)
    from lsmini import _build_info
except ImportError:
    _build_info = None


def not_built_reason(build_info):
    """Why lsmini._C is absent, from the install's record `build_info` (a module with EXTENSION and
    REASON, or None when there is none)."""
    if build_info is None:
        return ("not built (lsmini/_build_info.py, which the install writes, is missing: this tree was never "
                "installed)")
    if build_info.EXTENSION:
        return f"missing although the install set out to build it ({build_info.REASON}); reinstall to rebuild it"
    return f"not built: {build_info.REASON}"


if importlib.util.find_spec("lsmini._C") is None:  # the pure-Python install
    _C, _IMPORT_ERROR = None, not_built_reason(_build_info)
else:
    try:
        from lsmini import _C
        _IMPORT_ERROR = None
    except ImportError as e:  # built, but does not load (e.g. built against another torch)
        _C, _IMPORT_ERROR = None, f"it does not load: {e}"

BUILD_HINT = "build it with `pip install --no-build-isolation -e .` on a machine with nvcc and a CUDA build of torch"


class Backend(str):
    """``"cuda"`` or ``"reference"``; ``.reason`` says why."""

    def __new__(cls, name, reason):
        obj = super().__new__(cls, name)
        obj.reason = reason
        return obj

    def __repr__(self):
        return f"Backend({str(self)!r}, reason={self.reason!r})"


def force_reference():
    """True when ``lsmini.config.reference`` asks every op to call its pure-PyTorch reference directly (to
    compare against it, or to debug) instead of its registered operator or kernels."""
    return config.reference


def backend():
    """Report the active backend and why: ``lsmini.backend() == "cuda"``, ``lsmini.backend().reason``."""
    if force_reference():
        return Backend("reference", "lsmini.config.reference is set")
    if _C is None:
        return Backend("reference", f"the CUDA extension lsmini._C is {_IMPORT_ERROR}; {BUILD_HINT}")
    if not torch.cuda.is_available():
        return Backend("reference", "lsmini._C is built but no CUDA device is available")
    return Backend("cuda", "lsmini._C is built and a CUDA device is available")


_warned_missing = False


def use_kernels(*tensors):
    """True when a layer's primitives should run their CUDA kernels: the extension is there, the reference
    path is not forced, and every given tensor (None ignored) lives on a CUDA device. (The ops decide with
    ``force_reference`` and ``has_op_impl``.)"""
    if not all(t is None or t.is_cuda for t in tensors):
        return False
    if force_reference():
        return False
    if _C is None:
        _warn_missing()
        return False
    return True


def has_op_impl(device):
    """True when the registered operators ``torch.ops.lsmini.<op>`` have an implementation for tensors on
    ``device``: CPU always (the references), CUDA when the extension is built and loads (the kernels).
    Without it, a CUDA call warns once and the op runs its reference instead."""
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    if _C is None:
        _warn_missing()
        return False
    return True


def _warn_missing():
    global _warned_missing
    if not _warned_missing and not torch.compiler.is_compiling():  # a warning would break the compiled graph
        _warned_missing = True
        warnings.warn(f"lsmini: CUDA tensors but the CUDA extension lsmini._C is {_IMPORT_ERROR}; using the "
                      f"PyTorch reference path; {BUILD_HINT}")


def ext():
    """The compiled extension module; raises a clear error when it is missing."""
    if _C is None:
        raise RuntimeError(f"lsmini: the CUDA extension lsmini._C is {_IMPORT_ERROR}; {BUILD_HINT}")
    return _C


def ext_or_none():
    """The compiled extension module when it is built and loads, else None (no error, no warning)."""
    return _C


# The rng of a dropout call with p == 0: nothing is drawn and the kernels read none of it.
NO_RNG = (0, 0, 0, 0)


def philox_seed_offset(device=None):
    """The Philox state ``rng`` of one fused dropout call, from torch's CUDA generator of ``device`` (a
    torch.device; None or no index: the current device), as the dropout bindings take it: ``(seed,
    offset, seed_ptr, offset_ptr)``.

    Eager: ``(seed, offset, 0, 0)``, so ``torch.manual_seed`` reproduces every mask. While a CUDA graph
    is being captured: ``(0, offset within the graph, seed_ptr, offset_ptr)``, the device addresses of
    the words torch's generator refills before each replay; the kernels read them at run time, so every
    replay draws fresh masks (graph-safe). Ops with ``p == 0`` pass ``NO_RNG`` and draw nothing.
    """
    index = None if device is None else device.index
    return ext().philox_seed_offset(-1 if index is None else index)


def dropout_rng(p, device):
    """``rng`` for one fused dropout call with probability p on a CUDA device: drawn from that device's
    generator (``philox_seed_offset``) when p > 0, else ``NO_RNG`` without drawing. The extension selects
    the device itself: ``with torch.cuda.device(...)`` would cost 3–4 µs of Python per call, more than the
    draw itself (``benchmarks/bench_host.py`` times ``dropout_rng``)."""
    return philox_seed_offset(device) if p > 0 else NO_RNG


def dropout_state(rngs, device):
    """The Philox states ``rngs`` (``philox_seed_offset`` tuples, ``NO_RNG`` allowed) as an int64 tensor
    [len(rngs), 2] on the CUDA device: each row the resolved (seed, offset), written by one kernel, so it
    holds the right values even in a replay of a captured CUDA graph. For torch.compile's custom operators,
    whose forward hands the state to its backward as a tensor; ``rng_in`` reads it back."""
    out = torch.empty(len(rngs), 2, dtype=torch.int64, device=device)
    ext().philox_state_fwd(list(rngs), out)
    return out


def rng_in(state, i=0):
    """The rng tuple that makes a kernel read row i of a ``dropout_state`` tensor: the same masks as the
    tuple the row was written from. ``state`` must stay alive until the kernel has run."""
    ptr = state.data_ptr() + 16 * i
    return (0, 0, ptr, ptr + 8)
