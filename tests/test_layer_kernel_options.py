"""The layer operators (csrc/layers/layer.cpp) with the options of Llama-style blocks: RMSNorm (pre- and
post-norm), gated FFNs (swiglu, geglu), absent biases, rotary positions on Q/K (full and partial rotary_dim,
one table or one per batch row), grouped K/V heads, QK-norm, alone and together, in self/cross/ffn blocks.
Each runs on the kernel path (lsmini.layers.runtime.run_layer) and is compared, forward and every gradient, with the reference layer
(lsmini.layers.reference) in float64 from the same inputs: the kernel's error must be at most twice the
reference's own error in the same low precision. Dropout: the same seed gives the same results, recompute on
and off agree bit for bit, and the gated activation's mask keeps 1 − p. Eager and torch.compile. CUDA only."""
import math

import pytest
import torch

from layer_testing import _one_thread, _poison_freed_memory, padding_mask  # noqa: F401  (fixtures)
from lsmini.layers.precision import cast_block
from lsmini.layers.reference import reference_layer
from lsmini.layers.runtime import kernel_path, run_layer
from lsmini.layers.spec import PARAMS_PER_BLOCK, LayerOptions
from lsmini.ops.rotary import rotary_cos_sin
from util import assert_dropout_keep_stats, assert_lowp_rule

pytestmark = pytest.mark.cuda

B, L, LS, H, HEADS, FFN = 3, 11, 7, 64, 4, 96  # head_dim 16
DTYPES = [torch.float16, torch.bfloat16]

# name → (blocks, LayerOptions fields, which biases are absent, rotary tables per batch row)
CASES = {
    "rms_pre": (("self", "ffn"), dict(norm="rms_norm"), "norm", False),
    "rms_post": (("self", "ffn"), dict(norm="rms_norm", pre_ln=False), "norm", False),
    "swiglu": (("self", "ffn"), dict(activation="swiglu"), "", False),
    "geglu": (("self", "ffn"), dict(activation="geglu", pre_ln=False), "", False),
    "no_bias": (("self", "ffn"), dict(), "all", False),
    "rotary_full": (("self", "ffn"), dict(rotary_dim=16, causal=True), "", False),
    "rotary_partial_per_batch": (("self", "ffn"), dict(rotary_dim=8), "", True),
    # a Llama layer: RMSNorm weights in float32 beside float16/bfloat16 GEMM weights (two gradient dtypes)
    "llama": (("self", "ffn"), dict(norm="rms_norm", activation="swiglu", rotary_dim=16, causal=True), "all", False),
    # a decoder layer: some biases absent, some present; rotary on the self block only
    "decoder": (("self", "cross", "ffn"), dict(norm="rms_norm", pre_ln=False, activation="geglu", rotary_dim=8),
                "some", True),
    # grouped K/V heads: 4 query heads on 2 and on 1 K/V head; with rotary (the K views hold fewer heads), and in
    # a decoder's self and cross blocks
    "gqa": (("self", "ffn"), dict(kv_heads=2), "", False),
    "llama_gqa": (("self", "ffn"), dict(norm="rms_norm", activation="swiglu", rotary_dim=16, causal=True, kv_heads=2),
                  "all", False),
    "decoder_mqa": (("self", "cross", "ffn"), dict(rotary_dim=8, causal=True, kv_heads=1), "", True),
    # the attention backward's dQ/dK stores undoing the rotation at head_dim 64 (the Hopper kernels there), with a
    # partial rotary_dim whose pairs lie 20 apart (in other lanes)
    "rotary_d64_partial": (("self", "ffn"), dict(heads=1, kv_heads=1, head_dim=64, scale=0.125, rotary_dim=40,
                                                 causal=True), "", True),
    # 3 query heads on 1 K/V head at head_dim 64: on Hopper a cluster of CTAs sums dK, rotating it back as it
    # writes; rotary_dim 36 pairs columns 18 apart (across the sum's 4-column chunks)
    "rotary_d64_gqa": (("self", "ffn"), dict(hidden=192, heads=3, kv_heads=1, head_dim=64, scale=0.125,
                                             rotary_dim=36, causal=True), "", True),
    # QK-norm on the self block's Q and K heads (before rotary, in the same pass): alone; in a Llama layer with
    # float32 norm weights; in a decoder layer with grouped K/V heads; at head_dim 64 (two values a lane) with a
    # partial rotary_dim whose pairs lie 20 apart (in other lanes)
    "qk_norm": (("self", "ffn"), dict(qk_norm=True), "", False),
    "qk_norm_d64": (("self", "ffn"), dict(heads=1, kv_heads=1, head_dim=64, scale=0.125, rotary_dim=40, causal=True,
                                          qk_norm=True), "", True),
    "llama_qk_norm": (("self", "ffn"), dict(norm="rms_norm", activation="swiglu", rotary_dim=16, causal=True,
                                            kv_heads=2, qk_norm=True), "all", False),
    "decoder_qk_norm": (("self", "cross", "ffn"), dict(rotary_dim=8, kv_heads=2, qk_norm=True), "some", True),
}


