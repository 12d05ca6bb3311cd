"""A layer call as torch.compile sees it: the PyTorch custom operators ``lsmini::layer`` (the whole forward)
and ``lsmini::layer_backward`` (the whole backward), with fake implementations and registered autograd, so
``torch.compile(model, fullgraph=True)`` traces a model built from lsmini layers without a graph break; and,
for the reference path, the layer as plain differentiable PyTorch for the compiler to trace.

This module defines the operators' schemas, fake implementations and autograd, and plans each call's layout
(``cpp_plan``). Their CUDA kernels are C++ (csrc/layers/layer.cpp, around the eager layer's layer_fwd /
layer_bwd), so that a compiled step calls no Python per layer: they ask ``cpp_plan`` once per options and
shapes and keep the answer, so the layout they follow is the one the fake implementations compute.

The layer modules call ``layer_call`` instead of ``LayerFunction`` while ``torch.compiler.is_compiling()``;
eager calls keep LayerFunction, which takes its temporaries from the layer's arena and adds weight gradients
straight into an existing .grad (the compiled path returns them to autograd, which is what a compiled graph
expects).

What differs from the eager one-call layer, because a custom operator must be a pure function of tensors:
- Its outputs may not alias its inputs or each other, so of the state layer_fwd saves, ``lsmini::layer``
  returns only the tensors it creates (``saved_layout`` says which slot is which, computed from the options
  as csrc/layers/layer.cpp fills them; the slots that are inputs or repeats are put back for backward).
  They come back as ONE byte buffer: layer_fwd writes each where ``state_plan`` puts it. One output
  instead of ~10–20 per layer is what keeps the compiled graph, and the compile time, small: each output
  of an operator is a node and a buffer of its own in every stage of the compiler.
- The dropout states travel as a tensor (written by the philox_state kernel: resolved on the device, right
  inside a CUDA-graph replay of the compiled step too); backward reads them back through pointers into it.
  They and the GEMM weights the call casts (for backward to read again) go into the same buffer
  (``state_tail``), so the operator has two outputs: y and the state.
- Backward takes a fresh scratch tensor instead of the shared arena, and returns the encoder K/V
  gradients of a cross-attention block as tensors instead of writing a decoder stack's slots. Both
  operators take the encoder K/V as [b, ls, H] column blocks of the decoder's one projection (the kernels
  make the [b, heads, ls, d] views), so those gradients gather back by a stack along the columns.
- Backward returns the parameters' gradients as ONE tensor too: layer_bwd writes each where ``grad_plan``
  puts it, and autograd is handed views of it.
The kernels, GEMMs and dropout draws are those of the eager layer: same seed, same outputs.

Layer graphs: a compiled step calls each layer's operators with the same shapes and parameters step after step,
and issuing a layer's ~25 kernels and GEMMs one by one is most of a call's host time. So once a call site (the
same parameters, device and stream; forward and backward apart) repeats its plan, its CUDA kernels capture the
call into a CUDA graph and replay it from then on, with the eager call's dropout draws (details and the rules
that keep a replay right: csrc/layers/layer.cpp). A replay overwrites the site's outputs, so it runs only while
nothing holds them (nor the outputs of later graphs in its temporaries); otherwise the call runs eagerly. Under an
outer capture (mode="reduce-overhead", lsmini.train's CUDA graphs) the outer graph takes the kernels instead.
``set_layer_graphs`` turns them off and on, ``layer_graph_counts`` tells what they did.
"""
import functools
import math

import torch
import torch.nn.functional as F

from lsmini import _backend
from lsmini.layers.arena import align
from lsmini.layers.blocks import heads_of
from lsmini.layers.precision import cast_block, cast_plan
from lsmini.layers.spec import PARAMS_PER_BLOCK, LayerOptions, scratch_numel
from lsmini.ops.attention import attention_ref, fused_attention_supported, keep_numel, keeps_bits
from lsmini.ops.bias_act_dropout import bias_act_dropout_ref
from lsmini.ops.bias_dropout_residual import bias_dropout_residual_ref
from lsmini.ops.layernorm import layer_norm_ref
from lsmini.ops.library import RANDOM_TAGS


def set_layer_graphs(on):
    """Whether the CUDA kernels of ``lsmini::layer`` / ``lsmini::layer_backward`` replay a CUDA graph per call
    site (default True); off also drops every graph, and their memory goes back to the allocator once nothing
    holds the outputs they handed out. Returns the previous setting. Without the CUDA extension there is nothing
    to switch: returns False."""
    ext = _backend.ext_or_none()
    return bool(ext.set_layer_graphs(bool(on))) if ext is not None else False


