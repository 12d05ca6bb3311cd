"""FusedAdam: Adam / AdamW for every parameter of a model in one fused step over a contiguous workspace.

Math (per element, fp32; identical to ``torch.optim.AdamW`` / ``torch.optim.Adam``)::

    g  = grad · inv_scale · clip                 inv_scale = 1/loss scale, clip = min(1, max_norm/(‖g‖+1e-6))
    g  = g + wd·p                                Adam (adam_w_mode=False) only: L2 in the gradient
    p  = p · (1 − lr·wd)                         AdamW only: decoupled weight decay
    m  = lerp(m, g, 1 − β1)
    v  = β2·v + (1 − β2)·g²
    p  = p − lr/(1 − β1ᵗ) · m / (sqrt(v)/sqrt(1 − β2ᵗ) + eps)

with t the group's step count including this step, and ‖g‖ the global L2 norm of all unscaled gradients
of the optimizer (``torch.nn.utils.clip_grad_norm_`` over them, the same number).

Storage. The parameters live in a ``ParameterWorkspace`` (one flat buffer per dtype, gradients in a
second flat buffer); FusedAdam keeps flat fp32 buffers of the same layout for m, v and — for fp16/bf16
parameters — the fp32 master weights, which are what the update works on; the fp16/bf16 parameter is
written from the master in the same pass. fp32 parameters are updated in place. FusedAdam lays the
workspace out so that each param group is one contiguous range, and the kernel receives the groups'
hyperparameters by value: one launch per dtype updates all parameters, with no host-to-device copy and
no host synchronisation. When the step clips or checks for overflow, a reduction pass over the gradient
buffer runs first and leaves (skip flag, norm, clip coefficient) in device memory for the update.

Overflow. With fp16 parameters or a loss scale (``step(scale=...)``, which ``LossScaler`` passes), a
non-finite gradient skips the whole step on the device: parameters, moments and step counts stay as they
are. ``found_inf`` / ``last_step_skipped`` report it.

Reference path. On CPU, without the compiled extension, with float64 parameters, or when
``lsmini.config.reference``, the same step runs as PyTorch ops on the flat buffers (device-side as
well: no synchronisation).
"""
import math
import weakref

import torch
from torch import nn

from lsmini import _backend, limits
from lsmini.optim.workspace import ParameterWorkspace, workspace_of

__all__ = ["FusedAdam", "MAX_GROUPS"]

MAX_GROUPS = limits.ADAM_MAX_GROUPS  # the kernel's limit, under the name this module exports
_LOWP = (torch.float16, torch.bfloat16)


class _Flat:
    """The optimizer's view of one dtype buffer of the workspace."""

    __slots__ = ("dtype", "param", "grad", "seg_begin", "seg_end", "seg_group", "active_end", "master", "exp_avg",
                 "exp_avg_sq")

    def __init__(self, dtype, param, grad):
        self.dtype, self.param, self.grad = dtype, param, grad
        self.seg_begin, self.seg_end, self.seg_group = [], [], []
        self.active_end = 0
        self.master = self.exp_avg = self.exp_avg_sq = None


def _check_hyper(where, lr, betas, eps, weight_decay):
    if not 0.0 <= lr:
        raise ValueError(f"{where}: invalid learning rate {lr} (must be >= 0)")
    if not 0.0 <= eps:
        raise ValueError(f"{where}: invalid eps {eps} (must be >= 0)")
    if len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{where}: invalid beta at index {i}: {b} (must be in [0, 1))")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{where}: invalid weight_decay {weight_decay} (must be >= 0)")


def _scalar(v):
    """A hyperparameter as a Python float (a tensor is read with .item(), which synchronises for CUDA)."""
    return v.item() if isinstance(v, torch.Tensor) else float(v)


