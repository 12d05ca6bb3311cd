"""Same-process A/B of several trees' attention kernels (bf16, head dims 64 and 128, sm_90a build):

    scripts/ab_probe.sh attention DIR BASE_REV REV[,NVCC_FLAG...] ...   # here: one shared library a tree
    python benchmarks/probes/attention_ab.py [--sm80] DIR/*.so       # on an H100/H200; the first is the base

The Hopper kernels, or with --sm80 the sm_80 ones (as `lsmini._debug.sm90_attention(False)` runs them).

Not a benchmark of the op (benchmarks/bench_attention.py is, beside PyTorch): a measurement to steer changes to
the kernels, without building the extension once per tree. Each library holds one tree's launchers
(benchmarks/probes/attention_ab.cu), so every kernel runs on the same inputs, machine and clocks.

Correctness, each library against the base on random inputs (causal or not, grouped K/V heads, partial
blocks, dropout with the forward's bits kept): out, lse, Δ, the dropout bits, dQ and, without grouped K/V
heads, dK and dV must be bitwise equal (a change to how the kernels schedule their work leaves each row's
arithmetic alone); with grouped K/V heads dK and dV within 2% of the base's largest (the group's heads may
be summed in another order) and bitwise equal on a second call. A loose check against fp32 SDPA guards against
a bug the trees share. Timing: forward and backward (dQ and dK/dV kernels) of each library, CUDA events around
20 calls, the median of 3 rounds that alternate the libraries (a few shapes also with dropout 0.1, the forward's
bits kept); printed as ms and base / library. Host time: the CPU time to issue a forward or a backward call
(the median of 3 rounds of 100 calls, no synchronization inside a round), at two shapes.
With --rounding (a change to the arithmetic) every output but the dropout bits is compared within 2% of the
base's largest instead, and the deviations are printed. Exit status 1 when a check fails.

The layer's conditions, which the kernels meet inside a training step, each on its own so that their costs can be
told apart (checks and timings then take them, and skip the shapes with q_len ≠ k_len): --packed, Q, K and V as
views of one [b, len, h + 2·hk, d] projection and dQ, dK and dV of one such gradient (the layer's layout);
--rotary, the backward folds rotary positions over all of head_dim into its dQ and dK stores; --cold, every timed
call after a 256 MB write that leaves none of its inputs in L2 (each call timed on its own).
"""
import argparse
import ctypes
import os
import sys
import time

import torch

from ab_common import add_library_arguments, load_libraries, medians

BF16 = torch.bfloat16
# (batch, heads, kv_heads, q_len, k_len, head_dim), causal
CHECKS = [((2, 4, 4, 200, 200, 64), True), ((2, 4, 4, 129, 1031, 64), False), ((1, 6, 2, 1031, 129, 128), True),
          ((2, 4, 1, 70, 2053, 128), True), ((2, 3, 3, 64, 300, 64), False), ((1, 12, 4, 1000, 1000, 64), True),
          ((3, 2, 2, 257, 257, 128), False), ((1, 2, 2, 130, 700, 64), True), ((1, 16, 1, 300, 300, 64), True),
          ((1, 11, 1, 200, 200, 64), True), ((2, 14, 2, 333, 333, 128), True), ((2, 8, 4, 100, 500, 64), False),
          ((4, 6, 2, 100, 100, 64), False), ((3, 4, 4, 128, 128, 128), True),
          # more d 128 query blocks past 512 keys than SMs: the warp-specialized forward's CTAs walk several each
          ((4, 12, 4, 1100, 1100, 128), True), ((2, 8, 2, 1500, 600, 128), True), ((4, 12, 12, 700, 900, 128), False)]
DROPOUT_CHECKS = [((2, 4, 4, 200, 200, 64), True), ((1, 6, 2, 1031, 129, 128), True), ((2, 3, 3, 64, 300, 64), False),
                  ((4, 12, 4, 1100, 1100, 128), True)]