def layer_graph_counts():
    """(graphs captured, replays, calls run eagerly because a replay would have overwritten outputs held
    elsewhere) of the layer operators so far in this process; zeros without the CUDA extension."""
    ext = _backend.ext_or_none()
    return tuple(ext.layer_graph_counts()) if ext is not None else (0, 0, 0)


# The slots of one block's saved state, in csrc/layers/layer.cpp's order (its enum Slot).
(INPUT, NORM_X, MEAN, RSTD, CORE_INPUT, PROJECTION, HIDDEN, CONTEXT, LSE, KEYS, VALUES, MASK, BITS) = range(13)
SLOTS = 13

_INPUTS = ("x", "key_padding_mask", "encoder_k", "encoder_v", "encoder_padding_mask")


class _Made:
    """A tensor the layer creates (as opposed to one of its inputs), until it is first placed in a slot."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def saved_layout(options, batch, q_len, has_mask, has_encoder_mask, dtype, src_len=0):
    """What ``_C.layer_fwd`` leaves in each of its ``len(options.kinds) · SLOTS`` saved slots, per slot:
    None (nothing), ``("input", name)`` (one of _INPUTS, x as [tokens, hidden]), ``("same", j)`` (the
    tensor of slot j), or ``("new", shape, dtype)`` (a tensor the call creates, contiguous). src_len: the
    encoder's length, for a layer with a cross block."""
    t, hidden = batch * q_len, options.hidden
    layout, placed = [], {}

    def place(index, value):
        if isinstance(value, _Made):  # keyed by the object itself: the dict keeps it alive, so no id is reused
            if value in placed:
                return ("same", placed[value])
            placed[value] = index
            return ("new", value.shape, value.dtype)
        return value

    residual = ("input", "x")
    for kind in options.kinds:
        slots = [None] * SLOTS
        core_input = _Made((t, hidden), dtype) if options.pre_ln else residual
        slots[CORE_INPUT] = core_input
        if kind == "ffn":
            if options.activation == "relu":  # relu's derivative is read off its output
                slots[HIDDEN] = _Made((t, options.ffn), dtype)
            else:
                slots[PROJECTION] = _Made((t, options.ffn), dtype)
                if not options.recompute:
                    slots[HIDDEN] = _Made((t, options.ffn), dtype)
        else:
            slots[PROJECTION] = _Made((t, (3 if kind == "self" else 1) * hidden), dtype)
            slots[CONTEXT] = _Made((t, hidden), dtype)
            slots[LSE] = _Made((batch, options.heads, q_len), torch.float32)
            if kind == "cross":
                slots[KEYS], slots[VALUES] = ("input", "encoder_k"), ("input", "encoder_v")
            k_len = q_len if kind == "self" else src_len
            if keeps_bits(options.attn_dropout, k_len, options.head_dim):
                slots[BITS] = _Made((keep_numel(batch, options.heads, q_len, k_len),), torch.int32)
            if has_mask if kind == "self" else has_encoder_mask:
                slots[MASK] = ("input", "key_padding_mask" if kind == "self" else "encoder_padding_mask")
        slots[MEAN], slots[RSTD] = _Made((t,), torch.float32), _Made((t,), torch.float32)
        if options.pre_ln:
            slots[NORM_X] = residual
            if options.recompute:  # the core input is recomputed from the block input
                slots[CORE_INPUT], slots[INPUT] = None, residual
            residual = _Made((t, hidden), dtype)  # the block's output: the next block's input
        else:
            slots[NORM_X] = _Made((t, hidden), dtype)
            residual = _Made((t, hidden), dtype)  # the LayerNorm's output
        base = len(layout)
        layout.extend([place(base + i, v) for i, v in enumerate(slots)])
    return layout


def _options(kinds, hidden, ffn, heads, scale, eps, pre_ln, activation, dropout, attn_dropout, activation_dropout,
             causal, recompute):
    return LayerOptions(kinds=tuple(kinds.split(",")), hidden=hidden, ffn=ffn, heads=heads, head_dim=hidden // heads,
                        scale=scale, eps=eps, pre_ln=pre_ln, activation=activation, training=True, dropout=dropout,
                        attn_dropout=attn_dropout, activation_dropout=activation_dropout, causal=causal, kernels=True,
                        recompute=recompute)


STATE_ALIGN = 64  # bytes; csrc/layers/layer.cpp checks it
CAST_ALIGN = 128  # bytes: where the cast weights start in the state (cast_plan aligns each copy from there)


