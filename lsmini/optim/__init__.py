"""Optimizers over a contiguous parameter workspace.

- ``ParameterWorkspace``: one flat parameter buffer and one flat gradient buffer per dtype for any module.
- ``FusedAdam``: Adam/AdamW (a drop-in for ``torch.optim.AdamW``) in one fused launch per step, with fp32
  master weights for fp16/bf16 parameters, in-kernel unscaling, overflow skipping and gradient clipping.
- ``LossScaler``: dynamic loss scaling for fp16 training with FusedAdam, kept on the device.
"""
from lsmini.optim.workspace import ParameterWorkspace
from lsmini.optim.adam import FusedAdam
from lsmini.optim.loss_scaler import LossScaler

__all__ = ["ParameterWorkspace", "FusedAdam", "LossScaler"]
