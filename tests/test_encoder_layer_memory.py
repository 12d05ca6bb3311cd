"""TransformerEncoderLayer's memory: the backward arena is sized once and never aliased by the returned
gradients, a layer saves for backward exactly the tensors it needs, the per-call parameter casts land in
one buffer (CPU + CUDA); on CUDA, a training step peaks below torch.nn's and allocates nothing new after
the first steps."""
import pytest
import torch
from torch import nn

from layer_testing import DEVICES, _one_thread, _poison_arena, encoder_layer, padding_mask  # noqa: F401  (fixtures)
from lsmini.layers import TransformerConfig, TransformerEncoder, TransformerEncoderLayer, arena
from lsmini.layers.precision import cast_block, cast_blocks_batched


@pytest.mark.parametrize("device", DEVICES)
def test_arena_sized_once_and_returns_fresh_grads(device):
    """After the first step the arena does not grow or move; returned gradients never alias it."""
    arena.release()
    enc = TransformerEncoder(TransformerConfig(32, 4, 64, dropout=0.1, attn_dropout=0.1, activation_dropout=0.1,
                                               max_batch_tokens=4096), 3).to(device)
    x = torch.randn(4, 12, 32, device=device, requires_grad=True)
    mask = padding_mask(4, 12, "suffix").to(device)
    seen = []
    for _ in range(4):
        x.grad = None
        enc(x, mask).square().mean().backward()
        (a,) = [s for s in arena.stats() if s["device"].type == torch.device(device).type]
        buf = arena.get_arena(x.device, x.dtype).buffer
        seen.append((a["numel"], a["grows"], buf.data_ptr()))
        base = buf.untyped_storage().data_ptr()
        for g in [x.grad] + [p.grad for p in enc.parameters()]:
            assert g.untyped_storage().data_ptr() != base
    assert seen[0][1] == 1 and all(s == seen[0] for s in seen), seen
    need = enc.scratch_numel(4, 12)
    assert seen[0][0] >= need


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("pre", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_saves_only_what_backward_needs(device, pre, recompute, act):
    """The bytes a layer saves for backward (parameters aside), counted with saved-tensor hooks, are
    exactly: input, Q/K/V, attention context, the second block's input (pre-LN) or the two residual
    sums and the first LayerNorm's output (post-LN), the first FFN GEMM's output — relu: its activation
    instead —, the padding mask (+ per-row LayerNorm statistics on the kernel path); without recompute
    also the LayerNorm outputs (pre-LN) and (gelu) the FFN activation. Attention saves no [len, len]
    tensor at all."""
    b, l, h, heads, ffn = 4, 16, 32, 4, 64
    m = encoder_layer(device, pre, h, heads, ffn, activation=act)
    m.recompute = recompute
    x = torch.randn(b, l, h, device=device, requires_grad=True)
    mask = padding_mask(b, l, "suffix").to(device)
    params = {p.data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x, mask)
    t, e = b * l, 4
    units = (6 if pre else 8) * t * h + t * ffn  # x, qkv (3), ctx, r1 | x, qkv, ctx, s1, ln1 out, s2; + f1
    if not recompute:
        units += (2 * t * h if pre else 0) + (t * ffn if act != "relu" else 0)  # LN outputs, activation
    expect = units * e + b * l  # + the bool mask
    if device == "cuda":
        expect += 2 * 2 * t * 4  # mean and rstd of two LayerNorms, float32
    assert sum(seen.values()) == expect, (sum(seen.values()), expect)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_blocks_batched_equals_cast_block(device, dtype):
    """The layer's one-launch parameter cast gives what cast_block gives per tensor: GEMM weights in the
    compute dtype, float32 vectors as they are (the same tensors), others cast; on CUDA every cast
    lands 128-byte aligned in one buffer."""
    m = TransformerEncoderLayer(TransformerConfig(32, 4, 72)).to(device)
    params = [p for blk in m.blocks() for p in blk]
    params[3] = params[3].double()  # a vector neither float32 nor dtype: cast too
    got = cast_blocks_batched(params, dtype)
    want = cast_block(params[:6], dtype) + cast_block(params[6:], dtype)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and torch.equal(g, w), i
        if w is params[i]:
            assert g is params[i], i
        elif device == "cuda":
            assert g.data_ptr() % 128 == 0 and g.untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()


# ================================================================================================= CUDA ===
def _step_peak_bytes(step):
    """Peak bytes above the starting allocation of one training step (after a warm-up step); the
    lsmini arena is released first so that its allocation counts inside the step."""
    step()
    torch.cuda.synchronize()
    arena.release()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.cuda
def test_cuda_peak_memory_below_torch_6_layers(monkeypatch):
    """A 6-layer pre-LN stack's training step (AMP fp16, dropout 0.1) peaks below torch.nn's in eager."""
    arena.set_poison(False)
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


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_no_new_allocations_after_first_step(autocast):
    """The arena is sized in step 1 and never regrows or moves. From step 3 on, training calls cudaMalloc
    zero times (the allocator's segment count is stable), reserves no more memory and ends each step
    with the same bytes allocated (nothing leaks). Step 2 may still settle the caching allocator's pool
    (its first step starts from an empty pool, the second from step 1's cached blocks)."""
    arena.set_poison(False)
    arena.release()
    cfg = TransformerConfig(256, 8, 1024, dropout=0.1, attn_dropout=0.1, activation_dropout=0.1,
                            max_batch_tokens=4096, max_seq_len=128)
    model = TransformerEncoder(cfg, 3).cuda()
    if not autocast:
        model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dtype = torch.float16
    x = torch.randn(16, 128, 256, device="cuda", dtype=torch.float32 if autocast else dtype)
    mask = padding_mask(16, 128, "suffix").cuda()
    allocator, arenas = [], []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=autocast):
            y = model(x, mask)
        y.float().square().mean().backward()
        opt.step()
        del y
        torch.cuda.synchronize()
        s = torch.cuda.memory_stats()
        (a,) = [r for r in arena.stats() if r["device"].type == "cuda" and r["dtype"] == dtype]
        arenas.append((a["numel"], a["grows"], arena.get_arena(x.device, dtype).buffer.data_ptr()))
        allocator.append((s["segment.all.allocated"], torch.cuda.memory_reserved(), torch.cuda.memory_allocated()))
    assert arenas[0][1] == 1 and all(r == arenas[0] for r in arenas), arenas
    assert all(r == allocator[1] for r in allocator[2:]), allocator
