"""Helpers shared by the op tests."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lsmini import _backend

LOWP = (torch.float16, torch.bfloat16)


class LsminiOps(TorchDispatchMode):
    """Within the block, records the name of every lsmini operator that runs, forward and backward, in
    order: ``with LsminiOps() as ops: ...`` then ``ops.names == ["layer_norm", "layer_norm_backward"]``.
    An op that calls its reference directly records nothing."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "lsmini":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


def poison(t):
    """Fill with NaN (so an unwritten element shows) and return it."""
    return t.fill_(float("nan"))


def max_err(a, ref):
    return (a.double() - ref.double()).abs().max().item() if a.numel() else 0.0


def assert_close_fp32(out, ref, atol=1e-5, rtol=1e-5, name="output"):
    """fp32 rule: |out − ref| ≤ atol + rtol·|ref| everywhere; NaN never passes."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all() or not torch.isfinite(ref).all(), f"{name}: non-finite values"
    diff = (out.double() - ref.double()).abs()
    bound = atol + rtol * ref.double().abs()
    bad = ~(diff <= bound)
    assert not bad.any(), f"{name}: {int(bad.sum())} elements off, max err {diff.max().item():.3g}"


def assert_lowp_rule(out, ref32, torch_lowp, atol=1e-3, name="output"):
    """fp16/bf16 rule: the kernel's max error against the fp32 reference must be at most twice the
    max error of plain PyTorch run in the same low precision, plus a small atol."""
    assert out.shape == ref32.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref32.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in output"
    e_k = max_err(out, ref32)
    e_t = max_err(torch_lowp, ref32)
    assert e_k <= 2 * e_t + atol, f"{name}: kernel max err {e_k:.3g} > 2 x torch max err {e_t:.3g} + {atol}"


def check(out, ref32, torch_lowp=None, dtype=torch.float32, atol32=1e-5, rtol32=1e-5, atol_lowp=1e-3, name="output"):
    """fp32: tight elementwise rule; fp16/bf16: the 2x-PyTorch-error rule."""
    if dtype in LOWP:
        assert_lowp_rule(out, ref32, torch_lowp, atol=atol_lowp, name=name)
    else:
        assert_close_fp32(out, ref32, atol=atol32, rtol=rtol32, name=name)


# ---- dropout: an independent Philox oracle and keep-mask statistics --------------------------------
# Philox4x32-7 on int64 torch tensors holding 32-bit values, following csrc/kernels/common.cuh:
# element i of a call keyed by (seed, offset) takes the 16-bit half (i % 2, low first) of word
# (i % 8) / 2 of philox(counter = {i/8 lo, i/8 hi, offset lo, offset hi}, key = {seed lo, seed hi})
# and is kept iff that value ≥ threshold(p) = round(p · 65536).
_M32 = 0xFFFFFFFF


def _mulhilo32(a, b):
    """(hi, lo) 32-bit halves of a·b for a constant a < 2^32 and an int64 tensor b < 2^32, without
    overflowing int64: b is split into 16-bit halves."""
    t = a * (b & 0xFFFF)
    u = a * (b >> 16) + (t >> 16)
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


PHILOX_ROUNDS = 7  # common.cuh's kPhiloxRounds


def philox4x32(c0, c1, c2, c3, k0, k1, rounds=PHILOX_ROUNDS):
    """Philox4x32 with `rounds` rounds of counters (int64 tensors, values < 2^32) and a key (two ints < 2^32)."""
    for _ in range(rounds):
        hi0, lo0 = _mulhilo32(0xD2511F53, c0)
        hi1, lo1 = _mulhilo32(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c0, c1, c2, c3


def dropout_threshold(p):
    """common.cuh's dropout_threshold for the float32 value of p."""
    t = float(torch.tensor(p, dtype=torch.float32)) * 65536.0 + 0.5
    return 0 if t <= 0 else 65536 if t >= 65536 else int(t)


def philox_keep_mask(numel, p, seed, offset, device="cpu"):
    """Bool [numel]: keep[i] for flat element indices i of one dropout call keyed by (seed, offset)."""
    groups = torch.arange((numel + 7) // 8, dtype=torch.int64, device=device)
    full = lambda v: torch.full_like(groups, v)  # noqa: E731
    words = torch.stack(philox4x32(groups & _M32, groups >> 32, full(offset & _M32), full(offset >> 32),
                                   seed & _M32, seed >> 32), dim=1)  # [groups, 4]
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=2).reshape(-1)  # low half first
    return halves[:numel] >= dropout_threshold(p)


