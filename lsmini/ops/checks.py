"""Argument checks shared by the ops (and the layers built on them).

Each check raises TypeError (wrong kind of value) or ValueError (wrong shape, range or device) with a
message that starts with the calling op's name (``op``) and names the argument, the expected and the
actual value; it returns None when the argument is fine. Checks that only one op needs stay in that op.
"""
import numbers

import torch


def check_tensor(op, name, value, or_none=False):
    """value is a Tensor (or None, when or_none)."""
    if value is None and or_none:
        return
    if not isinstance(value, torch.Tensor):
        allowed = "a Tensor or None" if or_none else "a Tensor"
        raise TypeError(f"{op}: {name} must be {allowed}, got {type(value).__name__}")


def check_floating(op, name, tensor):
    """tensor has a floating-point dtype."""
    if not tensor.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point tensor, got {tensor.dtype}")


def check_same_device(op, name, tensor, ref_name, ref_device):
    """tensor lives on ref_device, the device of the argument ref_name."""
    if tensor.device != ref_device:
        raise ValueError(f"{op}: {name} is on {tensor.device} but {ref_name} is on {ref_device}")


def check_last_dim_vector(op, name, vector, x):
    """vector has shape [hidden], hidden being the last dimension of x (a bias, a LayerNorm weight)."""
    if vector.shape != x.shape[-1:]:
        raise ValueError(f"{op}: {name} must have shape ({x.shape[-1]},) to match the last dimension of x, "
                         f"got {tuple(vector.shape)}")


def check_x(op, x):
    """x is a floating-point Tensor [..., hidden] with hidden >= 1 (the row-wise ops' input)."""
    check_tensor(op, "x", x)
    check_floating(op, "x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dimension, got shape {tuple(x.shape)}")


def check_param_dtype(op, name, vector, x):
    """vector (a bias, a LayerNorm weight) is in x's dtype or float32: the two the kernels read parameters
    in. The reference path takes the same, so a mix that would fail on the GPU fails on the CPU too."""
    if vector.dtype not in (x.dtype, torch.float32):
        allowed = f"{x.dtype} (x's dtype)" + ("" if x.dtype == torch.float32 else " or torch.float32")
        raise TypeError(f"{op}: {name} must be {allowed}, got {vector.dtype}")


def check_bias(op, bias, x):
    """bias is None or a [hidden] Tensor in x's dtype or float32, on x's device."""
    check_tensor(op, "bias", bias, or_none=True)
    if bias is None:
        return
    check_last_dim_vector(op, "bias", bias, x)
    check_param_dtype(op, "bias", bias, x)
    check_same_device(op, "bias", bias, "x", x.device)


def check_dropout_p(op, dropout_p):
    """dropout_p is a real number (not a bool) in [0, 1]."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{op}: dropout_p must be a float in [0, 1], got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) <= 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1], got {dropout_p}")


def check_causal_and_dropout(op, causal, dropout_p):
    """causal is a bool; dropout_p is an int or float (not a bool) in [0, 1] (the attention ops)."""
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{op}: dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1], got {dropout_p}")


def check_key_padding_mask(op, mask, batch, k_len, device, ref_name, name="key_padding_mask", dims="batch, k_len"):
    """mask is None or a bool [batch, k_len] Tensor (True = pad) on device, the device of ref_name.

    name: how the messages call the mask; dims: how they call its two dimensions (a layer's padding mask
    is ``("src_key_padding_mask", "batch, len")``, say)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a bool Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{op}: {name} must have dtype torch.bool (True = pad), got {mask.dtype}")
    if tuple(mask.shape) != (batch, k_len):
        raise ValueError(f"{op}: {name} must have shape ({dims}) = ({batch}, {k_len}), got {tuple(mask.shape)}")
    check_same_device(op, name, mask, ref_name, device)
