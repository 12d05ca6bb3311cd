"""The one-call layers (csrc/layers/layer.cpp: a layer's whole forward, and its whole backward, as one call
into the extension) against the same layers with their blocks run from Python (function.ONE_CALL = False):
equal bit for bit — outputs, input gradients, every parameter gradient, the cross-attention K/V gradient
of a decoder stack — for the same RNG state, with dropout on, in every layer variant. CUDA only: on other
devices (and float32, other head dims) the layers always run their blocks from Python."""
import pytest
import torch

from layer_testing import _one_thread, _poison_arena, padding_mask, perturb_  # noqa: F401  (fixtures)
from lsmini import _backend
from lsmini.layers import (TransformerConfig, TransformerDecoder, TransformerEncoder, TransformerEncoderLayer,
                           function)

pytestmark = pytest.mark.cuda

DROPOUTS = {"dropout": 0.1, "attn_dropout": 0.15, "activation_dropout": 0.2}
PRECISIONS = ["float16", "bfloat16", "autocast"]


def _dtypes(precision):
    """(parameter dtype, input dtype) of a precision case."""
    if precision == "autocast":
        return torch.float32, torch.float16
    dtype = getattr(torch, precision)
    return dtype, dtype


def _run(module, inputs, grad, one_call, precision, seed=3, **kw):
    """(output, [input grads], {param: grad}) of one forward + backward under the given orchestration."""
    old = function.ONE_CALL
    function.ONE_CALL = one_call
    try:
        module.zero_grad(set_to_none=True)
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None
                  for t in inputs]
        torch.manual_seed(seed)
        with torch.autocast("cuda", dtype=torch.float16, enabled=precision == "autocast"):
            out = module(*leaves, **kw)
        out.backward(grad)
        return (out.detach(), [t.grad for t in leaves if t is not None and t.is_floating_point()],
                {n: p.grad for n, p in module.named_parameters()})
    finally:
        function.ONE_CALL = old


def _assert_bitwise(a, b):
    out_a, inputs_a, params_a = a
    out_b, inputs_b, params_b = b
    assert torch.equal(out_a, out_b), "outputs differ"
    for i, (ga, gb) in enumerate(zip(inputs_a, inputs_b)):
        assert torch.equal(ga, gb), f"gradient of input {i} differs"
    for name, ga in params_a.items():
        assert ga is not None and torch.equal(ga, params_b[name]), f"gradient of {name} differs"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("pre", [True, False])
def test_encoder_layer_bitwise(pre, act, recompute, precision):
    param_dtype, input_dtype = _dtypes(precision)
    cfg = TransformerConfig(128, 4, 256, activation=act, pre_layer_norm=pre, **DROPOUTS)
    torch.manual_seed(0)
    layer = perturb_(TransformerEncoderLayer(cfg)).to("cuda", param_dtype)
    layer.recompute = recompute
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 37, 128, generator=gen).to("cuda", input_dtype)
    g = torch.randn(3, 37, 128, generator=gen).to("cuda", torch.float16 if precision == "autocast" else input_dtype)
    mask = padding_mask(3, 37, "random").cuda()
    one = _run(layer, [x, mask], g, True, precision)
    blocks = _run(layer, [x, mask], g, False, precision)
    _assert_bitwise(one, blocks)
    dropped = _run(layer, [x, mask], g, True, precision, seed=4)
    assert not torch.equal(one[0], dropped[0])  # dropout acted, and follows the seed


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("pre", [True, False])
def test_causal_encoder_stack_bitwise(pre, precision):
    param_dtype, input_dtype = _dtypes(precision)
    cfg = TransformerConfig(64, 2, 128, activation="gelu", pre_layer_norm=pre, **DROPOUTS)
    torch.manual_seed(0)
    stack = perturb_(TransformerEncoder(cfg, 2)).to("cuda", param_dtype)
    x = torch.randn(2, 50, 64).to("cuda", input_dtype)
    g = torch.randn(2, 50, 64).to("cuda", torch.float16 if precision == "autocast" else input_dtype)
    _assert_bitwise(_run(stack, [x, None], g, True, precision, causal=True),
                    _run(stack, [x, None], g, False, precision, causal=True))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("pre", [True, False])
