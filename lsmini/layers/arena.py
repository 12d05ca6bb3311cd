"""Scratch memory shared by the backward passes of every Transformer layer.

A layer's backward needs large temporaries only while it runs: the attention-score gradient
[batch, heads, q_len, k_len], the Q/K/V gradients, the FFN hidden gradient [tokens, ffn]. Layers run
their backward one after another, so one buffer per (device, dtype) — the arena — serves them all:
each backward takes a flat view of the size it needs and lays its temporaries out in it. Forward uses
the same arena for the attention scores, which die inside the layer as well.

Sizing: the arena grows to the largest request it has seen (each request is bounded by the layer's
config.max_batch_tokens / max_seq_len, which the layers check first) and never shrinks; after the
first training step on the largest batch nothing is allocated again. ``reserve`` sizes it up front.

Rules that keep the sharing safe (the layers follow them):
- nothing a layer returns — outputs, input gradients, parameter gradients — lives in the arena;
- a backward unpacks its saved tensors before it writes the arena (a checkpointing recompute that runs
  while they are unpacked may use the arena itself);
- the work of one device runs on one CUDA stream, so reuse is ordered by the stream.
"""
import torch

ALIGN = 64  # elements: every region starts 128 bytes (fp16) apart, good for cuBLAS and vector loads
_GRANULE = 1 << 16  # growth rounds up to this many elements, so slowly changing shapes regrow rarely

_arenas = {}
_poison = False


def align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def region(flat, offset, shape):
    """The contiguous view of ``flat[offset:]`` with ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return flat[offset:offset + n].view(shape)


class Arena:
    """One growing scratch buffer for one (device, dtype)."""

    def __init__(self, device, dtype):
        self.device, self.dtype = device, dtype
        self.buffer = None
        self.grows = 0

    @property
    def numel(self):
        return 0 if self.buffer is None else self.buffer.numel()

    def take(self, numel):
        """A flat view of ``numel`` elements of the arena, growing it first when it is smaller."""
        if numel > self.numel:
            self.buffer = None  # let the allocator reuse the old block for the new one
            size = (numel + _GRANULE - 1) // _GRANULE * _GRANULE
            self.buffer = torch.empty(size, dtype=self.dtype, device=self.device)
            self.grows += 1
        view = self.buffer[:numel]
        if _poison and self.dtype.is_floating_point:
            view.fill_(float("nan"))
        return view


def _key(device, dtype):
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, dtype


def get_arena(device, dtype):
    """The arena of (device, dtype), created empty on first use."""
    a = _arenas.get((device, dtype))  # a tensor's own device: the key as it is (every layer call asks)
    if a is None:
        key = _key(device, dtype)
        a = _arenas.get(key)
        if a is None:
            a = _arenas[key] = Arena(*key)
    return a


def reserve(device, dtype, numel):
    """Grow the arena of (device, dtype) to at least ``numel`` elements now (e.g. before training, from
    ``TransformerEncoder.scratch_numel``)."""
    get_arena(device, dtype).take(numel)


def stats():
    """[{device, dtype, numel, bytes, grows}] for every arena."""
    return [{"device": a.device, "dtype": a.dtype, "numel": a.numel, "bytes": a.numel * a.dtype.itemsize,
             "grows": a.grows} for a in _arenas.values()]


def release():
    """Drop every arena (the memory returns to torch's allocator); the next backward allocates again."""
    _arenas.clear()


def set_poison(enabled):
    """Debug aid: fill every view handed out with NaN, so a read of scratch nobody wrote shows up as NaN in
    the results. Costs one fill per take; the tests turn it on."""
    global _poison
    _poison = bool(enabled)
