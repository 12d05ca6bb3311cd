"""TransformerEncoderLayer's memory on the kernel path (CUDA): a layer saves for backward exactly the
tensors its backward needs, a training step peaks below torch.nn's and allocates nothing new after the
first steps."""
import pytest
import torch
from torch import nn

from layer_testing import _one_thread, _poison_freed_memory, encoder_layer, padding_mask  # noqa: F401  (fixtures)
from lsmini.layers import TransformerConfig, TransformerEncoder

pytestmark = pytest.mark.cuda


def _padded(n, to=64):
    return (n + to - 1) // to * to


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("pre", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_saves_only_what_backward_needs(pre, recompute, act):
    """The bytes a float16 layer saves for backward (parameters aside), counted with saved-tensor hooks, are
    exactly: its input and the padding mask, and in one state buffer Q/K/V, the attention context and its
    row log-sum-exp, the second block's input (pre-LN) or the two residual sums and the first LayerNorm's
    output (post-LN), the first FFN GEMM's output — relu: its activation instead —, the LayerNorms' row
    statistics and the dropout states; without recompute also the LayerNorm outputs (pre-LN) and (gelu)
    the FFN activation. Attention saves no [len, len] tensor at all."""
    b, l, h, heads, ffn = 4, 16, 32, 2, 64  # head_dim 16: the fused attention's
    m = encoder_layer("cuda", pre, h, heads, ffn, activation=act).half()
    m.recompute = recompute
    x = torch.randn(b, l, h, device="cuda", dtype=torch.float16, requires_grad=True)
    mask = padding_mask(b, l, "suffix").cuda()
    params = {p.data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x, mask)
    t, e = b * l, 2
    units = (5 if pre else 7) * t * h + t * ffn  # qkv (3), ctx, r1 | s1, qkv, ctx, ln1 out, s2; + f1
    if not recompute:
        units += (2 * t * h if pre else 0) + (t * ffn if act != "relu" else 0)  # LN outputs, activation
    state = units * e + b * heads * l * 4 + 2 * 2 * t * 4  # + lse, the LayerNorms' mean and rstd (float32)
    state = _padded(state + 2 * 2 * 16, 128)  # + two dropout states a block (int64 pairs)
    expect = t * h * e + b * l + state  # + x, the bool mask
    assert sum(seen.values()) == expect, (sum(seen.values()), expect)


def _step_peak_bytes(step):
    """Peak bytes above the starting allocation of one training step (after a warm-up step)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_cuda_peak_memory_below_torch_6_layers():
    """A 6-layer pre-LN stack's training step (AMP fp16, dropout 0.1) peaks below torch.nn's in eager."""
    h, heads, ffn, b, l = 512, 8, 2048, 32, 128
    cfg = TransformerConfig(h, heads, ffn, dropout=0.1, attn_dropout=0.1, activation_dropout=0.1,
                            max_batch_tokens=b * l, max_seq_len=l)
    ours = TransformerEncoder(cfg, 6).cuda()
    layer = nn.TransformerEncoderLayer(h, heads, ffn, dropout=0.1, batch_first=True, norm_first=True, device="cuda")
    theirs = nn.TransformerEncoder(layer, 6, norm=nn.LayerNorm(h, device="cuda"), enable_nested_tensor=False)
    x = torch.randn(b, l, h, device="cuda")
    mask = padding_mask(b, l, "suffix").cuda()

    def step(model, call):
        def f():
            for p in model.parameters():
                p.grad = None
            with torch.autocast("cuda", dtype=torch.float16):
                y = call(model)
            y.float().square().mean().backward()
        return f

    ours_peak = _step_peak_bytes(step(ours, lambda mdl: mdl(x, mask)))
    torch_peak = _step_peak_bytes(step(theirs, lambda mdl: mdl(x, src_key_padding_mask=mask)))
    print(f"peak MB: lsmini {ours_peak / 2**20:.1f}, torch.nn {torch_peak / 2**20:.1f}")
    assert ours_peak < torch_peak, (ours_peak, torch_peak)


@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_no_new_allocations_after_first_step(autocast):
    """From step 3 on, training calls cudaMalloc zero times (the allocator's segment count is stable),
    reserves no more memory and ends each step with the same bytes allocated (nothing leaks). Step 2 may
    still settle the caching allocator's pool (its first step starts from an empty pool, the second from
    step 1's cached blocks)."""
    cfg = TransformerConfig(256, 8, 1024, dropout=0.1, attn_dropout=0.1, activation_dropout=0.1,
                            max_batch_tokens=4096, max_seq_len=128)
    model = TransformerEncoder(cfg, 3).cuda()
    if not autocast:
        model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dtype = torch.float16
    x = torch.randn(16, 128, 256, device="cuda", dtype=torch.float32 if autocast else dtype)
    mask = padding_mask(16, 128, "suffix").cuda()
    allocator = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=autocast):
            y = model(x, mask)
        y.float().square().mean().backward()
        opt.step()
        del y
        torch.cuda.synchronize()
        s = torch.cuda.memory_stats()
        allocator.append((s["segment.all.allocated"], torch.cuda.memory_reserved(), torch.cuda.memory_allocated()))
    assert all(r == allocator[1] for r in allocator[2:]), allocator
