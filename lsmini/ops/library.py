"""What the ops' PyTorch custom operators (``torch.ops.lsmini.<op>``) share.

torch.compile cannot trace into the extension's pybind functions, so each op's kernel path is also a
pair of custom operators: ``lsmini::<op>`` (forward) and ``lsmini::<op>_backward``, each calling the same
``_backend.ext()`` bindings as the op's autograd Function, with a fake implementation that gives the
exact shapes, dtypes and strides of what the bindings return, and ``register_autograd`` on the forward
one. The public ops call them while torch.compile traces (``torch.compiler.is_compiling()``) and keep
their autograd Functions in eager mode, which cost less host time per call.

A custom operator is a pure function of its inputs, which shapes them:
- Outputs are fresh tensors, never an input nor another output (torch refuses aliases): where a binding
  would hand back an input, or one tensor twice, the operator returns something else or nothing there,
  as its docstring says; options that write in place are not offered.
- An operator cannot return None: outputs that exist only for some inputs (a bias gradient when there
  is a bias) come back as a ``list[Tensor]`` holding just the present ones, in a documented order
  (``optional_outputs`` reads them back).
- Dropout: a forward that draws a Philox state returns it as a tensor (``draw_dropout_state``); its
  backward takes that tensor and hands the kernels ``state_rng(state, p)``, which makes them read the
  state on the device, so they regenerate the forward's mask — inside a CUDA-graph replay too. Such
  forwards carry ``RANDOM_TAGS``, so the compiler neither merges two calls nor recomputes one in the
  backward (which would draw a new mask).
"""
import torch

from lsmini import _backend

# Tags of a forward operator that draws a dropout state.
RANDOM_TAGS = (torch.Tag.nondeterministic_seeded,)


def draw_dropout_state(p, device):
    """``(rng, state)`` for one fused dropout call with probability p on the CUDA device: rng from
    ``_backend.dropout_rng`` (nothing drawn when p == 0) and its resolved (seed, offset) as an int64
    tensor [1, 2] for the backward operator."""
    rng = _backend.dropout_rng(p, device)
    return rng, _backend.dropout_state([rng], device)


def fake_dropout_state(like):
    """What ``draw_dropout_state``'s state looks like, on like's device."""
    return like.new_empty((1, 2), dtype=torch.int64)


def state_rng(state, p):
    """The rng a backward binding takes to regenerate the mask of the forward that returned ``state``;
    ``_backend.NO_RNG`` when p == 0, by lsmini's convention that a call without dropout reads none."""
    return _backend.rng_in(state, 0) if p > 0 else _backend.NO_RNG


def optional_outputs(values, *present):
    """``values`` (an operator's list of the outputs that exist) spread over the slots ``present`` says
    exist, None in the others: ``optional_outputs([g], True, False) == [g, None]``."""
    values = iter(values)
    return [next(values) if here else None for here in present]