TIMINGS = [((8, 12, 4, 1024, 1024, 64), True), ((8, 12, 4, 2048, 2048, 64), True), ((4, 12, 4, 4096, 4096, 64), True),
           ((8, 12, 4, 2048, 2048, 128), True), ((8, 32, 8, 1024, 1024, 128), True), ((8, 14, 2, 1024, 1024, 64), True),
           ((8, 16, 16, 2048, 2048, 64), True), ((8, 8, 8, 2048, 2048, 128), True), ((64, 16, 16, 256, 256, 64), True),
           ((8, 12, 4, 2048, 2048, 64), False), ((64, 16, 16, 256, 256, 128), True), ((32, 8, 8, 512, 512, 128), True),
           ((8, 12, 4, 2048, 2048, 128), False), ((2, 32, 8, 8192, 8192, 128), True), ((32, 12, 12, 128, 128, 64), False),
           ((16, 12, 4, 1024, 1024, 128), True), ((4, 12, 4, 4096, 4096, 128), True)]
# with dropout 0.1, the forward's bits kept
DROPOUT_TIMINGS = [((8, 12, 12, 1024, 1024, 64), True), ((8, 16, 16, 2048, 2048, 64), True),
                   ((8, 12, 4, 2048, 2048, 128), True), ((32, 12, 12, 128, 128, 64), False)]
# the host's time a call
HOST_TIMINGS = [((8, 12, 4, 1024, 1024, 64), True), ((32, 12, 12, 128, 128, 64), False)]
LABELS = ("out", "dq", "dk", "dv", "lse", "delta", "keep")


def load(path):
    lib = ctypes.CDLL(os.path.abspath(path))
    lib.attn_run.restype = ctypes.c_int
    lib.attn_run.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 10 + [ctypes.c_int] * 7 +
                             [ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])
    lib.attn_use_sm90.restype = ctypes.c_int
    lib.attn_use_sm90.argtypes = [ctypes.c_int]
    return lib


class Mode:
    """The layer's conditions a run takes (module docstring): packed, rotary, cold."""

    def __init__(self, packed=False, rotary=False, cold=False):
        self.packed, self.rotary, self.cold = packed, rotary, cold
        self.tables = {}

    def takes(self, shape):
        return not (self.packed or self.rotary) or shape[3] == shape[4]

    def split(self, t, shape):
        """[b, len, h + 2·hk, d] → its q, k, v views, or t itself unpacked."""
        h, hk = shape[1], shape[2]
        return (t[:, :, :h], t[:, :, h:h + hk], t[:, :, h + hk:]) if self.packed else t

    def rot(self, shape):
        """(cos, sin, rot_dim) as the layer passes them: float32 [len, head_dim], rotate-half, theta 10000."""
        if not self.rotary:
            return None, None, 0
        lq, d = shape[3], shape[5]
        if (lq, d) not in self.tables:
            inv = 10000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
            ang = torch.arange(lq, device="cuda", dtype=torch.float32)[:, None] * inv
            ang = torch.cat([ang, ang], dim=1)
            self.tables[lq, d] = ang.cos().contiguous(), ang.sin().contiguous()
        cos, sin = self.tables[lq, d]
        return cos, sin, d


def inputs(shape, seed, mode):
    b, h, hk, lq, lk, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    dout = torch.randn(b, lq, h, d, device="cuda", dtype=BF16, generator=g)
    if mode.packed:
        q, k, v = mode.split(torch.randn(b, lq, h + 2 * hk, d, device="cuda", dtype=BF16, generator=g), shape)
    else:
        q = torch.randn(b, lq, h, d, device="cuda", dtype=BF16, generator=g)
        k, v = (torch.randn(b, lk, hk, d, device="cuda", dtype=BF16, generator=g) for _ in range(2))
    return q, k, v, dout


