"""Dynamic loss scaling for fp16 training with FusedAdam, kept entirely on the device.

Usage (the torch.amp.GradScaler pattern)::

    scaler = LossScaler()
    loss = model(batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)      # FusedAdam unscales inside its kernel, skips the step on inf/NaN
    scaler.update()             # backoff on overflow, growth after growth_interval clean steps
    optimizer.zero_grad()

Why not GradScaler: it refuses fp16 gradients ("Attempting to unscale FP16 gradients"), and unscaling in a
separate pass would read and write every gradient once more; FusedAdam unscales while it updates.

There is no ``unscale_()``: to clip gradients, give ``FusedAdam`` a ``max_grad_norm``; the norm is taken of
the unscaled gradients inside the step.

Nothing here waits for the device: the scale and the growth tracker are device tensors, and ``update``
is one device-side op. ``get_scale()``, ``last_step_skipped`` and ``state_dict()`` read them back and do
synchronise.
"""
import math

import torch

__all__ = ["LossScaler"]


def _update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """GradScaler's rule, in place on device tensors: overflow → scale ·= backoff, tracker = 0; else
    tracker += 1 and, when it reaches growth_interval, scale ·= growth (if that stays finite), tracker = 0."""
    try:
        torch._amp_update_scale_(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)
        return
    except (AttributeError, NotImplementedError, RuntimeError):
        pass
    ok = found_inf.reshape(()) == 0
    successful = torch.where(ok, tracker + 1, torch.zeros_like(tracker))
    grow = successful >= growth_interval
    grown = scale * growth_factor
    new_scale = torch.where(ok, torch.where(grow & torch.isfinite(grown), grown, scale), scale * backoff_factor)
    scale.copy_(new_scale)
    tracker.copy_(torch.where(grow, torch.zeros_like(successful), successful))


class LossScaler:
    """Dynamic loss scaler for ``FusedAdam`` (growth/backoff as ``torch.amp.GradScaler``).

    Args:
        init_scale: initial loss scale.
        growth_factor: multiplier after ``growth_interval`` consecutive steps without overflow (> 1).
        backoff_factor: multiplier after an overflow (in (0, 1)).
        growth_interval: clean steps between growths.
        enabled: False turns every method into a pass-through (``scale`` returns its input, ``step`` calls
            ``optimizer.step()``), so one training loop serves fp32 and fp16.
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"LossScaler: init_scale must be finite and > 0, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"LossScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"LossScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"LossScaler: growth_interval must be an int >= 1, got {growth_interval!r}")
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._enabled = bool(enabled)
        self._scale = None  # float32 0-dim device tensor, created on first use
        self._growth_tracker = None  # int32 0-dim device tensor
        self._found_inf = None  # the stepped optimizer's flag, until update()
        self._last_found_inf = None
        self._init_tracker = 0

    def is_enabled(self):
        return self._enabled

    def _lazy_init(self, device):
        if self._scale is None:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((), self._init_tracker, dtype=torch.int32, device=device)

    def _to(self, device):
        if self._scale.device != device:
            self._scale = self._scale.to(device)
            self._growth_tracker = self._growth_tracker.to(device)

    def scale(self, outputs):
        """``outputs`` (a tensor, or a list/tuple of tensors) multiplied by the current scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            self._lazy_init(outputs.device)
            s = self._scale
            if s.device != outputs.device:
                s = s.to(outputs.device, non_blocking=True)
            return outputs * s
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"LossScaler.scale: expected a tensor or a list/tuple of tensors, got {type(outputs).__name__}")

    def step(self, optimizer, *args, **kwargs):
        """``optimizer.step(*args, scale=<device scale>, **kwargs)``: FusedAdam unscales the gradients inside
        its kernel and skips the step (on the device) when one is inf/NaN. Returns what step returns."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        from lsmini.optim.adam import FusedAdam

        if not isinstance(optimizer, FusedAdam):
            raise TypeError("LossScaler.step: the optimizer must be lsmini.optim.FusedAdam (it unscales inside its "
                            f"kernel), got {type(optimizer).__name__}; for other optimizers use torch.amp.GradScaler")
        if optimizer.skip_nonfinite is False:
            raise ValueError("LossScaler.step: the optimizer was built with skip_nonfinite=False, so it cannot "
                             "report overflows; dynamic loss scaling needs them")
        if "scale" in kwargs:
            raise TypeError("LossScaler.step: do not pass scale=; the scaler supplies it")
        device = optimizer.workspace.device
        self._lazy_init(device)
        self._to(device)
        out = optimizer.step(*args, scale=self._scale, **kwargs)
        self._found_inf = optimizer.found_inf
        self._last_found_inf = self._found_inf
        return out

    def update(self, new_scale=None):
        """Adjust the scale after a step: backoff on overflow, growth after growth_interval clean steps.
        ``new_scale`` (float or one-element tensor) sets the scale instead. Device-side, no synchronisation."""
        if not self._enabled:
            return
        if new_scale is not None:
            if self._scale is None:
                raise RuntimeError("LossScaler.update: the scale does not exist yet; call scale() or step() first")
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1:
                    raise ValueError(f"LossScaler.update: new_scale must hold one element, got {new_scale.numel()}")
                self._scale.copy_(new_scale.reshape(()))
            else:
                if not (math.isfinite(new_scale) and new_scale > 0):
                    raise ValueError(f"LossScaler.update: new_scale must be finite and > 0, got {new_scale}")
                self._scale.fill_(float(new_scale))
        else:
            if self._found_inf is None:
                raise RuntimeError("LossScaler.update: no step(optimizer) was recorded since the last update()")
            found = self._found_inf
            if found.device != self._scale.device:
                found = found.to(self._scale.device)
            _update_scale_(self._scale, self._growth_tracker, found, self._growth_factor, self._backoff_factor,
                           self._growth_interval)
        self._found_inf = None

    @property
    def found_inf(self):
        """Float32 device tensor [1] of the last ``step``: 1.0 if it was skipped for inf/NaN gradients."""
        return self._last_found_inf

    @property
    def last_step_skipped(self):
        """True when the last ``step`` was skipped for inf/NaN gradients (synchronises with the device)."""
        return self._last_found_inf is not None and bool(self._last_found_inf.item())

    def get_scale(self):
        """The current scale as a Python float (synchronises with the device); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else self._scale.item()

    def get_growth_tracker(self):
        return self._init_tracker if self._growth_tracker is None else int(self._growth_tracker.item())

    def state_dict(self):
        """Scale, growth tracker and settings (GradScaler's keys); empty when disabled."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": self.get_growth_tracker()}

    def load_state_dict(self, state_dict):
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("LossScaler.load_state_dict: the state_dict is empty (saved from a disabled scaler?)")
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._init_tracker = int(state_dict["_growth_tracker"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._init_tracker)
