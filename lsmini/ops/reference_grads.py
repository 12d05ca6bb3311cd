"""The backward of a reference, by autograd.

Two kinds of callers differentiate a reference instead of saving its autograd graph in forward:
- a primitive's reference backward (``<op>_bwd`` with ``kernels=False``) runs the reference again on the
  saved inputs, so forward keeps only what the kernel path keeps (plus the reference dropout mask) and
  one hand-written layer backward serves both paths;
- the CPU implementation of a backward operator (``lsmini::<op>_backward``), which gets the forward's
  inputs (or, for a linear op, only their shapes) and its dropout mask.
"""
import contextlib

import torch

_DispatchKey = torch._C.DispatchKey
_AUTOGRAD_KEYS = (_DispatchKey.AutogradFunctionality, _DispatchKey.AutogradOther, _DispatchKey.AutogradNestedTensor)


def _autograd_dispatch():
    """A context in which autograd records again where the dispatcher has turned it off: inside an
    operator's implementation (a custom operator's kernel runs below autograd), where
    ``torch.autograd.grad`` would otherwise find no graph. A no-op elsewhere."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    if not excluded.has(_DispatchKey.AutogradFunctionality):
        return contextlib.nullcontext()
    for key in _AUTOGRAD_KEYS:
        excluded = excluded.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def reference_grads(reference, inputs, grad_out):
    """Gradients of ``reference(*inputs)`` with respect to inputs, given the output's gradient grad_out.

    The inputs are detached first, so the caller's tensors and any graph they belong to are untouched.
    None inputs are passed through as None and get None back; the rest come back in order.
    """
    leaves = [None if t is None else t.detach().requires_grad_(True) for t in inputs]
    live = [t for t in leaves if t is not None]
    with _autograd_dispatch(), torch.enable_grad():
        grads = iter(torch.autograd.grad(reference(*leaves), live, grad_out))
    return [None if t is None else next(grads) for t in leaves]
