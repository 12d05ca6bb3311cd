"""Token embedding with scale, positions and dropout in one pass: the public op, its reference, its
registered operators, the sinusoidal position table and the token-range check.

    out[b, j] = dropout(scale · weight[tokens[b, j]] + pos_table[step + j])   for non-pad tokens
    out[b, j] = 0                                                              for tokens == padding_idx

Shapes: tokens [batch, len] (int64 or int32); weight [vocab, hidden]; pos_table [max_positions, hidden]
(a fixed sinusoidal buffer, see ``sinusoidal_positions``, or a learned parameter); out
[batch, len, hidden] in weight's dtype. ``scale`` defaults to sqrt(hidden). ``step`` offsets the
positions (incremental decoding: the token at column j sits at position step + j).

Gradients: weight gets a dense [vocab, hidden] gradient (like nn.Embedding without sparse), summed
in fp32 without atomics and bitwise reproducible; the padding row gets none. Where autograd would add
it into weight's existing ``.grad`` in this very backward with nothing watching (the layers' rule,
``lsmini.layers.runtime``), the kernels add it there themselves, touching only the rows of the ids
that occur, instead of making a full table for autograd to add. pos_table gets a
gradient when it requires grad (rows step .. step+len-1; pad tokens contribute nothing).
Dropout element i is the flat index into the [batch, len, hidden] output; the CUDA backward
regenerates the mask from the call's Philox state ``rng`` (``_backend.philox_seed_offset``), nothing
per element is stored. The kernels read ``rng`` at run time, so the op can be captured in a CUDA graph
and every replay draws a fresh mask. On CPU the reference's bool keep-mask, drawn from torch's CPU
generator, is what the backward gets instead.

- ``embedding(tokens, weight, pos_table, ...)``: the op: argument checks (the token range with one host
  sync), then ``torch.ops.lsmini.embedding``.
- ``embedding_ref``: pure PyTorch in fp32 math, the oracle and the operators' CPU implementation.
- ``lsmini::embedding`` / ``lsmini::embedding_backward``: the op registered once (see
  ``lsmini.ops.library``): the kernels on CUDA, the reference and its gradients by autograd on CPU, fake
  implementations for tracing, autograd saving the tokens and the dropout state.
- ``sinusoidal_positions``: the fixed positional table; ``check_token_range``: the id range check.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_dropout_p, check_floating, check_same_device, check_tensor
from lsmini.ops.dropout import dropout_ref
from lsmini.ops.library import (RANDOM_TAGS, draw_dropout_state, draw_keep_mask, fake_dropout_state, grad_into,
                                keep_mask_or_none, operator, state_rng)
from lsmini.ops.reference_grads import reference_grads

_TOKEN_DTYPES = (torch.int64, torch.int32)


def sinusoidal_positions(max_positions, hidden, dtype=torch.float32, device=None):
    """The fixed positional table [max_positions, hidden]: column i < hidden/2 holds
    sin(pos / 10000^(2i/hidden)), column hidden/2 + i holds cos(pos / 10000^(2i/hidden)).
    Computed in float64, then cast to dtype."""
    if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 0:
        raise ValueError(f"sinusoidal_positions: max_positions must be an int >= 0, got {max_positions!r}")
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0 or hidden % 2:
        raise ValueError(f"sinusoidal_positions: hidden must be a positive even int (half sin, half cos "
                         f"columns), got {hidden!r}")
    half = hidden // 2
    pos = torch.arange(max_positions, dtype=torch.float64, device=device).unsqueeze(1)
    inv_freq = torch.pow(10000.0, -2.0 * torch.arange(half, dtype=torch.float64, device=device) / hidden)
    angle = pos * inv_freq
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).to(dtype)


def _normalize_padding_idx(padding_idx, vocab, fn="embedding"):
    """None → -1 (no padding token); negative indices count from the end, as in nn.Embedding."""
    if padding_idx is None:
        return -1
    if not isinstance(padding_idx, int) or isinstance(padding_idx, bool):
        raise TypeError(f"{fn}: padding_idx must be an int or None, got {type(padding_idx).__name__}")
    if not -vocab <= padding_idx < vocab:
        raise ValueError(f"{fn}: padding_idx must be in [-{vocab}, {vocab}) for a vocabulary of {vocab}, "
                         f"got {padding_idx}")
    return padding_idx + vocab if padding_idx < 0 else padding_idx


def embedding_ref(tokens, weight, pos_table, scale=None, padding_idx=None, step=0, dropout_p=0.0, training=True,
                  mask=None):
    """Pure-PyTorch embedding in fp32 math (the oracle and the CPU path); returns weight's dtype.
    Pass float64 tensors for a float64 oracle. ``mask`` (bool [batch, len, hidden], True = keep) replaces
    the random dropout draw, so a caller can reproduce a given dropout pattern."""
    hidden = weight.shape[1]
    scale = math.sqrt(hidden) if scale is None else float(scale)
    pad = _normalize_padding_idx(padding_idx, weight.shape[0], "embedding_ref")
    math_dtype = torch.promote_types(weight.dtype, torch.float32)
    length = tokens.shape[1]
    x = F.embedding(tokens, weight.to(math_dtype)) * scale + pos_table[step:step + length].to(math_dtype)
    if pad >= 0:
        x = x.masked_fill(tokens.eq(pad).unsqueeze(-1), 0.0)
    return dropout_ref(x, dropout_p, training, mask).to(weight.dtype)


@operator("lsmini::embedding", tags=RANDOM_TAGS)
def _embedding_op(tokens: Tensor, weight: Tensor, pos_table: Tensor, scale: float, padding_idx: int, step: int,
                  dropout_p: float) -> tuple[Tensor, Tensor]:
    """(out [batch, len, hidden] contiguous in weight's dtype, dropout state); padding_idx -1 = none;
    pos_table in weight's dtype. This function is the CUDA implementation (the kernel; the state is the
    call's Philox state)."""
    rng, state = draw_dropout_state(dropout_p, weight.device)
    out = _backend.ext().embedding_fwd(tokens, weight, pos_table, scale, padding_idx, step, dropout_p, rng)
    return out, state


@_embedding_op.register_kernel("cpu")
def _embedding_cpu(tokens, weight, pos_table, scale, padding_idx, step, dropout_p):
    state = draw_keep_mask((tokens.shape[0], tokens.shape[1], weight.shape[1]), dropout_p, weight.device)
    out = embedding_ref(tokens, weight, pos_table, scale, None if padding_idx < 0 else padding_idx, step, dropout_p,
                        True, keep_mask_or_none(state, dropout_p))
    return out.contiguous(), state


@_embedding_op.register_fake
def _(tokens, weight, pos_table, scale, padding_idx, step, dropout_p):
    batch, length = tokens.shape
    shape = (batch, length, weight.shape[1])
    return weight.new_empty(shape), fake_dropout_state(weight, shape, dropout_p)


@operator("lsmini::embedding_backward", mutates_args=("weight_grad_into",), differentiable=False)
def _embedding_backward_op(grad_out: Tensor, tokens: Tensor, state: Tensor, vocab: int, max_positions: int,
                           need_weight_grad: bool, need_pos_grad: bool, scale: float, padding_idx: int, step: int,
                           dropout_p: float, weight_grad_into: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(grad_weight [vocab, hidden], grad_pos [max_positions, hidden]) in grad_out's dtype, each an empty tensor
    where it is not asked for (two plain tensors, not a list: that keeps an operator with a mutable argument
    auto-functionalizable); the forward's dropout mask applied again (the kernel regenerates it from the Philox
    state). With weight_grad_into (contiguous [vocab, hidden] in grad_out's dtype, needs need_weight_grad) the
    token-table gradient is added into it, and grad_weight is empty."""
    grad_weight, grad_pos = _backend.ext().embedding_bwd(grad_out, tokens, vocab, max_positions, need_weight_grad,
                                                         need_pos_grad, scale, padding_idx, step, dropout_p,
                                                         state_rng(state, dropout_p), weight_grad_into)
    if weight_grad_into is not None:
        torch.autograd.graph.increment_version(weight_grad_into)
    return _or_empty(grad_weight, grad_out), _or_empty(grad_pos, grad_out)


def _or_empty(grad, like):
    return like.new_empty((0,)) if grad is None else grad


@_embedding_backward_op.register_kernel("cpu")
def _embedding_backward_cpu(grad_out, tokens, state, vocab, max_positions, need_weight_grad, need_pos_grad, scale,
                            padding_idx, step, dropout_p, weight_grad_into):
    if weight_grad_into is not None and not need_weight_grad:
        raise ValueError("embedding_backward: weight_grad_into given with need_weight_grad false")
    if not (need_weight_grad or need_pos_grad):
        return _or_empty(None, grad_out), _or_empty(None, grad_out)
    # The op is linear in weight and pos_table: its gradient is the same at every point, so zeros stand in
    # for them (and for the one whose gradient is not asked, a constant here).
    hidden = grad_out.shape[2]
    weight = grad_out.new_zeros((vocab, hidden))
    pos_table = grad_out.new_zeros((max_positions, hidden))
    pad = None if padding_idx < 0 else padding_idx
    keep = keep_mask_or_none(state, dropout_p)

    def reference(w, q):
        return embedding_ref(tokens, weight if w is None else w, pos_table if q is None else q, scale, pad, step,
                             dropout_p, True, keep)

    grads = reference_grads(reference, [weight if need_weight_grad else None, pos_table if need_pos_grad else None],
                            grad_out)
    if weight_grad_into is not None:
        weight_grad_into.add_(grads[0])
        grads[0] = None
    return _or_empty(grads[0], grad_out), _or_empty(grads[1], grad_out)


@_embedding_backward_op.register_fake
def _(grad_out, tokens, state, vocab, max_positions, need_weight_grad, need_pos_grad, scale, padding_idx, step,
      dropout_p, weight_grad_into):
    hidden = grad_out.shape[2]
    weight_rows = vocab if need_weight_grad and weight_grad_into is None else None
    return tuple(grad_out.new_empty((0,) if n is None else (n, hidden))
                 for n in (weight_rows, max_positions if need_pos_grad else None))


def _embedding_setup_context(ctx, inputs, output):
    tokens, weight, pos_table, scale, padding_idx, step, dropout_p = inputs
    ctx.save_for_backward(tokens, output[1])
    ctx.weight = weight  # the parameter itself, for grad_into (not its data: nothing of it is read)
    ctx.args = (weight.shape[0], pos_table.shape[0], scale, padding_idx, step, dropout_p)


def _embedding_backward(ctx, grad_out, _grad_state):
    tokens, state = ctx.saved_tensors
    vocab, max_positions, scale, padding_idx, step, dropout_p = ctx.args
    need_weight, need_pos = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    into = grad_into(ctx.weight, grad_out) if need_weight else None
    grad_weight, grad_pos = torch.ops.lsmini.embedding_backward.default(
        grad_out, tokens, state, vocab, max_positions, need_weight, need_pos, scale, padding_idx, step, dropout_p, into)
    return (None, grad_weight if need_weight and into is None else None, grad_pos if need_pos else None, None, None,
            None, None)


_embedding_op.register_autograd(_embedding_backward, setup_context=_embedding_setup_context)


def _check_args(tokens, weight, pos_table, step, dropout_p, learned_positions):
    op = "embedding"
    check_tensor(op, "tokens", tokens)
    if tokens.dtype not in _TOKEN_DTYPES:
        raise TypeError(f"embedding: tokens must be int64 or int32, got {tokens.dtype}")
    if tokens.dim() != 2:
        raise ValueError(f"embedding: tokens must be 2-D [batch, len], got shape {tuple(tokens.shape)}")
    check_tensor(op, "weight", weight)
    check_floating(op, "weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"embedding: weight must be 2-D [vocab, hidden], got shape {tuple(weight.shape)}")
    if tokens.device != weight.device:
        raise ValueError(f"embedding: tokens are on {tokens.device} but weight is on {weight.device}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"embedding: step must be an int >= 0, got {step!r}")
    check_dropout_p(op, dropout_p)
    if pos_table is None:
        if learned_positions:
            raise ValueError("embedding: learned_positions=True needs the learned pos_table, got None")
        return
    check_tensor(op, "pos_table", pos_table, or_none=True)
    check_floating(op, "pos_table", pos_table)
    if pos_table.dim() != 2 or pos_table.shape[1] != weight.shape[1]:
        raise ValueError(f"embedding: pos_table must have shape [max_positions, {weight.shape[1]}] to match "
                         f"weight's hidden size, got {tuple(pos_table.shape)}")
    check_same_device(op, "pos_table", pos_table, "weight", weight.device)
    if step + tokens.shape[1] > pos_table.shape[0]:
        raise ValueError(f"embedding: step + len = {step} + {tokens.shape[1]} = {step + tokens.shape[1]} exceeds "
                         f"max_positions = {pos_table.shape[0]} (rows of pos_table)")
    if pos_table.requires_grad and not learned_positions and torch.is_grad_enabled():
        raise ValueError("embedding: pos_table requires grad but learned_positions=False; pass "
                         "learned_positions=True to train the positional table, or a buffer / detached table")


def check_token_range(tokens, vocab):
    """Raise ValueError when a token id is outside [0, vocab). Costs one host-device sync, so it skips
    itself while torch.compile traces it (the sync would break the graph) and while the current CUDA
    stream is capturing a graph (it would abort the capture). Those calls are not checked: bad ids give
    zero rows there (on the CPU reference path, the lookup's index error), never an out-of-bounds read."""
    if (tokens.numel() == 0 or torch.compiler.is_compiling()
            or (tokens.is_cuda and torch.cuda.is_current_stream_capturing())):
        return
    lo, hi = (int(v) for v in torch.stack([tokens.min(), tokens.max()]).tolist())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"embedding: token ids must be in [0, {vocab}) (vocab = weight.shape[0]), got ids in "
                         f"[{lo}, {hi}]")


def embedding(tokens, weight, pos_table, scale=None, padding_idx=None, step=0, dropout_p=0.0, training=True,
              learned_positions=False, check_tokens=True):
    """Fused ``dropout(scale · weight[tokens] + pos_table[step + j])`` with pad tokens → 0.

    Args:
        tokens: [batch, len] int64 or int32 token ids in [0, vocab).
        weight: [vocab, hidden] token table (float32/float16/bfloat16 for the CUDA kernel).
        pos_table: [max_positions, hidden] positional table, or None for
            ``sinusoidal_positions(step + len, hidden)`` built on the fly (layers should keep a buffer).
            Cast to weight's dtype when it differs.
        scale: multiplies the token rows; default sqrt(hidden).
        padding_idx: id whose rows are exact zeros and get no gradient (negative counts from the end).
        step: position of column 0 (incremental decoding); step + len must be <= max_positions.
        dropout_p, training: dropout on the sum (none when not training).
        learned_positions: True when pos_table is a trained parameter; it then gets a gradient when it
            requires grad. With False, a pos_table that requires grad is an error (it would be trained
            without anyone asking).
        check_tokens: validate the id range (one host sync); turn off in a hot loop once the data is
            known to be clean. Unchecked bad ids never touch memory out of bounds: the kernel gives
            their rows zeros and no gradient. Not checked while torch.compile traces the op, nor during
            a CUDA graph capture (no sync is possible there).

    Returns: [batch, len, hidden] in weight's dtype.
    """
    _check_args(tokens, weight, pos_table, step, float(dropout_p), learned_positions)
    vocab, hidden = weight.shape
    pad = _normalize_padding_idx(padding_idx, vocab)
    scale = math.sqrt(hidden) if scale is None else float(scale)
    p = float(dropout_p) if training else 0.0
    if pos_table is None:
        pos_table = sinusoidal_positions(step + tokens.shape[1], hidden, weight.dtype, weight.device)
    if check_tokens:
        check_token_range(tokens, vocab)
    if (_backend.force_reference() or weight.dtype not in limits.KERNEL_DTYPES
            or not _backend.has_op_impl(weight.device)):
        return embedding_ref(tokens, weight, pos_table, scale, pad if pad >= 0 else None, step, p, True)
    if pos_table.dtype != weight.dtype:
        # The kernel reads one dtype; cast only the rows in use (autograd carries a gradient back).
        pos_table, step = pos_table[step:step + tokens.shape[1]].to(weight.dtype), 0
    out, _ = torch.ops.lsmini.embedding.default(tokens, weight, pos_table, scale, pad, step, p)
    return out
