"""The backward of a reference, by autograd.

A primitive's reference backward (``<op>_bwd`` with ``kernels=False``) does not save the reference's
autograd graph in forward: it runs the reference again on the saved inputs and differentiates that.
Forward then keeps only what the kernel path keeps (plus the reference dropout mask), so one hand-written
layer backward serves both paths.
"""
import torch


def reference_grads(reference, inputs, grad_out):
    """Gradients of ``reference(*inputs)`` with respect to inputs, given the output's gradient grad_out.

    The inputs are detached first, so the caller's tensors and any graph they belong to are untouched.
    None inputs are passed through as None and get None back; the rest come back in order.
    """
    leaves = [None if t is None else t.detach().requires_grad_(True) for t in inputs]
    live = [t for t in leaves if t is not None]
    with torch.enable_grad():
        grads = iter(torch.autograd.grad(reference(*leaves), live, grad_out))
    return [None if t is None else next(grads) for t in leaves]