def state_plan(layout):
    """(per slot the byte offset of its tensor in the state buffer, or -1 where the slot holds an input or
    nothing; the buffer's size in bytes): the "new" tensors one after the other, each aligned to
    STATE_ALIGN, and a "same" slot at the offset of the slot it repeats. Sizes may be symbolic."""
    offsets, end = [], 0
    for entry in layout:
        if entry is not None and entry[0] == "new":
            offsets.append(end)
            end = (end + math.prod(entry[1]) * entry[2].itemsize + STATE_ALIGN - 1) // STATE_ALIGN * STATE_ALIGN
        else:
            offsets.append(offsets[entry[1]] if entry is not None and entry[0] == "same" else -1)
    return offsets, end


def state_tail(o, nbytes, cast_numel, dtype):
    """After the saved tensors (nbytes, state_plan's), the state buffer holds the dropout states (int64
    [2·blocks, 2], as the philox_state kernel writes them) and then the GEMM weights cast to the activations'
    dtype (cast_plan's layout, cast_numel elements): (the dropout states' byte offset, the weights', the
    buffer's size in bytes). Sizes may be symbolic."""
    rng_at = nbytes
    cast_at = (rng_at + 2 * len(o.kinds) * 16 + CAST_ALIGN - 1) // CAST_ALIGN * CAST_ALIGN
    return rng_at, cast_at, cast_at + cast_numel * dtype.itemsize


def _plan(*args):
    layout = saved_layout(*args)
    return (layout, *state_plan(layout))


_cached_plan = functools.lru_cache(maxsize=256)(_plan)  # the operators' own calls: concrete sizes


def _plan_of(o, x, key_padding_mask, encoder_k, encoder_padding_mask, cached=True):
    """(saved_layout, its state offsets, the state's bytes) of a call."""
    plan = _cached_plan if cached else _plan  # symbolic sizes (dynamic shapes) do not hash
    return plan(o, x.shape[0], x.shape[1], key_padding_mask is not None, encoder_padding_mask is not None, x.dtype,
                0 if encoder_k is None else encoder_k.shape[1])