def _options(kinds, training=False, dropouts=(0.0, 0.0, 0.0), recompute=True, **fields):
    base = LayerOptions(kinds=tuple(kinds), hidden=H, ffn=FFN, heads=HEADS, kv_heads=HEADS, head_dim=H // HEADS,
                        scale=1.0 / math.sqrt(H // HEADS), eps=1e-5, norm="layer_norm", pre_ln=True,
                        activation="gelu", training=training, dropout=dropouts[0], attn_dropout=dropouts[1],
                        activation_dropout=dropouts[2], causal=False, recompute=recompute, rotary_dim=0,
                        qk_norm=False)
    return base._replace(**fields)


def _params(options, absent, dtype, norm_dtype=None, seed=0):
    """Every block's six parameters in the contract's shapes (None where absent), then with qk_norm the Q and K
    norm weights [head_dim], seeded, off their inits."""
    gen = torch.Generator().manual_seed(seed)
    glu = options.activation in ("swiglu", "geglu")
    H = options.hidden
    params = []
    kv_width = options.kv_heads * options.head_dim
    for i, kind in enumerate(options.kinds):
        rows = {"self": H + 2 * kv_width, "cross": H, "ffn": (2 if glu else 1) * FFN}[kind]
        cols_out = FFN if kind == "ffn" else H
        block = [torch.randn(rows, H, generator=gen) / H ** 0.5, 0.1 * torch.randn(rows, generator=gen),
                 torch.randn(H, cols_out, generator=gen) / cols_out ** 0.5, 0.1 * torch.randn(H, generator=gen),
                 1 + 0.2 * torch.randn(H, generator=gen), 0.1 * torch.randn(H, generator=gen)]
        gone = {"all": (1, 3, 5), "norm": (5,), "": (), "some": ((1, 5) if i == 0 else (5,))}[absent]
        if options.norm == "rms_norm":
            gone = set(gone) | {5}
        for j, p in enumerate(block):
            vector_dtype = norm_dtype if j == 4 and norm_dtype is not None else dtype
            params.append(None if j in gone else p.to("cuda", dtype if j in (0, 2) else vector_dtype))
    if options.qk_norm:
        params += [(1 + 0.2 * torch.randn(options.head_dim, generator=gen)).to("cuda", norm_dtype or dtype)
                   for _ in range(2)]
    return params


def _rotary(options, per_batch, seed=0):
    if options.rotary_dim == 0:
        return None
    if not per_batch:
        return rotary_cos_sin(L, options.rotary_dim, device="cuda")
    offsets = torch.tensor([0, 5, 17], device="cuda")[:B]
    positions = torch.arange(L, device="cuda")[None] + offsets[:, None]
    return rotary_cos_sin(positions, options.rotary_dim, device="cuda")


def _setup(case, dtype, **option_fields):
    kinds, fields, absent, per_batch = CASES[case]
    options = _options(kinds, **{**fields, **option_fields})
    params = _params(options, absent, dtype, norm_dtype=torch.float32 if case.startswith("llama") else None)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, L, options.hidden, generator=gen).to("cuda", dtype)
    cross = "cross" in kinds
    kv_width = options.kv_heads * options.head_dim
    kv = [torch.randn(B, LS, kv_width, generator=gen).to("cuda", dtype) for _ in range(2)] if cross else [None, None]
    masks = (padding_mask(B, L, "suffix").cuda(), padding_mask(B, LS, "random", seed=2).cuda()) if cross \
        else (None, None)
    grad = torch.randn(B, L, options.hidden, generator=gen).to("cuda", dtype)
    return options, x, params, _rotary(options, per_batch), kv, masks, grad


def _leaf(t, dtype=None):
    if t is None:
        return None
    return t.detach().to(dtype or t.dtype).clone().requires_grad_()


def _run(fn, x, kv, params, grad, dtype=None):
    """(y, [grads of x, of the encoder K/V when given, of every parameter given]) of one forward and backward,
    the inputs as fresh leaves (in dtype when given)."""
    x, k, v = _leaf(x, dtype), _leaf(kv[0], dtype), _leaf(kv[1], dtype)
    ps = [_leaf(p, dtype) for p in params]
    y = fn(x, k, v, *ps)
    y.backward(grad.to(y.dtype))
    leaves = [x, *(t for t in (k, v) if t is not None), *(p for p in ps if p is not None)]
    return y.detach(), [t.grad for t in leaves]


