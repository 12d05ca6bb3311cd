"""bias_dropout_residual_fwd / _bwd beside plain PyTorch ``residual + F.dropout(x + bias, p)`` (same
run, same inputs, p = 0.1 in training mode for both; torch.compile of the same expression for the
forward outside --quick).

Bytes (the minimum the op must move; bias and grad_bias, [hidden], are left out):
  fwd: read x and residual, write out                       3 · rows · hidden · s
  bwd: read grad_out, write grad_x (grad_residual is grad_out itself, no traffic)
                                                            2 · rows · hidden · s
The backward's fp32 column-sum partials (≤ 2 · 4·SMs · hidden · 4 B, about 2 % here) are not counted.
Backward rows time autograd's backward only, on both sides: torch.autograd.grad(out, (x, bias,
residual), grad, retain_graph=True) on a graph built once.
"""
import torch
import torch.nn.functional as F

from lsmini.ops.bias_dropout_residual import bias_dropout_residual

P = 0.1


def _compiled(fn):
    try:
        torch._dynamo.reset()  # each shape/dtype/activation is its own graph: stay under the recompile limit
        c = torch.compile(fn)
        c()  # compile now, outside the timed region; no column when it cannot
        return c
    except Exception as e:  # noqa: BLE001 - the compiled column is optional
        print(f"# bias_dropout_residual: torch.compile baseline skipped: {type(e).__name__}: {e}")
        return None


def bench(ctx):
    rows = 65536
    hiddens = [1024] if ctx.quick else [512, 1024]
    for dtype in (torch.float16, torch.bfloat16):
        for hidden in hiddens:
            shape = f"{rows}x{hidden}"
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
            bias = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
            residual = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
            grad = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            s = x.element_size()
            fwd_bytes = 3 * rows * hidden * s
            bwd_bytes = 2 * rows * hidden * s

            def torch_fwd():
                return residual + F.dropout(x + bias, P, training=True)

            ctx.row("bias_dropout_residual_fwd", dtype, shape,
                    lambda: bias_dropout_residual(x, bias, residual, P), torch_fwd, nbytes=fwd_bytes,
                    compiled_fn=None if ctx.quick else _compiled(torch_fwd))

            inputs = (x, bias, residual)
            ours = bias_dropout_residual(x, bias, residual, P)
            theirs = torch_fwd()
            ctx.row("bias_dropout_residual_bwd", dtype, shape,
                    lambda: torch.autograd.grad(ours, inputs, grad, retain_graph=True),
                    lambda: torch.autograd.grad(theirs, inputs, grad, retain_graph=True),
                    nbytes=bwd_bytes, note="autograd backward only; grad_bias from fp32 partials")
            del x, bias, residual, grad, ours, theirs, inputs
            torch.cuda.empty_cache()
