"""CUDAGraphStep: run a whole training step — forward, backward, optimizer step, loss-scale update — as one
CUDA graph replay, so the host launches one graph instead of a thousand kernels.

Why: at small and medium sizes a Transformer step is a long chain of short kernels, and the Python and
launch cost of each one can exceed its GPU time; the GPU then idles between kernels. A graph replays the
recorded kernels back to back with no host work in between.

    step_fn = lambda src, tgt_in, tgt_out: ...   # forward + backward + scaler.step(opt) + update + zero_grad
    step = lsmini.graph.CUDAGraphStep(step_fn, optimizers=[opt])
    for batch in batches:                          # every call with the same shapes and dtypes
        loss = step(*batch)                        # overwritten by the next call: .clone() to keep it
        scheduler.step()                           # host-side state changes go outside the step

``lsmini.train.TrainStep(..., cuda_graph=True)`` builds such a step for lsmini training (one recording per
batch shape, sharing one memory pool); use CUDAGraphStep directly for a step of your own.

The first ``warmup`` calls run ``step_fn`` eagerly (on a side stream, as capture requires: libraries set up
their workspaces there); the next call records it and then replays it; later calls copy their inputs into
the recorded input tensors and replay. Every call is one real training step.

What the step function must respect (it runs once, at capture; replays repeat its kernels only):
- Static shapes: each call's inputs have the shapes, dtypes and device of the first call's (checked).
- No host synchronisation (``.item()``, ``.cpu()``, data-dependent Python branches); capture fails on most.
  lsmini's layers, criterion, embedding, FusedAdam and LossScaler qualify: the embedding's token-range
  check and the criterion's target check synchronise, so they skip themselves while the stream is
  capturing (eager calls still check; replays do not). Their dropout draws graph-safe random numbers,
  fresh at every replay.
- State the host changes between steps must live on the device: FusedAdam reads its learning rates from
  device memory refreshed before each replay (``prepare_graph_replay``), so LR schedulers work; its other
  hyperparameters, and the model's structure, are frozen at capture. After ``load_state_dict`` on the model
  or optimizer, or anything that reallocates their tensors, build a new CUDAGraphStep.
- Data-parallel: with a ``lsmini.distributed.GradientReducer`` over NCCL the step records its bucket
  all-reduces too (the reducer's hooks run once, at capture; replays repeat the collectives, in the same
  order on every rank), so every rank must build the same step and call it the same number of times, as
  with any collective. gloo collectives run on the host and cannot be recorded: refused. Call ``reset()``
  (or drop the step) before ``torch.distributed.destroy_process_group()``: a group whose collectives a
  live graph recorded does not shut down (the call never returns).
"""
import torch

__all__ = ["CUDAGraphStep"]


class CUDAGraphStep:
    """Callable running ``fn(*inputs)`` as a CUDA graph after ``warmup`` eager calls (see the module doc).

    Args:
        fn: the training step; takes tensors, returns a tensor, a tuple/list of tensors, or None.
        optimizers: the FusedAdam optimizers ``fn`` steps (their learning rates are refreshed before each
            replay).
        warmup: eager calls before the capture (≥ 1: lazily built state — optimizer moments, the layers'
            cuBLAS handles — must exist before recording).
        pool: a memory pool shared with other CUDAGraphSteps (``torch.cuda.graph_pool_handle()``), e.g. one
            step per batch shape: their temporaries then share memory. Safe as long as the graphs replay one
            at a time on one stream and each call's outputs are consumed (or cloned) before the next call.
    """

    def __init__(self, fn, optimizers=(), warmup=3, pool=None):
        if not callable(fn):
            raise TypeError(f"CUDAGraphStep: fn must be callable, got {type(fn).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"CUDAGraphStep: warmup must be an int >= 1, got {warmup!r}")
        from lsmini.optim import FusedAdam

        self.optimizers = list(optimizers)
        for o in self.optimizers:
            if not isinstance(o, FusedAdam):
                raise TypeError(f"CUDAGraphStep: optimizers must be lsmini.optim.FusedAdam, got {type(o).__name__}")
            reducer = o.workspace.reducer
            if reducer is not None and reducer.backend != "nccl":
                raise ValueError(f"CUDAGraphStep: the optimizer's GradientReducer communicates with "
                                 f"{reducer.backend}, whose collectives run on the host and cannot be recorded in "
                                 "a CUDA graph; use NCCL (one GPU per process) or train without a graph")
        self.fn = fn
        self.warmup = warmup
        self.pool = pool
        self.calls = 0
        self.graph = None
        self._signature = None
        self._static_inputs = None
        self._static_output = None
        self._side = None

    @property
    def captured(self):
        return self.graph is not None

    def reset(self):
        """Drop the recording and its memory; the next call warms up and records again (with any shapes)."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.calls = 0
        self._signature = self._static_inputs = self._static_output = None

    def _check(self, inputs):
        sig = []
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"CUDAGraphStep: input {i} must be a tensor, got {type(x).__name__}")
            if x.device.type != "cuda":
                raise ValueError(f"CUDAGraphStep: input {i} must be on a CUDA device, got {x.device}")
            sig.append((tuple(x.shape), x.dtype, x.device))
        if self._signature is None:
            self._signature = sig
        elif sig != self._signature:
            for i, (a, b) in enumerate(zip(sig, self._signature)):
                if a != b:
                    raise ValueError(f"CUDAGraphStep: input {i} is {a[1]} {list(a[0])} on {a[2]}, but the step was "
                                     f"built for {b[1]} {list(b[0])} on {b[2]}; a CUDA graph replays fixed shapes "
                                     "(pad batches to one shape, or keep one CUDAGraphStep per shape)")
            raise ValueError(f"CUDAGraphStep: {len(sig)} inputs given, the step was built for {len(self._signature)}")

    def __call__(self, *inputs):
        self._check(inputs)
        self.calls += 1
        if self.graph is not None:
            for dst, src in zip(self._static_inputs, inputs):
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src, non_blocking=True)
            self._replay()
            return self._static_output
        if self.calls <= self.warmup:
            return self._on_side_stream(lambda: self.fn(*inputs))
        self._static_inputs = [x.clone() for x in inputs]
        for o in self.optimizers:
            o.prepare_graph_replay()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._static_output = self.fn(*self._static_inputs)
        # The first replay of a fresh capture can read the generator's seed/offset words before their refill
        # lands (torch 2.11, its own dropout too), unless the device is idle first
        # (tests/test_graph.py::test_first_replay_draws_from_the_generator_state).
        torch.cuda.synchronize()
        self.graph = graph
        self._replay()
        return self._static_output

    def _on_side_stream(self, run):
        main = torch.cuda.current_stream()
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            out = run()
        main.wait_stream(self._side)
        return out

    def _replay(self):
        for o in self.optimizers:
            o.prepare_graph_replay()
        self.graph.replay()
