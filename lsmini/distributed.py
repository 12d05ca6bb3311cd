"""Data-parallel training: all-reduce the contiguous gradient workspace while backward runs.

Usage (one process per GPU, launched with ``torchrun --nproc_per_node=N train.py``)::

    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    model = build_model().cuda().half()
    optimizer = FusedAdam(model, lr=..., max_grad_norm=1.0)
    reducer = GradientReducer(optimizer)          # broadcasts rank 0's parameters to every rank
    scaler = LossScaler()
    for batch in my_shard_of_the_batches:
        loss = model(batch)                       # this rank's share, normalised as part of the global batch
        scaler.scale(loss).backward()             # buckets are all-reduced as their gradients become ready
        scaler.step(optimizer)                    # finishes the reduction first (reducer.finish())
        scaler.update()
        optimizer.zero_grad()

Gradient accumulation: run all but the last backward of a step inside ``with reducer.no_sync():``.
CUDA graphs: ``lsmini.graph.CUDAGraphStep`` records such a step with its all-reduces (NCCL only).

How it works. ``ParameterWorkspace`` keeps every gradient as a view into one flat buffer per dtype, so
the buffer can be reduced in place: ``GradientReducer`` cuts each buffer into contiguous buckets of about
``bucket_mb`` MiB at parameter boundaries, numbered from the END of the buffer (backward produces the
gradients of the last parameters first). A post-accumulate-grad hook on every parameter counts the
parameters of its bucket; when a bucket is complete, and every bucket before it has been sent, it is
divided by the world size and all-reduced (SUM, ``async_op=True``) on the slice of the flat buffer
itself: no gradient is copied. ``finish()`` sends the buckets that never completed (parameters that got
no gradient this step: their slice is zero), always in bucket order, so every rank issues the same
collectives in the same order (NCCL needs that), then waits for all of them (on CUDA that only makes the
current stream wait: no host synchronisation) and resets for the next step. ``FusedAdam.step`` and
``ParameterWorkspace.zero_grad`` call ``finish()`` themselves, so a plain loop cannot forget it;
calling it twice is harmless (nothing happened in between: nothing to do).

Averaging. Each bucket is divided by the world size before the SUM all-reduce, like the default hook of
``DistributedDataParallel``: the result is the mean of the ranks' gradients, and fp16 buckets of loss-
scaled gradients never hold more than one rank's magnitude (a sum of N of them could overflow where the
mean does not). For a world size that is a power of two the division is exact. gloo has no AVG
reduction, so the same path serves gloo (CPU tests) and NCCL. To make the mean of per-rank gradients the
gradient of the whole batch, each rank normalises its loss by the global batch size divided by the
world size (e.g. its summed token losses · world / tokens of all ranks' batches).

Consistency across ranks. After ``finish()`` every rank holds the same averaged gradient, bit for bit
(NCCL's and gloo's all-reduce algorithms reduce each element once and hand that result to every rank; a
non-finite value on one rank becomes non-finite everywhere). So ``FusedAdam``'s overflow check, its
global-norm clipping (the norm of the averaged, i.e. the whole batch's, gradient) and ``LossScaler``'s
backoff/growth decide the same on every rank, with no extra communication.

Robustness. A parameter used several times in one graph (tied embeddings) gets one accumulation per
backward, so its hook fires once; a second backward outside ``no_sync()`` before ``finish()`` adds to a
gradient that may already be on the wire, which is refused with an error (a bucket not yet sent simply
accumulates). Gradients that autograd placed outside the buffer (after ``zero_grad(set_to_none=True)``
the first accumulation allocates a fresh tensor) are copied into the buffer by the hook before their
bucket is sent; a gradient that is None at ``finish()`` counts as zero. If the workspace is re-laid out
(``FusedAdam`` construction reorders it, ``workspace.to(...)``), the buckets are rebuilt before the next
step; every rank must make the same changes.

Why not a DDP communication hook: DDP hands a hook its own bucket tensors (gradients copied in, or
``p.grad`` re-pointed into them), never the workspace buffer, so reducing "straight into our gradient
buffer" through DDP would still copy every gradient, and FusedAdam needs the gradients back in its one
flat buffer. Owning the buckets also lets them follow the workspace layout exactly (contiguous slices
of it, cut at parameter boundaries).

Plain ``torch.nn.parallel.DistributedDataParallel`` also works around an lsmini model with FusedAdam:
DDP copies each gradient into its own buckets and back (with ``gradient_as_bucket_view=True`` it points
``p.grad`` at its bucket and ``FusedAdam.step`` copies the values back into the workspace). Both are
correct; ``GradientReducer`` is the path without those copies. Do not use both on one model.

Requirements: ``torch.distributed`` initialised; one workspace with the same layout on every rank (same
model, same optimizer groups; checked at construction); every rank runs backward for every step (as
with DDP); the workspace on the device the backend serves (CUDA for NCCL).
"""
import contextlib
import weakref
import zlib

