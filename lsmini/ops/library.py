"""What the ops' PyTorch operators (``torch.ops.lsmini.<op>``) share.

Each op is registered once as a custom operator ``lsmini::<op>`` (and ``lsmini::<op>_backward`` where its
backward is an operator of its own), which eager and compiled code alike call:
- the CUDA implementation calls the extension's bindings (``_backend.ext()``);
- the CPU implementation computes the same outputs from the op's pure-PyTorch reference ``<op>_ref``, and
  a backward operator's from the reference's gradients by autograd (``reference_grads``);
- a fake implementation gives the exact shapes, dtypes and strides of the outputs, for tracing;
- ``register_autograd`` on the forward operator saves only what the backward needs.

A custom operator is a pure function of its inputs, which shapes them:
- Outputs are fresh tensors, never an input nor another output (opcheck checks it): where a binding
  would hand back an input, or one tensor twice, the operator returns something else or nothing there,
  as its docstring says. The operators that write into an input declare it (``mutates_args``):
  ``lsmini::cross_entropy_backward_`` (the in-place backward ``cross_entropy`` offers) returns nothing;
  ``lsmini::embedding_backward`` adds the token-table gradient into a given ``.grad`` (``grad_into``).
- An operator cannot return None: outputs that exist only for some inputs (a bias gradient when there
  is a bias) come back as a ``list[Tensor]`` holding just the present ones, in a documented order
  (``optional_outputs`` reads them back), except from an operator with a mutable argument, which returns
  plain tensors, empty where absent (torch.compile cannot functionalize one that returns a list).
- Dropout: a forward that draws a dropout mask returns what its backward needs to apply that mask again,
  the dropout state. On CUDA it is the call's Philox state as an int64 tensor [1, 2]
  (``draw_dropout_state``); the backward hands the kernels ``state_rng(state, p)``, which makes them read
  the state on the device, so they regenerate the forward's mask — inside a CUDA-graph replay too. On
  CPU it is the reference's bool keep-mask, drawn from torch's CPU generator (``draw_keep_mask``; empty
  when p == 0). ``fake_dropout_state`` gives either by the tensors' device. Such forwards carry
  ``RANDOM_TAGS``, so the compiler neither merges two calls nor recomputes one in the backward (which
  would draw a new mask).
"""
import torch

from lsmini import _backend
from lsmini.ops.dropout import keep_mask

# Tags of a forward operator that draws a dropout mask.
RANDOM_TAGS = (torch.Tag.nondeterministic_seeded,)

# The library the Python-defined operators of the lsmini namespace are registered in.
_LIB = torch.library.Library("lsmini", "FRAGMENT")


class Operator:
    """One operator ``lsmini::<name>``, defined from its CUDA implementation's type hints, with the same
    registration methods as ``torch.library.custom_op``'s result. It registers straight with
    ``torch.library``: ``custom_op`` wraps each device implementation in a guard that imports
    ``torch._dynamo`` at the operator's first call (seconds of a short run's start-up, even when nothing is
    compiled) and checks the outputs for aliases on every call (host time each call). The aliasing rule
    still holds (see above) and ``torch.library.opcheck`` checks it in the tests.

    Every operator registers autograd: a formula (``register_autograd``) or ``differentiable=False``
    (backward operators), whose gradient raises a clear error instead of being silently wrong.
    ``torch.library`` has no autograd for an operator that mutates an input; such an operator is not
    differentiable, and its implementations bump the mutated tensor's version (``increment_version``) so
    that autograd catches a saved tensor it overwrote.
    """

    def __init__(self, qualname, fn, mutates_args, tags, differentiable):
        self.qualname = qualname
        self.name = qualname.split("::")[1]
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        _LIB.define(self.name + schema, tags=(*tags, torch.Tag.pt2_compliant_tag))
        self.register_kernel("cuda")(fn)
        if not differentiable and not mutates_args:
            self.register_autograd(self._no_derivative)

    def _no_derivative(self, ctx, *grads):
        raise RuntimeError(f"lsmini::{self.name} is not differentiable: a backward of lsmini's ops cannot be "
                           f"differentiated again (double backward, create_graph=True)")

    def register_kernel(self, device_type):
        def register(fn):
            torch.library.impl(self.qualname, device_type, fn, lib=_LIB)
            return fn
        return register

    def register_fake(self, fn):
        torch.library.register_fake(self.qualname, fn, lib=_LIB)
        return fn

    def register_autograd(self, backward, *, setup_context=None):
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context, lib=_LIB)


def operator(qualname, *, mutates_args=(), tags=(), differentiable=True):
    """Decorator: define ``qualname`` from the decorated function's signature and register that function as
    its CUDA implementation; returns the ``Operator``."""
    return lambda fn: Operator(qualname, fn, mutates_args, tags, differentiable)


def draw_dropout_state(p, device):
    """``(rng, state)`` for one fused dropout call with probability p on the CUDA device: rng from
    ``_backend.dropout_rng`` (nothing drawn when p == 0) and its resolved (seed, offset) as an int64
    tensor [1, 2] for the backward operator."""
    rng = _backend.dropout_rng(p, device)
    return rng, _backend.dropout_state([rng], device)


def draw_keep_mask(shape, p, device):
    """The CPU implementations' dropout state: a fresh bool keep-mask of ``shape`` (True = kept, see
    ``dropout.keep_mask``) when p > 0, else an empty bool tensor (nothing drawn)."""
    mask = keep_mask(shape, p, device)
    return torch.empty(0, dtype=torch.bool, device=device) if mask is None else mask


def keep_mask_or_none(state, p):
    """The reference's keep-mask from a CPU dropout state (None when p == 0: no dropout to apply)."""
    return state if p > 0 else None


def fake_dropout_state(like, shape, p):
    """What a forward's dropout state looks like, on like's device: ``draw_dropout_state``'s int64 [1, 2]
    on CUDA, ``draw_keep_mask(shape, p)``'s bool tensor elsewhere."""
    if like.device.type == "cuda":
        return like.new_empty((1, 2), dtype=torch.int64)
    return like.new_empty(shape if p > 0 else (0,), dtype=torch.bool)


def state_rng(state, p):
    """The rng a backward binding takes to regenerate the mask of the forward that returned ``state``;
    ``_backend.NO_RNG`` when p == 0, by lsmini's convention that a call without dropout reads none."""
    return _backend.rng_in(state, 0) if p > 0 else _backend.NO_RNG


def grad_into(param, like):
    """``param.grad`` where a CUDA backward in ``like``'s dtype may add ``param``'s gradient into it itself instead
    of returning it: autograd would accumulate into that very tensor in this backward, with nothing watching
    (``_C.layer_grad_into``'s rule, see ``lsmini.layers.runtime``). None elsewhere, and always in compiled code
    (a compiled backward returns every gradient)."""
    if not like.is_cuda or torch.compiler.is_compiling():
        return None
    into = _backend.ext().layer_grad_into([param])[0]
    return into if into is not None and into.dtype == like.dtype else None


def optional_outputs(values, *present):
    """``values`` (an operator's list of the outputs that exist) spread over the slots ``present`` says
    exist, None in the others: ``optional_outputs([g], True, False) == [g, None]``."""
    values = iter(values)
    return [next(values) if here else None for here in present]
