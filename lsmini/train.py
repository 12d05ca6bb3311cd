"""TrainStep: one optimizer step of lsmini training — loss scaling, backward, FusedAdam, scaler update,
zero_grad — with gradient accumulation, data-parallel reduction and, optionally, a CUDA graph per batch
shape. Also the inverse-square-root learning-rate schedule the examples use.

    step = TrainStep(loss_fn, optimizer, scaler)          # loss_fn(*batch) -> loss, or (loss, report)
    scheduler = inverse_sqrt_schedule(optimizer, warmup=4000)
    for batches in steps:
        report = step(*batches, loss_weight=1 / tokens)   # one or more micro-batches, one optimizer step
        scheduler.step()
        log_sum += report                                 # a device tensor: read it back every N steps

The order of one step, and why:
1. For each micro-batch: ``loss_fn(*batch)``, then ``scaler.scale(loss · loss_weight).backward()``.
   Gradients accumulate in the optimizer's flat gradient buffer. Under data parallelism (a
   ``lsmini.distributed.GradientReducer`` on the optimizer's workspace) every micro-batch but the last
   runs inside ``reducer.no_sync()``: only the last backward communicates, overlapping its all-reduces
   with the rest of backward.
2. ``scaler.step(optimizer)``: finishes the gradient reduction, then FusedAdam unscales, checks for
   overflow (skipping the step on the device when it finds one), clips and updates in one launch.
3. ``scaler.update()`` (backoff or growth of the loss scale, on the device), then ``optimizer.zero_grad()``.
Nothing in it reads a value back from the device: the report comes back as a device tensor, so the host
runs ahead and queues the next step while the GPU works (read reports every N steps, not every step).

``cuda_graph=True`` replays the whole step as a CUDA graph (``lsmini.graph.CUDAGraphStep``): one recording
per (shapes, dtypes) of the batch, because a graph replays fixed shapes; the recordings share one memory
pool, so their temporaries take the memory of the largest, not of all of them together. Each recording
is preceded by ``graph_warmup`` eager steps. ``loss_weight`` enters the graph as a 0-d float32 device
tensor input, so each replay uses the value of its own call: a Python number would be frozen into the
graph at recording. Host checks that would break the recording — the embedding's token-range check and
the criterion's target check — skip themselves while a stream is capturing; eager calls keep checking.
A graph step takes one micro-batch (accumulation would need one recording per micro-batch position).
"""
import contextlib
import math
import numbers

import torch

from lsmini.graph import CUDAGraphStep
from lsmini.optim import FusedAdam, LossScaler

__all__ = ["TrainStep", "InverseSqrt", "inverse_sqrt_schedule"]