import torch
import torch.distributed as dist
from torch import nn

from lsmini.optim.workspace import ParameterWorkspace, workspace_of

__all__ = ["GradientReducer"]

DEFAULT_BUCKET_MB = 25.0


class _Bucket:
    """One contiguous slice [start, end) of a dtype's gradient buffer and the parameters that fill it."""

    __slots__ = ("index", "dtype", "start", "end", "params", "flat", "pending", "sent")

    def __init__(self, index, dtype, start, end, params, flat):
        self.index, self.dtype, self.start, self.end = index, dtype, start, end
        self.params = params  # the parameters (with gradients) whose gradients live in the slice
        self.flat = flat  # the slice of the flat gradient buffer: what is reduced, in place
        self.pending = len(params)
        self.sent = False


def _workspace_from(target):
    from lsmini.optim.adam import FusedAdam

    if isinstance(target, ParameterWorkspace):
        return target
    if isinstance(target, FusedAdam):
        return target.workspace
    if isinstance(target, nn.Module):
        owners = {id(w): w for w in (workspace_of(p) for p in target.parameters())}
        if len(owners) == 1 and None not in owners.values():
            return next(iter(owners.values()))
        raise ValueError("GradientReducer: the module's parameters must all live in one ParameterWorkspace; build "
                         "the FusedAdam (or the ParameterWorkspace) first and pass it")
    raise TypeError("GradientReducer: expected a FusedAdam, a ParameterWorkspace or an nn.Module whose parameters "
                    f"live in one, got {type(target).__name__}")