def outputs(q, k, shape, p, mode):
    """out, dq, dk, dv, lse, delta (NaN-filled: a value a kernel fails to write shows), keep (or None)."""
    b, h, hk, lq, lk, d = shape
    nan = float("nan")
    keep = torch.zeros(b * h * ((lq + 63) // 64 * 4) * ((lk + 63) // 64) * 32, dtype=torch.int32, device="cuda") \
        if p > 0 else None
    if mode.packed:
        dq, dk, dv = mode.split(torch.full((b, lq, h + 2 * hk, d), nan, device="cuda", dtype=BF16), shape)
    else:
        dq, dk, dv = torch.full_like(q, nan), torch.full_like(k, nan), torch.full_like(k, nan)
    return [torch.full((b, lq, h, d), nan, device="cuda", dtype=BF16), dq, dk, dv,
            torch.full((b, h, lq), nan, device="cuda"), torch.full((b, h, lq), nan, device="cuda"), keep]


def run(lib, backward, tensors, outs, shape, causal, mode, p=0.0):
    q, k, v, dout = tensors
    out, dq, dk, dv, lse, delta, keep = outs
    cos, sin, rot_dim = mode.rot(shape)
    rc = lib.attn_run(backward, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(),
                      dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), lse.data_ptr(), delta.data_ptr(), *shape,
                      int(causal), torch.cuda.current_stream().cuda_stream, p,
                      keep.data_ptr() if keep is not None else None, q.stride(1), k.stride(1),
                      cos.data_ptr() if cos is not None else None, sin.data_ptr() if sin is not None else None,
                      rot_dim)
    if rc != 0:
        raise RuntimeError(f"attn_run returned CUDA error {rc}")


def forward_backward(lib, tensors, shape, causal, p, mode):
    outs = outputs(tensors[0], tensors[1], shape, p, mode)
    run(lib, 0, tensors, outs, shape, causal, mode, p)
    run(lib, 1, tensors, outs, shape, causal, mode, p)
    torch.cuda.synchronize()
    return outs


def check(base, lib, name, shape, causal, p, mode, rounding=False):
    tensors = inputs(shape, seed=1, mode=mode)
    want, got = (forward_backward(base, tensors, shape, causal, p, mode),
                 forward_backward(lib, tensors, shape, causal, p, mode))
    grouped = shape[1] != shape[2]
    bad, devs = [], []
    for label, w, g in zip(LABELS, want, got):
        if w is None or torch.isnan(w.float()).all():  # the base leaves this buffer unwritten
            continue
        if torch.isnan(g.float()).any():
            bad.append(f"{label} NaN")
        elif label != "keep" and (rounding or grouped and label in ("dk", "dv")):
            finite = torch.isfinite(w)  # lse is -inf on rows that see no key: those must match exactly
            wf, gf = w.float()[finite], g.float()[finite]
            rel = ((wf - gf).abs().max() / wf.abs().max()).item() if finite.any() else 0.0
            devs.append(f"{label} {rel:.1e}")
            if not torch.equal(w[~finite], g[~finite]):
                bad.append(f"{label} differs where the base is infinite")
            elif not rel < 2e-2:
                bad.append(f"{label} off by {rel:.2e} of its largest")
        elif not torch.equal(w, g):
            bad.append(f"{label} differs")
    if grouped:
        again = forward_backward(lib, tensors, shape, causal, p, mode)[:6]
        if not all(torch.allclose(x, y, rtol=0, atol=0, equal_nan=True) for x, y in zip(again, got[:6])):
            bad.append("a second call differs")
    err = ""
    b, h, hk, lq, lk, d = shape
    if p == 0 and (lq == lk or not causal):  # SDPA's causal mask is top-left aligned, lsmini's bottom-right
        qf, kf, vf = (t.float().transpose(1, 2) for t in tensors[:3])
        ref = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=causal, enable_gqa=h != hk)
        dev = (got[0].float().transpose(1, 2) - ref).abs().max().item()
        err = f"; |out − fp32 SDPA| {dev:.4f}"
        if not dev < 0.05:
            bad.append("out far from SDPA")
    if rounding:
        err += "; off the base by " + ", ".join(devs) + " of the largest"
    print(f"[{name}] {shape} causal={causal} p={p}: {'ok' if not bad else ', '.join(bad)}{err}", flush=True)
    return not bad


