"""Gated linear units, the FFN activation of Llama-style blocks: the public ops ``swiglu`` and ``geglu``, their
reference and their registered operators (one family, ``glu``, with the activation as an argument).

    out = dropout(act(gate) · up),   act: swiglu → silu;  geglu → gelu (exact, erf; or its tanh
                                     approximation with approximate="tanh", as F.gelu takes it)

Shapes: gate and up [..., ffn] of one shape, dtype and device → out [..., ffn]. The fused form: up=None and
gate [..., 2·ffn] holding both side by side, the output of one GEMM with the two weights stacked: the FIRST
half of the last dimension is the gate, the second the up projection (``gate_up[..., :ffn]``,
``gate_up[..., ffn:]``; the convention of vLLM's SiluAndMul and TransformerEngine's swiglu). Its gradient is
again one [..., 2·ffn] tensor, written by the kernel without a concatenation. The CUDA kernel takes
float32/float16/bfloat16 with fp32 math and one rounding; out has gate's dtype.

Dropout (training and dropout_p > 0): element e of out, with flat index i = row · ffn + col of out viewed as
[rows, ffn], is kept iff its Philox word (keyed by the call's Philox state drawn from torch's CUDA
generator, so ``torch.manual_seed`` reproduces it) passes the threshold; kept values are scaled by
1 / (1 − p). The backward regenerates the mask; nothing per element is stored. On CPU the reference's bool
keep-mask, drawn from torch's CPU generator, is what the backward gets instead (see
``lsmini.ops.library``).

Backward: with d = dropout backward of grad_out, grad_up = d · act(gate) and grad_gate = d · up · act'(gate),
recomputed from the saved inputs (no activation is kept).

- ``swiglu(gate, up, dropout_p, training)`` / ``geglu(gate, up, dropout_p, training, approximate)``: the
  ops: argument checks, then ``torch.ops.lsmini.glu``.
- ``glu_ref``: pure PyTorch in fp32 math, the oracle and the operators' CPU implementation.
- ``lsmini::glu`` / ``lsmini::glu_backward``: the family registered once (see ``lsmini.ops.library``): the
  kernels on CUDA, the reference and its gradients by autograd on CPU, fake implementations for tracing,
  autograd saving gate, up and the dropout state.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_dropout_p, check_floating, check_same_device, check_tensor
from lsmini.ops.dropout import dropout_ref
from lsmini.ops.library import (RANDOM_TAGS, draw_dropout_state, draw_keep_mask, fake_dropout_state, keep_mask_or_none,
                                operator, optional_outputs, state_rng)
from lsmini.ops.reference_grads import reference_grads

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")  # the operators' activation names
GELU_APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh"}  # geglu's approximate → the activation


def _act_ref(v, activation):
    if activation == "silu":
        return F.silu(v)
    return F.gelu(v, approximate="tanh" if activation == "gelu_tanh" else "none")


def glu_ref(gate, up=None, activation="silu", dropout_p=0.0, training=True, mask=None):
    """Pure-PyTorch ``dropout(act(gate) · up)`` in fp32 math (float64 for float64 inputs; the oracle and the
    CPU path); returns gate's dtype. up=None splits gate's last dimension in half: [gate | up]. ``mask`` (bool,
    shaped like the output, True = keep) replaces the random draw, so a caller can reproduce a given dropout
    pattern."""
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    dt = torch.promote_types(gate.dtype, torch.float32)
    h = _act_ref(gate.to(dt), activation) * up.to(dt)
    return dropout_ref(h, dropout_p, training, mask).to(gate.dtype)


def _out_shape(gate, up):
    return gate.shape if up is not None else (*gate.shape[:-1], gate.shape[-1] // 2)


# ---- the registered operators ---------------------------------------------------------------------------
@operator("lsmini::glu", tags=RANDOM_TAGS)
def _glu_op(gate: Tensor, up: Tensor | None, activation: str, p: float) -> tuple[Tensor, Tensor]:
    """(out [rows, ffn] contiguous, dropout state) for gate, up [rows, ffn], or up None and gate [rows, 2·ffn] =
    [gate | up]. This function is the CUDA implementation (the kernel; the state is the call's Philox state)."""
    rng, state = draw_dropout_state(p, gate.device)
    return _backend.ext().glu_fwd(gate, up, activation, p, rng), state


@_glu_op.register_kernel("cpu")
def _glu_cpu(gate, up, activation, p):
    state = draw_keep_mask(_out_shape(gate, up), p, gate.device)
    out = glu_ref(gate, up, activation, p, True, keep_mask_or_none(state, p))
    return out.contiguous(), state


@_glu_op.register_fake
def _(gate, up, activation, p):
    shape = _out_shape(gate, up)
    return gate.new_empty(shape), fake_dropout_state(gate, shape, p)


@operator("lsmini::glu_backward", differentiable=False)
def _glu_backward_op(grad: Tensor, gate: Tensor, up: Tensor | None, state: Tensor, activation: str,
                     p: float) -> list[Tensor]:
    """[grad_gate like gate, grad_up like up (only when up is given)], contiguous; act and act' recomputed from
    gate, the forward's dropout mask applied again (the kernel regenerates it from the Philox state). With
    up None, grad_gate is the gradient of the fused [rows, 2·ffn] gate."""
    grad_gate, grad_up = _backend.ext().glu_bwd(grad, gate, up, activation, p, state_rng(state, p))
    return [grad_gate] if grad_up is None else [grad_gate, grad_up]


@_glu_backward_op.register_kernel("cpu")
def _glu_backward_cpu(grad, gate, up, state, activation, p):
    keep = keep_mask_or_none(state, p)
    # fp32 gradients rounded once to the inputs' dtype, as the kernel does
    inputs = [gate.float(), None if up is None else up.float()]
    grads = reference_grads(lambda g, u: glu_ref(g, u, activation, p, True, keep), inputs, grad.float())
    return [g.to(gate.dtype).contiguous() for g in grads if g is not None]


@_glu_backward_op.register_fake
def _(grad, gate, up, state, activation, p):
    return [gate.new_empty(gate.shape)] + ([] if up is None else [up.new_empty(up.shape)])


def _glu_setup_context(ctx, inputs, output):
    gate, up, activation, p = inputs
    ctx.save_for_backward(gate, up, output[1])
    ctx.activation, ctx.p = activation, p


def _glu_backward(ctx, grad, _grad_state):
    gate, up, state = ctx.saved_tensors
    grads = torch.ops.lsmini.glu_backward.default(grad, gate, up, state, ctx.activation, ctx.p)
    grad_gate, grad_up = optional_outputs(grads, True, up is not None)
    return grad_gate, grad_up, None, None


_glu_op.register_autograd(_glu_backward, setup_context=_glu_setup_context)


# ---- the public ops -------------------------------------------------------------------------------------
def _check_args(op, gate, up, dropout_p):
    check_tensor(op, "gate", gate)
    check_floating(op, "gate", gate)
    if gate.dim() < 1 or gate.shape[-1] == 0:
        raise ValueError(f"{op}: gate must have a non-empty last dimension, got shape {tuple(gate.shape)}")
    check_tensor(op, "up", up, or_none=True)
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"{op}: without up, gate holds [gate | up] along its last dimension, which must be "
                             f"even, got shape {tuple(gate.shape)}")
    else:
        if up.shape != gate.shape:
            raise ValueError(f"{op}: up must have gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
        if up.dtype != gate.dtype:
            raise TypeError(f"{op}: up must have gate's dtype {gate.dtype}, got {up.dtype}")
        check_same_device(op, "up", up, "gate", gate.device)
    check_dropout_p(op, dropout_p)


def _glu(op, gate, up, activation, dropout_p, training):
    _check_args(op, gate, up, dropout_p)
    p = float(dropout_p) if training else 0.0
    if _backend.force_reference() or gate.dtype not in limits.KERNEL_DTYPES or not _backend.has_op_impl(gate.device):
        return glu_ref(gate, up, activation, p, bool(training))
    width = gate.shape[-1]
    gate2d = gate.reshape(-1, width).contiguous()
    up2d = None if up is None else up.reshape(-1, width).contiguous()
    out, _ = torch.ops.lsmini.glu.default(gate2d, up2d, activation, p)
    return out.view(_out_shape(gate, up))


def swiglu(gate, up=None, dropout_p=0.0, training=True):
    """SwiGLU: ``dropout(silu(gate) · up)`` for gate, up [..., ffn] → [..., ffn]; or, with up=None, gate
    [..., 2·ffn] = [gate | up] (first half the gate) → [..., ffn].

    Calls ``torch.ops.lsmini.glu`` for float32/float16/bfloat16 inputs: the fused CUDA kernel for CUDA
    tensors, ``glu_ref`` (with a keep-mask drawn from torch's CPU generator) for CPU tensors; other dtypes and
    the forced reference run ``glu_ref``. Dropout applies when ``training`` and ``dropout_p > 0``; the output
    has gate's dtype.
    """
    return _glu("swiglu", gate, up, "silu", dropout_p, training)


def geglu(gate, up=None, dropout_p=0.0, training=True, approximate="none"):
    """GeGLU: ``dropout(gelu(gate) · up)``, gelu exact (erf) by default, as ``F.gelu``; approximate="tanh"
    takes its tanh approximation (``F.gelu(approximate="tanh")``, Gemma's). Shapes, the fused form (up=None),
    dropout and dtypes as ``swiglu``."""
    if not isinstance(approximate, str) or approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _glu("geglu", gate, up, GELU_APPROXIMATIONS[approximate], dropout_p, training)
