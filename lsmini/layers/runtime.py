"""How a layer call runs: on the kernel path, the operators ``lsmini::layer`` / ``lsmini::layer_backward``
(csrc/layers/layer.cpp: the whole forward and the whole backward, one call each, their plan computed there)
under one autograd Function, ``LayerFunction``, in eager and compiled code alike; elsewhere the reference
layer (reference.py), whose backward autograd derives. Which one runs depends only on the call's arguments:
``kernel_path``. The operators implement every option the reference does.

Gradients only where autograd asks: the backward hands the operator the parameters' existing ``.grad``
tensors to add their gradients into (a GEMM's beta = 1 instead of a fresh gradient that autograd then adds
in another pass) only for parameters whose ``.grad`` autograd would accumulate into in this very backward,
with nothing watching (``_C.layer_grad_into`` decides: hooks, ``retain_grad``, ``backward(inputs=...)``,
``torch.autograd.grad``, double backward and data-parallel reducers all keep PyTorch's semantics). A compiled
graph's backward returns every gradient: autograd's accumulation is part of what the compiler traced. A model's
output projection (``output_projection``) and the token embedding (``lsmini.ops.embedding``) follow the same
rule for their weights (``lsmini.ops.library.grad_into``).

Cross-attention of a decoder stack: the encoder output is the same input to every layer's K/V projection, so
one GEMM ([b·ls, H] × [H, L·2W], W = kv_heads·head_dim) gives them all, and each layer takes its K and V as
[b, ls, W] column blocks of that one output. In eager code ``CrossKVFunction`` makes that GEMM and hands its
backward one stacked gradient that the layers' backward filled in place (``KVGradSlots``: each layer's operator
writes its dK/dV into its columns). Compiled and reference code make the same GEMM as plain PyTorch.
"""
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lsmini import _backend
from lsmini.layers.precision import cast_block, no_autocast
from lsmini.layers.reference import reference_layer
from lsmini.layers.spec import GATED, PARAMS_PER_BLOCK
from lsmini.ops.attention import fused_attention_supported
from lsmini.ops.bias_dropout_residual import bias_grad
from lsmini.ops.library import grad_into


def kernel_path(options, x):
    """True when a layer call on x runs the operators: CUDA, the extension built and not forced
    off, and a dtype and head_dim the fused attention kernel has."""
    return x.is_cuda and fused_attention_supported(x.dtype, options.head_dim) and _backend.use_kernels(x)


class KVGradSlots:
    """The [b·ls, P·W] gradient of a decoder stack's cross-attention K/V projection (W = kv_heads·head_dim
    columns per K or V), filled column block by column block by the layers' backward (layer i writes blocks
    2i and 2i+1) and handed whole to CrossKVFunction."""

    def __init__(self, parts):
        self.parts = parts
        self.shape = self.dtype = self.device = None  # (b, ls, W), set by CrossKVFunction.forward
        self.buf = self.views = None

    def slot(self, index):
        """[dK, dV], [b, ls, W] views for layer ``index``."""
        if self.buf is None:
            b, ls, width = self.shape
            self.buf = torch.empty(b * ls, self.parts * width, dtype=self.dtype, device=self.device)
            self.views = self.buf.view(b, ls, self.parts, width).unbind(2)
        return [self.views[2 * index], self.views[2 * index + 1]]

    def collect(self, grads):
        """The stacked gradient: blocks a layer wrote are used as they are; blocks that got no gradient are
        zeros; gradients that arrive elsewhere (the K/V also used outside) are copied in."""
        if self.buf is None:
            self.slot(0)
        buf, views = self.buf, self.views
        self.buf = self.views = None
        for view, g in zip(views, grads):
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
                view.copy_(g)
        return buf


