"""A/B and debugging switches: each chooses between equivalent kernels of one op, for the tests and
benchmarks that compare them. They are context managers only: the previous choice comes back when the block
ends, so nothing set here outlives the code that asked for it. User-facing settings are in ``lsmini.config``.

- ``sm90_attention(enabled)``: fused attention on Hopper runs its sm_90a kernels (True, the default) or the
  sm_80 kernels (False). The same math, masks and dropout bits; rounding may differ.
- ``adam_bulk(enabled)``: FusedAdam's step on Hopper moves its buffers with bulk asynchronous copies (True,
  the default) or through registers (False). Bit-identical results.

A switch is read when a kernel launches; a CUDA graph keeps the kernels it captured. Without the extension
(nothing but references runs) the switches do nothing.
"""
import contextlib

from lsmini import _backend


@contextlib.contextmanager
def _switch(setter_name, enabled):
    ext = _backend.ext_or_none()
    if ext is None:
        yield
        return
    setter = getattr(ext, setter_name)
    previous = setter(bool(enabled))
    try:
        yield
    finally:
        setter(previous)


def sm90_attention(enabled):
    """Within the block, fused attention uses the Hopper kernels where available (True) or the sm_80 kernels
    everywhere (False)."""
    return _switch("set_attention_sm90", enabled)


def adam_bulk(enabled):
    """Within the block, FusedAdam's kernel uses bulk asynchronous copies where available (True) or not."""
    return _switch("set_adam_bulk", enabled)
