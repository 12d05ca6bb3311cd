"""cross_entropy rows: lsmini's fused label-smoothed cross-entropy beside F.cross_entropy(label_smoothing=0.1).

Bytes (the minimum the op must move; the [N] fp32 per-row tensors and int64 targets are < 0.1% and
left out): cross_entropy_fwd reads the logits once (N·V·s); cross_entropy_fwd_bwd reads them in the
forward, reads them again in the backward and writes the gradient once: 3·N·V·s (s = element size).
Targets carry no ignore_index, so no row is skipped. check_targets=False keeps the lsmini call free
of host syncs, as on a training hot path. (F.cross_entropy's own float16 loss overflows to inf at
these vocabulary sizes with smoothing; that does not change its timing.) torch.compile is timed on
the first shape only, outside --quick: every shape/dtype/grad-mode is a separate compilation.
"""
import torch
import torch.nn.functional as F

EPS = 0.1


def _works(fn):
    """fn, or None when it raises (torch.compile compiles on the first call and may be unavailable)."""
    if fn is None:
        return None
    try:
        fn()
        return fn
    except Exception as e:  # noqa: BLE001 - the benchmark should still run without inductor
        print(f"# cross_entropy: torch.compile baseline skipped: {type(e).__name__}: {e}")
        return None


def bench(ctx):
    from lsmini.ops import cross_entropy

    shapes = [(16384, 32000)] if ctx.quick else [(16384, 32000), (8192, 50257), (2048, 256000)]
    for dtype in (torch.float16, torch.bfloat16):
        for i, (n, vocab) in enumerate(shapes):
            compiled = None
            if not ctx.quick and i == 0:
                compiled = torch.compile(lambda x, t: F.cross_entropy(x, t, label_smoothing=EPS))
            shape = f"{n}x{vocab}"
            logits = torch.randn(n, vocab, device="cuda").mul_(2).to(dtype).requires_grad_(True)
            target = torch.randint(0, vocab, (n,), device="cuda")
            elems = n * vocab * logits.element_size()

            def lsmini_fwd_bwd():
                loss = cross_entropy(logits, target, EPS, check_targets=False)
                torch.autograd.grad(loss, logits)

            def torch_fwd_bwd():
                loss = F.cross_entropy(logits, target, label_smoothing=EPS)
                torch.autograd.grad(loss, logits)

            compiled_fwd_bwd = None
            if compiled is not None:
                def compiled_fwd_bwd():
                    torch.autograd.grad(compiled(logits, target), logits)

            ctx.row("cross_entropy_fwd_bwd", dtype, shape, lsmini_fwd_bwd, torch_fwd_bwd, nbytes=3 * elems,
                    compiled_fn=_works(compiled_fwd_bwd), note="bytes: 2 reads of logits + 1 write of grad")

            # In-place backward: the gradient overwrites the logits (own buffer, so the rows above
            # keep their inputs). Same bytes; one [N, V] allocation less.
            scratch = logits.detach().clone().requires_grad_(True)

            def lsmini_fwd_bwd_inplace():
                loss = cross_entropy(scratch, target, EPS, check_targets=False, inplace_backward=True)
                torch.autograd.grad(loss, scratch)

            ctx.row("cross_entropy_fwd_bwd", dtype, shape, lsmini_fwd_bwd_inplace, torch_fwd_bwd, nbytes=3 * elems,
                    note="inplace_backward=True", variant="lsmini inplace_backward")
            del scratch

            with torch.no_grad():
                compiled_fwd = None
                if compiled is not None:
                    def compiled_fwd():
                        compiled(logits, target)

                ctx.row("cross_entropy_fwd", dtype, shape,
                        lambda: cross_entropy(logits, target, EPS, check_targets=False),
                        lambda: F.cross_entropy(logits, target, label_smoothing=EPS),
                        nbytes=elems, compiled_fn=_works(compiled_fwd), note="bytes: 1 read of logits")
            del logits, target
            torch.cuda.empty_cache()