def _kernel_fn(options, masks, rotary):
    def fn(x, k, v, *params):
        return run_layer(options, x, masks[0], k, v, masks[1], list(params), rotary=rotary)
    return fn


def _reference_fn(options, masks, rotary):
    def fn(x, k, v, *params):
        cast = [p for i in range(len(options.kinds))
                for p in cast_block(params[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)], x.dtype)]
        n = PARAMS_PER_BLOCK * len(options.kinds)
        return reference_layer(options, x, masks[0], k, v, masks[1], cast + list(params[n:]), rotary=rotary)
    return fn


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_path_matches_reference(case, dtype):
    """Output and every gradient (x, encoder K/V, each parameter given) of the kernel path against the float64
    reference, at most twice the error of the reference run in dtype (atol: 1e-3 of the magnitude)."""
    _check_against_reference(*_setup(case, dtype))


def _check_against_reference(options, x, params, rotary, kv, masks, grad):
    assert kernel_path(options, x)
    y_k, g_k = _run(_kernel_fn(options, masks, rotary), x, kv, params, grad)
    y_r, g_r = _run(_reference_fn(options, masks, rotary), x, kv, params, grad)
    y_o, g_o = _run(_reference_fn(options, masks, rotary), x, kv, params, grad, dtype=torch.float64)
    assert len(g_k) == len(g_o)
    names = ["output", "grad x"] + [f"grad {i}" for i in range(len(g_o) - 1)]
    for name, k, r, o in zip(names, [y_k, *g_k], [y_r, *g_r], [y_o, *g_o]):
        assert k is not None and k.dtype == r.dtype, name
        assert_lowp_rule(k.float(), o, r.float(), atol=1e-3 * max(1.0, o.abs().max().item()), name=name)


# head_dim 16 (the sm_80 kernels), 64 and 128 (Hopper); grouped K/V heads, whose Hopper dK/dV kernel runs in
# clusters on grids this small; rotary_dim a multiple of 16 or not
@pytest.mark.parametrize("head_dim,heads,kv_heads,length,causal,rotary_dim", [
    (64, 3, 1, 300, True, 64), (64, 3, 1, 300, False, 34), (128, 2, 1, 600, True, 128), (16, 4, 2, 300, True, 10)])
def test_rotary_folded_into_the_attention_backward_over_many_blocks(head_dim, heads, kv_heads, length, causal,
                                                                    rotary_dim):
    """The attention backward undoes the rotary positions in its dQ and dK stores, also where a cluster of CTAs
    sums dK: over several key and query blocks, every output and gradient as the reference's."""
    options = _options(("self", "ffn"), hidden=heads * head_dim, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       scale=head_dim ** -0.5, rotary_dim=rotary_dim, causal=causal)
    params = _params(options, "all", torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, length, options.hidden, generator=gen).to("cuda", torch.bfloat16)
    grad = torch.randn(2, length, options.hidden, generator=gen).to("cuda", torch.bfloat16)
    rotary = rotary_cos_sin(length, options.rotary_dim, device="cuda")
    _check_against_reference(options, x, params, rotary, [None, None], (None, None), grad)