def _heads(t, heads):
    """[b, ls, H] encoder keys or values (a column block of the cross-K/V projection: any row stride) as the
    [b, heads, ls, d] view the attention kernels read."""
    b, ls, hidden = t.shape
    return t.view(b, ls, heads, hidden // heads).transpose(1, 2)


def grad_plan(params):
    """(per parameter the element offset of its gradient in the one gradient tensor ``lsmini::layer_backward``
    returns, of params[0]'s dtype — -1 for a parameter of another dtype, whose gradient comes back on its own
    —; that tensor's length). One output instead of one per parameter (12–18 a layer): as with the saved
    state, each output of an operator is a node and a buffer of its own in every stage of the compiler, while
    the gradients handed to autograd are views of it, which cost the compiler no buffer."""
    dtype = params[0].dtype
    offsets, end = [], 0
    for p in params:
        if p.dtype != dtype:
            offsets.append(-1)
            continue
        offsets.append(end)
        end += align(p.numel())  # each starts 128-byte aligned (fp16), as the cast weights, for the GEMMs
    return offsets, end


def _contiguous_strides(shape):
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


# The operators' schemas. The options travel as plain arguments (an operator takes tensors and scalars only),
# kinds joined by ",". Their CUDA kernels are C++ (csrc/layers/layer.cpp, TORCH_LIBRARY_IMPL), so that a
# compiled step calls no Python per layer; the plans they follow come from cpp_plan, once per shape.
_OPTION_ARGS = ("str kinds, int hidden, int ffn, int heads, float scale, float eps, bool pre_ln, str activation, "
                "float dropout, float attn_dropout, float activation_dropout, bool causal, bool recompute")
_LIB = torch.library.Library("lsmini", "FRAGMENT")
# (y [b, l, H], the call's state for backward in one uint8 buffer: the tensors it created (saved_layout's "new"
# slots where state_plan puts them), then its dropout states and the GEMM weights it cast to x's dtype
# (state_tail), for backward to read again)
_LIB.define("layer(Tensor x, Tensor? key_padding_mask, Tensor? encoder_k, Tensor? encoder_v, "
            f"Tensor? encoder_padding_mask, Tensor[] params, {_OPTION_ARGS}) -> (Tensor, Tensor)",
            tags=(torch.Tag.pt2_compliant_tag, *RANDOM_TAGS))
# (grad_x [b, l, H], the parameters' gradients in one tensor (grad_plan: each where its offset puts it), the
# gradients of the parameters grad_plan leaves out, [grad_encoder_k, grad_encoder_v] ([b, ls, H]) or [])
_LIB.define("layer_backward(Tensor grad, Tensor state, Tensor x, Tensor? key_padding_mask, Tensor? encoder_k, "
            f"Tensor? encoder_v, Tensor? encoder_padding_mask, Tensor[] params, {_OPTION_ARGS}) -> "
            "(Tensor, Tensor, Tensor[], Tensor[])", tags=(torch.Tag.pt2_compliant_tag,))
layer_op = torch.ops.lsmini.layer.default
layer_backward_op = torch.ops.lsmini.layer_backward.default

_INPUT_INDEX = {name: i for i, name in enumerate(_INPUTS)}
_LAYOUT_NONE, _LAYOUT_INPUT, _LAYOUT_SAME, _LAYOUT_NEW = range(4)


def cpp_plan(kinds, hidden, ffn, heads, scale, eps, pre_ln, activation, dropout, attn_dropout, activation_dropout,
             causal, recompute, batch, q_len, has_mask, has_encoder_mask, dtype, src_len, param_dtypes,
             param_shapes):
    """Everything the operators' C++ kernels need to lay out one call, as plain numbers (they ask once per
    shape and keep the answer): (per slot (kind, reference, dtype, shape) — _LAYOUT_NONE / _INPUT (reference:
    _INPUTS index) / _SAME (reference: slot) / _NEW (dtype, shape) —, the slots' byte offsets (state_plan),
    the dropout states' and the cast weights' byte offsets and the state's bytes (state_tail), the cast
    positions and their element offsets (cast_plan), the gradients' element offsets and length (grad_plan),
    whether the gradient tensor has gaps to zero, the backward's scratch elements)."""
    o = _options(kinds, hidden, ffn, heads, scale, eps, pre_ln, activation, dropout, attn_dropout,
                 activation_dropout, causal, recompute)
    layout, offsets, nbytes = _plan(o, batch, q_len, has_mask, has_encoder_mask, dtype, src_len)
    params = [torch.empty(shape, dtype=d, device="meta") for d, shape in zip(param_dtypes, param_shapes)]
    positions, starts = cast_plan(params, dtype)
    rng_at, cast_at, total = state_tail(o, nbytes, starts[-1], dtype)
    grad_offsets, grad_numel = grad_plan(params)
    gaps = grad_numel != sum(p.numel() for p, at in zip(params, grad_offsets) if at >= 0)
    slots = []
    for entry in layout:
        if entry is None:
            slots.append((_LAYOUT_NONE, 0, dtype, []))
        elif entry[0] == "input":
            slots.append((_LAYOUT_INPUT, _INPUT_INDEX[entry[1]], dtype, []))
        elif entry[0] == "same":
            slots.append((_LAYOUT_SAME, entry[1], dtype, []))
        else:
            slots.append((_LAYOUT_NEW, 0, entry[2], list(entry[1])))
    return (slots, offsets, rng_at, cast_at, total, list(positions), starts[:-1], grad_offsets, grad_numel, gaps,
            scratch_numel(o, batch, q_len))


if _backend.ext_or_none() is not None:
    _backend.ext().set_layer_planner(cpp_plan)


@torch.library.register_fake("lsmini::layer", lib=_LIB)
def _layer_fake(x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params, kinds, hidden, ffn, heads,
                scale, eps, pre_ln, activation, dropout, attn_dropout, activation_dropout, causal, recompute):
    o = _options(kinds, hidden, ffn, heads, scale, eps, pre_ln, activation, dropout, attn_dropout,
                 activation_dropout, causal, recompute)
    sizes = (*x.shape, *(() if encoder_k is None else encoder_k.shape))
    _, _, nbytes = _plan_of(o, x, key_padding_mask, encoder_k, encoder_padding_mask,
                            cached=not any(isinstance(d, torch.SymInt) for d in sizes))
    total = state_tail(o, nbytes, cast_plan(params, x.dtype)[1][-1], x.dtype)[2]
    return torch.empty_like(x), x.new_empty(total, dtype=torch.uint8)


@torch.library.register_fake("lsmini::layer_backward", lib=_LIB)
def _layer_backward_fake(grad, state, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params,
                         *options):
    kv = [] if encoder_k is None else [encoder_k.new_empty(encoder_k.shape), encoder_v.new_empty(encoder_v.shape)]
    offsets, numel = grad_plan(params)
    others = [torch.empty_like(p, memory_format=torch.contiguous_format) for p, at in zip(params, offsets) if at < 0]
    return x.new_empty(x.shape), x.new_empty(numel, dtype=params[0].dtype), others, kv


def _setup_context(ctx, inputs, output):
    x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params = inputs[:6]
    ctx.options = inputs[6:]
    ctx.save_for_backward(output[1], x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, *params)


def _backward(ctx, grad, grad_state):
    state, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, *params = ctx.saved_tensors
    grad_x, grads, others, kv = layer_backward_op(grad.contiguous(), state, x, key_padding_mask, encoder_k, encoder_v,
                                                  encoder_padding_mask, list(params), *ctx.options)
    others = iter(others)
    param_grads = [next(others) if at < 0 else grads.as_strided(p.shape, _contiguous_strides(p.shape), at)
                   for p, at in zip(params, grad_plan(params)[0])]
    grad_k, grad_v = kv if encoder_k is not None else (None, None)
    return (grad_x, None, grad_k, grad_v, None, param_grads) + (None,) * len(ctx.options)


torch.library.register_autograd("lsmini::layer", _backward, setup_context=_setup_context, lib=_LIB)


# ---- the reference path: plain differentiable PyTorch ------------------------------------------------------
def _reference_core(kind, x, p, o, batch, q_len, inputs):
    w_in, b_in, w_out = p[0], p[1], p[2]
    if kind == "ffn":
        hidden = bias_act_dropout_ref(F.linear(x, w_in), b_in, o.activation, o.activation_dropout, o.training)
        return F.linear(hidden, w_out)
    projection = F.linear(x, w_in, b_in.to(x.dtype))
    if kind == "self":
        q, k, v = heads_of(projection, batch, q_len, 3, o.heads, o.head_dim)
        mask, causal = inputs["key_padding_mask"], o.causal
    else:
        q = heads_of(projection, batch, q_len, 1, o.heads, o.head_dim)[0]
        k, v, mask, causal = inputs["encoder_k"], inputs["encoder_v"], inputs["encoder_padding_mask"], False
    context = attention_ref(q, k, v, mask, causal, o.attn_dropout, o.training, o.scale)
    return F.linear(context.transpose(1, 2).reshape(batch * q_len, o.hidden), w_out)


def reference_layer(o, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params):
    """The layer's forward from the ops' references, differentiable by autograd (the compiler traces it)."""
    batch, q_len, hidden = x.shape
    inputs = {"key_padding_mask": key_padding_mask, "encoder_k": encoder_k, "encoder_v": encoder_v,
              "encoder_padding_mask": encoder_padding_mask}
    r = x.reshape(batch * q_len, hidden)
    for i, kind in enumerate(o.kinds):
        p = params[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)]
        if o.pre_ln:
            core = _reference_core(kind, layer_norm_ref(r, p[4], p[5], o.eps), p, o, batch, q_len, inputs)
            r = bias_dropout_residual_ref(core, p[3], r, o.dropout, o.training)
        else:
            core = _reference_core(kind, r, p, o, batch, q_len, inputs)
            r = layer_norm_ref(bias_dropout_residual_ref(core, p[3], r, o.dropout, o.training), p[4], p[5], o.eps)
    return r.view(batch, q_len, hidden)


