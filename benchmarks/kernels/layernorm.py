"""layernorm_fwd / layernorm_bwd beside torch.nn.functional.layer_norm (same run), and layernorm_fwd's residual
form (s = residual + dropout(x + bias), then LayerNorm(s): a post-norm block's add & norm) beside the same
expression in PyTorch, eager and compiled."""
import torch
import torch.nn.functional as F

import common
import lsmini


def bench(ctx):
    shapes = [(65536, 512), (65536, 768), (65536, 1024), (65536, 4096), (16384, 16384)]
    # (activations, parameters): the last two are mixed precision's LayerNorm, fp32 parameters on 16-bit activations
    for dtype, param_dtype in ((torch.float16,) * 2, (torch.bfloat16,) * 2, (torch.float16, torch.float32),
                               (torch.bfloat16, torch.float32)):
        for rows, hidden in shapes:
            shape = f"{rows}x{hidden}" + ("" if param_dtype == dtype else " fp32 params")
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            w = torch.randn(hidden, device="cuda", dtype=param_dtype)
            b = torch.randn(hidden, device="cuda", dtype=param_dtype)
            dy = torch.randn_like(x)
            e = x.element_size()
            # forward: read x, write y (+ mean/rstd, 8 B a row); backward: read x, dy, write dx (+ mean/rstd)
            fwd_bytes = 2 * x.numel() * e + 8 * rows
            bwd_bytes = 3 * x.numel() * e + 8 * rows
            # torch's layer_norm takes one dtype for all three. With fp32 parameters torch's side is what
            # autocast runs: the activations cast to fp32, LayerNorm in fp32, an fp32 output.
            mixed = param_dtype != dtype
            tx, tdy = (x.float(), dy.float()) if mixed else (x, dy)
            note = "torch: autocast, fp32 LayerNorm" if mixed else ""

            def torch_fwd():
                with torch.autocast("cuda", dtype=dtype, enabled=mixed):
                    return F.layer_norm(x, (hidden,), w, b, 1e-5)

            ctx.row("layernorm_fwd", dtype, shape, lambda: torch.ops.lsmini.layer_norm.default(x, w, b, 1e-5),
                    torch_fwd, nbytes=fwd_bytes, note=note)

            # backward at the op level on both sides: our binding vs torch's layer_norm backward
            ext = lsmini._backend.ext()
            _, mean, rstd = ext.layernorm_fwd(x, w, b, 1e-5)
            _, tmean, trstd = torch.ops.aten.native_layer_norm(tx, (hidden,), w, b, 1e-5)
            ctx.row("layernorm_bwd", dtype, shape,
                    lambda: ext.layernorm_bwd(dy, x, w, b, mean, rstd),
                    lambda: torch.ops.aten.native_layer_norm_backward(tdy, tx, (hidden,), tmean, trstd, w, b,
                                                                       (True, True, True)),
                    nbytes=bwd_bytes, note=note)
            del x, w, b, dy, tx, tdy, mean, rstd, tmean, trstd
    residual_form(ctx)


def residual_form(ctx):
    """65536 rows, dropout 0.1, the bias and norm parameters in the activations' dtype or (autocast) float32.
    Bytes: read x and residual, write s and y (4 · rows · hidden · s; the bias, the parameters and mean/rstd left
    out)."""
    if not ctx.wanted("layernorm_fwd"):
        return
    ext = lsmini._backend.ext()
    rows, p = 65536, 0.1
    for dtype, param_dtype in ((torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)):
        for hidden in ([1024] if ctx.quick else [512, 768, 1024, 4096]):
            shape = f"{rows}x{hidden} residual form p={p}" + ("" if param_dtype == dtype else " fp32 params")
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            res = torch.randn_like(x)
            w, b, xb = (torch.randn(hidden, device="cuda", dtype=param_dtype) for _ in range(3))
            rng = lsmini._backend.philox_seed_offset()
            mixed = param_dtype != dtype

            def torch_fwd():
                with torch.autocast("cuda", dtype=dtype, enabled=mixed):
                    s = res + F.dropout(x + xb, p)
                    return s, F.layer_norm(s, (hidden,), w, b, 1e-5)

            compiled = None if ctx.quick else common.compiled_or_none(torch_fwd, "layernorm_fwd residual form")
            ctx.row("layernorm_fwd", dtype, shape,
                    lambda: ext.layernorm_fwd(x, w, b, 1e-5, residual=res, x_bias=xb, p=p, rng=rng), torch_fwd,
                    nbytes=4 * x.numel() * x.element_size(), compiled_fn=compiled,
                    note="torch: autocast" if mixed else "")
            del x, res, w, b, xb
