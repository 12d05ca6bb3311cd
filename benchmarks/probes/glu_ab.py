"""Same-process A/B of several trees' GLU kernels (bf16, sm_90a build):

    scripts/ab_probe.sh glu DIR BASE_REV REV[,NVCC_FLAG...] ...   # here: one shared library a tree
    python benchmarks/probes/glu_ab.py DIR/*.so                    # on an H100/H200; the first is the base

Not a benchmark of the op (bench_kernels.py's glu rows are, beside PyTorch): a measurement to steer changes to the
kernels without building the extension once per tree. Correctness, each library against the base on random
inputs: the forward's output and the backward's two gradients bitwise equal, for SwiGLU and GeGLU (tanh), the
fused layout and two tensors, with dropout 0.1 too. Timing: forward and backward of each library, CUDA events
around 20 calls, the median of 3 rounds that alternate the libraries; printed as ms, GB/s and base / library.
Exit status 1 when a check fails.
"""
import argparse
import ctypes
import os
import sys

import torch

from ab_common import add_library_arguments, load_libraries, medians

BF16 = torch.bfloat16
SILU, GELU_TANH = 0, 2  # GluAct
# (rows, cols, fused: gate and up the halves of one [rows, 2·cols] tensor), act, dropout
CHECKS = [((333, 264, True), SILU, 0.0), ((333, 264, False), SILU, 0.0), ((257, 1000, True), GELU_TANH, 0.0),
          ((129, 72, True), SILU, 0.1), ((65, 13, False), SILU, 0.0)]
TIMINGS = [((8192, 2048, True), SILU, 0.0), ((32768, 2048, True), SILU, 0.0), ((32768, 2048, False), SILU, 0.0),
           ((32768, 4096, True), SILU, 0.0), ((32768, 4096, True), GELU_TANH, 0.0), ((32768, 4096, True), SILU, 0.1)]


def load(path):
    lib = ctypes.CDLL(os.path.abspath(path))
    lib.glu_run.restype = ctypes.c_int
    lib.glu_run.argtypes = ([ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 +
                            [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p])
    return lib


def tensors(shape, seed):
    """(grad_out, gate, up) and NaN-filled (out, grad_gate, grad_up): a value a kernel fails to write shows."""
    rows, cols, fused = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    grad_out = torch.randn(rows, cols, device="cuda", dtype=BF16, generator=g)
    if fused:
        both = torch.randn(rows, 2 * cols, device="cuda", dtype=BF16, generator=g)
        gate, up = both[:, :cols], both[:, cols:]
        grads = torch.full_like(both, float("nan"))
        grad_gate, grad_up = grads[:, :cols], grads[:, cols:]
    else:
        gate, up = (torch.randn(rows, cols, device="cuda", dtype=BF16, generator=g) for _ in range(2))
        grad_gate, grad_up = torch.full_like(gate, float("nan")), torch.full_like(up, float("nan"))
    return (grad_out, gate, up), (torch.full_like(grad_out, float("nan")), grad_gate, grad_up)


def run(lib, backward, ins, outs, shape, act, p):
    rows, cols, _ = shape
    (grad_out, gate, up), (out, grad_gate, grad_up) = ins, outs
    rc = lib.glu_run(backward, grad_out.data_ptr(), gate.data_ptr(), up.data_ptr(), gate.stride(0), out.data_ptr(),
                     grad_gate.data_ptr(), grad_up.data_ptr(), rows, cols, act, p,
                     torch.cuda.current_stream().cuda_stream)
    if rc != 0:
        raise RuntimeError(f"glu_run returned CUDA error {rc}")


def check(base, lib, name, shape, act, p):
    ins, _ = tensors(shape, seed=1)
    results = []
    for each in (base, lib):
        outs = tensors(shape, seed=1)[1]
        run(each, 0, ins, outs, shape, act, p)
        run(each, 1, ins, outs, shape, act, p)
        torch.cuda.synchronize()
        results.append(outs)
    bad = [label for label, w, g in zip(("out", "grad_gate", "grad_up"), *results)
           if torch.isnan(g.float()).any() or not torch.equal(w, g)]
    print(f"[{name}] {shape} act={act} p={p}: {'ok' if not bad else ', '.join(bad) + ' differ'}", flush=True)
    return not bad


def timing(libs, shape, act, p, iters=20, rounds=3):
    ins, outs = tensors(shape, seed=2)
    med = medians(libs, (0, 1), lambda lib, backward: run(lib, backward, ins, outs, shape, act, p), iters, rounds)
    rows, cols, _ = shape
    nbytes = {0: 3 * rows * cols * 2, 1: 5 * rows * cols * 2}  # forward: gate, up, out; backward: 3 in, 2 out
    names = list(libs)
    line = f"{shape} act={act} p={p}:"
    for name in names:
        line += f" | {name}"
        for way, label in ((0, "fwd"), (1, "bwd")):
            ms = med[name, way]
            line += f" {label} {ms:.4f} ms {nbytes[way] / ms / 1e6:.0f} GB/s"
            if name != names[0]:
                line += f" ({med[names[0], way] / ms:.3f}×)"
    print(line, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_library_arguments(ap)
    args = ap.parse_args(argv)
    libs = load_libraries(ap, args.libs, load, "glu_ab.py")
    names = list(libs)
    ok = True
    for name in names[1:]:
        for shape, act, p in CHECKS:
            ok &= check(libs[names[0]], libs[name], name, shape, act, p)
    print("checks:", "all passed" if ok else "FAILED", flush=True)
    if not args.no_timing:
        for shape, act, p in TIMINGS:
            timing(libs, shape, act, p)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
