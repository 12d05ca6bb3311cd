"""A contiguous parameter/gradient workspace for any ``nn.Module`` (or list of parameters).

``ParameterWorkspace(module_or_params)`` moves every parameter into one flat buffer per dtype and makes
the parameters views into it; each gradient becomes a view into a second flat buffer with the same
layout, so backward accumulates gradients straight into it. An optimizer (``lsmini.optim.FusedAdam``)
then updates every parameter with one kernel launch per dtype, and the gradient buffer can be zeroed,
reduced or clipped as one tensor.

Layout of one dtype's buffers (elements of that dtype)::

    | p0 ........ | pad | p1 ... | pad | p2 ............ | pad |
    ^ offset 0          ^ aligned      ^ aligned

Every parameter starts on a 16-byte boundary (an offset that is a multiple of 16 / element size), so
kernels can use 16-byte vector accesses; the padding is zero in both buffers and stays zero.

What keeps working: forward/backward, ``state_dict()`` / ``load_state_dict()`` (loading copies into the
views in place), ``named_parameters()``, ``module.zero_grad(set_to_none=False)``.

Things to know:

- Moving or casting: call ``workspace.to(device=..., dtype=...)`` instead of ``module.to(...)``; it moves
  the flat buffers and re-points the parameters. ``module.to()`` / ``.cuda()`` / ``.half()`` after the
  workspace was built replaces the parameters' storage; the workspace detects this (``check()``, called
  by every ``FusedAdam.step``) and raises, and ``workspace.rebuild()`` gathers the moved parameters into
  fresh buffers.
- ``p.grad`` is the workspace view. ``FusedAdam.zero_grad()`` zeroes the flat buffer and keeps the views;
  ``FusedAdam.zero_grad(set_to_none=True)`` (like ``module.zero_grad()`` with its default) sets the
  gradients to None, and backward makes new ones. ``sync_grads()`` (called by ``FusedAdam.step``) copies
  every gradient that is another tensor into the buffer (None counts as zero), in one multi-tensor copy,
  and re-attaches the views.
- Only parameters with ``requires_grad=True`` at build time get a gradient view.
- Data-parallel training: ``lsmini.distributed.GradientReducer(workspace)`` all-reduces the flat gradient
  buffer in buckets while backward runs; ``FusedAdam.step`` waits for it (see that module).
- Tied parameters are fine (``module.parameters()`` yields them once). Parameters that are views of
  another tensor, or that share storage with each other, are rejected: the workspace would silently
  untie them.
- Saving a single parameter with ``torch.save`` writes the whole flat storage (it is a view); save
  ``state_dict()`` of the module as usual, which is fine (all views share one storage).
"""
import weakref

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ParameterWorkspace"]

ALIGN_BYTES = 16

# parameter -> weakref(the ParameterWorkspace that last laid it out). Weak on both sides, and not an
# attribute on the parameter (that would travel with pickles and deep copies). An entry whose workspace
# is gone marks a parameter that is a view of a dead workspace's buffer: it may be taken by a new one.
_OWNERS = WeakIdKeyDictionary()


def workspace_of(param):
    """The live ParameterWorkspace whose buffer ``param`` is a view of, or None."""
    ref = _OWNERS.get(param)
    ws = ref() if ref is not None else None
    return ws if ws is not None and ws.owns(param) else None


def _round_up(n, m):
    return (n + m - 1) // m * m


class _Slot:
    """Where one parameter lives: dtype buffer, element offset, length, shape, and the views handed out."""

    __slots__ = ("param", "name", "dtype", "offset", "numel", "shape", "grad", "pptr", "gptr")

    def __init__(self, param, name, dtype, offset):
        self.param = param
        self.name = name
        self.dtype = dtype
        self.offset = offset
        self.numel = param.numel()
        self.shape = param.shape
        self.grad = None
        self.pptr = None
        self.gptr = None


