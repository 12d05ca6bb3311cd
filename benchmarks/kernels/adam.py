"""adam: one FusedAdam step over a Transformer-base-sized model beside torch.optim.AdamW (same run).

lsmini runs what a mixed-precision user runs: fp16 parameters and gradients in the workspace, fp32 master
weights and moments, the loss scale unscaled inside the step with the overflow check on. torch runs
AdamW on the same shapes with fp32 parameters (the AMP recipe): fused=True (row adam), foreach=True
(row adam_foreach), and fused=True driven by torch.amp.GradScaler (row adam_amp, beside lsmini's
LossScaler: step + update).

Bytes lsmini must move per parameter: gradient 2 + master/m/v 12 read, master/m/v 12 + fp16 parameter 2
written = 28, plus 2 for the overflow/norm pass over the gradients = 30. (torch's fp32 AdamW moves 28:
gradient, parameter, m, v read; parameter, m, v written; GradScaler adds a read+write of every gradient.)
"""
import torch
from torch import nn

from lsmini.optim import FusedAdam, LossScaler


def transformer_base_shapes(vocab=44000, d=512, ffn=2048, layers=6):
    """Parameter shapes of a Transformer-base translation model (separate q/k/v/out projections, source
    and target embeddings, output projection tied to the target embedding): ~89M parameters, 258 tensors."""
    attn = [(d, d), (d,)] * 4
    ln = [(d,), (d,)]
    ff = [(ffn, d), (ffn,), (d, ffn), (d,)]
    enc = attn + ln + ff + ln
    dec = attn + ln + attn + ln + ff + ln
    return [(vocab, d), (vocab, d)] + enc * layers + ln + dec * layers + ln


def bench(ctx):
    if not any(ctx.wanted(n) for n in ("adam", "adam_foreach", "adam_amp")):
        return
    shapes = transformer_base_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)
    shape_str = f"{n / 1e6:.1f}M params in {len(shapes)} tensors"
    torch.manual_seed(0)

    ours = [nn.Parameter(0.02 * torch.randn(s, device="cuda", dtype=torch.float16)) for s in shapes]
    opt = FusedAdam(ours, lr=1e-4, weight_decay=0.01)
    opt.workspace.grad_buffer(torch.float16).normal_()
    scale = torch.full((), 2.0 ** 16, device="cuda")
    scaler = LossScaler()

    theirs = [nn.Parameter(0.02 * torch.randn(s, device="cuda")) for s in shapes]
    for p in theirs:
        p.grad = torch.randn_like(p)
    fused = torch.optim.AdamW(theirs, lr=1e-4, weight_decay=0.01, fused=True)
    foreach = torch.optim.AdamW(theirs, lr=1e-4, weight_decay=0.01, foreach=True)
    gscaler = torch.amp.GradScaler("cuda")
    gscaler.scale(torch.ones((), device="cuda"))  # creates its scale tensor

    def ours_amp():
        scaler.step(opt)
        scaler.update()

    def torch_amp():
        gscaler.step(fused)
        gscaler.update()

    nbytes = 30 * n
    note = ("lsmini: fp16 params + fp32 master/m/v, unscale + overflow check (30 B/param); "
            "torch: fp32 params, AdamW(fused=True).step() (28 B/param)")
    ctx.row("adam", torch.float16, shape_str, lambda: opt.step(scale=scale), fused.step, nbytes=nbytes, note=note,
            baseline="torch AdamW fused")
    ctx.row("adam_foreach", torch.float16, shape_str, lambda: opt.step(scale=scale), foreach.step, nbytes=nbytes,
            note="as adam; torch: fp32 params, AdamW(foreach=True).step()", baseline="torch AdamW foreach")
    ctx.row("adam_amp", torch.float16, shape_str, ours_amp, torch_amp, nbytes=nbytes,
            note="LossScaler.step+update vs GradScaler.step+update around AdamW(fused=True)",
            baseline="torch GradScaler + AdamW fused")
    del ours, opt, theirs, fused, foreach