class GradientReducer:
    """All-reduce (average) the flat gradient buffers of a ``ParameterWorkspace`` across processes, in
    buckets that are sent while backward is still running. See the module docstring.

    Args:
        target: a ``FusedAdam``, its ``ParameterWorkspace``, or a module whose parameters live in one.
            Build it after the optimizer (whose construction lays the workspace out).
        process_group: the group to reduce over (default: the default group).
        bucket_mb: bucket size in MiB (default 25); a parameter larger than that gets a bucket of its own.
        broadcast_parameters: copy rank 0's parameters to every rank at construction (default True), as
            DDP does, so the replicas start equal whatever each rank's initialisation was.

    Raises:
        RuntimeError: torch.distributed is unavailable or not initialised; the workspace already has a
            reducer; the ranks' workspaces differ in layout; NCCL with a workspace that is not on CUDA.
        ValueError / TypeError: a bad ``bucket_mb`` or ``target``.

    Attributes:
        world_size, rank, backend: of the process group (backend: "nccl", "gloo", ...).
        buckets: ``[(dtype, start, end, number of parameters)]`` in send order (element offsets).
    """

    def __init__(self, target, process_group=None, bucket_mb=DEFAULT_BUCKET_MB, broadcast_parameters=True):
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"GradientReducer: bucket_mb must be a number > 0, got {bucket_mb!r}")
        if not dist.is_available():
            raise RuntimeError("GradientReducer: this build of torch has no torch.distributed")
        if not dist.is_initialized():
            raise RuntimeError("GradientReducer: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group(...) first (in a script started by torchrun, "
                               "init_process_group('nccl') or ('gloo') reads the rank and world size from the "
                               "environment)")
        self.attached = False
        ws = _workspace_from(target)
        if ws.reducer is not None:
            raise RuntimeError("GradientReducer: this workspace already has a GradientReducer; use one per "
                               "workspace (call .remove() on the old one first)")
        self._ws = ws
        self._group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.backend = str(dist.get_backend(process_group)).lower()
        if self.backend == "nccl" and ws.device.type != "cuda":
            raise RuntimeError(f"GradientReducer: the process group uses NCCL, which reduces CUDA tensors, but the "
                               f"workspace is on {ws.device}; move the model to its GPU first, or use gloo on CPU")
        self._bucket_bytes = float(bucket_mb) * 2 ** 20
        self._sync = True  # False inside no_sync()
        self._accumulated = False  # some gradient was accumulated since the last finish()
        self._started = False  # ... outside no_sync(): buckets may be on the wire
        self._works = []
        self._next = 0  # the next bucket to send: buckets go out strictly in index order
        self._marked = set()  # id(param) whose gradient counted towards its bucket this step
        self._buckets = []
        self._bucket_of = {}  # id(param) -> _Bucket
        self._version = None
        self._layout()
        self._check_same_layout()
        if broadcast_parameters and self.world_size > 1:
            src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            with torch.no_grad():
                for dt in ws.dtypes:
                    dist.broadcast(ws.param_buffer(dt), src=src, group=process_group)
                owner = ws._owner() if ws._owner is not None else None
                if owner is not None and owner._state_ready:
                    # fp16/bf16 weights are really their fp32 masters once the optimizer state exists
                    for b in owner._bufs:
                        if b.master is not None:
                            dist.broadcast(b.master, src=src, group=process_group)
        self._handles = []
        ref = weakref.ref(self)

        def hook(param):
            reducer = ref()
            if reducer is not None:
                reducer._on_grad(param)

        for p in ws.params:
            if ws.has_grad_view(p):
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
        self.attached = True
        ws._reducer = self  # the workspace keeps it alive until remove(), even if the caller drops it

    # ---- layout -------------------------------------------------------------------------------------
    def _layout(self):
        """Cut every gradient buffer into buckets from its end; remember which bucket each parameter fills."""
        ws = self._ws
        buckets, bucket_of = [], {}
        for dt in ws.dtypes:
            flat = ws.grad_buffer(dt)
            esize = flat.element_size()
            members = [(p, off, n) for p, off, n in ws.slots(dt) if ws.has_grad_view(p)]
            group, size = [], 0
            for p, off, n in reversed(members):
                group.append((p, off, n))
                size += n * esize
                if size >= self._bucket_bytes:
                    buckets.append(self._make_bucket(len(buckets), dt, flat, group))
                    group, size = [], 0
            if group:
                buckets.append(self._make_bucket(len(buckets), dt, flat, group))
        for b in buckets:
            for p in b.params:
                bucket_of[id(p)] = b
        self._buckets, self._bucket_of = buckets, bucket_of
        self._version = ws.version

    @staticmethod
    def _make_bucket(index, dtype, flat, group):
        start = min(off for _, off, _ in group)
        end = max(off + n for _, off, n in group)
        return _Bucket(index, dtype, start, end, [p for p, _, _ in group], flat[start:end])

    def _check_same_layout(self):
        """Ranks with different layouts would reduce unrelated slices into each other (or hang): refuse."""
        if self.world_size == 1:
            return
        digest = zlib.crc32(repr([(str(b.dtype), b.start, b.end, len(b.params)) for b in self._buckets]).encode())
        sig = [len(self._buckets), sum(b.end - b.start for b in self._buckets),
               sum(len(b.params) for b in self._buckets), digest]
        mine = torch.tensor(sig, dtype=torch.int64, device=self._ws.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self._group)
        rows = [tuple(t.tolist()) for t in every]
        if len(set(rows)) != 1:
            detail = "; ".join(f"rank {r}: {n} buckets, {e} elements, {k} parameters"
                               for r, (n, e, k, _) in enumerate(rows))
            raise RuntimeError("GradientReducer: the ranks' parameter workspaces differ (different models or "
                               f"optimizer groups?): {detail}")

    @property
    def buckets(self):
        self._refresh()
        return [(b.dtype, b.start, b.end, len(b.params)) for b in self._buckets]

    def _refresh(self):
        if self._ws.version != self._version:
            if self._accumulated:
                raise RuntimeError("GradientReducer: the workspace was re-laid out (reorder/to/rebuild) between "
                                   "backward and finish(); change the workspace only between steps")
            self._layout()

    # ---- the per-step protocol ----------------------------------------------------------------------
    def _on_grad(self, param):
        """Post-accumulate-grad hook: keep the gradient in the buffer, count it, send complete buckets."""
        if not self.attached:
            return
        if not self._accumulated:
            self._refresh()
        self._ws.sync_grad(param)
        self._accumulated = True
        if not self._sync:
            return
        self._started = True
        bucket = self._bucket_of.get(id(param))
        if bucket is None:
            return
        key = id(param)
        if key in self._marked:
            if bucket.sent:
                name = self._ws.name_of(param) or f"of shape {tuple(param.shape)}"
                raise RuntimeError(f"GradientReducer: the gradient of parameter {name} was accumulated again after "
                                   "its bucket was sent for reduction in this step (a second backward before "
                                   "finish() / optimizer.step()); run the earlier backward passes of a step inside "
                                   "reducer.no_sync()")
            return
        self._marked.add(key)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._send_ready()

    def _send_ready(self):
        buckets = self._buckets
        while self._next < len(buckets) and buckets[self._next].pending == 0:
            self._send(buckets[self._next])
            self._next += 1

    def _send(self, bucket):
        bucket.sent = True
        if self.world_size == 1:
            return
        with torch.no_grad():
            bucket.flat.div_(self.world_size)
        self._works.append(dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self._group, async_op=True))

    def finish(self):
        """Send the buckets not sent yet (in order), wait for every reduction, reset for the next step.

        Afterwards each gradient is the average over the ranks. A no-op when no gradient was accumulated
        since the last call. Called by ``FusedAdam.step`` and ``ParameterWorkspace.zero_grad``; calling it
        yourself (e.g. to read the averaged gradients before the step) is fine.
        """
        if not self._accumulated:
            return
        if not self._sync:
            raise RuntimeError("GradientReducer.finish: called inside no_sync(); the gradient is reduced by the "
                               "step after the no_sync() block")
        try:
            for b in self._buckets[self._next:]:
                for p in b.params:
                    if id(p) not in self._marked:
                        self._ws.sync_grad(p)  # None counts as zero; a gradient outside the buffer moves in
                b.pending = 0
            self._send_ready()
            for w in self._works:
                w.wait()
        finally:
            self._works = []
            self._reset()

    def _reset(self):
        self._accumulated = False
        self._started = False
        self._next = 0
        self._marked = set()
        for b in self._buckets:
            b.pending = len(b.params)
            b.sent = False

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside the block, like DDP's ``no_sync``; the
        first step after the block reduces the accumulated sum. Use it for all but the last micro-batch."""
        if self._started:
            raise RuntimeError("GradientReducer.no_sync: a backward since the last step already started the "
                               "reduction; enter no_sync() for the first micro-batches of a step, before their "
                               "backward, and call finish() / optimizer.step() after the last one")
        outer = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = outer

    def remove(self):
        """Detach from the workspace: finish any reduction in flight, remove the hooks."""
        if not self.attached:
            return
        self.finish()
        for h in self._handles:
            h.remove()
        self._handles = []
        self.attached = False
        self._ws._reducer = None

    def __repr__(self):
        return (f"GradientReducer(world_size={self.world_size}, backend={self.backend}, "
                f"buckets={len(self._buckets)}, bucket_mb={self._bucket_bytes / 2 ** 20:g})")

