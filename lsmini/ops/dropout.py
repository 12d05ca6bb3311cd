"""Dropout on the reference path: the keep-masks that the references draw and the dropout they apply.

The kernels regenerate their masks from a Philox state (``_backend.dropout_rng``) and store nothing per
element. The references instead draw a bool keep-mask with torch's generator of the tensor's device;
a primitive whose backward needs the mask keeps it in its saved state (reference path only), and passes
it back in to apply exactly that dropout again.
"""
import torch
import torch.nn.functional as F


def keep_mask(shape, dropout_p, device):
    """A fresh bool keep-mask (True = kept, each element with probability 1 − dropout_p), or None when
    dropout_p <= 0 (nothing is dropped, nothing is drawn)."""
    return None if dropout_p <= 0 else torch.rand(shape, device=device) >= dropout_p


def dropout_ref(y, dropout_p, training, mask):
    """Dropout of y: kept elements scaled by 1 / (1 − dropout_p), the others zero; y itself when not
    training or dropout_p == 0. mask (bool like y, True = keep) replaces the random draw; without it
    ``F.dropout`` draws one."""
    if not training or dropout_p == 0:
        return y
    if mask is None:
        return F.dropout(y, dropout_p, training=True)
    if dropout_p >= 1:
        return torch.zeros_like(y)
    return torch.where(mask, y * (1.0 / (1.0 - dropout_p)), torch.zeros_like(y))
