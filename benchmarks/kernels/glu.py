"""glu_fwd / glu_bwd (swiglu and geglu) beside PyTorch in the same run: eager ``F.silu(gate) * up`` (``F.gelu`` for
geglu; for the fused form on ``gate_up.chunk(2, -1)``; ``F.dropout`` of it where p > 0) and torch.compile of the
same expression (outside --quick). 32768 rows of ffn 2048 and 4096; p = 0 (Llama-style models train without
dropout) except the one row that says p=0.1.

Variants (the shape column): "swiglu" takes gate and up as two tensors; "fused" one [rows, 2·ffn] tensor, the
output of one GEMM, whose gradient comes back as one tensor too.

Bytes (the minimum the op must move):
  fwd: read gate and up, write out                                    3 · rows · ffn · s
  bwd: read grad_out, gate and up (act is recomputed), write the two input gradients
                                                                      5 · rows · ffn · s
Backward rows time autograd's backward only, on every side: torch.autograd.grad(out, inputs, grad,
retain_graph=True) on a graph built once (for PyTorch's fused form that includes the chunk's backward, which
writes both halves' gradients into one tensor).
"""
import torch
import torch.nn.functional as F

import common
from lsmini.ops import geglu, swiglu

ROWS = 32768
OURS = {"swiglu": swiglu, "geglu": geglu}
TORCH_ACT = {"swiglu": F.silu, "geglu": F.gelu}


def bench(ctx):
    if not (ctx.wanted("glu_fwd") or ctx.wanted("glu_bwd")):
        return
    ffns = [4096] if ctx.quick else [2048, 4096]
    dtypes = [torch.bfloat16] if ctx.quick else [torch.bfloat16, torch.float16]
    # (op, fused, p)
    variants = [("swiglu", False, 0.0), ("swiglu", True, 0.0)]
    if not ctx.quick:
        variants += [("geglu", True, 0.0), ("swiglu", True, 0.1)]
    for dtype in dtypes:
        for ffn in ffns:
            gate_up = torch.randn(ROWS, 2 * ffn, device="cuda", dtype=dtype, requires_grad=True)
            gate = torch.randn(ROWS, ffn, device="cuda", dtype=dtype, requires_grad=True)
            up = torch.randn(ROWS, ffn, device="cuda", dtype=dtype, requires_grad=True)
            grad = torch.randn(ROWS, ffn, device="cuda", dtype=dtype)
            n = ROWS * ffn * gate.element_size()
            for op, fused, p in variants:
                shape = f"{ROWS}x{ffn} {op}" + (" fused" if fused else "") + (f" p={p}" if p else "")
                act, ours_op = TORCH_ACT[op], OURS[op]
                inputs = (gate_up,) if fused else (gate, up)

                def ours_fn():
                    return ours_op(gate_up, None, p) if fused else ours_op(gate, up, p)

                def torch_fn():
                    g, u = gate_up.chunk(2, -1) if fused else (gate, up)
                    h = act(g) * u
                    return F.dropout(h, p, training=True) if p > 0 else h

                compiled = None if ctx.quick else common.compiled_or_none(torch_fn, "glu")
                ctx.row("glu_fwd", dtype, shape, ours_fn, torch_fn, nbytes=3 * n, compiled_fn=compiled)
                ours, theirs = ours_fn(), torch_fn()
                theirs_compiled = compiled() if compiled is not None else None
                ctx.row("glu_bwd", dtype, shape,
                        lambda: torch.autograd.grad(ours, inputs, grad, retain_graph=True),
                        lambda: torch.autograd.grad(theirs, inputs, grad, retain_graph=True),
                        nbytes=5 * n,
                        compiled_fn=None if theirs_compiled is None else (
                            lambda: torch.autograd.grad(theirs_compiled, inputs, grad, retain_graph=True)),
                        note="autograd backward only")
                del compiled, ours, theirs, theirs_compiled
                torch.cuda.empty_cache()
            del gate_up, gate, up, grad
            torch.cuda.empty_cache()