def layer_call(o, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params):
    """One layer call while compiling: x [b, l, H] contiguous in the compute dtype, params as the module
    holds them (e.g. float32 under autocast), encoder_k/encoder_v [b, ls, H] for a layer with a cross block
    (column blocks of the decoder's one cross-K/V projection: their gradients then gather back into the
    projection's by a stack along the columns, where [b, heads, ls, d] views needed a permuting copy too,
    whose index arithmetic the compiler spent time simplifying). The custom operator on the kernel path
    with the fused attention, the references otherwise.

    The operators cast the GEMM weights themselves (one multi-tensor copy into one buffer, which forward
    returns for backward to read) and return every gradient in its parameter's dtype straight out of its
    GEMM, as the eager LayerFunction does. Casting in the graph instead cost a cast node per weight each way
    (~150 for a 6+6 model), and the compile time that goes with them."""
    if o.kernels and x.is_cuda and fused_attention_supported(x.dtype, o.head_dim):
        return layer_op(x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, list(params),
                        ",".join(o.kinds), o.hidden, o.ffn, o.heads, o.scale, o.eps, o.pre_ln, o.activation,
                        o.dropout, o.attn_dropout, o.activation_dropout, o.causal, o.recompute)[0]
    cast = [p for i in range(len(o.kinds))
            for p in cast_block(params[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)], x.dtype)]
    if encoder_k is not None:
        encoder_k, encoder_v = _heads(encoder_k, o.heads), _heads(encoder_v, o.heads)
    return reference_layer(o, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, cast)
