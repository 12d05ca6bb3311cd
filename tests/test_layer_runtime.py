"""The layer runtime (lsmini/layers/runtime.py, csrc/layers/layer.cpp): which implementation a call runs, and
gradients only where autograd asks — torch.autograd.grad, backward(inputs=...), tensor hooks, post-accumulate
hooks, retain_grad and double backward see PyTorch's semantics exactly, on CPU (the reference layer) and on
CUDA (the kernel path, where the backward may add a gradient straight into an existing .grad). On CUDA also:
the operators' checks, what the state holds, recompute on and off agreeing, dropout reproducible."""
import copy

import pytest
import torch

from layer_testing import DEVICES, _one_thread, _poison_freed_memory, padding_mask, perturb_  # noqa: F401  (fixtures)
from lsmini.layers import TransformerConfig, TransformerDecoder, TransformerEncoder, TransformerEncoderLayer
from lsmini.layers.runtime import kernel_path, run_layer

DROPOUTS = {"dropout": 0.1, "attn_dropout": 0.15, "activation_dropout": 0.2}


def _layer(device, dropout=False, **config):
    """An encoder layer on the kernel path on CUDA (float16, head_dim 16) and the reference on CPU."""
    cfg = TransformerConfig(64, 4, 128, **(DROPOUTS if dropout else {"dropout": 0.0, "attn_dropout": 0.0,
                                                                      "activation_dropout": 0.0}), **config)
    torch.manual_seed(0)
    layer = perturb_(TransformerEncoderLayer(cfg))
    return layer.to(device, torch.float16 if device == "cuda" else torch.float32)


def _input(layer, seed=1, b=2, l=9):
    w = layer.self_attn.in_proj_weight
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, l, 64, generator=g).to(w.device, w.dtype).requires_grad_()


def _loss(layer, x):
    return (layer(x).float() ** 2).mean()


def _grads_set(layer, value=0.5):
    """Every parameter gets an existing .grad (as a FusedAdam workspace gives them), filled with value."""
    for p in layer.parameters():
        p.grad = torch.full_like(p, value)
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


def _path_of(device):
    layer = _layer(device)
    return kernel_path(layer.options(False), _input(layer))


@pytest.mark.parametrize("device", DEVICES)
def test_path_follows_the_arguments(device):
    """CUDA float16 with a head_dim the fused attention has runs the operators; CPU, float32 and other
    head dims run the reference."""
    assert _path_of(device) == (device == "cuda")
    if device == "cuda":
        layer = _layer("cuda").float()
        assert not kernel_path(layer.options(False), _input(layer))
        layer = TransformerEncoderLayer(TransformerConfig(60, 4, 128)).to("cuda", torch.float16)  # head_dim 15
        assert not kernel_path(layer.options(False), torch.zeros(1, 2, 60, device="cuda", dtype=torch.float16))


def test_run_layer_needs_rotary_tables_exactly_with_rotary_dim():
    layer = _layer("cpu")
    x, params = _input(layer), layer.layer_params()
    with pytest.raises(ValueError, match="rotary must be"):
        run_layer(layer.options(False)._replace(rotary_dim=8), x, None, None, None, None, params)
    tables = (torch.ones(9, 8), torch.zeros(9, 8))
    with pytest.raises(ValueError, match="rotary must be"):
        run_layer(layer.options(False), x, None, None, None, None, params, rotary=tables)


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_grad_leaves_parameter_grads_alone(device):
    """torch.autograd.grad through a layer whose parameters hold .grad from an earlier backward returns the
    input gradient and changes no .grad."""
    layer = _layer(device)
    x = _input(layer)
    _loss(layer, x).backward()
    before = {n: p.grad.clone() for n, p in layer.named_parameters()}
    (gx,) = torch.autograd.grad(_loss(layer, x), x)
    assert gx is not None and torch.isfinite(gx).all()
    for n, p in layer.named_parameters():
        assert torch.equal(p.grad, before[n]), n