class CrossKVFunction(torch.autograd.Function):
    """apply(enc [b, ls, H], weight [P·W, H], bias [P·W] or None, slots) → P views [b, ls, W] of ONE GEMM
    over the encoder output: the K/V of every decoder layer (W = kv_heads·head_dim). weight/bias as the
    module holds them (cast here, gradients in their dtypes)."""

    @staticmethod
    def forward(ctx, enc, weight, bias, slots):
        b, ls, hidden = enc.shape
        width = weight.shape[0] // slots.parts
        enc2d = enc.reshape(b * ls, hidden)
        weight_c, bias_c = cast_block((weight, bias), enc.dtype)
        kv = torch.mm(enc2d, weight_c.t()) if bias is None else torch.addmm(bias_c.to(enc.dtype), enc2d, weight_c.t())
        slots.shape, slots.dtype, slots.device = (b, ls, width), kv.dtype, kv.device
        ctx.save_for_backward(enc2d, weight_c)
        ctx.dtypes = weight.dtype, None if bias is None else (bias.dtype, bias_c.dtype)
        ctx.slots, ctx.enc_shape = slots, enc.shape
        ctx.set_materialize_grads(False)
        return kv.view(b, ls, slots.parts, width).unbind(2)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        enc2d, weight_c = ctx.saved_tensors
        if all(g is None for g in grads):
            return None, None, None, None
        weight_dtype, bias_dtypes = ctx.dtypes
        with no_autocast(enc2d.device.type):
            grad_kv = ctx.slots.collect(grads)
            grad_bias = None if bias_dtypes is None else \
                bias_grad(grad_kv, bias_dtypes[1], kernels=True).to(bias_dtypes[0])
            grad_enc = torch.mm(grad_kv, weight_c).view(ctx.enc_shape) if ctx.needs_input_grad[0] else None
            grad_weight = None
            if ctx.needs_input_grad[1]:
                grad_weight = torch.mm(grad_kv.t(), enc2d, out_dtype=weight_dtype) if weight_dtype != grad_kv.dtype \
                    else torch.mm(grad_kv.t(), enc2d)
        return grad_enc, grad_weight, grad_bias, None


