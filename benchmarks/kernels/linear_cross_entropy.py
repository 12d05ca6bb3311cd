"""linear_cross_entropy rows: the output projection and the label-smoothed criterion, forward and backward
(gradients of the features and of the weight), as lsmini's chunked op beside PyTorch's F.linear +
F.cross_entropy(label_smoothing=0.1) on float32 logits (float16 logits overflow the smoothed loss to inf).

The note of each row gives the memory the call adds at its peak beyond its inputs (MB), and the chunk size.
One more row per shape times lsmini's own unfused path (F.linear, then cross_entropy with its in-place
backward), the logits materialised: the op this one replaces in the training examples. Shapes are the
training benchmark's base and big output layers (8192 target tokens, vocabulary 32000, hidden 512 / 1024).
"""
import torch
import torch.nn.functional as F

EPS = 0.1


def _peak_mb(fn):
    """Memory allocated at fn's peak beyond what was allocated before it, in MB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def bench(ctx):
    from lsmini.ops import cross_entropy, linear_cross_entropy
    from lsmini.ops.linear_cross_entropy import default_chunk_tokens

    if not ctx.wanted("linear_cross_entropy"):  # the notes' memory measurements run the calls
        return
    shapes = [(8192, 512, 32000), (8192, 1024, 32000)]
    chunk_sweep = (None,) if ctx.quick else (None, 512, 2048, 4096)
    for dtype in (torch.float16, torch.bfloat16):
        for n, hidden, vocab in shapes:
            shape = f"{n}x{hidden}x{vocab}"
            x = torch.randn(n, hidden, device="cuda").to(dtype).requires_grad_(True)
            w = (torch.randn(vocab, hidden, device="cuda") * hidden ** -0.5).to(dtype).requires_grad_(True)
            target = torch.randint(0, vocab, (n,), device="cuda")

            def torch_fwd_bwd():
                loss = F.cross_entropy(F.linear(x, w).float(), target, label_smoothing=EPS)
                torch.autograd.grad(loss, (x, w))

            def unfused_fwd_bwd():
                loss = cross_entropy(F.linear(x, w), target, EPS, check_targets=False, inplace_backward=True)
                torch.autograd.grad(loss, (x, w))

            ctx.row("linear_cross_entropy_fwd_bwd", dtype, shape, unfused_fwd_bwd, torch_fwd_bwd,
                    note=f"lsmini: F.linear + cross_entropy (logits materialised); +{_peak_mb(unfused_fwd_bwd):.0f} MB "
                         f"(torch +{_peak_mb(torch_fwd_bwd):.0f} MB)", variant="lsmini unfused")
            for chunk in chunk_sweep:
                def fused_fwd_bwd(chunk=chunk):
                    loss = linear_cross_entropy(x, w, target, EPS, check_targets=False, chunk_tokens=chunk)
                    torch.autograd.grad(loss, (x, w))

                rows = chunk or default_chunk_tokens(vocab, dtype)
                ctx.row("linear_cross_entropy_fwd_bwd", dtype, shape, fused_fwd_bwd, torch_fwd_bwd,
                        note=f"chunk_tokens {rows}{' (default)' if chunk is None else ''}; "
                             f"+{_peak_mb(fused_fwd_bwd):.0f} MB",
                        variant="lsmini" if chunk is None else f"lsmini chunk_tokens={chunk}")
            del x, w, target