def test_decoder_stack_bitwise(pre, act, recompute, precision):
    """Self, cross (K/V from the stack's one GEMM, dK/dV written into its gradient slots) and FFN blocks;
    the encoder output's gradient comes through the layers' dK/dV."""
    param_dtype, input_dtype = _dtypes(precision)
    cfg = TransformerConfig(128, 8, 256, activation=act, pre_layer_norm=pre, **DROPOUTS)
    torch.manual_seed(0)
    decoder = perturb_(TransformerDecoder(cfg, 3)).to("cuda", param_dtype)
    for layer in decoder.layers:
        layer.recompute = recompute
    gen = torch.Generator().manual_seed(2)
    y = torch.randn(4, 21, 128, generator=gen).to("cuda", input_dtype)
    enc = torch.randn(4, 33, 128, generator=gen).to("cuda", input_dtype)
    g = torch.randn(4, 21, 128, generator=gen).to("cuda", torch.float16 if precision == "autocast" else input_dtype)
    mask = padding_mask(4, 33, "suffix").cuda()
    one = _run(decoder, [y, enc, mask], g, True, precision)
    blocks = _run(decoder, [y, enc, mask], g, False, precision)
    _assert_bitwise(one, blocks)


def _workspace_grads(one_call, passes):
    """Gradients of a layer whose .grad are a FusedAdam workspace's views, after `passes` backward passes."""
    from lsmini.optim import FusedAdam
    cfg = TransformerConfig(128, 4, 256, activation="gelu", **DROPOUTS)
    torch.manual_seed(0)
    layer = perturb_(TransformerEncoderLayer(cfg)).to("cuda", torch.float16)
    opt = FusedAdam(layer)
    opt.zero_grad()
    x = torch.randn(3, 29, 128, device="cuda", dtype=torch.float16)
    old = function.ONE_CALL
    function.ONE_CALL = one_call
    try:
        for i in range(passes):
            torch.manual_seed(10 + i)
            (layer(x).float() ** 2).mean().backward()
    finally:
        function.ONE_CALL = old
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_gradients_added_into_workspace():
    """Where .grad exists (a FusedAdam workspace's views) the one-call backward adds each gradient there
    itself — a GEMM weight's in its GEMM — instead of returning it for autograd to add: one backward
    gives autograd's result bit for bit; accumulating a second differs from autograd's (which rounds the
    new gradient to fp16 before adding) by at most that one rounding."""
    one, blocks = _workspace_grads(True, 1), _workspace_grads(False, 1)
    for name, g in one.items():
        assert torch.equal(g, blocks[name]), name
    one, blocks = _workspace_grads(True, 2), _workspace_grads(False, 2)
    for name, g in one.items():
        torch.testing.assert_close(g, blocks[name], rtol=2e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_gradient_hooks_still_fire():
    """A parameter with a post-accumulate-grad hook (a data-parallel reducer's, say) gets its gradient
    through autograd, so the hook sees it."""
    from lsmini.optim import FusedAdam
    layer = TransformerEncoderLayer(TransformerConfig(64, 4, 128)).to("cuda", torch.float16)
    FusedAdam(layer).zero_grad()
    seen = []
    layer.linear1.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.abs().sum().item()))
    x = torch.randn(2, 9, 64, device="cuda", dtype=torch.float16)
    (layer(x).float() ** 2).sum().backward()
    assert len(seen) == 1 and seen[0] > 0


def test_one_call_runs_no_python_blocks(monkeypatch):
    """On the kernel path the blocks do not run from Python at all (so the comparisons above compare two
    different orchestrations)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a block ran from Python")

    monkeypatch.setattr(function, "block_forward", refuse)
    monkeypatch.setattr(function, "block_backward", refuse)
    cfg = TransformerConfig(64, 4, 128)
    layer = TransformerEncoderLayer(cfg).to("cuda", torch.float16)
    x = torch.randn(2, 9, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_layer_fwd_rejects_mismatched_arguments():
    """The extension's entry points check what Python hands them, naming the call."""
    cfg = TransformerConfig(64, 4, 128)
    layer = TransformerEncoderLayer(cfg).to("cuda", torch.float16)
    options = layer.options(False, True)
    params = [p for block in layer.blocks() for p in block]
    x = torch.randn(2, 9, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="layer_fwd: expected 12 parameters for 2 blocks, got 11"):
        _backend.ext().layer_fwd(options, x, None, None, None, None, params[:-1])
    with pytest.raises(RuntimeError, match=r"layer_fwd: x must be a contiguous \[batch, len, hidden=64\]"):
        _backend.ext().layer_fwd(options, x[..., :32], None, None, None, None, params)
    with pytest.raises(RuntimeError, match="layer_fwd: options.kernels is False"):
        _backend.ext().layer_fwd(layer.options(False, False), x, None, None, None, None, params)


