"""The autograd Functions of the fused layers: one per layer call (LayerFunction) and one for the
cross-attention K/V of a whole decoder stack (CrossKVFunction), with the slots in which the layers'
backward leaves that stack's K/V gradient.

LayerFunction runs a layer's blocks (blocks.py) forward, saves what their backward needs and runs the
hand-written backward in reverse block order, its temporaries in the arena of (device, dtype). On the
kernel path (CUDA, float16/bfloat16, a head_dim the fused attention has) the whole forward is ONE call
into the extension (``_C.layer_fwd``, csrc/layers/layer.cpp) and so is the whole backward
(``_C.layer_bwd``): the same blocks, kernels, GEMMs, dropout draws and arena, issued from C++ instead of
one Python call per kernel. ``ONE_CALL = False`` runs the blocks from Python everywhere (the tests check
the two agree bit for bit). Where a parameter's .grad already exists (a FusedAdam workspace's views),
the one-call backward adds the gradient there itself — a GEMM weight's in its GEMM (beta = 1), the
vectors' in one multi-tensor add — instead of handing autograd a fresh tensor to add (``_grad_into``).

Cross-attention of a decoder stack: CrossKVFunction projects the encoder output with the K/V weights of
ALL layers at once ([b·ls, H] × [H, L·2H], one GEMM) and hands each layer its K and V as views. In
backward each layer's attention writes its dK/dV straight into its columns of one [b·ls, L·2H] buffer
(KVGradSlots), so CrossKVFunction gets the stacked gradient without a copy and runs one GEMM for
d(encoder output) and one for d(weight).

Under CUDA graph capture the dropout states hold device pointers that each replay refills, so forward,
recompute and backward of one replay share one mask and every replay draws a new one.
"""
import torch
from torch.autograd.function import once_differentiable

from lsmini import _backend
from lsmini.layers.arena import get_arena
from lsmini.layers.blocks import block_backward, block_forward, heads_of, project, weight_grad
from lsmini.layers.precision import cast_block, cast_blocks_batched, no_autocast
from lsmini.layers.spec import PARAMS_PER_BLOCK, CallShape, scratch_numel
from lsmini.ops.attention import fused_attention_supported
from lsmini.ops.bias_dropout_residual import bias_grad


class KVGradSlots:
    """The [b·ls, L·2H] gradient of the stacked cross-attention K/V projection, filled slice by slice by the
    layers' backward (layer i writes parts 2i and 2i+1) and handed whole to CrossKVFunction."""

    def __init__(self, parts):
        self.parts = parts
        self.dims = self.dtype = self.device = None  # (b, ls, heads, d), set by CrossKVFunction.forward
        self.buf = self.views = None

    def slot(self, index):
        """(dK, dV) [b, heads, ls, d] views for layer ``index``."""
        if self.buf is None:
            b, ls, h, d = self.dims
            self.buf = torch.empty(b * ls, self.parts * h * d, dtype=self.dtype, device=self.device)
            self.views = heads_of(self.buf, b, ls, self.parts, h, d)  # made once: each layer asks for its pair
        return self.views[2 * index], self.views[2 * index + 1]

    def collect(self, grads):
        """The stacked gradient: parts a layer wrote are used as they are; parts that got no gradient are
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


# ---- saving the blocks' nested states through save_for_backward -----------------------------------------
class _Saved:
    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


def _pack(obj, tensors):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Saved(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _pack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pack(v, tensors) for v in obj)
    return obj


def _unpack(obj, tensors):
    if isinstance(obj, _Saved):
        return tensors[obj.i]
    if isinstance(obj, dict):
        return {k: _unpack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v, tensors) for v in obj)
    return obj


# Run a kernel-path layer as one extension call each way (see the module docstring).
ONE_CALL = True


def _one_call(x, shape):
    return ONE_CALL and shape.fused and x.is_cuda and hasattr(_backend.ext_or_none(), "layer_fwd")


def _grad_into(params, needed):
    """Per parameter, its .grad when the layer's backward may add the gradient there itself — what
    autograd's accumulation would do, without its kernel per parameter: e.g. the gradient views of a
    FusedAdam workspace — else None. Only for a leaf whose gradient already exists, contiguous, with no
    hooks that must see the gradient (a data-parallel reducer's, say), outside double backward. (torch
    itself keeps a .grad in its parameter's dtype, shape and device.)"""
    if torch.is_grad_enabled():
        return [None] * len(params)
    into = []
    for p, need in zip(params, needed):
        g = p.grad
        ok = (need and g is not None and p.is_leaf and not p._post_accumulate_grad_hooks and not p._backward_hooks
              and g.is_contiguous())
        into.append(g if ok else None)
    return into


def _block_params(params, i):
    return params[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)]


