"""rms_norm_fwd / _bwd and add_rms_norm_fwd / _bwd beside PyTorch in the same run: eager
``F.rms_norm(x, (hidden,), weight, eps)`` (and ``s = x + residual`` before it for the residual form) and
torch.compile of the same expression (outside --quick). 32768 rows, hidden 512-4096 (the widths of
Llama-style models; 768: the 12-layer ones), the weight in the activations' dtype, as a Llama-style model in
bf16 holds it.

Bytes (the minimum each op must move; the weight and its gradient, [hidden], and the per-row rstd are left out):
  rms_norm fwd:      read x, write y                                      2 · rows · hidden · s
  rms_norm bwd:      read x and dy, write dx                              3 · rows · hidden · s
  add_rms_norm fwd:  read x and residual, write s and y                   4 · rows · hidden · s
  add_rms_norm bwd:  read s, dy and ds, write dx (x's and residual's)     4 · rows · hidden · s
The backward's fp32 dweight partials (≤ 8·SMs rows of hidden floats, < 4 % here) are not counted. Backward rows
time autograd's backward only, on every side: torch.autograd.grad(outputs, inputs, grads, retain_graph=True) on a
graph built once.
"""
import torch
import torch.nn.functional as F

import common
from lsmini.ops import add_rms_norm, rms_norm

EPS = 1e-6
ROWS = 32768


def bench(ctx):
    hiddens = [1024, 4096] if ctx.quick else [512, 768, 1024, 2048, 4096]
    dtypes = [torch.bfloat16] if ctx.quick else [torch.bfloat16, torch.float16]
    for dtype in dtypes:
        for hidden in hiddens:
            shape = f"{ROWS}x{hidden}"
            x = torch.randn(ROWS, hidden, device="cuda", dtype=dtype, requires_grad=True)
            res = torch.randn(ROWS, hidden, device="cuda", dtype=dtype, requires_grad=True)
            w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype).requires_grad_()
            dy, ds = torch.randn_like(x), torch.randn_like(x)
            n = ROWS * hidden * x.element_size()

            def torch_fwd():
                return F.rms_norm(x, (hidden,), w, EPS)

            def torch_add_fwd():
                s = x + res
                return s, F.rms_norm(s, (hidden,), w, EPS)

            for name, ours_fn, torch_fn, inputs, grads, fwd_bytes, bwd_bytes in (
                    ("rms_norm", lambda: rms_norm(x, w, EPS), torch_fwd, (x, w), (dy,), 2 * n, 3 * n),
                    ("add_rms_norm", lambda: add_rms_norm(x, res, w, EPS), torch_add_fwd, (x, res, w), (ds, dy),
                     4 * n, 4 * n)):
                if not (ctx.wanted(f"{name}_fwd") or ctx.wanted(f"{name}_bwd")):
                    continue
                compiled = None if ctx.quick else common.compiled_or_none(torch_fn, name)
                ctx.row(f"{name}_fwd", dtype, shape, ours_fn, torch_fn, nbytes=fwd_bytes, compiled_fn=compiled)

                def outputs(fn):
                    out = fn()
                    return out if isinstance(out, tuple) else (out,)

                ours, theirs = outputs(ours_fn), outputs(torch_fn)
                theirs_compiled = outputs(compiled) if compiled is not None else None
                ctx.row(f"{name}_bwd", dtype, shape,
                        lambda: torch.autograd.grad(ours, inputs, grads, retain_graph=True),
                        lambda: torch.autograd.grad(theirs, inputs, grads, retain_graph=True),
                        nbytes=bwd_bytes,
                        compiled_fn=None if theirs_compiled is None else (
                            lambda: torch.autograd.grad(theirs_compiled, inputs, grads, retain_graph=True)),
                        note="autograd backward only; dweight from fp32 partials")
                del compiled, ours, theirs, theirs_compiled
                torch.cuda.empty_cache()
            del x, res, w, dy, ds
            torch.cuda.empty_cache()