class TrainStep:
    """One optimizer step over one or more micro-batches (see the module doc for its order).

    Args:
        loss_fn: ``loss_fn(*batch)`` returns the loss (a 0-d tensor to backpropagate) or a tuple
            ``(loss, report)`` where ``report`` is a detached tensor to log (e.g. the summed NLL).
        optimizer: the ``lsmini.optim.FusedAdam`` over the model's parameters. A
            ``lsmini.distributed.GradientReducer`` on its workspace, if any, reduces the gradients.
        scaler: an ``lsmini.optim.LossScaler``; default a disabled one (fp32/bf16 training).
        cuda_graph: replay each step as a CUDA graph recorded once per batch shape (CUDA tensors, one
            micro-batch per step).
        graph_warmup: eager steps before each shape's recording (>= 1: the optimizer state, the
            layers' scratch memory and library handles must exist before recording).

    ``step(*batches, loss_weight=None)`` runs one optimizer step over the micro-batches ``batches`` (each
    a tuple of tensors for ``loss_fn``) and returns the reports (or detached losses) summed over them, as
    a device tensor. ``loss_weight`` (a float or a 0-d tensor) multiplies each micro-batch's loss, e.g.
    1 / (the step's tokens) for a per-token mean of summed losses; reports are not multiplied. With
    ``cuda_graph`` the returned tensor is the recorded step's output: the next call overwrites it, so
    consume it (add it to a running sum) or ``.clone()`` it first.

    Attributes: ``loss_fn``, ``optimizer``, ``scaler``, ``graphs`` (the ``CUDAGraphStep`` of each batch
    key). ``reset()`` drops every recording and its memory: call it after ``load_state_dict`` on the model
    or optimizer (a recording keeps the tensors it was recorded with), and before
    ``torch.distributed.destroy_process_group()`` when the recordings hold all-reduces.
    """

    def __init__(self, loss_fn, optimizer, scaler=None, cuda_graph=False, graph_warmup=1):
        if not callable(loss_fn):
            raise TypeError(f"TrainStep: loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(optimizer, FusedAdam):
            raise TypeError(f"TrainStep: optimizer must be lsmini.optim.FusedAdam, got {type(optimizer).__name__}")
        if scaler is None:
            scaler = LossScaler(enabled=False)
        if not isinstance(scaler, LossScaler):
            raise TypeError(f"TrainStep: scaler must be lsmini.optim.LossScaler or None, got {type(scaler).__name__}")
        if not isinstance(cuda_graph, bool):
            raise TypeError(f"TrainStep: cuda_graph must be True or False, got {cuda_graph!r}")
        if isinstance(graph_warmup, bool) or not isinstance(graph_warmup, int) or graph_warmup < 1:
            raise ValueError(f"TrainStep: graph_warmup must be an int >= 1, got {graph_warmup!r}")
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scaler = scaler
        self.cuda_graph = cuda_graph
        self.graph_warmup = graph_warmup
        self.graphs = {}
        self._graph_pool = None

    def __call__(self, *batches, loss_weight=None):
        if not batches:
            raise ValueError("TrainStep: give at least one micro-batch (a tuple of tensors for loss_fn)")
        for index, batch in enumerate(batches):
            if not isinstance(batch, (tuple, list)):
                raise TypeError(f"TrainStep: each micro-batch must be a tuple of tensors (loss_fn(*batch)), got "
                                f"{type(batch).__name__} for micro-batch {index}")
        _check_loss_weight(loss_weight)
        if self.cuda_graph:
            if len(batches) != 1:
                raise ValueError(f"TrainStep: cuda_graph=True takes one micro-batch per step, got {len(batches)}; "
                                 "accumulate gradients without a graph (cuda_graph=False), or use update_freq 1")
            return self._graphed_step(tuple(batches[0]), loss_weight)
        return self._eager_step(batches, loss_weight)

    def reset(self):
        """Drop every recorded graph and its memory; later calls warm up and record again."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self._graph_pool = None

    def _loss_and_report(self, batch):
        out = self.loss_fn(*batch)
        if isinstance(out, torch.Tensor):
            loss, report = out, out.detach()
        elif isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out):
            loss, report = out
        else:
            raise TypeError("TrainStep: loss_fn must return the loss tensor or a tuple (loss, report) of two "
                            f"tensors, got {type(out).__name__}")
        if loss.dim() != 0:
            raise ValueError(f"TrainStep: the loss loss_fn returns must be a 0-d tensor (a sum or a mean), got "
                             f"shape {list(loss.shape)}")
        return loss, report

    def _backward(self, batch, loss_weight):
        loss, report = self._loss_and_report(batch)
        self.scaler.scale(loss if loss_weight is None else loss * loss_weight).backward()
        return report

    def _finish(self):
        self.scaler.step(self.optimizer)  # finishes the data-parallel gradient reduction first
        self.scaler.update()
        self.optimizer.zero_grad()

    def _eager_step(self, batches, loss_weight):
        reducer = self.optimizer.workspace.reducer
        total = None
        for index, batch in enumerate(batches):
            accumulate_only = reducer is not None and index < len(batches) - 1
            with reducer.no_sync() if accumulate_only else contextlib.nullcontext():
                report = self._backward(batch, loss_weight)
            total = report if total is None else total + report
        self._finish()
        return total

    def _graphed_step(self, batch, loss_weight):
        for index, tensor in enumerate(batch):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cuda":
                where = tensor.device if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"TrainStep: cuda_graph=True needs CUDA tensors, but element {index} of the batch "
                                 f"is {where}; move the batch to the GPU or use cuda_graph=False")
        weighted = loss_weight is not None
        key = (tuple((tuple(t.shape), t.dtype) for t in batch), weighted)
        graph = self.graphs.get(key)
        if graph is None:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = self.graphs[key] = CUDAGraphStep(self._recordable_step(weighted), [self.optimizer],
                                                     warmup=self.graph_warmup, pool=self._graph_pool)
        if not weighted:
            return graph(*batch)
        return graph(*batch, self._device_weight(loss_weight))

    def _recordable_step(self, weighted):
        """The step as a function of tensors alone; with `weighted`, the last input is the loss weight."""
        def step(*inputs):
            if weighted:
                report = self._backward(inputs[:-1], inputs[-1])
            else:
                report = self._backward(inputs, None)
            self._finish()
            return report

        return step

    def _device_weight(self, loss_weight):
        device = self.optimizer.workspace.device
        if isinstance(loss_weight, torch.Tensor) and loss_weight.device.type != "cpu":
            return loss_weight.to(device=device, dtype=torch.float32)
        # torch.full fills on the device: no host-to-device copy to wait for
        return torch.full((), float(loss_weight), dtype=torch.float32, device=device)


def _check_loss_weight(loss_weight):
    if loss_weight is None:
        return
    if isinstance(loss_weight, torch.Tensor):
        if loss_weight.dim() != 0 or not loss_weight.is_floating_point():
            raise ValueError(f"TrainStep: loss_weight must be a float or a 0-d floating-point tensor, got a "
                             f"{loss_weight.dtype} tensor of shape {list(loss_weight.shape)}")
        return
    if isinstance(loss_weight, bool) or not isinstance(loss_weight, numbers.Real):
        raise TypeError(f"TrainStep: loss_weight must be a float or a 0-d tensor, got {type(loss_weight).__name__}")
    if not math.isfinite(loss_weight):
        raise ValueError(f"TrainStep: loss_weight must be finite, got {loss_weight}")


class InverseSqrt:
    """Learning-rate factor for the optimizer step that follows ``i`` completed steps: linear warmup to 1
    over ``warmup`` steps, then sqrt(warmup / step). With ``cooldown`` > 0 the last ``cooldown`` steps of a
    ``total``-step run also fall linearly towards 0: step ``total`` gets 1/cooldown of the inverse-sqrt
    value, and any step after it keeps that fraction. A callable object, not a lambda, so that
    ``LambdaLR.state_dict()`` records it (as its ``__dict__``: warmup, total, cooldown) and checkpoints
    restore it."""

    def __init__(self, warmup, total=None, cooldown=0):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"InverseSqrt: warmup must be an int >= 1, got {warmup!r}")
        if isinstance(cooldown, bool) or not isinstance(cooldown, int) or cooldown < 0:
            raise ValueError(f"InverseSqrt: cooldown must be an int >= 0, got {cooldown!r}")
        if cooldown and (isinstance(total, bool) or not isinstance(total, int) or total < cooldown):
            raise ValueError(f"InverseSqrt: a cooldown of {cooldown} steps needs total, the run's steps, as an "
                             f"int >= {cooldown}; got {total!r}")
        self.warmup = warmup
        self.total = total
        self.cooldown = cooldown

    def __call__(self, i):
        step = i + 1
        factor = min(step / self.warmup, math.sqrt(self.warmup / step))
        if self.cooldown:
            factor *= min(1.0, max(1, self.total - i) / self.cooldown)
        return factor

    def __repr__(self):
        return f"InverseSqrt(warmup={self.warmup}, total={self.total}, cooldown={self.cooldown})"


def inverse_sqrt_schedule(optimizer, warmup, total=None, cooldown=0):
    """``torch.optim.lr_scheduler.LambdaLR(optimizer, InverseSqrt(warmup, total, cooldown))``: call its
    ``step()`` after each optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, InverseSqrt(warmup, total, cooldown))
