"""layernorm_fwd / layernorm_bwd beside torch.nn.functional.layer_norm (same run)."""
import torch
import torch.nn.functional as F

from lsmini.ops.layernorm import LayerNormFunction


def bench(ctx):
    shapes = [(65536, 512), (65536, 1024), (65536, 4096), (16384, 16384)]
    for dtype in (torch.float16, torch.bfloat16):
        for rows, hidden in shapes:
            shape = f"{rows}x{hidden}"
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            w = torch.randn(hidden, device="cuda", dtype=dtype)
            b = torch.randn(hidden, device="cuda", dtype=dtype)
            dy = torch.randn_like(x)
            e = x.element_size()
            # forward: read x, write y (+ mean/rstd, 8 B a row); backward: read x, dy, write dx (+ mean/rstd)
            fwd_bytes = 2 * x.numel() * e + 8 * rows
            bwd_bytes = 3 * x.numel() * e + 8 * rows
            ctx.row("layernorm_fwd", dtype, shape,
                    lambda: LayerNormFunction.apply(x, w, b, 1e-5),
                    lambda: F.layer_norm(x, (hidden,), w, b, 1e-5), nbytes=fwd_bytes)

            xr, wr, br = (t.detach().requires_grad_() for t in (x, w, b))
            y_ours = LayerNormFunction.apply(xr, wr, br, 1e-5)
            y_torch = F.layer_norm(xr, (hidden,), wr, br, 1e-5)
            ctx.row("layernorm_bwd", dtype, shape,
                    lambda: torch.autograd.grad(y_ours, (xr, wr, br), dy, retain_graph=True),
                    lambda: torch.autograd.grad(y_torch, (xr, wr, br), dy, retain_graph=True), nbytes=bwd_bytes)
            del x, w, b, dy, xr, wr, br, y_ours, y_torch
