"""bias_act_dropout_fwd / _bwd beside plain PyTorch ``F.dropout(act(x + bias), p)`` with act relu,
gelu (exact) and gelu_tanh (same run, same inputs, p = 0.1 in training mode for both; torch.compile of the same
expression for the forward outside --quick).

Bytes (the minimum the op must move; bias and grad_bias, [hidden], are left out):
  fwd: read x, write out                                    2 · rows · hidden · s
  bwd: read grad_out and x (act' is recomputed), write grad_x
                                                            3 · rows · hidden · s
The backward's fp32 column-sum partials (≤ 2 · 8·SMs/tiles · hidden · 4 B, < 1 % here) are not
counted. Backward rows time autograd's backward only, on both sides: torch.autograd.grad(out,
(x, bias), grad, retain_graph=True) on a graph built once.
"""
import functools

import torch
import torch.nn.functional as F

from lsmini.ops.bias_act_dropout import bias_act_dropout

P = 0.1
TORCH_ACT = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def _compiled(fn):
    try:
        torch._dynamo.reset()  # each shape/dtype/activation is its own graph: stay under the recompile limit
        c = torch.compile(fn)
        c()  # compile now, outside the timed region; no column when it cannot
        return c
    except Exception as e:  # noqa: BLE001 - the compiled column is optional
        print(f"# bias_act_dropout: torch.compile baseline skipped: {type(e).__name__}: {e}")
        return None


def bench(ctx):
    rows = 65536
    hiddens = [4096] if ctx.quick else [2048, 4096]
    activations = ["gelu"] if ctx.quick else ["relu", "gelu", "gelu_tanh"]
    for dtype in (torch.float16, torch.bfloat16):
        for hidden in hiddens:
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype, requires_grad=True)
            bias = torch.randn(hidden, device="cuda", dtype=dtype, requires_grad=True)
            grad = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            s = x.element_size()
            fwd_bytes = 2 * rows * hidden * s
            bwd_bytes = 3 * rows * hidden * s
            for act in activations:
                shape = f"{rows}x{hidden} {act}"
                torch_act = TORCH_ACT[act]

                def torch_fwd():
                    return F.dropout(torch_act(x + bias), P, training=True)

                ctx.row("bias_act_dropout_fwd", dtype, shape,
                        lambda: bias_act_dropout(x, bias, act, P), torch_fwd, nbytes=fwd_bytes,
                        compiled_fn=None if ctx.quick else _compiled(torch_fwd))

                inputs = (x, bias)
                ours = bias_act_dropout(x, bias, act, P)
                theirs = torch_fwd()
                ctx.row("bias_act_dropout_bwd", dtype, shape,
                        lambda: torch.autograd.grad(ours, inputs, grad, retain_graph=True),
                        lambda: torch.autograd.grad(theirs, inputs, grad, retain_graph=True),
                        nbytes=bwd_bytes, note="autograd backward only; grad_bias from fp32 partials")
                del ours, theirs, inputs
                torch.cuda.empty_cache()
            del x, bias, grad
            torch.cuda.empty_cache()