class FusedAdam(torch.optim.Optimizer):
    """Adam / AdamW over a contiguous parameter workspace, fused into one launch per step.

    A drop-in for ``torch.optim.AdamW`` (and for ``torch.optim.Adam`` with ``adam_w_mode=False``): param
    groups, ``zero_grad``, ``state_dict``/``load_state_dict`` and ``torch.optim.lr_scheduler`` work as usual.

    Args:
        params: an ``nn.Module``, a ``ParameterWorkspace``, or an iterable of parameters / param-group dicts
            (as for any torch optimizer). Parameters that already live in a workspace use it; otherwise
            FusedAdam builds one over them (they become views of its buffers). At most 16 groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (per-group overrides allowed). Note the
            AdamW default ``weight_decay=1e-2``; pass 0 for Adam's default.
        adam_w_mode: True (default): decoupled weight decay (AdamW). False: L2 added to the gradient (Adam).
        max_grad_norm: clip the global gradient norm to this value inside the step (None or 0: off).
        skip_nonfinite: skip the step when a gradient is inf/NaN. Default (None): on when there are fp16
            parameters or a loss scale is given to ``step``; off otherwise, where torch's AdamW would write
            the NaNs through, and so does this.

    Notes:
        - Which parameters are updated is fixed at construction: those of the groups with
          ``requires_grad=True`` then. Workspace parameters outside the groups are left alone.
        - A parameter whose gradient is None at step time is treated as having a zero gradient (the
          workspace always holds one), so it still decays; ``torch.optim.AdamW`` would skip it.
        - fp16/bf16 parameters: the fp32 masters are created from the parameters at the first step (or
          by ``load_state_dict``). Call ``sync_master_weights()`` after changing such parameters by hand
          later on (loading model weights mid-run, for instance).
        - ``optimizer.state`` stays empty; the state lives in flat buffers and ``state_dict()`` exposes it
          per parameter (``step``, ``exp_avg``, ``exp_avg_sq`` and, for fp16/bf16 parameters, ``master``).
        - ``add_param_group`` after construction is not supported (the layout follows the groups).
        - One FusedAdam per workspace.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, adam_w_mode=True,
                 max_grad_norm=None, skip_nonfinite=None):
        _check_hyper("FusedAdam", lr, betas, eps, weight_decay)
        if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm >= 0):
            raise ValueError(f"FusedAdam: max_grad_norm must be None or a finite number >= 0, got {max_grad_norm}")
        given_ws = None
        if isinstance(params, ParameterWorkspace):
            given_ws, params = params, params.params
        elif isinstance(params, nn.Module):
            params = list(params.parameters())
        self._ws = None  # set once the groups exist: add_param_group refuses from then on
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm else 0.0
        self.skip_nonfinite = skip_nonfinite
        self._bufs = []
        self._member = {}  # id(param) -> (_Flat, offset, numel, group index) for updated parameters
        self._member_ids = None
        self._state_ready = False
        self._steps = None  # int32 [2, MAX_GROUPS]: row self._parity holds the counts done so far
        self._parity = 0
        self._last_ctrl = None
        self._lr_device = None  # learning rates a captured step reads on the device (prepare_graph_replay)
        self._ws = self._adopt_workspace(given_ws)
        self._bind()

    # ---- construction -------------------------------------------------------------------------------
    def add_param_group(self, param_group):
        if getattr(self, "_ws", None) is not None:
            raise RuntimeError("FusedAdam.add_param_group: the param groups are fixed once the optimizer is built "
                               "(the workspace is laid out group by group); pass every group to the constructor")
        if len(self.param_groups) >= MAX_GROUPS:
            raise ValueError(f"FusedAdam supports at most {MAX_GROUPS} param groups (their hyperparameters travel "
                             "to the kernel in a fixed-size table); merge groups with equal settings")
        # the base method undecorated: its torch._disable_dynamo wrapper imports torch._dynamo on first use
        # (seconds of start-up) only to keep a compiled region from tracing it, which construction never is
        base = torch.optim.Optimizer.add_param_group
        getattr(base, "__wrapped__", base)(self, param_group)
        g = self.param_groups[-1]
        try:
            _check_hyper(f"FusedAdam (param group {len(self.param_groups) - 1})", _scalar(g["lr"]),
                         tuple(_scalar(b) for b in g["betas"]), _scalar(g["eps"]), _scalar(g["weight_decay"]))
        except ValueError:
            self.param_groups.pop()
            raise

    def _adopt_workspace(self, given):
        params = [p for g in self.param_groups for p in g["params"]]
        if given is not None:
            ws = given
            for p in params:
                if not ws.owns(p):
                    raise ValueError("FusedAdam: a parameter of the groups is not in the given ParameterWorkspace")
        else:
            owners = {}
            for p in params:
                w = workspace_of(p)
                owners[id(w)] = w
            if list(owners.values()) == [None]:
                ws = ParameterWorkspace(params)
            elif len(owners) == 1:
                ws = next(iter(owners.values()))
            else:
                raise ValueError("FusedAdam: the parameters must all live in one ParameterWorkspace, or none of them "
                                 "(then FusedAdam builds one over them)")
        owner = ws._owner() if ws._owner is not None else None
        if owner is not None and owner is not self:
            raise RuntimeError("FusedAdam: this ParameterWorkspace already has a FusedAdam; use one optimizer per "
                               "workspace (param groups give different settings to different parameters)")
        ws._owner = weakref.ref(self)
        ws.reorder([p for g in self.param_groups for p in g["params"] if p.requires_grad])
        return ws

    def _bind(self):
        """(Re)read the workspace layout: flat buffers and the segment table of each dtype."""
        ws = self._ws
        group_of = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                group_of[id(p)] = gi
        old_sig = getattr(self, "_layout_sig", None)
        bufs, member = [], {}
        for dt in ws.dtypes:
            b = _Flat(dt, ws.param_buffer(dt), ws.grad_buffer(dt))
            members_done = False
            for p, off, n in ws.slots(dt):
                updated = p.requires_grad if self._member_ids is None else id(p) in self._member_ids
                gi = group_of.get(id(p)) if updated else None
                if gi is None:
                    members_done = True
                    continue
                if members_done:
                    raise RuntimeError("FusedAdam: the workspace layout interleaves optimized and other parameters "
                                       "(was it reordered after the optimizer was built?)")
                if b.seg_group and b.seg_group[-1] == gi:
                    b.seg_end[-1] = off + n
                else:
                    if gi in b.seg_group:
                        raise RuntimeError("FusedAdam: a param group is split in the workspace layout (was it "
                                           "reordered after the optimizer was built?)")
                    b.seg_begin.append(off)
                    b.seg_end.append(off + n)
                    b.seg_group.append(gi)
                member[id(p)] = (b, off, n, gi)
            b.active_end = b.seg_end[-1] if b.seg_end else 0
            bufs.append(b)
        sig = [(b.dtype, tuple((id(p), off, n) for p, off, n in ws.slots(b.dtype))) for b in bufs]
        if self._state_ready:
            if sig != old_sig:
                raise RuntimeError("FusedAdam: the workspace was re-laid out or cast after the optimizer state was "
                                   "created; only moving it to another device (workspace.to(device)) keeps the state. "
                                   "Build the optimizer after casting the model")
            for nb, ob in zip(bufs, self._bufs):  # same layout, maybe another device: the state follows
                for name in ("master", "exp_avg", "exp_avg_sq"):
                    t = getattr(ob, name)
                    setattr(nb, name, None if t is None else t.to(ws.device))
            self._steps = self._steps.to(ws.device)
        self._bufs = bufs
        self._member = member
        if self._member_ids is None:  # membership is decided once, at construction
            self._member_ids = frozenset(member)
        self._layout_sig = sig
        self._ws_version = ws.version

    def _init_state(self):
        dev = self._ws.device
        for b in self._bufs:
            sdt = torch.float64 if b.dtype == torch.float64 else torch.float32
            b.master = b.param.to(sdt, copy=True) if b.dtype in _LOWP else None
            b.exp_avg = torch.zeros(b.param.numel(), dtype=sdt, device=dev)
            b.exp_avg_sq = torch.zeros(b.param.numel(), dtype=sdt, device=dev)
        self._steps = torch.zeros(2, MAX_GROUPS, dtype=torch.int32, device=dev)
        self._parity = 0
        self._state_ready = True

    def _drop_state(self):
        for b in self._bufs:
            b.master = b.exp_avg = b.exp_avg_sq = None
        self._steps = None
        self._parity = 0
        self._state_ready = False

    # ---- public helpers -----------------------------------------------------------------------------
    @property
    def workspace(self):
        """The ParameterWorkspace this optimizer updates."""
        return self._ws

    @property
    def found_inf(self):
        """Float32 device tensor [1] of the last step: 1.0 when it was skipped for a non-finite gradient,
        else 0.0; None when that step did not check (no fp16, no loss scale, no clipping)."""
        return None if self._last_ctrl is None else self._last_ctrl[0:1]

    @property
    def grad_norm(self):
        """0-dim float32 device tensor: global L2 norm of the unscaled gradients at the last step (before
        clipping), like the return value of ``clip_grad_norm_``; None when that step did not compute it."""
        return None if self._last_ctrl is None else self._last_ctrl[2]

    @property
    def last_step_skipped(self):
        """True when the last step was skipped for a non-finite gradient. Reads a device flag: this
        synchronises with the device."""
        return self._last_ctrl is not None and bool(self._last_ctrl[0].item())

    def sync_master_weights(self):
        """Copy the fp16/bf16 parameters into their fp32 masters (after changing parameters by hand)."""
        if self._state_ready:
            self._refresh()
            with torch.no_grad():
                for b in self._bufs:
                    if b.master is not None:
                        b.master.copy_(b.param)

    def prepare_graph_replay(self):
        """Make the step capturable in a CUDA graph, and keep a captured step current: call it before the
        capture and before every replay. A captured step reads each group's learning rate from a device
        buffer that this refreshes from ``param_groups`` (so schedulers keep working); the other
        hyperparameters are frozen into the graph at capture. Asynchronous."""
        if self._lr_device is None or self._lr_device.device != self._ws.device:
            self._lr_device = torch.zeros(MAX_GROUPS, dtype=torch.float64, device=self._ws.device)
            self._lr_host = [None] * MAX_GROUPS
        for i, g in enumerate(self.param_groups):
            lr = _scalar(g["lr"])
            if lr != self._lr_host[i]:
                self._lr_device[i].fill_(lr)
                self._lr_host[i] = lr

    def zero_grad(self, set_to_none=None):
        """Clear the gradients. By default (and with ``set_to_none=False``) the flat gradient buffer(s) are
        zeroed, one fill each, and every gradient stays its workspace view, so backward adds into the buffer
        (lsmini's layers write their gradients there themselves in eager mode). ``set_to_none=True`` sets
        the gradients to None, as torch's optimizers do: backward then hands over the gradient tensors it
        makes instead of adding each into the buffer (one launch a parameter), and ``step`` copies them in
        with one multi-tensor copy per dtype. That is the cheaper choice where backward makes a new tensor
        for every gradient anyway, as a ``torch.compile``'d backward does; eagerly it takes a gradient's
        memory more and a copy."""
        if set_to_none:
            self._ws.drop_grads()
        else:
            self._ws.zero_grad()

    # ---- the step -----------------------------------------------------------------------------------
    def _refresh(self):
        if self._ws.version != self._ws_version:
            self._bind()

    def _hyper(self):
        lrs, b1s, b2s, epss, wds = [], [], [], [], []
        for gi, g in enumerate(self.param_groups):
            lr, eps, wd = _scalar(g["lr"]), _scalar(g["eps"]), _scalar(g["weight_decay"])
            b1, b2 = (_scalar(b) for b in g["betas"])
            if not (lr >= 0 and eps >= 0 and wd >= 0 and 0 <= b1 < 1 and 0 <= b2 < 1):
                _check_hyper(f"FusedAdam (param group {gi})", lr, (b1, b2), eps, wd)
            lrs.append(lr)
            b1s.append(b1)
            b2s.append(b2)
            epss.append(eps)
            wds.append(wd)
        return lrs, b1s, b2s, epss, wds

    def _scale_args(self, scale):
        """(host inverse scale, device scale tensor or None)."""
        if scale is None:
            return 1.0, None
        if isinstance(scale, torch.Tensor):
            if scale.numel() != 1:
                raise ValueError(f"FusedAdam.step: scale must hold one element, got shape {tuple(scale.shape)}")
            t = scale
            if t.dtype != torch.float32 or t.device != self._ws.device:
                t = t.to(device=self._ws.device, dtype=torch.float32, non_blocking=True)
            return 1.0, t
        s = float(scale)
        if not (s > 0 and math.isfinite(s)):
            raise ValueError(f"FusedAdam.step: scale must be finite and > 0, got {scale}")
        return 1.0 / s, None

    def _use_kernels(self):
        return (all(b.dtype in limits.KERNEL_DTYPES for b in self._bufs)
                and _backend.use_kernels(*(b.param for b in self._bufs)))

    @torch.no_grad()
    def step(self, closure=None, *, scale=None):
        """One Adam(W) step for every parameter.

        Args:
            closure: re-evaluates the model and returns the loss (optional, as for torch optimizers).
            scale: the loss scale the gradients carry (float, or a one-element tensor on the device —
                what ``LossScaler`` passes); gradients are divided by it inside the step and overflow
                checking turns on (unless ``skip_nonfinite=False``).

        Never synchronises with the device (Python-number hyperparameters assumed). A non-finite gradient
        (when checked) skips the step on the device; see ``found_inf`` and ``last_step_skipped``. With an
        ``lsmini.distributed.GradientReducer`` on the workspace, its ``finish()`` runs first, so every rank
        steps with the same averaged gradient (and so makes the same skip and clipping decisions).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ws = self._ws
        reducer = ws.reducer
        if reducer is not None:  # data-parallel: the step must see the averaged gradient of every rank
            reducer.finish()
        ws.sync_grads()
        self._refresh()
        if not self._state_ready:
            self._init_state()
        hyper = self._hyper()
        inv_scale, scale_t = self._scale_args(scale)
        check = self.skip_nonfinite
        if check is None:
            check = scale is not None or any(b.dtype == torch.float16 for b in self._bufs)
        clip = self.max_grad_norm
        ctrl = torch.empty(4, dtype=torch.float32, device=ws.device) if (check or clip > 0) else None
        capturing = ws.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing and (self._lr_device is None or not self._use_kernels()):
            raise RuntimeError("FusedAdam.step: capturing a step in a CUDA graph needs the CUDA kernels and "
                               "prepare_graph_replay() called before the capture (lsmini.graph.CUDAGraphStep does "
                               "both)")
        if self._use_kernels():
            ext = _backend.ext()
            if ctrl is not None:
                ext.adam_grad_norm([b.grad for b in self._bufs], [b.active_end for b in self._bufs], inv_scale,
                                   scale_t, clip, bool(check), ctrl)
            lr_device = self._lr_device if capturing else None
            for i, b in enumerate(self._bufs):
                ext.adam_step(b.param, b.grad, b.master, b.exp_avg, b.exp_avg_sq, b.seg_begin, b.seg_end,
                              b.seg_group, *hyper, self.adam_w_mode, self._steps, self._parity, i == 0, lr_device,
                              inv_scale, scale_t, ctrl)
        else:
            self._reference_step(hyper, inv_scale, scale_t, bool(check), clip, ctrl)
        if self._lr_device is not None:
            # A recorded step reads the row that was current at its capture, so once graphs are in play
            # (prepare_graph_replay was called) the rows stop alternating: every step, eager ones between
            # replays included, brings the new counts back into that row.
            self._steps[self._parity].copy_(self._steps[1 - self._parity])
        else:
            self._parity ^= 1
        self._last_ctrl = ctrl
        return loss

    def _reference_step(self, hyper, inv_scale, scale_t, check, clip, ctrl):
        """The step as PyTorch ops on the flat buffers: torch.optim.Adam(W)'s single-tensor formula, op for
        op; the skip decision stays on the device (torch.where), like the kernel's."""
        dev = self._ws.device
        lrs, b1s, b2s, epss, wds = hyper
        gmul = torch.full((), inv_scale, dtype=torch.float32, device=dev)
        if scale_t is not None:
            gmul = gmul * torch.reciprocal(scale_t.reshape(()).float())
        skip = None
        if ctrl is not None:
            sumsq = torch.zeros((), dtype=torch.float32, device=dev)
            bad = torch.zeros((), dtype=torch.bool, device=dev)
            for b in self._bufs:
                g = b.grad[:b.active_end].float()
                sumsq = sumsq + (g * gmul).square().sum()
                bad = bad | ~torch.isfinite(g).all()
            norm = sumsq.sqrt()
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0) if clip > 0 else torch.ones_like(norm)
            skip = bad if check else torch.zeros_like(bad)
            ctrl.copy_(torch.stack([skip.float(), gmul * coef, norm, coef]))
            gmul = gmul * coef
        steps_in = self._steps[self._parity]
        t = steps_in.double() + 1.0
        for b in self._bufs:
            work = b.master if b.master is not None else b.param
            for begin, end, gi in zip(b.seg_begin, b.seg_end, b.seg_group):
                lr, beta1, beta2, eps, wd = lrs[gi], b1s[gi], b2s[gi], epss[gi], wds[gi]
                p, m, v = work[begin:end], b.exp_avg[begin:end], b.exp_avg_sq[begin:end]
                g = b.grad[begin:end].to(work.dtype) * gmul
                p_new = p
                if wd != 0:
                    if self.adam_w_mode:
                        p_new = p * (1 - lr * wd)
                    else:
                        g = g.add(p, alpha=wd)
                m_new = m.lerp(g, 1 - beta1)
                v_new = (v * beta2).addcmul_(g, g, value=1 - beta2)
                bc1 = 1 - torch.pow(beta1, t[gi])
                bc2 = 1 - torch.pow(beta2, t[gi])
                step_size = (lr / bc1).to(work.dtype)
                bc2_sqrt = bc2.sqrt().to(work.dtype)
                denom = (v_new.sqrt() / bc2_sqrt).add_(eps)
                p_new = p_new - (step_size * m_new) / denom
                if skip is not None:
                    p_new = torch.where(skip, p, p_new)
                    m_new = torch.where(skip, m, m_new)
                    v_new = torch.where(skip, v, v_new)
                m.copy_(m_new)
                v.copy_(v_new)
                p.copy_(p_new)
                if b.master is not None:
                    lowp = b.param[begin:end]
                    lowp.copy_(p_new if skip is None else torch.where(skip, lowp, p_new.to(lowp.dtype)))
        done = steps_in + 1 if skip is None else steps_in + (~skip).to(torch.int32)
        self._steps[1 - self._parity].copy_(done)

    # ---- checkpoints --------------------------------------------------------------------------------
    def state_dict(self):
        """torch-style: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "master"]}}, "param_groups": [...]}``.

        Parameters are numbered across the groups as torch does, so the layout does not matter. The
        tensors are views of the live flat buffers (torch's state_dict also returns live tensors: clone or
        save before stepping on). ``master`` (fp32) is present for fp16/bf16 parameters. Reading the step
        counts synchronises with the device. The loss scale is saved by ``LossScaler.state_dict()``.
        """
        index, groups_out, nxt = {}, [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            for p in g["params"]:
                if id(p) not in index:
                    index[id(p)] = nxt
                    nxt += 1
            packed["params"] = [index[id(p)] for p in g["params"]]
            groups_out.append(packed)
        state = {}
        if self._state_ready:
            self._refresh()
            steps = self._steps[self._parity].tolist()
            for g in self.param_groups:
                for p in g["params"]:
                    where = self._member.get(id(p))
                    if where is None:
                        continue
                    b, off, n, gi = where
                    entry = {"step": torch.tensor(float(steps[gi]), dtype=torch.float32),
                             "exp_avg": b.exp_avg[off:off + n].view(p.shape),
                             "exp_avg_sq": b.exp_avg_sq[off:off + n].view(p.shape)}
                    if b.master is not None:
                        entry["master"] = b.master[off:off + n].view(p.shape)
                    state[index[id(p)]] = entry
        return {"state": state, "param_groups": groups_out}

    def load_state_dict(self, state_dict):
        """Load a ``state_dict()`` (of a FusedAdam, or of a torch.optim.Adam/AdamW over the same parameters:
        the fp16/bf16 masters then start from the current parameters). Group hyperparameters come from the
        checkpoint, as with torch. Resuming gives bit-identical steps to an uninterrupted run."""
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"FusedAdam.load_state_dict: the checkpoint has {len(saved_groups)} param groups, "
                             f"the optimizer {len(self.param_groups)}")
        id_map = {}
        for gi, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(f"FusedAdam.load_state_dict: param group {gi} has {len(sg['params'])} parameters in "
                                 f"the checkpoint and {len(g['params'])} in the optimizer")
            id_map.update(zip(sg["params"], g["params"]))
        for k, entry in saved_state.items():
            if k not in id_map:
                raise ValueError(f"FusedAdam.load_state_dict: state for parameter {k!r}, which no group lists")
            p = id_map[k]
            for name in ("exp_avg", "exp_avg_sq", "master"):
                if name in entry and tuple(entry[name].shape) != tuple(p.shape):
                    raise ValueError(f"FusedAdam.load_state_dict: {name} of parameter {k} has shape "
                                     f"{tuple(entry[name].shape)}, the parameter {tuple(p.shape)}")
        for g, sg in zip(self.param_groups, saved_groups):
            for key, value in sg.items():
                if key != "params":
                    g[key] = value
        self._refresh()
        if not saved_state:
            self._drop_state()
            return
        self._init_state()
        steps = [None] * len(self.param_groups)
        with torch.no_grad():
            for k, entry in saved_state.items():
                where = self._member.get(id(id_map[k]))
                if where is None:
                    continue  # not updated by this optimizer (frozen at construction)
                b, off, n, gi = where
                b.exp_avg[off:off + n].copy_(entry["exp_avg"].reshape(-1))
                b.exp_avg_sq[off:off + n].copy_(entry["exp_avg_sq"].reshape(-1))
                if b.master is not None and "master" in entry:
                    b.master[off:off + n].copy_(entry["master"].reshape(-1))
                s = int(_scalar(entry["step"]))
                if steps[gi] is None:
                    steps[gi] = s
                elif steps[gi] != s:
                    raise ValueError(f"FusedAdam.load_state_dict: FusedAdam keeps one step count per param group, "
                                     f"but group {gi} has parameters at steps {steps[gi]} and {s}")
        counts = torch.tensor([s or 0 for s in steps], dtype=torch.int32)
        self._steps[self._parity, :len(steps)].copy_(counts)
