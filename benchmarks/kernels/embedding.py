"""embedding_fwd / embedding_bwd beside plain PyTorch: F.embedding(...) · scale + positions, F.dropout
(same run, same inputs, dropout p = 0.1 in training mode for both)."""
import math

import torch
import torch.nn.functional as F

import lsmini
from lsmini.ops.embedding import sinusoidal_positions


def _compiled(fn):
    try:
        c = torch.compile(fn)
        c()  # compile now, outside the timed region; fall back to no column if it cannot
        return c
    except Exception:  # noqa: BLE001 - the compiled column is optional
        return None


def bench(ctx):
    vocab, batch, length, p = 32000, 64, 1024, 0.1
    rows = batch * length
    hiddens = [1024] if ctx.quick else [512, 1024]
    for dtype in (torch.float16, torch.bfloat16):
        for hidden in hiddens:
            shape = f"{batch}x{length}x{hidden} vocab{vocab}"
            tokens = torch.randint(0, vocab, (batch, length), device="cuda")
            weight = torch.randn(vocab, hidden, device="cuda", dtype=dtype)
            pos = sinusoidal_positions(length, hidden, dtype, "cuda")
            dy = torch.randn(batch, length, hidden, device="cuda", dtype=dtype)
            scale = math.sqrt(hidden)
            e = weight.element_size()
            # forward: write the output, read the gathered token rows, the positional rows (each distinct
            # row once) and the token ids
            fwd_bytes = 2 * rows * hidden * e + length * hidden * e + rows * tokens.element_size()
            # backward: read grad_out and the ids, write the dense [vocab, hidden] gradient
            bwd_bytes = rows * hidden * e + vocab * hidden * e + rows * tokens.element_size()

            def torch_fwd():
                return F.dropout(F.embedding(tokens, weight) * scale + pos, p, True)

            ctx.row("embedding_fwd", dtype, shape,
                    lambda: torch.ops.lsmini.embedding.default(tokens, weight, pos, scale, -1, 0, p), torch_fwd,
                    nbytes=fwd_bytes, compiled_fn=None if ctx.quick else _compiled(torch_fwd))

            # backward at the op level on both sides: our binding vs the ops torch's autograd runs for
            # the baseline (dropout backward with its saved mask, · scale, embedding_dense_backward)
            ext = lsmini._backend.ext()
            rng = lsmini._backend.philox_seed_offset()
            _, mask = torch.ops.aten.native_dropout(F.embedding(tokens, weight) * scale + pos, p, True)
            ctx.row("embedding_bwd", dtype, shape,
                    lambda: ext.embedding_bwd(dy, tokens, vocab, length, True, False, scale, -1, 0, p, rng),
                    lambda: torch.ops.aten.embedding_dense_backward(
                        torch.ops.aten.native_dropout_backward(dy, mask, 1.0 / (1.0 - p)) * scale, tokens, vocab,
                        -1, False),
                    nbytes=bwd_bytes)
            del tokens, weight, pos, dy, mask
