"""The sub-blocks of a fused layer, forward and hand-written backward: attention (self and cross) and FFN
cores, each wrapped in its LayerNorm and bias + dropout + residual step.

Each block has the six parameters of spec.BLOCK_PARAMS:

    self:   weight_in = fused QKV [3H, H]     weight_out = attention output [H, H]
    cross:  weight_in = query     [H, H]      (K/V come from the decoder stack's one GEMM, function.py)
    ffn:    weight_in = [F, H]                weight_out = [H, F]    (bias_in added by bias_act_dropout)
    bias_out is added by bias_dropout_residual; norm_weight/norm_bias is the block's LayerNorm.

    pre-LN:  r ← r + dropout(core(LN(r)) + bias_out)     post-LN:  r ← LN(r + dropout(core(r) + bias_out))

Attention core: the input projection with its bias in the GEMM (addmm), then the fused attention op
(``lsmini.ops.attention``: QKᵀ, masks, softmax, dropout and ·V without writing the [len, len] scores)
reading Q/K/V as per-head views of the projection output and writing the context in the merged
[tokens, H] layout, then the output GEMM. fp32 and head dims the kernel lacks run the reference instead
(its dropout mask kept). FFN core: GEMM, bias_act_dropout, GEMM.

Every element-wise step is an lsmini op primitive (``lsmini.ops.<op>.<op>_fwd/_bwd``), which runs the
kernel or the reference: the same block code serves both paths.

What forward saves (options.recompute, the default): each block's input, the Q/K/V projection, the
attention context and its per-row log-sum-exp, the first FFN GEMM's output, LayerNorm statistics, each
dropout's Philox state; backward recomputes the FFN activation (bias_act_dropout again, same mask) and,
for pre-LN, the LayerNorm outputs. recompute = False saves those instead. With relu the FFN keeps its
activation instead of the GEMM output either way (same size): relu's derivative and the dropout mask can
be read off it, so there is nothing to recompute.

Backward temporaries are views into the scratch arena (arena.py), laid out per core:

    self:   [0, TH) d(context), then the recomputed pre-LN input, then d(core input);
            [TH', TH' + 3TH) d(core output) (bias_dropout_residual's input gradient), then
            d(QKV projection) (TH' = TH aligned)
    cross:  [0, TH) as above; [TH', TH' + TH) d(core output), then d(Q projection). dK/dV go to the
            stack's K/V gradient slots.
    ffn:    [0, TF) the recomputed activation (not with relu), then its gradient, then (in place)
            d(first GEMM output); its [t, H] temporaries are fresh (see ffn_backward).

Regions overlap only where one is dead before the other is written (stream order). spec.scratch_numel
sizes the arena for this layout. Everything a block's backward returns is a fresh tensor or the
incoming gradient itself.
"""
import torch

from lsmini.layers.arena import align, region
from lsmini.ops.attention import attention_bwd, attention_fwd
from lsmini.ops.bias_act_dropout import bias_act_dropout_bwd, bias_act_dropout_fwd, relu_output_saved
from lsmini.ops.bias_dropout_residual import bias_dropout_residual_bwd, bias_dropout_residual_fwd, bias_grad
from lsmini.ops.layernorm import layer_norm_bwd, layer_norm_fwd


def heads_of(x2d, batch, length, parts, heads, head_dim):
    """The ``parts`` [batch, heads, length, head_dim] views of a projection output x2d
    [batch·length, parts·heads·head_dim] (columns part-major, then head): what the attention kernel reads
    and its gradients are written into, no copies."""
    return x2d.view(batch, length, parts, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)


def project(x, weight, bias):
    """x·weightᵀ + bias in one GEMM (the bias in the GEMM's epilogue)."""
    return torch.addmm(bias.to(x.dtype), x, weight.t())


def weight_grad(a, b, dtype):
    """a·b, a weight gradient, in the parameter's dtype: with fp16/bf16 operands and float32 parameters
    (autocast) the GEMM writes float32 itself on CUDA, instead of a half-precision result plus a cast pass."""
    if dtype == torch.float32 and a.dtype != dtype and a.is_cuda:
        return torch.mm(a, b, out_dtype=dtype)
    return torch.mm(a, b).to(dtype)


# ---- attention cores ----------------------------------------------------------------------------------------
def _attention_core_forward(x, q, k, v, key_padding_mask, causal, weight_out, options, shape):
    context, attention_saved = attention_fwd(q, k, v, key_padding_mask, causal, options.attn_dropout, options.scale,
                                             shape.fused)
    context = context.view(x.shape[0], options.hidden)
    return torch.mm(context, weight_out.t()), {"input": x, "attention": attention_saved, "context": context}