def test_attention_keep_bits_saved_and_read():
    """With attention dropout the one-call forward keeps the self-attention's dropout keep bits (slot BITS)
    and the backward reads them: the gradients equal those of a backward that draws the bits again, and
    differ once the saved bits are cleared (every score dropped). No bits without attention dropout."""
    from lsmini.layers.compiled import BITS, SLOTS
    from lsmini.layers.spec import scratch_numel
    from lsmini.ops import dropout_bits
    from lsmini.ops.attention import keep_numel

    ext = _backend.ext()
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(TransformerConfig(64, 4, 128, attn_dropout=0.2)).to("cuda", torch.float16)
    options = layer.options(False, True)
    params = [p.detach() for block in layer.blocks() for p in block]
    x = torch.randn(2, 9, 64, device="cuda", dtype=torch.float16)
    grad = torch.randn_like(x)
    _, saved, rngs = ext.layer_fwd(options, x, None, None, None, None, params)
    bits = saved[BITS]
    assert bits.dtype == torch.int32 and bits.numel() == keep_numel(2, 4, 9, 9) and saved[SLOTS + BITS] is None
    scratch = torch.empty(scratch_numel(options, 2, 9), device="cuda", dtype=torch.float16)

    def backward(state):
        g, param_grads = ext.layer_bwd(options, grad, state, rngs, params, scratch, None, None,
                                       [p.dtype for p in params], [None] * len(params))
        return [g.clone()] + [p.clone() for p in param_grads]

    kept = backward(saved)
    drawn = backward(saved[:BITS] + [None] + saved[BITS + 1:])
    assert all(torch.equal(a, b) for a, b in zip(kept, drawn))
    bits.zero_()
    assert not torch.equal(backward(saved)[0], kept[0])
    _, saved, _ = ext.layer_fwd(options._replace(attn_dropout=0.0), x, None, None, None, None, params)
    assert saved[BITS] is None
    # the policy of lsmini.ops.dropout_bits: none kept under "never"; past 16·head_dim keys (head_dim 16 here)
    # kept under "always" only
    with dropout_bits("never"):
        assert ext.layer_fwd(options, x, None, None, None, None, params)[1][BITS] is None
    x = torch.randn(2, 257, 64, device="cuda", dtype=torch.float16)
    assert ext.layer_fwd(options, x, None, None, None, None, params)[1][BITS] is None
    with dropout_bits("always"):
        assert ext.layer_fwd(options, x, None, None, None, None, params)[1][BITS].numel() == keep_numel(2, 4, 257, 257)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("pre", [True, False])
def test_layer_fwd_into_one_state_buffer(pre, act, recompute):
    """Given a state buffer and its offsets (the compiled layer's), layer_fwd writes every tensor it saves
    there, as views at those offsets, with the values it saves without the buffer: the same y and saved
    tensors bit for bit (decoder layer: self, cross and FFN blocks, dropout on)."""
    from lsmini.layers.compiled import _heads, _plan_of

    ext = _backend.ext()
    cfg = TransformerConfig(64, 4, 128, activation=act, pre_layer_norm=pre, **DROPOUTS)
    torch.manual_seed(0)
    layer = perturb_(TransformerDecoder(cfg, 1)).to("cuda", torch.float16).layers[0]
    layer.recompute = recompute
    options = layer.options(True, True)
    params = [p.detach() for block in layer.blocks() for p in block]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 11, 64, generator=gen).to("cuda", torch.float16)
    # the encoder K/V as the compiled layer takes them, [b, ls, H], and the [b, heads, ls, d] views layer_fwd reads
    ek, ev = (torch.randn(3, 13, 64, generator=gen).to("cuda", torch.float16) for _ in range(2))
    mask = padding_mask(3, 13, "suffix").cuda()
    layout, offsets, nbytes = _plan_of(options, x, None, ek, mask)
    ek, ev = _heads(ek, 4), _heads(ev, 4)
    state = torch.full((nbytes,), 255, dtype=torch.uint8, device="cuda")
    torch.manual_seed(7)
    y, saved, _ = ext.layer_fwd(options, x, None, ek, ev, mask, params)
    torch.manual_seed(7)
    y_s, saved_s, _ = ext.layer_fwd(options, x, None, ek, ev, mask, params, state, offsets)
    assert torch.equal(y, y_s)
    for i, (a, b, offset) in enumerate(zip(saved, saved_s, offsets)):
        assert (a is None) == (b is None), i
        if a is not None:
            assert torch.equal(a, b), f"slot {i} differs"
        if offset >= 0:
            assert b.data_ptr() == state.data_ptr() + offset, i
    assert any(o >= 0 for o in offsets)
    with pytest.raises(RuntimeError, match="layer_fwd: state must be a contiguous uint8 vector"):
        ext.layer_fwd(options, x, None, ek, ev, mask, params, state.view(torch.int16), offsets)
    with pytest.raises(RuntimeError, match="does not fit the"):
        ext.layer_fwd(options, x, None, ek, ev, mask, params, state[:64], offsets)