@pytest.mark.parametrize("device", DEVICES)
def test_backward_inputs_accumulates_only_those(device):
    """backward(inputs=[x]) after zero_grad(set_to_none=False) writes x.grad and leaves every parameter's
    .grad (zeros) alone; backward(inputs=[one weight]) accumulates into that weight's .grad only."""
    layer = _layer(device)
    x = _input(layer)
    _loss(layer, x).backward()
    layer.zero_grad(set_to_none=False)
    x.grad = None
    _loss(layer, x).backward(inputs=[x])
    assert x.grad is not None
    for n, p in layer.named_parameters():
        assert not p.grad.any(), n
    w = layer.linear1.weight
    _loss(layer, x).backward(inputs=[w])
    assert w.grad.any()
    for n, p in layer.named_parameters():
        if p is not w:
            assert not p.grad.any(), n


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_accumulate_into_existing_grads(device):
    """Into existing .grad tensors a backward adds exactly what a backward from .grad = None gives (up to the
    one rounding autograd's separate add makes in float16), for every parameter."""
    layer = _layer(device)
    x = _input(layer)
    layer.zero_grad(set_to_none=True)
    _loss(layer, x).backward()
    fresh = {n: p.grad.clone() for n, p in layer.named_parameters()}
    start = _grads_set(layer)
    _loss(layer, x).backward()
    for n, p in layer.named_parameters():
        want = (start[n].float() + fresh[n].float()).to(p.dtype)
        torch.testing.assert_close(p.grad, want, rtol=2e-3, atol=1e-3, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_hooks_see_their_gradients(device):
    """A tensor hook, a post-accumulate-grad hook (a data-parallel reducer's, say) and retain_grad on other
    parameters all see the gradient through autograd, while the parameters without them still get theirs."""
    layer = _layer(device)
    x = _input(layer)
    layer.zero_grad(set_to_none=True)
    _loss(layer, x).backward()
    fresh = {n: p.grad.clone() for n, p in layer.named_parameters()}
    _grads_set(layer, 0.0)
    seen = {}
    layer.linear1.weight.register_hook(lambda g: seen.__setitem__("hook", g.clone()))
    layer.linear2.weight.register_post_accumulate_grad_hook(lambda p: seen.__setitem__("post", p.grad.clone()))
    _loss(layer, x).backward()
    torch.testing.assert_close(seen["hook"], fresh["linear1.weight"], rtol=0, atol=0)
    torch.testing.assert_close(seen["post"], fresh["linear2.weight"], rtol=0, atol=0)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, fresh[n], rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward(device):
    """create_graph=True: the reference layer is twice differentiable; the kernel path's backward is not
    and says so when a second backward reaches it."""
    layer = _layer(device)
    x = _input(layer)
    (gx,) = torch.autograd.grad(_loss(layer, x), x, create_graph=True)
    if device == "cpu":
        gx.square().sum().backward()
        assert layer.linear1.weight.grad is not None
    else:
        with pytest.raises(RuntimeError, match="once_differentiable|double backward"):
            gx.square().sum().backward()


# ================================================================================================= CUDA ===
@pytest.mark.cuda
def test_grads_added_into_workspace_views():
    """With a FusedAdam workspace (every .grad a view of one flat buffer) the layer's backward adds into the
    views themselves: the buffer holds the gradients, and no .grad is replaced by another tensor."""
    from lsmini.optim import FusedAdam

    layer = _layer("cuda")
    opt = FusedAdam(layer)
    opt.zero_grad()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    _loss(layer, _input(layer)).backward()
    for n, p in layer.named_parameters():
        assert p.grad is grads[n] and p.grad.any(), n


def test_param_grads_keep_a_transposed_parameter_layout():
    """The operator's flat gradient buffers → one gradient a parameter: contiguous, except for a transposed
    view of a contiguous 2-D tensor (GPT-2's Conv1D weight as weight.t()), whose gradient has the parameter's
    own layout, so that weight.grad is the buffer's memory as it is. Each starts at a multiple of 64
    elements."""
    from lsmini.layers.runtime import _param_grads
    conv1d = torch.randn(6, 10)  # [in, out]
    w, bias, plain = conv1d.t(), torch.randn(10), torch.randn(3, 5)
    grads = torch.arange(64 * 3, dtype=torch.float32)
    out = _param_grads([w, bias, None, plain], [None] * 4, grads, None)
    assert out[0].shape == (10, 6) and out[0].stride() == (1, 10) and out[0].storage_offset() == 0
    assert torch.equal(out[0].t().contiguous().flatten(), grads[:60])  # the memory in the parameter's order
    assert out[1].stride() == (1,) and out[1].storage_offset() == 64 and out[2] is None
    assert out[3].stride() == (5, 1) and out[3].storage_offset() == 128


@pytest.mark.cuda
@pytest.mark.parametrize("pre", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_recompute_equals_saving(pre, act):
    """recompute off saves what recompute on computes again, with the same dropout masks: the same output
    and gradients bit for bit (decoder stack: self, cross and FFN blocks)."""
    cfg = TransformerConfig(64, 4, 128, activation=act, pre_layer_norm=pre, **DROPOUTS)
    torch.manual_seed(0)
    dec = perturb_(TransformerDecoder(cfg, 2)).to("cuda", torch.float16)
    gen = torch.Generator().manual_seed(5)
    y = torch.randn(3, 11, 64, generator=gen).to("cuda", torch.float16)
    enc = torch.randn(3, 13, 64, generator=gen).to("cuda", torch.float16).requires_grad_()
    mask = padding_mask(3, 13, "suffix").cuda()
    runs = []
    for recompute in (True, False):
        for layer in dec.layers:
            layer.recompute = recompute
        dec.zero_grad(set_to_none=True)
        enc.grad = None
        torch.manual_seed(7)
        out = dec(y, enc, mask)
        out.float().square().mean().backward()
        runs.append([out, enc.grad] + [p.grad for p in dec.parameters()])
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), i


@pytest.mark.cuda
def test_unaligned_parameters_cast_like_aligned_ones():
    """float32 parameters under bf16 autocast are cast into the layer's state by one kernel, 16 bytes at a time
    where a parameter and its copy are 16-byte aligned and element by element where not: parameters that are
    views 4 bytes into their storage give the same output, input gradient and matrix gradients bit for bit.
    The LayerNorms read their float32 γ and β in place, so their unaligned (element-wise) backward sums the
    partials of dγ and dβ in another order: those four gradients agree to float32 rounding."""
    cfg = TransformerConfig(64, 4, 128, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    aligned = perturb_(TransformerEncoderLayer(cfg)).cuda()
    shifted = TransformerEncoderLayer(cfg).cuda()
    for (name, p), q in zip(aligned.named_parameters(), shifted.parameters()):
        storage = torch.zeros(p.numel() + 1, device="cuda")
        storage[1:].copy_(p.detach().flatten())
        q.data = storage[1:].view_as(p)
        assert q.data_ptr() % 16 == 4 and torch.equal(q, p), name
    x = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(2)).cuda()
    runs = []
    for layer in (aligned, shifted):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(xi)
        out.float().square().mean().backward()
        runs.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    names = ["output", "input grad"] + [name for name, _ in aligned.named_parameters()]
    for name, a, b in zip(names, *runs):
        if name.startswith("norm"):
            torch.testing.assert_close(a, b, msg=name)
        else:
            assert torch.equal(a, b), name


@pytest.mark.cuda
@pytest.mark.parametrize("hidden,heads,ffn", [(48, 3, 200), (512, 8, 2048)])
def test_float32_parameters_under_autocast_run_as_their_bf16_values(hidden, heads, ffn):
    """A layer's float32 parameters under bf16 autocast, every value a bf16 value, give the output and input
    gradient of the same layer in bf16 bit for bit: the cast into the layer's state writes every element of
    every weight and attention bias (at sizes whose last block of the launch is partly empty)."""
    cfg = TransformerConfig(hidden, heads, ffn, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    wide = perturb_(TransformerEncoderLayer(cfg)).cuda()
    with torch.no_grad():
        for p in wide.parameters():
            p.copy_(p.to(torch.bfloat16))
    narrow = copy.deepcopy(wide).to(torch.bfloat16)
    x = torch.randn(3, 10, hidden, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    runs = []
    for layer, autocast in ((wide, True), (narrow, False)):
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = layer(xi)
        out.float().square().mean().backward()
        runs.append((out, xi.grad))
    for name, a, b in zip(("output", "input grad"), *runs):
        assert a.dtype == b.dtype == torch.bfloat16, name
        assert torch.equal(a, b), name


@pytest.mark.cuda
def test_dropout_reproducible_under_manual_seed():
    layer = _layer("cuda", dropout=True)
    x = _input(layer)
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        outs.append(layer(x))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(layer(x), outs[0])


def _op_args(layer, x, **replace):
    return (x, None, None, None, None, layer.layer_params(), *layer.options(False)._replace(**replace).op_args())


@pytest.mark.cuda
def test_state_holds_keep_bits_only_with_attention_dropout_at_short_lengths():
    """The state grows by the attention's dropout keep bits exactly when attention dropout is on and the keys
    are no more than 16·head_dim (head_dim 16 here)."""
    from lsmini.ops.attention import keep_numel

    layer = _layer("cuda")
    for length, kept in ((9, True), (257, False)):
        x = torch.randn(2, length, 64, device="cuda", dtype=torch.float16)
        plain = torch.ops.lsmini.layer.default(*_op_args(layer, x))[1].numel()
        dropped = torch.ops.lsmini.layer.default(*_op_args(layer, x, attn_dropout=0.2))[1].numel()
        bits = keep_numel(2, 4, length, length) * 4 if kept else 0
        assert plain <= dropped - bits < plain + 128, (length, plain, dropped, bits)


@pytest.mark.cuda
def test_layer_operators_name_the_problem():
    """The operators check what they are given and say what is wrong, naming the operator."""
    layer = _layer("cuda")
    x = _input(layer).detach()
    op = torch.ops.lsmini.layer.default
    args = list(_op_args(layer, x))
    with pytest.raises(RuntimeError, match=r"lsmini::layer: expected 12 parameters for 2 blocks, got 11"):
        op(*args[:5], args[5][:-1], *args[6:])
    with pytest.raises(RuntimeError, match=r"lsmini::layer: x must be a contiguous \[batch, len, hidden=64\]"):
        op(x[..., :32], *args[1:])
    with pytest.raises(RuntimeError, match="x must be float16 or bfloat16"):
        op(x.float(), *args[1:])
    with pytest.raises(RuntimeError, match="unknown norm 'batch_norm'"):
        op(*_op_args(layer, x, norm="batch_norm"))
    with pytest.raises(RuntimeError, match=r"norm_bias\) must be None with norm rms_norm"):
        op(*_op_args(layer, x, norm="rms_norm"))
    with pytest.raises(RuntimeError, match=r"kv_heads \(3\) must divide heads \(4\)"):
        op(*_op_args(layer, x, kv_heads=3))
    with pytest.raises(RuntimeError, match=r"params\[0\] \(block 0, parameter 0\) must be a \[128, 64\] floating tensor"):
        op(*_op_args(layer, x, kv_heads=2))  # a QKV weight of 4 K/V heads where the options say 2
    with pytest.raises(RuntimeError, match="rotary_dim > 0 needs both rotary_cos and rotary_sin"):
        op(*_op_args(layer, x, rotary_dim=16))
    with pytest.raises(RuntimeError, match=r"rotary_dim must be 0 or even and in \[2, head_dim = 16\]"):
        op(*_op_args(layer, x, rotary_dim=3))
    table = torch.ones(9, 8, device="cuda")
    with pytest.raises(RuntimeError, match=r"rotary_cos must be float32 \[len=9, rotary_dim=16\]"):
        op(*_op_args(layer, x, rotary_dim=16), table, table)
    with pytest.raises(RuntimeError, match="rotary_cos / rotary_sin given with rotary_dim 0"):
        op(*args, table, table)
    with pytest.raises(RuntimeError, match="unknown activation 'swish'"):
        op(*_op_args(layer, x, activation="swish"))
    with pytest.raises(RuntimeError, match=r"params\[6\] \(block 1, parameter 0\) must be a \[256, 64\]"):
        op(*_op_args(layer, x, activation="swiglu"))  # a gated FFN's first weight has 2·ffn rows
    no_weight = list(args[5])
    no_weight[2] = None
    with pytest.raises(RuntimeError, match=r"params\[2\] \(block 0, parameter 2\) must be given"):
        op(*args[:5], no_weight, *args[6:])
    y, state = op(*args)
    back = torch.ops.lsmini.layer_backward.default
    rest = (layer.layer_params(), [], [], [], *layer.options(False).op_args())
    with pytest.raises(RuntimeError, match="lsmini::layer_backward: state must be the contiguous uint8"):
        back(torch.ones_like(y), state[:-1], x, None, None, None, None, *rest)
    with pytest.raises(RuntimeError, match="grad must be like x"):
        back(torch.ones_like(y).float(), state, x, None, None, None, None, *rest)
    with pytest.raises(RuntimeError, match="into_index holds 12"):
        back(torch.ones_like(y), state, x, None, None, None, None, layer.layer_params(), [12],
             [layer.linear1.weight.detach().clone()], [], *layer.options(False).op_args())


@pytest.mark.cuda
def test_stack_decoder_kv_gradient_gathered_in_place():
    """A decoder stack's layers write their dK/dV into the stacked gradient of its one K/V projection in
    eager code: the encoder output's gradient and the projection's equal those of the same decoder with that
    gradient gathered by autograd (a compiled graph's way: every layer's dK/dV returned)."""
    cfg = TransformerConfig(64, 4, 128, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    dec = perturb_(TransformerDecoder(cfg, 3)).to("cuda", torch.float16)
    gen = torch.Generator().manual_seed(5)
    y = torch.randn(3, 11, 64, generator=gen).to("cuda", torch.float16)
    enc = torch.randn(3, 13, 64, generator=gen).to("cuda", torch.float16)
    mask = padding_mask(3, 13, "suffix").cuda()

    def step(fn):
        dec.zero_grad(set_to_none=True)
        e = enc.clone().requires_grad_()
        fn(e).float().square().mean().backward()
        return [e.grad, dec.cross_attn_kv_weight.grad, dec.cross_attn_kv_bias.grad]

    eager = step(lambda e: dec(y, e, mask))
    compiled = step(torch.compile(lambda e: dec(y, e, mask), fullgraph=True))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.cuda
def test_other_head_dims_train_on_the_reference():
    """A TransformerEncoder with a head_dim the fused attention lacks runs the reference on CUDA and trains
    (float16)."""
    enc = TransformerEncoder(TransformerConfig(60, 4, 128), 2).to("cuda", torch.float16)
    x = torch.randn(2, 5, 60, device="cuda", dtype=torch.float16, requires_grad=True)
    enc(x).float().sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in enc.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_output_projection_adds_its_weight_gradient_into_grad(device, monkeypatch):
    """output_projection gives F.linear's logits and gradients; on CUDA, where autograd would accumulate into the
    weight's .grad, the backward's GEMM adds into that very tensor (the old value plus the gradient); with
    torch.autograd.grad, or a hook on the weight, .grad keeps PyTorch's semantics."""
    import lsmini.layers.runtime as runtime
    from lsmini.layers.runtime import output_projection
    seen = []
    real = runtime.grad_into
    monkeypatch.setattr(runtime, "grad_into", lambda p, like: seen.append(real(p, like)) or seen[-1])
    dtype = torch.float32
    gen = torch.Generator().manual_seed(4)
    h0 = torch.randn(3, 7, 32, generator=gen).to(device, dtype)
    w0 = torch.randn(50, 32, generator=gen).to(device, dtype)
    g = torch.randn(3, 7, 50, generator=gen).to(device, dtype)

    def run(fn, w, **kw):
        h = h0.clone().requires_grad_()
        out = fn(h, w)
        out.backward(g, **kw)
        return out, h.grad

    w_ref = w0.clone().requires_grad_()
    ref_out, ref_h = run(torch.nn.functional.linear, w_ref)
    w = w0.clone().requires_grad_()
    base = torch.randn(50, 32, generator=gen).to(device, dtype)
    w.grad = base.clone()
    held = w.grad
    out, gh = run(output_projection, w)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(gh, ref_h)
    assert w.grad is held
    torch.testing.assert_close(w.grad, base + w_ref.grad)
    assert seen == ([held] if device == "cuda" else [])
    (gw,) = torch.autograd.grad(output_projection(h0, w), w, g)
    torch.testing.assert_close(gw, w_ref.grad)
    torch.testing.assert_close(w.grad, base + w_ref.grad)
    handle = w.register_hook(lambda grad: 2 * grad)
    run(output_projection, w)
    handle.remove()
    torch.testing.assert_close(w.grad, base + 3 * w_ref.grad)
    assert seen == ([held, None, None] if device == "cuda" else [])