@pytest.mark.parametrize("case", ["llama", "decoder", "llama_gqa", "decoder_qk_norm"])
def test_dropout_reproducible_and_recompute_agrees(case):
    """With every dropout on: the same seed gives the same output and gradients, and backward recomputing the
    activations (recompute on) gives exactly what saving them gives (recompute off)."""
    runs = []
    for recompute, seed in ((True, 7), (True, 7), (False, 7), (True, 8)):
        options, x, params, rotary, kv, masks, grad = _setup(case, torch.float16, training=True,
                                                             dropouts=(0.1, 0.15, 0.2), recompute=recompute)
        torch.manual_seed(seed)
        y, grads = _run(_kernel_fn(options, masks, rotary), x, kv, params, grad)
        runs.append([y, *grads])
    for i, (a, b, c) in enumerate(zip(*runs[:3])):
        assert torch.equal(a, b) and torch.equal(a, c), i
    assert not torch.equal(runs[0][0], runs[3][0])


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gated_activation_dropout_keep_rate(activation):
    """An FFN block whose output weight is the identity and which has no biases adds exactly its dropped-out
    gated activation to x: the elements where y equals x are the dropped ones, kept at rate 1 − p with no
    pattern between neighbours."""
    p = 0.25
    options = _options(("ffn",), training=True, dropouts=(0.0, 0.0, p), norm="rms_norm", activation=activation,
                       ffn=H)
    gen = torch.Generator().manual_seed(3)
    w_in = (torch.randn(2 * H, H, generator=gen) / H ** 0.5).to("cuda", torch.float16)
    w_out = torch.eye(H, device="cuda", dtype=torch.float16)
    params = [w_in, None, w_out, None, torch.ones(H, device="cuda", dtype=torch.float16), None]
    # x small beside the activation (RMSNorm rescales it), so that a kept element always changes y
    x = (0.05 * torch.randn(4, 255, H, generator=gen)).to("cuda", torch.float16)
    with torch.no_grad():
        y = run_layer(options, x, None, None, None, None, params)
    keep = (y.float() - x.float()).reshape(-1, H) != 0
    assert_dropout_keep_stats(keep, p, name=f"{activation} dropout")


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("case", ["llama", "decoder", "rms_post", "llama_gqa", "llama_qk_norm"])
def test_compiled_matches_eager(case, dropout):
    """torch.compile(fullgraph=True) runs the same operators (their Meta implementations trace the shapes):
    the same output and gradients as eager, with dropout the same draws under the same seed."""
    train = dict(training=True, dropouts=(0.1, 0.15, 0.2)) if dropout else {}
    options, x, params, rotary, kv, masks, grad = _setup(case, torch.bfloat16, **train)
    fn = _kernel_fn(options, masks, rotary)
    # every case compiles the same code object: without a reset the cases past dynamo's recompile limit fail
    torch._dynamo.reset()
    torch.manual_seed(7)
    y_e, g_e = _run(fn, x, kv, params, grad)
    torch.manual_seed(7)
    y_c, g_c = _run(torch.compile(fn, fullgraph=True), x, kv, params, grad)
    assert torch.equal(y_c, y_e)
    for i, (c, e) in enumerate(zip(g_c, g_e)):
        torch.testing.assert_close(c, e, msg=lambda m: f"grad {i}: {m}")


@pytest.mark.parametrize("case", ["llama", "decoder", "no_bias", "decoder_mqa", "llama_qk_norm"])
def test_opcheck_layer_ops_with_options(case):
    """Schema and Meta implementations of lsmini::layer and lsmini::layer_backward (shapes, dtypes and strides
    of every output under fake tensors and dynamic shapes) with absent parameters and rotary tables; the
    gradient tensors hold exactly the parameters given."""
    options, x, params, rotary, kv, masks, grad = _setup(case, torch.float16)
    tables = tuple(rotary) if rotary is not None else (None, None)
    layer_op, layer_backward_op = torch.ops.lsmini.layer.default, torch.ops.lsmini.layer_backward.default
    forward_args = (x, masks[0], kv[0], kv[1], masks[1], params, *options.op_args(), *tables)
    torch.library.opcheck(layer_op, forward_args, test_utils=("test_schema", "test_faketensor"))
    y, state = layer_op(*forward_args)
    _, grads, grads_other, _, _ = layer_backward_op(grad, state, x, masks[0], kv[0], kv[1], masks[1], params, [], [],
                                                    [], *options.op_args(), *tables)
    given = [p for p in params if p is not None]
    main = sum((p.numel() + 63) // 64 * 64 for p in given if p.dtype == params[0].dtype)
    other = sum((p.numel() + 63) // 64 * 64 for p in given if p.dtype != params[0].dtype)
    assert (grads.numel(), grads_other.numel()) == (main, other)
    torch.library.opcheck(layer_backward_op, (grad, state, x, masks[0], kv[0], kv[1], masks[1], params, [], [], [],
                                              *options.op_args(), *tables))


def test_stacked_cross_kv_without_bias():
    """A decoder stack's one K/V GEMM with no bias (eager kernel path: CrossKVFunction): the views and the
    gradients of the encoder output and the weight equal plain PyTorch's, and no bias gradient appears."""
    from lsmini.layers.runtime import KVGradSlots, cross_kv

    gen = torch.Generator().manual_seed(4)
    enc = torch.randn(B, LS, H, generator=gen).to("cuda", torch.float16)
    weight = (torch.randn(4 * H, H, generator=gen) / H ** 0.5).to("cuda", torch.float16)
    out_grads = [torch.randn(B, LS, H, generator=gen).to("cuda", torch.float16) for _ in range(4)]

    def step(slots):
        e, w = _leaf(enc), _leaf(weight)
        views = cross_kv(e, w, None, 4, slots)
        torch.autograd.backward(views, out_grads)
        return [*views, e.grad, w.grad]

    for got, want in zip(step(KVGradSlots(4)), step(None)):
        torch.testing.assert_close(got, want)