def self_attention_forward(x, params, options, shape, inputs):
    q, k, v = heads_of(project(x, params[0], params[1]), shape.batch, shape.q_len, 3, options.heads,
                       options.head_dim)
    return _attention_core_forward(x, q, k, v, inputs["key_padding_mask"], options.causal, params[2], options, shape)


def cross_attention_forward(x, params, options, shape, inputs):
    (q,) = heads_of(project(x, params[0], params[1]), shape.batch, shape.q_len, 1, options.heads, options.head_dim)
    return _attention_core_forward(x, q, inputs["encoder_k"], inputs["encoder_v"], inputs["encoder_padding_mask"],
                                   False, params[2], options, shape)


def attention_core_backward(grad_core, params, saved, options, shape, scratch, input_of, kv_grads):
    """Backward of an attention core. Its input projection has 3 parts (QKV) when kv_grads is None, else 1
    (Q) and dK/dV go into kv_grads. The projection's gradient [t, parts·H] lives in scratch after
    d(context); input_of(out): the core's input (recomputed into out, or saved)."""
    weight_in, bias_in, weight_out = params[0], params[1], params[2]
    t, hidden = grad_core.shape[0], options.hidden
    parts = 3 if kv_grads is None else 1
    grad_weight_out = weight_grad(grad_core.t(), saved["context"], shape.weight_dtype)
    grad_context = region(scratch, 0, (t, hidden))
    torch.mm(grad_core, weight_out, out=grad_context)
    grad_projection = region(scratch, align(t * hidden), (t, parts * hidden))
    views = heads_of(grad_projection, shape.batch, shape.q_len, parts, options.heads, options.head_dim)
    grad_q, grad_k, grad_v = views if kv_grads is None else (views[0], *kv_grads)
    attention_bwd(grad_context, saved["attention"], grad_q, grad_k, grad_v, shape.fused)
    grad_bias_in = bias_grad(grad_projection, bias_in.dtype, options.kernels)
    # d(context) is dead once the attention backward has read it: the recomputed input may go there
    grad_weight_in = weight_grad(grad_projection.t(), input_of(region(scratch, 0, (t, hidden))), shape.weight_dtype)
    grad_input = region(scratch, 0, (t, hidden))  # so is a recomputed input, once that GEMM has read it
    torch.mm(grad_projection, weight_in, out=grad_input)
    return grad_input, grad_weight_in, grad_bias_in, grad_weight_out


# ---- FFN core ------------------------------------------------------------------------------------------------
def ffn_forward(x, params, options, shape, inputs):
    weight_in, bias_in, weight_out = params[0], params[1], params[2]
    pre_activation = torch.mm(x, weight_in.t())
    hidden, act_saved = bias_act_dropout_fwd(pre_activation, bias_in, options.activation, options.activation_dropout,
                                             options.kernels)
    if options.activation == "relu":  # relu's derivative is read off its output: keep that, not the GEMM output
        act_saved, pre_activation = relu_output_saved(hidden, options.activation_dropout), None
        kept_hidden = hidden
    else:
        kept_hidden = None if options.recompute else hidden
    return torch.mm(hidden, weight_out.t()), {"input": x, "pre_activation": pre_activation, "hidden": kept_hidden,
                                              "activation": act_saved}


def ffn_backward(grad_core, params, saved, options, shape, scratch, input_of, kv_grads=None):
    weight_in, bias_in, weight_out = params[0], params[1], params[2]
    t = grad_core.shape[0]
    # The arena holds the activation (recomputed, unless kept), then its gradient, then — in place — the
    # gradient of the first GEMM's output: each is dead before the next is written (stream order). The
    # [t, H] temporaries are fresh: that keeps the arena at t·F, and they are freed before the attention
    # blocks' backward, where a layer's memory peaks.
    act_region = region(scratch, 0, (t, options.ffn))
    act_saved = saved["activation"]
    hidden = saved["hidden"]
    if hidden is None:  # recompute the activation from its saved input, same dropout mask
        hidden = bias_act_dropout_fwd(saved["pre_activation"], bias_in, options.activation, options.activation_dropout,
                                      options.kernels, replay=act_saved, out=act_region)[0]
    grad_weight_out = weight_grad(grad_core.t(), hidden, shape.weight_dtype)
    del hidden
    torch.mm(grad_core, weight_out, out=act_region)
    grad_hidden, grad_bias_in = bias_act_dropout_bwd(act_region, bias_in, options.activation, act_saved,
                                                     options.kernels, out=act_region)
    grad_weight_in = weight_grad(grad_hidden.t(), input_of(None), shape.weight_dtype)
    return torch.mm(grad_hidden, weight_in), grad_weight_in, grad_bias_in, grad_weight_out