def cross_kv(enc, weight, bias, parts, slots=None):
    """The ``parts`` [b, ls, W] K/V column blocks (W = weight rows / parts = kv_heads·head_dim) of one GEMM
    over enc [b, ls, H] with a decoder's stacked projection (bias may be None): CrossKVFunction where
    ``slots`` is given (eager kernel path), plain PyTorch otherwise."""
    if slots is not None:
        return CrossKVFunction.apply(enc, weight, bias, slots)
    b, ls, _ = enc.shape
    weight, bias = cast_block((weight, bias), enc.dtype)
    kv = F.linear(enc, weight, None if bias is None else bias.to(enc.dtype))
    return kv.view(b, ls, parts, weight.shape[0] // parts).unbind(2)


class OutputProjectionFunction(torch.autograd.Function):
    """apply(h [..., H], weight [V, H], both in one dtype) → h · weightᵀ, as F.linear, except that the backward
    adds the weight's gradient into its .grad with the GEMM itself (beta = 1) where autograd would accumulate it
    there (``grad_into``: the layers' rule, module docstring), instead of making a fresh [V, H] gradient that
    autograd then adds in another pass."""

    @staticmethod
    def forward(ctx, h, weight):
        ctx.save_for_backward(h, weight)
        return F.linear(h, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_h = torch.mm(grad2d, weight).view(h.shape) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            h2d = h.reshape(-1, h.shape[-1])
            into = grad_into(weight, grad2d)
            if into is None:
                grad_weight = torch.mm(grad2d.t(), h2d)
            else:
                into.addmm_(grad2d.t(), h2d)
        return grad_h, grad_weight


def output_projection(h, weight):
    """h · weightᵀ, a model's logits: OutputProjectionFunction in eager CUDA code where h and weight share the
    dtype autocast (if on) computes in, F.linear elsewhere (CPU, compiled code, mixed dtypes)."""
    device = h.device.type
    same = h.dtype == weight.dtype and (not torch.is_autocast_enabled(device)
                                        or torch.get_autocast_dtype(device) == h.dtype)
    if h.is_cuda and same and not torch.compiler.is_compiling():
        return OutputProjectionFunction.apply(h, weight)
    return F.linear(h, weight)


def _contiguous_strides(shape):
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


def _transposed_layout(p):
    """A transposed view of a contiguous 2-D tensor (GPT-2's Conv1D weights, as weight.t()): the operator writes
    its gradient in that layout (layer.cpp's transposed_layout), so that it reaches the parameter without a copy."""
    return p.dim() == 2 and not p.is_contiguous() and p.stride() == (1, p.shape[0])


def _param_grads(params, into, grads, grads_other):
    """Each parameter's gradient as lsmini::layer_backward returns them (its schema's comment): in order, those
    of params[0]'s dtype in grads and those of the other dtype in grads_other, each at the next multiple of 64
    elements, contiguous or (_transposed_layout) in the parameter's layout; None for the absent parameters
    (None) and those whose gradient went into their .grad."""
    out, ends = [], [0, 0]
    for p, g in zip(params, into):
        if p is None or g is not None:
            out.append(None)
            continue
        b = 0 if p.dtype == params[0].dtype else 1
        strides = p.stride() if _transposed_layout(p) else _contiguous_strides(p.shape)
        out.append((grads, grads_other)[b].as_strided(p.shape, strides, ends[b]))
        ends[b] += (p.numel() + 63) // 64 * 64
    return out


class LayerFunction(torch.autograd.Function):
    """apply(options, kv_slots, layer_index, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask,
    rotary_cos, rotary_sin, *params) → y [b, l, H]: one layer on the kernel path. x contiguous in the compute
    dtype (float16 or bfloat16); params as the module holds them, None for an absent bias (the operator casts
    the GEMM weights, and backward returns each gradient in its parameter's dtype); encoder_k/encoder_v
    [b, ls, H] for a layer with a cross block; rotary_cos/rotary_sin the float32 rotary tables ([l, rotary_dim]
    or [b, l, rotary_dim]) when options.rotary_dim > 0, else None. kv_slots/layer_index: where the layer's
    backward writes dK/dV in eager code (KVGradSlots), or None."""

    @staticmethod
    def forward(ctx, options, kv_slots, layer_index, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask,
                rotary_cos, rotary_sin, *params):
        y, state = torch.ops.lsmini.layer.default(x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask,
                                                  list(params), *options.op_args(), rotary_cos, rotary_sin)
        ctx.save_for_backward(state, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, rotary_cos,
                              rotary_sin, *params)
        ctx.options, ctx.kv_slots, ctx.layer_index = options, kv_slots, layer_index
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (state, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, rotary_cos, rotary_sin,
         *params) = ctx.saved_tensors
        into = [None] * len(params)
        kv_into = []
        if not torch.compiler.is_compiling():  # a compiled backward returns every gradient (module docstring)
            into = _backend.ext().layer_grad_into(params)
            if ctx.kv_slots is not None:
                kv_into = ctx.kv_slots.slot(ctx.layer_index)
        index = [i for i, g in enumerate(into) if g is not None]
        grad_x, grads, grads_other, grad_k, grad_v = torch.ops.lsmini.layer_backward.default(
            grad.contiguous(), state, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params, index,
            [into[i] for i in index], kv_into, *ctx.options.op_args(), rotary_cos, rotary_sin)
        param_grads = [g if need else None for g, need in
                       zip(_param_grads(params, into, grads, grads_other), ctx.needs_input_grad[10:])]
        if encoder_k is None:
            grad_k = grad_v = None
        elif kv_into:
            grad_k, grad_v = kv_into
        return (None, None, None, grad_x, None, grad_k, grad_v, None, None, None, *param_grads)


def run_layer(options, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params, kv_slots=None,
              layer_index=0, cache=None, rotary=None):
    """One layer call: x [b, l, H] contiguous in the compute dtype; params as the module holds them (every
    block's six, spec.BLOCK_PARAMS, None for an absent bias, then spec.QK_NORM_PARAMS with qk_norm);
    encoder_k/encoder_v [b, ls, kv_heads·head_dim] for a layer with a cross block; rotary: None, or (cos, sin)
    float32 [l, rotary_dim] or [b, l, rotary_dim] for x's positions (lsmini.ops.rotary.rotary_cos_sin) exactly
    when options.rotary_dim > 0. The operators when ``kernel_path`` (and no cache), else the reference layer
    (with the GEMM weights cast to x's dtype)."""
    # two plain tests, no comparison of bools: under torch.compile rotary_dim may be a symbolic int
    if (rotary is None and options.rotary_dim) or (rotary is not None and not options.rotary_dim):
        raise ValueError(f"run_layer: rotary must be (cos, sin) tables exactly when options.rotary_dim > 0; got "
                         f"rotary_dim {options.rotary_dim} and rotary {'None' if rotary is None else 'tables'}")
    if cache is None and kernel_path(options, x):
        cos, sin = rotary if rotary is not None else (None, None)
        return LayerFunction.apply(options, kv_slots, layer_index, x, key_padding_mask, encoder_k, encoder_v,
                                   encoder_padding_mask, cos, sin, *params)
    n = PARAMS_PER_BLOCK * len(options.kinds)
    cast = [p for i in range(len(options.kinds))
            for p in cast_block(params[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)], x.dtype)]
    return reference_layer(options, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask,
                           cast + list(params[n:]), cache, rotary)