def timing(libs, shape, causal, mode, p=0.0, iters=20, rounds=3):
    tensors = inputs(shape, seed=2, mode=mode)
    outs = outputs(tensors[0], tensors[1], shape, p, mode)
    flush = None
    if mode.cold:
        scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        flush = scratch.zero_
    med = medians(libs, (0, 1), lambda lib, backward: run(lib, backward, tensors, outs, shape, causal, mode, p),
                  iters, rounds, flush)
    names = list(libs)
    line = f"{shape} causal={causal} p={p}: {names[0]} fwd {med[names[0], 0]:.4f} bwd {med[names[0], 1]:.4f} ms"
    for name in names[1:]:
        line += (f" | {name} fwd {med[name, 0]:.4f} ({med[names[0], 0] / med[name, 0]:.3f}×) "
                 f"bwd {med[name, 1]:.4f} ({med[names[0], 1] / med[name, 1]:.3f}×)")
    print(line, flush=True)


def host_timing(libs, shape, causal, mode, calls=100, rounds=3):
    """Microseconds of CPU time to issue one forward and one backward call of each library."""
    tensors = inputs(shape, seed=2, mode=mode)
    outs = outputs(tensors[0], tensors[1], shape, 0.0, mode)
    run(next(iter(libs.values())), 0, tensors, outs, shape, causal, mode)  # out and lse for the backward's calls
    times = {}
    for _ in range(rounds):
        for name, lib in libs.items():
            for backward in (0, 1):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(calls):
                    run(lib, backward, tensors, outs, shape, causal, mode)
                times.setdefault((name, backward), []).append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    med = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
    print(f"{shape} causal={causal} host µs a call: " + " | ".join(
        f"{name} fwd {med[name, 0]:.1f} bwd {med[name, 1]:.1f}" for name in libs), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_library_arguments(ap)
    ap.add_argument("--sm80", action="store_true", help="the sm_80 kernels instead of the Hopper ones")
    ap.add_argument("--rounding", action="store_true",
                    help="libraries whose arithmetic rounds differently: compare within 2%% of the base's largest")
    ap.add_argument("--packed", action="store_true", help="Q, K, V and their gradients in the layer's layout")
    ap.add_argument("--rotary", action="store_true", help="the backward folds rotary positions into dQ and dK")
    ap.add_argument("--cold", action="store_true", help="L2 written over before each timed call")
    args = ap.parse_args(argv)
    mode = Mode(args.packed, args.rotary, args.cold)
    libs = load_libraries(ap, args.libs, load, "attention_ab.py")
    for lib in libs.values():
        lib.attn_use_sm90(0 if args.sm80 else 1)
    names = list(libs)
    ok = True
    for name in names[1:]:
        for p, shapes in ((0.0, CHECKS), (0.1, DROPOUT_CHECKS)):
            for shape, causal in shapes:
                if mode.takes(shape):
                    ok &= check(libs[names[0]], libs[name], name, shape, causal, p, mode, args.rounding)
    print("checks:", "all passed" if ok else "FAILED", flush=True)
    if not args.no_timing:
        for p, shapes in ((0.0, TIMINGS), (0.1, DROPOUT_TIMINGS)):
            for shape, causal in shapes:
                if mode.takes(shape):
                    timing(libs, shape, causal, mode, p)
        for shape, causal in HOST_TIMINGS:
            if mode.takes(shape):
                host_timing(libs, shape, causal, mode)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