CORES = {"self": (self_attention_forward, attention_core_backward),
         "cross": (cross_attention_forward, attention_core_backward),
         "ffn": (ffn_forward, ffn_backward)}


# ---- a sub-block: LayerNorm + core + bias/dropout/residual ------------------------------------------------
def block_forward(kind, residual, params, options, shape, inputs):
    """residual [tokens, H] → (the block's output [tokens, H], what its backward needs)."""
    bias_out, norm_weight, norm_bias = params[3], params[4], params[5]
    core = CORES[kind][0]
    if options.pre_ln:
        x, norm_saved = layer_norm_fwd(residual, norm_weight, norm_bias, options.eps, options.kernels)
        out_core, core_saved = core(x, params, options, shape, inputs)
        out, residual_saved = bias_dropout_residual_fwd(out_core, bias_out, residual, options.dropout, options.kernels)
        if options.recompute:  # backward recomputes LN(residual) from the block's input instead
            core_saved["input"] = None
            return out, {"input": residual, "norm": norm_saved, "core": core_saved, "residual": residual_saved}
    else:
        out_core, core_saved = core(residual, params, options, shape, inputs)
        summed, residual_saved = bias_dropout_residual_fwd(out_core, bias_out, residual, options.dropout,
                                                           options.kernels)
        out, norm_saved = layer_norm_fwd(summed, norm_weight, norm_bias, options.eps, options.kernels)
    return out, {"norm": norm_saved, "core": core_saved, "residual": residual_saved}


def block_backward(kind, grad, params, saved, options, shape, scratch, grad_is_ours, kv_grads=None):
    """grad: gradient of the block output; grad_is_ours: grad is this backward's own tensor, which may become
    the result (else it is not modified). kv_grads: a cross block's (dK, dV) destinations. Returns (the
    gradient of the block input — grad itself or a fresh tensor —, the six parameter gradients)."""
    bias_out, norm_weight, norm_bias = params[3], params[4], params[5]
    core = CORES[kind][1]
    core_saved = saved["core"]
    # An attention core's output gradient goes into its projection-gradient region, not written before it is dead.
    grad_core_out = None if kind == "ffn" else region(scratch, align(grad.shape[0] * options.hidden), grad.shape)
    if options.pre_ln:
        def input_of(out):  # the core's input: saved, or LN(block input) recomputed when the core needs it
            x = core_saved["input"]
            if x is None:
                x = layer_norm_fwd(saved["input"], norm_weight, norm_bias, options.eps, options.kernels, out=out)[0]
            return x

        grad_core, grad_bias_out = bias_dropout_residual_bwd(grad, bias_out, saved["residual"], options.kernels,
                                                             out=grad_core_out)
        grad_x, grad_weight_in, grad_bias_in, grad_weight_out = core(grad_core, params, core_saved, options, shape,
                                                                     scratch, input_of, kv_grads)
        # the residual path: grad added to LN's input gradient in the same kernel, into grad when it is ours
        grad_residual, grad_norm_weight, grad_norm_bias = layer_norm_bwd(
            grad_x, norm_weight, norm_bias, options.eps, saved["norm"], options.kernels, add=grad,
            out=grad if grad_is_ours else None)
    else:
        grad_residual, grad_norm_weight, grad_norm_bias = layer_norm_bwd(grad, norm_weight, norm_bias, options.eps,
                                                                         saved["norm"], options.kernels)
        # without dropout grad_core IS grad_residual; the core has finished reading it before the add below
        grad_core, grad_bias_out = bias_dropout_residual_bwd(grad_residual, bias_out, saved["residual"],
                                                             options.kernels, out=grad_core_out)
        grad_x, grad_weight_in, grad_bias_in, grad_weight_out = core(grad_core, params, core_saved, options, shape,
                                                                     scratch, lambda out: core_saved["input"],
                                                                     kv_grads)
        grad_residual.add_(grad_x)
    return grad_residual, (grad_weight_in, grad_bias_in, grad_weight_out, grad_bias_out, grad_norm_weight,
                           grad_norm_bias)