def assert_dropout_keep_stats(keep, p, sigmas=5.0, name="dropout mask"):
    """keep: bool [rows, cols] (or any shape, read as flat). Checks, each within `sigmas` standard
    deviations: the keep rate is 1 − p; neighbours along the flat index are kept together at rate
    (1 − p)² (catches words reused across the four elements of a Philox group); and, for 2-D masks,
    vertically adjacent elements too (catches masks that repeat from row to row)."""
    q = 1.0 - p
    flat = keep.reshape(-1)
    n = flat.numel()
    rate = flat.double().mean().item()
    sd = (p * q / n) ** 0.5
    assert abs(rate - q) <= sigmas * sd, f"{name}: keep rate {rate:.5f}, expected {q:.5f} ± {sigmas * sd:.5f}"

    def pairs(a, b, what):
        m = a.numel()
        both = (a & b).double().mean().item()
        # overlapping pairs share elements: binomial variance plus the covariance of neighbours
        sd2 = ((q * q * (1 - q * q) + 2 * q ** 3 * (1 - q)) / m) ** 0.5
        assert abs(both - q * q) <= sigmas * sd2, \
            f"{name}: {what} kept together at rate {both:.5f}, expected {q * q:.5f} ± {sigmas * sd2:.5f}"

    if n > 1:
        pairs(flat[1:], flat[:-1], "flat neighbours")
    if keep.dim() == 2 and keep.shape[0] > 1:
        pairs(keep[1:].reshape(-1), keep[:-1].reshape(-1), "vertical neighbours")


EPS32 = 2.0 ** -24


def assert_column_sum_close(a, ref, abs_sum, rows, name="grad_bias"):
    """fp32 column sums of `rows` terms taken in another order than the reference's: each side's
    rounding error is at most about depth·eps·Σ|term| for a summation tree of depth ≈ log2(rows)
    (plus a few levels for the per-thread chains), so allow twice that per column. A missing or
    doubled row would be off by a whole |term|."""
    depth = max(rows, 2).bit_length() + 4
    bound = 1e-6 + 2 * depth * EPS32 * abs_sum.double()
    err = (a.double() - ref.double()).abs()
    bad = ~(err <= bound)
    assert not bad.any(), f"{name}: {int(bad.sum())} columns off, worst err {err.max().item():.3g}"


def next_seed_offset(s):
    """The eager (seed, offset) that the next dropout call will draw after torch.manual_seed(s)."""
    torch.manual_seed(s)
    seed, offset, seed_ptr, offset_ptr = _backend.philox_seed_offset()
    assert (seed_ptr, offset_ptr) == (0, 0)
    torch.manual_seed(s)
    return seed, offset


# ---- attention masks shared by the attention op tests ----
def padding_mask_kinds(b, k, gen):
    """Batch 0 unpadded, batch 1 random ~30 % pads, batch 2 (if any) fully padded, the rest suffix pads."""
    kpm = torch.zeros(b, k, dtype=torch.bool)
    if b > 1:
        kpm[1] = torch.rand(k, generator=gen) < 0.3
    if b > 2:
        kpm[2] = True
    for i in range(3, b):
        kpm[i, int(torch.randint(1, k + 1, (1,), generator=gen)):] = True
    return kpm


def attention_masks(b, q, k, kind, gen, device):
    """(key_padding_mask or None, causal, masked) where masked [b, 1, q, k] (True = masked) is built
    independently of the op under test: the causal part is tril(diagonal=k − q) (bottom-right)."""
    kpm = padding_mask_kinds(b, k, gen).to(device) if kind in ("pad", "both") else None
    causal = kind in ("causal", "both")
    masked = torch.zeros(b, 1, q, k, dtype=torch.bool, device=device)
    if kpm is not None:
        masked |= kpm.view(b, 1, 1, k)
    if causal:
        masked |= ~torch.ones(q, k, dtype=torch.bool, device=device).tril(diagonal=k - q)
    return kpm, causal, (masked if kind != "none" else None)


def amp_train_step(model, crit, opt, scaler):
    """The training step the CUDA-graph tests capture: loss, scaled backward, optimizer and scaler
    steps, gradients cleared; returns the detached loss."""
    def step(src, tgt_in, tgt_out):
        loss = crit(model(src, tgt_in), tgt_out)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss.detach()

    return step


def assert_same_up_to_sum_order(y, y_ref, *stats):
    """Each fp32 statistic within a few fp32 roundings (sums of about 10^3 terms in another order), y within
    those carried through plus one rounding of its dtype (a last-bit change of the statistics can move y across
    a rounding boundary)."""
    for ours, ref in zip(stats[::2], stats[1::2]):
        torch.testing.assert_close(ours, ref, rtol=2e-6, atol=1e-6)
    eps = torch.finfo(y.dtype).eps
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=eps + 4e-6, atol=4 * eps + 4e-6)