class LayerFunction(torch.autograd.Function):
    """apply(options, kv_slots, layer_index, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask,
    *params) → y, all [b, l, H]; spec.PARAMS_PER_BLOCK params per block of options.kinds.

    x contiguous, in the compute dtype; params as the module holds them (e.g. float32 under autocast):
    forward casts the GEMM weights itself and backward returns every gradient in its parameter's dtype —
    the weight gradients straight out of their GEMMs (``blocks.weight_grad``), so no cast pass runs either
    way. encoder_k/encoder_v [b, heads, ls, d], encoder_padding_mask and kv_slots/layer_index (where the
    layer's dK/dV go) only for layers with a "cross" block.
    """

    @staticmethod
    def forward(ctx, options, kv_slots, layer_index, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask,
                *params):
        b, l, hidden = x.shape
        shape = CallShape(batch=b, q_len=l, src_len=0 if encoder_k is None else encoder_k.shape[2],
                          fused=options.kernels and fused_attention_supported(x.dtype, options.head_dim),
                          weight_dtype=params[0].dtype)
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.leaf_params = params  # the module's own: backward may add their gradients into their .grad
        params = cast_blocks_batched(params, x.dtype)  # as the kernels and GEMMs take them
        ctx.scratch_numel = scratch_numel(options, b, l)
        if any(ctx.needs_input_grad):  # training: size the arena for the backward now, in one growth
            get_arena(x.device, x.dtype).take(ctx.scratch_numel)
        ctx.options, ctx.shape, ctx.kv_slots, ctx.layer_index = options, shape, kv_slots, layer_index
        ctx.one_call = _one_call(x, shape)
        if ctx.one_call:
            y, saved, ctx.rngs = _backend.ext().layer_fwd(options, x, key_padding_mask, encoder_k, encoder_v,
                                                          encoder_padding_mask, params)
            ctx.n_state = len(saved)
            ctx.save_for_backward(*saved, *params)
            return y
        inputs = {"key_padding_mask": key_padding_mask, "encoder_k": encoder_k, "encoder_v": encoder_v,
                  "encoder_padding_mask": encoder_padding_mask}
        residual = x.view(b * l, hidden)
        states = []
        for i, kind in enumerate(options.kinds):
            residual, saved = block_forward(kind, residual, _block_params(params, i), options, shape, inputs)
            states.append(saved)
        tensors = []
        ctx.packed = _pack(states, tensors)
        ctx.n_state = len(tensors)
        ctx.save_for_backward(*tensors, *params)
        return residual.view(b, l, hidden)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        saved = ctx.saved_tensors  # first: a checkpointing recompute may use the arena while unpacking
        options, shape = ctx.options, ctx.shape
        params = saved[ctx.n_state:]
        kv_grads = None if ctx.kv_slots is None else ctx.kv_slots.slot(ctx.layer_index)
        with no_autocast(grad.device.type):
            scratch = get_arena(grad.device, grad.dtype).take(ctx.scratch_numel)
            if ctx.one_call:
                grad_k, grad_v = (None, None) if kv_grads is None else kv_grads
                into = _grad_into(ctx.leaf_params, ctx.needs_input_grad[8:])
                g, param_grads = _backend.ext().layer_bwd(options, grad, saved[:ctx.n_state], ctx.rngs, params, scratch,
                                                          grad_k, grad_v, ctx.param_dtypes, into)
                return None, None, None, g, None, grad_k, grad_v, None, *param_grads
            states = _unpack(ctx.packed, saved[:ctx.n_state])
            g = grad.contiguous().view(shape.tokens, options.hidden)
            param_grads = [None] * len(params)
            for i in reversed(range(len(options.kinds))):
                ours = i < len(options.kinds) - 1  # the incoming gradient is autograd's, the others ours
                g, param_grads[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)] = block_backward(
                    options.kinds[i], g, _block_params(params, i), states[i], options, shape, scratch, ours,
                    kv_grads if options.kinds[i] == "cross" else None)
            # no-ops but for mixed parameter dtypes
            param_grads = [pg.to(dt) for pg, dt in zip(param_grads, ctx.param_dtypes)]
        grad_k, grad_v = (None, None) if kv_grads is None else kv_grads
        return (None, None, None, g.view(shape.batch, shape.q_len, options.hidden), None, grad_k, grad_v, None,
                *param_grads)


class CrossKVFunction(torch.autograd.Function):
    """apply(enc, weight [P·H, H], bias [P·H], heads, slots, kernels) → P views [b, heads, ls, d] of ONE
    [b·ls, P·H] GEMM over the encoder output: the K/V of every decoder layer. weight/bias as the module
    holds them (cast here, gradients in their dtypes, as LayerFunction)."""

    @staticmethod
    def forward(ctx, enc, weight, bias, heads, slots, kernels):
        b, ls, hidden = enc.shape
        enc2d = enc.reshape(b * ls, hidden)
        weight_c, bias_c = cast_block((weight, bias), enc.dtype)
        kv = project(enc2d, weight_c, bias_c)
        slots.dims, slots.dtype, slots.device = (b, ls, heads, hidden // heads), kv.dtype, kv.device
        ctx.save_for_backward(enc2d, weight_c)
        ctx.dtypes = weight.dtype, bias.dtype, bias_c.dtype
        ctx.slots, ctx.kernels, ctx.enc_shape = slots, kernels, enc.shape
        ctx.set_materialize_grads(False)
        return heads_of(kv, b, ls, slots.parts, heads, hidden // heads)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        enc2d, weight_c = ctx.saved_tensors
        if all(g is None for g in grads):
            return None, None, None, None, None, None
        weight_dtype, bias_dtype, bias_compute_dtype = ctx.dtypes
        with no_autocast(enc2d.device.type):
            grad_kv = ctx.slots.collect(grads)
            grad_bias = bias_grad(grad_kv, bias_compute_dtype, ctx.kernels).to(bias_dtype)
            grad_enc = torch.mm(grad_kv, weight_c).view(ctx.enc_shape) if ctx.needs_input_grad[0] else None
            grad_weight = weight_grad(grad_kv.t(), enc2d, weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_enc, grad_weight, grad_bias, None, None, None
