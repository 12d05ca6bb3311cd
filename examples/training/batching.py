"""Batches built once, up front: examples grouped by length into batches of at most --max-tokens padded
tokens, every length padded to a multiple of 8 (fewer distinct shapes for the kernels and CUDA graphs,
tensor-core friendly sizes), and the seeded order of the batches in each epoch, which a resumed run
rebuilds from the epoch number alone."""
import numpy as np
import torch

from builtin_data import SplitMix64

from .tokenizer import PAD

PAD_MULTIPLE = 8


def round_up(n, multiple=PAD_MULTIPLE):
    return (n + multiple - 1) // multiple * multiple


def token_batches(lengths, max_tokens, sort_keys=None):
    """Group example indices into batches of at most `max_tokens` padded tokens (rows × the longest row,
    rounded up to a multiple of 8). Examples are sorted by `sort_keys` (default: `lengths`), so each batch
    holds similar lengths and little padding. Returns a list of int64 index arrays."""
    lengths = np.asarray(lengths)
    if sort_keys is None:
        sort_keys = (lengths,)
    order = np.lexsort(tuple(reversed([np.asarray(k) for k in sort_keys]))) if len(lengths) else []
    batches, current, width = [], [], 0
    for i in order:
        w = max(width, round_up(int(lengths[i])))
        if current and w * (len(current) + 1) > max_tokens:
            batches.append(np.array(current, dtype=np.int64))
            current, w = [], round_up(int(lengths[i]))
        current.append(int(i))
        width = w
    if current:
        batches.append(np.array(current, dtype=np.int64))
    return batches


def epoch_order(n, seed, epoch):
    """The order of the n batches in `epoch`: a Fisher-Yates shuffle keyed by (seed, epoch), identical
    on every machine, so a resumed run can rebuild it from the epoch number alone."""
    rng = SplitMix64(seed * 1_000_003 + epoch)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def padded_tensor(rows, width, pin, prefix=None, suffix=None):
    """[len(rows), width] int64 tensor of the id rows (each optionally framed by prefix/suffix), PAD after."""
    out = torch.full((len(rows), width), PAD, dtype=torch.int64, pin_memory=pin)
    a = out.numpy()
    start = 0 if prefix is None else 1
    if prefix is not None:
        a[:, 0] = prefix
    for r, ids in enumerate(rows):
        a[r, start:start + len(ids)] = ids
        if suffix is not None:
            a[r, start + len(ids)] = suffix
    return out