class _Buffer:
    __slots__ = ("dtype", "params", "grads", "slots")

    def __init__(self, dtype, params, grads, slots):
        self.dtype, self.params, self.grads, self.slots = dtype, params, grads, slots


class ParameterWorkspace:
    """Put the parameters of ``module_or_params`` into one contiguous buffer per dtype.

    Args:
        module_or_params: an ``nn.Module`` (all of ``module.parameters()``) or an iterable of parameters
            (leaf tensors). All must be floating point, on one device, own their storage, and not belong
            to another workspace.

    Raises:
        RuntimeError: a parameter already lives in a workspace (building twice).
        ValueError: no parameters, parameters on several devices, a parameter that is a view of another
            tensor or shares its storage with another parameter, a non-leaf tensor.
        TypeError: a non-tensor or non-floating-point parameter, a single tensor instead of an iterable.

    Attributes:
        params: the parameters in layout order (list).
        device: their device.
        version: increases whenever the layout or the buffers change (``reorder``, ``to``, ``rebuild``);
            holders of flat buffers compare it to know when to fetch them again.
    """

    def __init__(self, module_or_params):
        params, names = _collect(module_or_params)
        _check_params(params, names)
        self.device = params[0].device
        self.version = 0
        self._owner = None  # weakref to the optimizer that laid this workspace out, if any
        # The lsmini.distributed.GradientReducer over the gradients, if any. A strong reference: a reducer
        # built and not kept (``GradientReducer(optimizer)`` as a statement) must keep reducing.
        self._reducer = None
        self._layout(params, names)
        ref = weakref.ref(self)
        for p in params:
            _OWNERS[p] = ref

    # ---- layout -------------------------------------------------------------------------------------
    def _layout(self, params, names, device=None, dtype=None):
        """(Re)build the flat buffers for `params` in this order, copying current values and gradients.
        `dtype` casts floating-point parameters; `device` moves everything."""
        device = self.device if device is None else torch.device(device)
        by_dtype = {}
        for p, name in zip(params, names):
            dt = p.dtype if dtype is None else dtype
            by_dtype.setdefault(dt, []).append((p, name))
        buffers, slots_all = {}, {}
        for dt, members in by_dtype.items():
            esize = torch.finfo(dt).bits // 8
            align = max(1, ALIGN_BYTES // esize)
            slots, off = [], 0
            for p, name in members:
                off = _round_up(off, align)
                slots.append(_Slot(p, name, dt, off))
                off += p.numel()
            total = _round_up(off, align)
            pflat = torch.zeros(total, dtype=dt, device=device)
            gflat = torch.zeros(total, dtype=dt, device=device)
            with torch.no_grad():
                for s in slots:
                    pflat[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                    old_grad = s.param.grad
                    if old_grad is not None:
                        gflat[s.offset:s.offset + s.numel].copy_(old_grad.detach().reshape(-1))
            buffers[dt] = _Buffer(dt, pflat, gflat, slots)
            for s in slots:
                slots_all[id(s.param)] = s
        # Re-point only after every value was copied (a parameter's old storage may be the old buffer).
        for buf in buffers.values():
            for s in buf.slots:
                p = s.param
                view = buf.params[s.offset:s.offset + s.numel].view(s.shape)
                p.data = view
                s.pptr = view.data_ptr() if s.numel else None
                if p.requires_grad:
                    s.grad = buf.grads[s.offset:s.offset + s.numel].view(s.shape)
                    s.gptr = s.grad.data_ptr() if s.numel else None
                    p.grad = s.grad
                else:
                    s.grad = s.gptr = None
                    p.grad = None
        self.device = next(iter(buffers.values())).params.device  # with its index: "cuda" → cuda:0
        self._buffers = buffers
        self._slots = [slots_all[id(p)] for p in params]
        self._slot_of = slots_all
        self.version += 1

    def reorder(self, params):
        """Lay the buffers out with ``params`` first, in this order (the rest follow in their current order).

        Values and gradients are kept; flat buffers fetched before the call are stale afterwards. FusedAdam
        calls it so that each param group is one contiguous range. A no-op when the layout already starts
        with ``params``.
        """
        params = list(params)
        ids = [id(p) for p in params]
        if len(set(ids)) != len(ids):
            raise ValueError("ParameterWorkspace.reorder: params contains duplicates")
        for p in params:
            if id(p) not in self._slot_of:
                raise ValueError(f"ParameterWorkspace.reorder: a parameter of shape {tuple(p.shape)} is not in "
                                 "this workspace")
        self.check()
        current = [s.param for s in self._slots]
        if [id(p) for p in current[:len(params)]] == ids:
            return
        chosen = set(ids)
        order = params + [p for p in current if id(p) not in chosen]
        self._layout(order, [self._slot_of[id(p)].name for p in order])

    def to(self, device=None, dtype=None):
        """Move and/or cast the workspace (and so the module's parameters and gradients); returns self.

        Use this instead of ``module.to(...)`` once a workspace exists. ``dtype`` (float16/bfloat16/float32/
        float64) applies to every parameter.
        """
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point
                                      and not dtype.is_complex):
            raise TypeError(f"ParameterWorkspace.to: dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.check()
        params = [s.param for s in self._slots]
        self._layout(params, [s.name for s in self._slots], device=device, dtype=dtype)
        return self

    def rebuild(self):
        """Gather the parameters again after ``module.to()`` / ``.cuda()`` / ``.half()`` replaced their storage.

        Uses each parameter's current device and dtype (all parameters must again share one device) and its
        current gradient, if any. Returns self.
        """
        params = [s.param for s in self._slots]
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError("ParameterWorkspace.rebuild: parameters are on several devices: "
                             f"{sorted(map(str, devices))}")
        for s in self._slots:
            if s.param.grad is not None and s.param.grad.dtype != s.param.dtype:
                s.param.grad = None  # module.to(dtype) cast grads too, so this only drops stray ones
        self._layout(params, [s.name for s in self._slots], device=devices.pop())
        return self

    # ---- queries ------------------------------------------------------------------------------------
    @property
    def params(self):
        return [s.param for s in self._slots]

    @property
    def dtypes(self):
        """The dtypes that have a buffer, in layout order."""
        return list(self._buffers)

    def param_buffer(self, dtype):
        """The flat parameter buffer of ``dtype`` (1-D, every parameter of that dtype is a view into it)."""
        return self._buffer(dtype).params

    def grad_buffer(self, dtype):
        """The flat gradient buffer of ``dtype`` (same layout as ``param_buffer(dtype)``)."""
        return self._buffer(dtype).grads

    def slots(self, dtype):
        """``(param, offset, numel)`` for every parameter of ``dtype``, in layout order."""
        return [(s.param, s.offset, s.numel) for s in self._buffer(dtype).slots]

    def location(self, param):
        """``(dtype, offset, numel)`` of ``param`` in the flat buffers."""
        s = self._slot_of.get(id(param))
        if s is None or s.param is not param:
            raise ValueError(f"ParameterWorkspace.location: a parameter of shape {tuple(param.shape)} is not in "
                             "this workspace")
        return s.dtype, s.offset, s.numel

    def owns(self, param):
        """True when ``param`` is one of this workspace's parameters and still a view of its buffer."""
        s = self._slot_of.get(id(param))
        return s is not None and s.param is param and (s.pptr is None or param.data_ptr() == s.pptr)

    def name_of(self, param):
        """The parameter's name in the module the workspace was built from (None for a plain list)."""
        s = self._slot_of.get(id(param))
        return s.name if s is not None and s.param is param else None

    def has_grad_view(self, param):
        """Whether ``param`` has a gradient view in the buffer (it required grad when the workspace was built)."""
        s = self._slot_of.get(id(param))
        return s is not None and s.param is param and s.grad is not None

    @property
    def reducer(self):
        """The live ``lsmini.distributed.GradientReducer`` attached to this workspace, or None.
        ``FusedAdam.step`` and ``zero_grad`` finish its reduction first."""
        r = self._reducer
        return r if r is not None and r.attached else None

    def numel(self):
        """Parameter elements (padding excluded)."""
        return sum(s.numel for s in self._slots)

    def __len__(self):
        return len(self._slots)

    def __repr__(self):
        parts = ", ".join(f"{str(dt).replace('torch.', '')}: {len(b.slots)} tensors / {b.params.numel()} elements"
                          for dt, b in self._buffers.items())
        return f"ParameterWorkspace({parts}; device={self.device})"

    def _buffer(self, dtype):
        try:
            return self._buffers[dtype]
        except KeyError:
            raise ValueError(f"ParameterWorkspace: no {dtype} parameters; buffers exist for "
                             f"{[str(d) for d in self._buffers]}") from None

    # ---- keeping parameters and gradients attached ----------------------------------------------------
    def check(self):
        """Raise RuntimeError when a parameter no longer lives in the workspace (moved by ``module.to()``,
        or ``.data`` replaced)."""
        for i, s in enumerate(self._slots):
            if s.pptr is not None and s.param.data_ptr() != s.pptr:
                raise RuntimeError(_stale_message(i, s))

    def sync_grads(self):
        """Make every gradient the workspace view again: the gradients set to other tensors are copied into
        the buffer and those set to None are zeroed there, each kind in one multi-tensor call; then ``p.grad``
        is the view. Also runs ``check()``. Asynchronous (no host synchronisation)."""
        self._bring_in(self._slots)

    def sync_grad(self, param):
        """``sync_grads()`` for one parameter (what a gradient hook needs: the value lands in the buffer)."""
        s = self._slot_of.get(id(param))
        if s is None or s.param is not param:
            raise ValueError(f"ParameterWorkspace.sync_grad: a parameter of shape {tuple(param.shape)} is not in "
                             "this workspace")
        self._bring_in((s,))

    def _bring_in(self, slots):
        zero, copy_to, copy_from, attach = [], [], [], []
        for s in slots:
            p, view = s.param, s.grad
            if s.pptr is not None and p.data_ptr() != s.pptr:
                raise RuntimeError(_stale_message(self._slots.index(s), s))
            if view is None:
                continue
            g = p.grad
            if g is view and (s.gptr is None or g.data_ptr() == s.gptr):
                continue
            if g is None:
                zero.append(view)
            elif g.data_ptr() != s.gptr:
                if g.shape != view.shape:
                    raise RuntimeError(f"ParameterWorkspace: the gradient of parameter #{self._slots.index(s)} "
                                       f"({s.name or 'unnamed'}) has shape {tuple(g.shape)}, expected "
                                       f"{tuple(view.shape)}")
                copy_to.append(view)
                copy_from.append(g)
            attach.append(s)
        with torch.no_grad():
            if zero:
                torch._foreach_zero_(zero)
            if copy_to:
                torch._foreach_copy_(copy_to, copy_from)
        for s in attach:
            s.param.grad = s.grad

    def drop_grads(self):
        """Set the gradient of every parameter with a workspace view to None (what
        ``FusedAdam.zero_grad(set_to_none=True)`` does): backward then makes new gradient tensors, which
        ``sync_grads`` copies in. The buffer keeps its values until then. With a ``GradientReducer``
        attached, a reduction still in flight is completed first."""
        reducer = self.reducer
        if reducer is not None:
            reducer.finish()
        for s in self._slots:
            if s.grad is not None:
                s.param.grad = None

    def zero_grad(self):
        """Zero the flat gradient buffers (one fill per dtype) and re-attach any gradient that is not the
        workspace view (its value is dropped: it is zero now). With a ``GradientReducer`` attached, a
        reduction still in flight is completed first (zeroing under it would race with the communication)."""
        reducer = self.reducer
        if reducer is not None:
            reducer.finish()
        for buf in self._buffers.values():
            buf.grads.zero_()
        for s in self._slots:
            if s.grad is not None and s.param.grad is not s.grad:
                s.param.grad = s.grad


def _stale_message(i, s):
    return (f"ParameterWorkspace: parameter #{i} ({s.name or 'unnamed'}, shape {tuple(s.shape)}) no longer lives in "
            "the workspace buffer: the module was probably moved or cast with .to()/.cuda()/.half() after the "
            "workspace was built. Move the workspace instead (workspace.to(device=..., dtype=...)), or call "
            "workspace.rebuild() to gather the parameters again.")


def _collect(module_or_params):
    """(params, names) without duplicates, in order."""
    if isinstance(module_or_params, ParameterWorkspace):
        raise TypeError("ParameterWorkspace: got a ParameterWorkspace; build one per module, once")
    if isinstance(module_or_params, nn.Module):
        named = list(module_or_params.named_parameters())
        params, names = [p for _, p in named], [n for n, _ in named]
    elif isinstance(module_or_params, torch.Tensor):
        raise TypeError("ParameterWorkspace: expected an nn.Module or an iterable of parameters, got a single "
                        "Tensor (wrap it in a list)")
    else:
        try:
            params = list(module_or_params)
        except TypeError:
            raise TypeError("ParameterWorkspace: expected an nn.Module or an iterable of parameters, got "
                            f"{type(module_or_params).__name__}") from None
        names = [None] * len(params)
    seen, out_p, out_n = set(), [], []
    for p, n in zip(params, names):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ParameterWorkspace: parameters must be tensors, got {type(p).__name__}")
        if id(p) in seen:
            continue
        seen.add(id(p))
        out_p.append(p)
        out_n.append(n)
    if not out_p:
        raise ValueError("ParameterWorkspace: got no parameters")
    return out_p, out_n


def _check_params(params, names):
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"ParameterWorkspace: all parameters must be on one device, got {sorted(map(str, devices))}")
    storages = {}
    for i, (p, name) in enumerate(zip(params, names)):
        label = f"parameter #{i}" + (f" ({name})" if name else "") + f" of shape {tuple(p.shape)}"
        if workspace_of(p) is not None:
            raise RuntimeError(f"ParameterWorkspace: {label} already lives in a ParameterWorkspace; build the "
                               "workspace once and pass it (or the module) to FusedAdam")
        # A view of a workspace that no longer exists (its optimizer was dropped): free to take.
        orphan = p in _OWNERS
        if not p.is_floating_point() or p.is_complex():
            raise TypeError(f"ParameterWorkspace: {label} must be floating point, got {p.dtype}")
        if p.layout != torch.strided or p.is_sparse:
            raise TypeError(f"ParameterWorkspace: {label} must be a dense (strided) tensor, got layout {p.layout}")
        if not p.is_leaf:
            raise ValueError(f"ParameterWorkspace: {label} is not a leaf tensor (it is computed from others)")
        if p._base is not None and not orphan:
            raise ValueError(f"ParameterWorkspace: {label} is a view of another tensor; parameters must own "
                             "their storage")
        if p.numel() == 0 or orphan:
            continue
        st = p.untyped_storage()
        if p.storage_offset() != 0 or st.nbytes() != p.numel() * p.element_size():
            raise ValueError(f"ParameterWorkspace: {label} shares a storage of {st.nbytes()} bytes (offset "
                             f"{p.storage_offset()}) with other tensors: it is a view into a larger buffer, and "
                             "moving it into the workspace would detach it from that buffer")
        key = st.data_ptr()
        if key in storages:
            raise ValueError(f"ParameterWorkspace: {label} shares its storage with parameter #{storages[key]}; "
                             "tie them as one Parameter object instead")
        storages[key] = i
