"""lsmini's user-facing settings, all in one place.

    lsmini.config.reference = True                 # from now on
    with lsmini.config.override(reference=True):   # within the block only
        ...

Settings:
- ``reference`` (bool, default False): every op, layer and FusedAdam step runs its pure-PyTorch reference
  instead of the CUDA kernels, to compare against it or to debug. Its starting value comes from the
  environment variable ``LSMINI_FORCE_REFERENCE`` (set and not "0": True), read once when lsmini is
  imported, so that a whole run can be switched without editing it.
- ``attention_dropout_bits`` ("auto", "always" or "never", default "auto"): where fused attention with
  dropout (``lsmini.ops.attention``) stores its forward's dropout mask, one bit per score, for the backward
  to read instead of drawing it again. "auto": where the bits take no more memory than q (k_len ≤
  16·head_dim, the usual training lengths); "always" (long sequences with memory to spare); "never"
  (saves that memory at short ones). The bits are the same either way, so results do not change; fwd+bwd
  is 1.03–1.13× faster where they are kept. The layers (``lsmini.layers``) keep them by the "auto" rule.

A setting is read when a call runs (a CUDA graph keeps what it captured; ``torch.compile`` recompiles when
one it read has changed). The settings are process-wide: ``override`` restores the previous values on
leaving the block, also on an exception. Unknown names and bad values raise.

A/B and debugging switches that choose between equivalent kernels live apart, in ``lsmini._debug``.
"""
import contextlib
import os

DROPOUT_BITS_POLICIES = ("auto", "always", "never")


def _check_reference(value):
    if not isinstance(value, bool):
        raise TypeError(f"lsmini.config.reference must be True or False, got {value!r}")


def _check_dropout_bits(value):
    if value not in DROPOUT_BITS_POLICIES:
        raise ValueError(f"lsmini.config.attention_dropout_bits must be one of {DROPOUT_BITS_POLICIES}, "
                         f"got {value!r}")


_CHECKS = {"reference": _check_reference, "attention_dropout_bits": _check_dropout_bits}


def _check(name, value):
    check = _CHECKS.get(name)
    if check is None:
        raise AttributeError(f"lsmini.config has no setting {name!r}; the settings are {sorted(_CHECKS)}")
    check(value)


class Config:
    """The settings (see the module docstring); ``lsmini.config`` is the one instance."""

    def __init__(self):
        object.__setattr__(self, "reference", os.environ.get("LSMINI_FORCE_REFERENCE", "0") not in ("", "0"))
        object.__setattr__(self, "attention_dropout_bits", "auto")

    def __setattr__(self, name, value):
        _check(name, value)
        object.__setattr__(self, name, value)

    @contextlib.contextmanager
    def override(self, **settings):
        """Within the block, the given settings have the given values; the previous ones come back after."""
        for name, value in settings.items():
            _check(name, value)
        previous = {name: getattr(self, name) for name in settings}
        for name, value in settings.items():
            object.__setattr__(self, name, value)
        try:
            yield self
        finally:
            for name, value in previous.items():
                object.__setattr__(self, name, value)

    def __repr__(self):
        return "lsmini.config(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in _CHECKS) + ")"


config = Config()
