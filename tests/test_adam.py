import copy
import io
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import lsmini
from lsmini._debug import adam_bulk
from lsmini.optim import FusedAdam, LossScaler, ParameterWorkspace
from util import assert_close_fp32

LOWP = (torch.float16, torch.bfloat16)
ALL = [torch.float32, torch.float16, torch.bfloat16]


def _name(dtype):
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------ helpers ---

class Net(nn.Module):
    """Odd sizes everywhere, so parameters need padding in the workspace."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 7)
        self.fc1 = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.fc2 = nn.Linear(13, 5)
        self.scalar = nn.Parameter(torch.tensor([0.5]))

    def forward(self, ids):
        h = torch.tanh(self.fc1(self.emb(ids)))
        return self.fc2(self.norm(h)) * self.scalar


def _net(seed=0, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    return Net().to(device=device, dtype=dtype)


def _ids(step, device="cpu"):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 11, (6, 4), generator=g).to(device)


def _loss(model, step):
    return model(_ids(step, next(model.parameters()).device)).float().square().mean()


def _split(model):
    """(decay, no_decay) parameter lists: matrices decay, vectors and norms do not (interleaved in the
    module order, so FusedAdam has to reorder the workspace)."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() != 2]
    return decay, no_decay


def _groups(model, wd=0.1):
    decay, no_decay = _split(model)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def _params(sizes, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(n, generator=g).to(device=device, dtype=dtype)) for n in sizes]


def _grad_values(sizes, step, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(10_000 * seed + step)
    return [torch.randn(n, generator=g) * scale for n in sizes]


def _set_grads(params, values, dtype=None):
    """Write gradient values. For workspace parameters p.grad is the view: copy into it."""
    for p, v in zip(params, values):
        v = v.to(device=p.device, dtype=dtype or p.dtype)
        if p.grad is None:
            p.grad = v.clone()
        else:
            p.grad.copy_(v)


def _assert_equal(a, b, name="tensor"):
    assert torch.equal(a, b), f"{name}: max diff {(a.double() - b.double()).abs().max().item():.3g}"


def _storage_ptr(t):
    return t.untyped_storage().data_ptr()


# ------------------------------------------------------------------------------ workspace (CPU) ---

def test_workspace_params_are_aligned_views_of_one_buffer():
    model = _net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = _ids(0)
    out_before = model(x)
    ws = ParameterWorkspace(model)
    assert ws.dtypes == [torch.float32]
    flat = ws.param_buffer(torch.float32)
    gflat = ws.grad_buffer(torch.float32)
    assert flat.dim() == 1 and flat.is_contiguous() and flat.numel() % 4 == 0
    for n, p in model.named_parameters():
        assert _storage_ptr(p) == _storage_ptr(flat), n
        assert p.data_ptr() % 16 == 0, n
        assert _storage_ptr(p.grad) == _storage_ptr(gflat), n
        _assert_equal(p.detach(), before[n], n)
        dtype, off, numel = ws.location(p)
        assert (dtype, numel) == (torch.float32, p.numel())
        assert p.data_ptr() == flat.data_ptr() + 4 * off
    assert ws.numel() == sum(p.numel() for p in model.parameters())
    # padding is zero in both buffers
    used = torch.zeros(flat.numel(), dtype=torch.bool)
    for p in model.parameters():
        _, off, numel = ws.location(p)
        used[off:off + numel] = True
    assert not flat[~used].any() and not gflat.any()
    _assert_equal(model(x), out_before, "forward")


def test_workspace_backward_writes_into_the_buffer():
    model = _net()
    twin = copy.deepcopy(model)
    ws = ParameterWorkspace(model)
    grads_before = [p.grad for p in model.parameters()]
    for step in range(2):  # the second backward accumulates, as without a workspace
        _loss(model, step).backward()
        _loss(twin, step).backward()
    gflat = ws.grad_buffer(torch.float32)
    for (n, p), q, g0 in zip(model.named_parameters(), twin.parameters(), grads_before):
        assert p.grad is g0, f"{n}: backward replaced the gradient view"
        _, off, numel = ws.location(p)
        assert_close_fp32(p.grad, q.grad, atol=1e-6, rtol=1e-5, name=n)
        _assert_equal(gflat[off:off + numel], p.grad.reshape(-1), n)


def test_workspace_module_state_dict_and_names():
    model = _net()
    names = [n for n, _ in model.named_parameters()]
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    ws = ParameterWorkspace(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert model.state_dict().keys() == sd.keys()
    for k, v in model.state_dict().items():
        _assert_equal(v, sd[k], k)
    other = _net(seed=1)
    model.load_state_dict(other.state_dict())
    flat = ws.param_buffer(torch.float32)
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        _assert_equal(p.detach(), q.detach(), n)
        assert _storage_ptr(p) == _storage_ptr(flat), f"{n}: load_state_dict must copy into the view"
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = _net(seed=2)
    fresh.load_state_dict(torch.load(buf))
    for p, q in zip(fresh.parameters(), other.parameters()):
        _assert_equal(p.detach(), q.detach())


def test_workspace_mixed_dtypes_get_one_buffer_each():
    model = _net()
    model.fc1.half()
    model.norm.to(torch.bfloat16)
    ws = ParameterWorkspace(model)
    assert set(ws.dtypes) == {torch.float32, torch.float16, torch.bfloat16}
    for p in model.parameters():
        assert _storage_ptr(p) == _storage_ptr(ws.param_buffer(p.dtype))
        assert p.data_ptr() % 16 == 0
        assert p.grad.dtype == p.dtype


def test_workspace_errors():
    model = _net()
    ws = ParameterWorkspace(model)
    with pytest.raises(RuntimeError, match="already lives in a ParameterWorkspace"):
        ParameterWorkspace(model)
    with pytest.raises(RuntimeError, match="already lives in a ParameterWorkspace"):
        ParameterWorkspace([model.fc1.weight])
    big = torch.randn(20)
    with pytest.raises(ValueError, match="view into a larger buffer"):
        ParameterWorkspace([nn.Parameter(big[:10])])
    with pytest.raises(ValueError, match="view of another tensor"):
        ParameterWorkspace([big[5:]])
    a = nn.Parameter(torch.randn(4))
    b = nn.Parameter(a.data)
    with pytest.raises(ValueError, match="shares its storage"):
        ParameterWorkspace([a, b])
    with pytest.raises(ValueError, match="no parameters"):
        ParameterWorkspace(nn.ReLU())
    with pytest.raises(TypeError, match="floating point"):
        ParameterWorkspace([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(TypeError, match="single"):
        ParameterWorkspace(torch.zeros(3, requires_grad=True))
    with pytest.raises(TypeError, match="ParameterWorkspace"):
        ParameterWorkspace(ws)
    assert len(ws) == len(list(model.parameters()))


def test_workspace_tied_parameters_stay_tied():
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10, bias=False))
    model[1].weight = model[0].weight
    ParameterWorkspace(model)
    assert model[1].weight is model[0].weight
    assert len(list(model.parameters())) == 1


def test_workspace_to_and_rebuild():
    model = _net()
    ref = copy.deepcopy(model)
    ws = ParameterWorkspace(model)
    ws.to(dtype=torch.float64)
    assert ws.dtypes == [torch.float64]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float64 and p.grad.dtype == torch.float64
        assert _storage_ptr(p) == _storage_ptr(ws.param_buffer(torch.float64))
        assert p.data_ptr() % 16 == 0
        _assert_equal(p.detach(), q.detach().double())
    model.float()  # module.to() after the workspace: detected
    with pytest.raises(RuntimeError, match="no longer lives in the workspace"):
        ws.check()
    ws.rebuild()
    ws.check()
    assert ws.dtypes == [torch.float32]
    for p in model.parameters():
        assert _storage_ptr(p) == _storage_ptr(ws.param_buffer(torch.float32))


def test_module_to_after_optimizer_raises_clearly_in_step():
    model = _net()
    opt = FusedAdam(model, lr=1e-2)
    _loss(model, 0).backward()
    opt.step()
    model.double()
    _loss(model, 1).backward()
    with pytest.raises(RuntimeError, match=r"workspace\.to\(|rebuild"):
        opt.step()


def test_move_workspace_keeps_optimizer_state():
    """workspace.to(device) keeps the state (here to the same device, the path is the same)."""
    model = _net()
    opt = FusedAdam(model, lr=1e-2)
    twin = _net()
    topt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    for step in range(3):
        if step == 1:
            opt.workspace.to(device="cpu")
        for m, o in ((model, opt), (twin, topt)):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close_fp32(p.detach(), q.detach(), atol=1e-6, rtol=1e-6)
    opt.workspace.to(dtype=torch.float64)
    with pytest.raises(RuntimeError, match="re-laid out or cast"):
        opt.step()


def test_zero_grad_keeps_views_and_foreign_gradients_are_taken_back():
    model = _net()
    twin = copy.deepcopy(model)
    opt = FusedAdam(model, lr=1e-2, weight_decay=0.0)
    topt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.0)
    views = [p.grad for p in model.parameters()]
    _loss(model, 0).backward()
    opt.zero_grad()  # set_to_none=True by default, still keeps the views
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    assert not opt.workspace.grad_buffer(torch.float32).any()
    # module.zero_grad() drops the views; backward then makes ordinary gradients; step takes them back
    model.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    _loss(model, 1).backward()
    _loss(twin, 1).backward()
    opt.step()
    topt.step()
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close_fp32(p.detach(), q.detach(), atol=1e-6, rtol=1e-6)
    # a stale foreign gradient is dropped by zero_grad, not accumulated into
    model.zero_grad(set_to_none=True)
    _loss(model, 2).backward()
    opt.zero_grad()
    assert all(p.grad is v for p, v in zip(model.parameters(), views))
    assert not opt.workspace.grad_buffer(torch.float32).any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_zero_grad_set_to_none_hands_gradients_over(device):
    """zero_grad(set_to_none=True): the gradients become None, backward hands its own tensors over (nothing is
    added into the buffer, accumulation goes into those tensors), step copies them in and matches AdamW."""
    model = _net(device=device)
    twin = copy.deepcopy(model)
    opt = FusedAdam(model, lr=1e-2, weight_decay=0.1)
    topt = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    views = [p.grad for p in model.parameters()]
    buffer = opt.workspace.grad_buffer(torch.float32)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        topt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
        stale = buffer.clone()
        for micro in range(2):  # two backwards: the second accumulates into the handed-over tensors
            _loss(model, 2 * step + micro).backward()
            _loss(twin, 2 * step + micro).backward()
        assert all(p.grad is not v for p, v in zip(model.parameters(), views))
        assert torch.equal(buffer, stale)  # backward did not touch the buffer
        opt.step()
        topt.step()
        assert all(p.grad is v for p, v in zip(model.parameters(), views))
        for p, q in zip(model.parameters(), twin.parameters()):  # (cuBLAS may sum in another order on CUDA)
            assert_close_fp32(p.grad, q.grad, atol=1e-6, rtol=1e-5)
            assert_close_fp32(p.detach(), q.detach(), atol=1e-6, rtol=1e-5)
    # zero_grad() and zero_grad(set_to_none=False) keep the views and zero them
    for set_to_none in (None, False):
        opt.zero_grad(set_to_none=True)
        _loss(model, 9).backward()
        opt.zero_grad() if set_to_none is None else opt.zero_grad(set_to_none=False)
        assert all(p.grad is v for p, v in zip(model.parameters(), views))
        assert not buffer.any()


def test_sync_grads_mixes_views_none_and_other_tensors():
    """One sync: a gradient that is the view stays, None is zeroed, another tensor (here a non-contiguous one)
    is copied in; afterwards every gradient is its view."""
    model = _net()
    ws = FusedAdam(model, lr=1e-2).workspace
    params = list(model.parameters())
    views = [p.grad for p in params]
    values = [torch.randn_like(p) for p in params]
    for v, x in zip(views, values):
        v.copy_(x)
    m = next(i for i, p in enumerate(params) if p.dim() == 2)
    n = next(i for i, p in enumerate(params) if p.dim() == 1)
    params[m].grad = (values[m] * 3).t().contiguous().t()
    params[n].grad = None
    expected = list(values)
    expected[m], expected[n] = values[m] * 3, torch.zeros_like(values[n])
    ws.sync_grads()
    for p, v, e in zip(params, views, expected):
        assert p.grad is v
        assert torch.equal(v, e)


# ------------------------------------------------------------------- FusedAdam vs torch (CPU) ---

def _run_pair(make_ours, make_theirs, steps=20, scheduler=None, clip=None, seed=0):
    model, twin = _net(seed), _net(seed)
    opt, topt = make_ours(model), make_theirs(twin)
    scheds = [scheduler(opt), scheduler(topt)] if scheduler else []
    norms = []
    for step in range(steps):
        for m, o in ((model, opt), (twin, topt)):
            o.zero_grad()
            _loss(m, step).backward()
            if o is topt and clip:
                norms.append(torch.nn.utils.clip_grad_norm_(twin.parameters(), clip))
            o.step()
        for s in scheds:
            s.step()
        if clip:
            assert_close_fp32(opt.grad_norm, norms[-1], atol=1e-7, rtol=1e-6, name="grad_norm")
    return model, twin, opt, topt


@pytest.mark.parametrize("adam_w", [True, False], ids=["adamw", "adam"])
def test_matches_torch_two_groups_with_scheduler(adam_w):
    torch_cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.3 * s))  # noqa: E731
    model, twin, opt, topt = _run_pair(
        lambda m: FusedAdam(_groups(m), lr=3e-2, betas=(0.8, 0.95), eps=1e-6, adam_w_mode=adam_w),
        lambda m: torch_cls(_groups(m), lr=3e-2, betas=(0.8, 0.95), eps=1e-6), scheduler=sched)
    assert opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"] != 3e-2
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close_fp32(p.detach(), q.detach(), atol=1e-7, rtol=1e-6, name=n)
    ours, theirs = opt.state_dict(), topt.state_dict()
    for k, st in theirs["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close_fp32(ours["state"][k][key], st[key], atol=1e-9, rtol=1e-5, name=f"{key}[{k}]")
        assert float(ours["state"][k]["step"]) == float(st["step"]) == 20


def test_matches_torch_with_step_lr_and_clipping():
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5)  # noqa: E731
    model, twin, opt, topt = _run_pair(lambda m: FusedAdam(_groups(m), lr=1e-2, max_grad_norm=0.05),
                                       lambda m: torch.optim.AdamW(_groups(m), lr=1e-2), scheduler=sched, clip=0.05)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close_fp32(p.detach(), q.detach(), atol=1e-7, rtol=1e-6, name=n)


def test_clipping_inactive_below_the_threshold():
    model, twin, opt, _ = _run_pair(lambda m: FusedAdam(m.parameters(), lr=1e-2, max_grad_norm=1e6),
                                    lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), steps=3, clip=1e6)
    assert float(opt._last_ctrl[3]) == 1.0
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close_fp32(p.detach(), q.detach(), atol=1e-7, rtol=1e-6)


def test_accepts_module_workspace_and_param_list():
    for make in (lambda m: m, lambda m: ParameterWorkspace(m), lambda m: list(m.parameters()),
                 lambda m: m.parameters()):
        model = _net()
        opt = FusedAdam(make(model), lr=1e-2)
        _loss(model, 0).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
        assert all(opt.workspace.owns(p) for p in model.parameters())


def test_frozen_and_outside_parameters_are_not_updated():
    model = _net()
    model.emb.weight.requires_grad_(False)
    opt = FusedAdam([p for n, p in model.named_parameters() if not n.startswith("fc2")], lr=1e-2)
    # fc2 is outside the optimizer, but in no workspace: FusedAdam built one over its own parameters
    assert not opt.workspace.owns(model.fc2.weight)
    model2 = _net()
    ws = ParameterWorkspace(model2)
    model2.emb.weight.requires_grad_(False)
    ws2_opt_params = [p for n, p in model2.named_parameters() if not n.startswith("fc2")]
    frozen_before = model2.emb.weight.detach().clone()
    fc2_before = model2.fc2.weight.detach().clone()
    opt2 = FusedAdam(ws2_opt_params, lr=1e-2, weight_decay=0.5)
    assert opt2.workspace is ws
    _loss(model2, 0).backward()
    opt2.step()
    _assert_equal(model2.emb.weight.detach(), frozen_before, "frozen parameter")
    _assert_equal(model2.fc2.weight.detach(), fc2_before, "parameter outside the optimizer")
    assert not torch.equal(model2.fc1.weight.detach(), _net().fc1.weight.detach())
    del opt


def test_construction_errors():
    model = _net()
    with pytest.raises(ValueError, match="learning rate"):
        FusedAdam(model, lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        FusedAdam(model, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedAdam(model, max_grad_norm=-1.0)
    params = _params([3] * 17)
    with pytest.raises(ValueError, match="at most 16 param groups"):
        FusedAdam([{"params": [p]} for p in params])
    opt = FusedAdam(model, lr=1e-2)
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))]})
    with pytest.raises(RuntimeError, match="already has a FusedAdam"):
        FusedAdam(opt.workspace)
    mixed = [model.fc1.weight, nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="one ParameterWorkspace, or none"):
        FusedAdam(mixed)
    # dropping the optimizer frees the workspace for a new one (or a new workspace over the same model)
    del opt
    FusedAdam(model, lr=1e-2)
    with pytest.raises(ValueError, match="learning rate"):
        g = FusedAdam(_net(), lr=1e-2)
        g.param_groups[0]["lr"] = -1.0
        g.step()


def test_state_dict_round_trip_is_bit_identical():
    def make(model):
        return FusedAdam(_groups(model), lr=1e-2, max_grad_norm=0.1)

    model = _net()
    opt = make(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    for step in range(5):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    for step in range(5, 10):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        sched.step()

    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = _net(seed=7)
    ropt = make(resumed)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=2, gamma=0.7)
    resumed.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["opt"])
    rsched.load_state_dict(ckpt["sched"])
    for step in range(5, 10):
        ropt.zero_grad()
        _loss(resumed, step).backward()
        ropt.step()
        rsched.step()
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        _assert_equal(p.detach(), q.detach(), n)
    a, b = opt.state_dict(), ropt.state_dict()
    for k in a["state"]:
        for key in a["state"][k]:
            _assert_equal(a["state"][k][key], b["state"][k][key], f"{key}[{k}]")
    assert a["param_groups"] == b["param_groups"]


def test_state_dict_before_any_step_and_torch_checkpoints():
    model = _net()
    opt = FusedAdam(_groups(model), lr=1e-2)
    sd = opt.state_dict()
    assert sd["state"] == {} and len(sd["param_groups"]) == 2
    opt.load_state_dict(sd)
    # a torch.optim.AdamW checkpoint over the same parameters loads and continues identically
    twin = _net()
    topt = torch.optim.AdamW(_groups(twin), lr=1e-2)
    for step in range(3):
        topt.zero_grad()
        _loss(twin, step).backward()
        topt.step()
    model.load_state_dict(twin.state_dict())
    opt.load_state_dict(topt.state_dict())
    for step in range(3, 6):
        for m, o in ((model, opt), (twin, topt)):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close_fp32(p.detach(), q.detach(), atol=1e-7, rtol=1e-6)
    bad = opt.state_dict()
    bad["param_groups"] = bad["param_groups"][:1]
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(bad)


# ------------------------------------------------------- fp16/bf16 masters, overflow, scaler (CPU) ---

SIZES = [1, 7, 1023, 4097, 8, 16, 5]


def _lowp_pair(dtype, device, sizes=SIZES, **kw):
    ours = _params(sizes, dtype, device)
    theirs = [nn.Parameter(p.detach().float().clone()) for p in ours]  # same starting values, in fp32
    half = len(sizes) // 2
    mk = lambda ps: [{"params": ps[:half]}, {"params": ps[half:], "weight_decay": 0.0}]  # noqa: E731
    return ours, theirs, FusedAdam(mk(ours), lr=1e-2, weight_decay=0.1, **kw), torch.optim.AdamW(mk(theirs), lr=1e-2,
                                                                                                   weight_decay=0.1)


def _state_of(opt, params):
    """The state_dict entries of `params`, in that order (state_dict numbers parameters group by group)."""
    order = [id(p) for g in opt.param_groups for p in g["params"]]
    st = opt.state_dict()["state"]
    return [st[order.index(id(p))] for p in params]


def _masters(opt, params):
    return [s["master"] for s in _state_of(opt, params)]


@pytest.mark.parametrize("dtype", LOWP, ids=_name)
def test_lowp_masters_follow_fp32_adamw_cpu(dtype):
    ours, theirs, opt, topt = _lowp_pair(dtype, "cpu")
    for step in range(5):
        vals = [v.to(dtype).float() for v in _grad_values(SIZES, step)]  # the gradient both runs see
        _set_grads(ours, vals)
        _set_grads(theirs, vals)
        opt.step()
        topt.step()
    for i, (m, p, q) in enumerate(zip(_masters(opt, ours), ours, theirs)):
        assert m.dtype == torch.float32
        assert_close_fp32(m, q.detach(), atol=1e-7, rtol=1e-6, name=f"master[{i}]")
        _assert_equal(p.detach(), m.to(dtype), f"param[{i}] = rounded master")


def test_overflow_skips_the_step_on_device_cpu():
    ours, _, opt, _ = _lowp_pair(torch.float16, "cpu")
    fresh, _, fopt, _ = _lowp_pair(torch.float16, "cpu")
    vals = _grad_values(SIZES, 0)
    bad = [v.clone() for v in vals]
    bad[3][100] = float("inf")
    _set_grads(ours, bad)
    opt.step()
    assert opt.last_step_skipped and float(opt.found_inf) == 1.0
    for p, q in zip(ours, fresh):
        _assert_equal(p.detach(), q.detach(), "parameter after a skipped step")
    st = opt.state_dict()["state"]
    assert all(float(s["step"]) == 0 for s in st.values())
    assert all(not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in st.values())
    # NaN is caught as well
    bad[3][100] = float("nan")
    _set_grads(ours, bad)
    opt.step()
    assert opt.last_step_skipped
    # the next clean step is the first real one: same as a fresh optimizer's first step
    _set_grads(ours, vals)
    _set_grads(fresh, vals)
    opt.step()
    fopt.step()
    assert not opt.last_step_skipped
    for p, q in zip(ours, fresh):
        _assert_equal(p.detach(), q.detach(), "first step after skips")


def test_fp32_does_not_skip_by_default_like_torch():
    ours = _params([5])
    opt = FusedAdam(ours, lr=1e-2)
    _set_grads(ours, [torch.tensor([1.0, float("inf"), 0.0, 0.0, 0.0])])
    opt.step()
    assert opt.found_inf is None and not opt.last_step_skipped
    assert not torch.isfinite(ours[0].detach()).all()


def test_loss_scaler_growth_backoff_and_skip():
    ours, theirs, opt, topt = _lowp_pair(torch.float16, "cpu", sizes=[8, 33])
    scaler = LossScaler(init_scale=2.0 ** 10, growth_interval=3)
    # three clean steps → growth; the overflow at step 3 backs off and restarts the count
    expected = [2.0 ** 10, 2.0 ** 10, 2.0 ** 10, 2.0 ** 11, 2.0 ** 10, 2.0 ** 10, 2.0 ** 10, 2.0 ** 11]
    overflow_at = {3}
    for step in range(8):
        vals = [v.to(torch.float16).float() for v in _grad_values([8, 33], step)]
        s = scaler.get_scale()
        assert s == expected[step], (step, s)
        scaled = [v * s for v in vals]
        if step in overflow_at:
            scaled[1][4] = float("inf")
        _set_grads(ours, scaled)
        scaler.step(opt)
        scaler.update()
        assert scaler.last_step_skipped == (step in overflow_at)
        if step not in overflow_at:
            _set_grads(theirs, vals)
            topt.step()
    assert scaler.get_scale() == 2.0 ** 11
    for i, (m, q) in enumerate(zip(_masters(opt, ours), theirs)):
        assert_close_fp32(m, q.detach(), atol=1e-7, rtol=1e-6, name=f"master[{i}]")
    assert float(opt.state_dict()["state"][0]["step"]) == 7
    sd = scaler.state_dict()
    assert sd["scale"] == 2.0 ** 11 and sd["_growth_tracker"] == 1 and sd["growth_interval"] == 3
    other = LossScaler()
    other.load_state_dict(sd)
    assert other.get_scale() == 2.0 ** 11
    with pytest.raises(RuntimeError, match="no step"):
        scaler.update()


def test_loss_scaler_disabled_and_errors():
    scaler = LossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    with pytest.raises(ValueError, match="growth_factor"):
        LossScaler(growth_factor=0.5)
    with pytest.raises(TypeError, match="FusedAdam"):
        LossScaler().step(torch.optim.SGD(_params([3]), lr=0.1))
    ours = _params([4], torch.float16)
    with pytest.raises(ValueError, match="skip_nonfinite=False"):
        LossScaler().step(FusedAdam(ours, skip_nonfinite=False))
    s = LossScaler(init_scale=8.0)
    out = s.scale([torch.tensor(1.0), torch.tensor(2.0)])
    assert [float(o) for o in out] == [8.0, 16.0]


def test_fp16_training_with_scaler_state_dict_round_trip_cpu():
    def run(model, opt, scaler, steps):
        for step in steps:
            opt.zero_grad()
            scaler.scale(_loss(model, step)).backward()
            scaler.step(opt)
            scaler.update()

    def make(seed):
        m = _net(seed).to(torch.float16)
        return m, FusedAdam(_groups(m), lr=1e-2), LossScaler(init_scale=2.0 ** 8, growth_interval=2)

    model, opt, scaler = make(0)
    run(model, opt, scaler, range(4))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}, buf)
    run(model, opt, scaler, range(4, 8))
    buf.seek(0)
    ckpt = torch.load(buf)
    m2, o2, s2 = make(3)
    m2.load_state_dict(ckpt["model"])
    o2.load_state_dict(ckpt["opt"])
    s2.load_state_dict(ckpt["scaler"])
    run(m2, o2, s2, range(4, 8))
    for (n, p), q in zip(model.named_parameters(), m2.parameters()):
        _assert_equal(p.detach(), q.detach(), n)
    assert s2.get_scale() == scaler.get_scale()
    for k, st in opt.state_dict()["state"].items():
        _assert_equal(st["master"], o2.state_dict()["state"][k]["master"], f"master[{k}]")


def test_sync_master_weights():
    ours = _params([9], torch.float16)
    opt = FusedAdam(ours, lr=1e-2)
    _set_grads(ours, _grad_values([9], 0))
    opt.step()
    with torch.no_grad():
        ours[0].fill_(1.0)
    opt.sync_master_weights()
    assert (_masters(opt, ours)[0] == 1.0).all()


# ------------------------------------------------------------------------------------------- CUDA ---

@pytest.fixture(params=["bulk", "registers"])
def update_path(request):
    """Runs a CUDA test with each update kernel for aligned buffers: tiles streamed through shared memory by
    the bulk copy engine (compute capability 9.0 and later) and 16-byte chunks through registers."""
    ext = lsmini._backend.ext()
    if request.param == "bulk" and not ext.adam_bulk_available():
        pytest.skip("the bulk-copy update needs a compute capability 9.0 or later device")
    with adam_bulk(request.param == "bulk"):
        yield request.param


def _to_fp32_twins(params):
    return [nn.Parameter(p.detach().float().clone()) for p in params]


def _cuda_groups(params, n_groups=2):
    """Interleaved membership (param i → group i % n_groups), so the workspace must be reordered."""
    return [{"params": params[g::n_groups], "weight_decay": 0.1 * g, "lr": 1e-2 / (g + 1)} for g in range(n_groups)]


def _run_cuda_vs_torch(sizes, dtype, steps=6, n_groups=2, adam_w=True, clip=None, scale=None, seed=0):
    """FusedAdam on `dtype` parameters vs torch.optim.Adam(W) in fp32 on the same gradients (rounded to dtype).
    Returns (ours, masters or params in fp32, theirs, opt, topt)."""
    ours = _params(sizes, dtype, "cuda", seed)
    theirs = _to_fp32_twins(ours)
    torch_cls = torch.optim.AdamW if adam_w else torch.optim.Adam
    opt = FusedAdam(_cuda_groups(ours, n_groups), betas=(0.9, 0.99), eps=1e-6, adam_w_mode=adam_w,
                    max_grad_norm=clip)
    topt = torch_cls(_cuda_groups(theirs, n_groups), betas=(0.9, 0.99), eps=1e-6)
    for step in range(steps):
        vals = [v.to(dtype).float() for v in _grad_values(sizes, step, seed)]
        _set_grads(theirs, vals)
        if clip:
            torch.nn.utils.clip_grad_norm_(theirs, clip)
        topt.step()
        if scale is not None:
            _set_grads(ours, [v * scale for v in vals])
            opt.step(scale=torch.full((), scale, device="cuda"))
        else:
            _set_grads(ours, vals)
            opt.step()
    if dtype in LOWP:
        weights = _masters(opt, ours)
        for p, m in zip(ours, weights):
            _assert_equal(p.detach(), m.to(dtype), "param = rounded master")
    else:
        weights = [p.detach() for p in ours]
    return ours, weights, theirs, opt, topt


def _assert_state_close(opt, topt, n):
    """m can cancel to ~0 (β1·m ≈ −(1−β1)·g), so its absolute error scales with |g| ≈ 1, not with |m|:
    atol 1e-6 covers the ulp-level differences (clip coefficients rounded differently, for instance);
    v is a sum of positive terms and is compared relatively."""
    a, b = opt.state_dict()["state"], topt.state_dict()["state"]
    for i in range(n):
        assert_close_fp32(a[i]["exp_avg"], b[i]["exp_avg"], atol=1e-6, rtol=1e-5, name=f"exp_avg[{i}]")
        assert_close_fp32(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"], atol=1e-9, rtol=2e-5, name=f"exp_avg_sq[{i}]")
        assert float(a[i]["step"]) == float(b[i]["step"])


# The kernel rounds fp32 like torch except for fast-math sqrt/division (≈1 ulp per element per step):
# after a few steps with lr 1e-2 that is ≈1e-8 absolute on O(1) weights; 1e-6 leaves margin.
W_ATOL, W_RTOL = 1e-6, 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("adam_w", [True, False], ids=["adamw", "adam"])
def test_cuda_kernel_matches_fp32_torch(dtype, adam_w, update_path):
    sizes = [1, 7, 1023, 4097, 3, 8, 16, 2048, 5, 65537]
    ours, weights, theirs, opt, topt = _run_cuda_vs_torch(sizes, dtype, adam_w=adam_w)
    for i, (w, q) in enumerate(zip(weights, theirs)):
        assert_close_fp32(w, q.detach(), atol=W_ATOL, rtol=W_RTOL, name=f"weight[{i}] ({dtype})")
    _assert_state_close(opt, topt, len(sizes))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=_name)
def test_cuda_kernel_matches_reference_path(dtype, monkeypatch):
    """Same gradients through the kernel and through the PyTorch reference path on the GPU."""
    sizes = [1, 7, 1023, 4097, 33, 64]
    runs = []
    for force in (False, True):
        monkeypatch.setattr(lsmini.config, "reference", force)
        ours = _params(sizes, dtype, "cuda")
        opt = FusedAdam(_cuda_groups(ours, 3), max_grad_norm=2.0)
        for step in range(4):
            _set_grads(ours, _grad_values(sizes, step, scale=0.5))
            opt.step()
        st = opt.state_dict()["state"]
        state = {k: {n: t.clone() for n, t in v.items()} for k, v in st.items()}
        runs.append(([p.detach().clone() for p in ours], state, opt.grad_norm.clone()))
    (pk, sk, nk), (pr, sr, nr) = runs
    assert_close_fp32(nk, nr, atol=1e-6, rtol=1e-5, name="grad_norm")
    for i in range(len(sizes)):
        for key in sk[i]:
            if key == "step":
                assert float(sk[i][key]) == float(sr[i][key]) == 4
            else:  # atol: see _assert_state_close (m cancels; the clip coefficients differ by an ulp)
                assert_close_fp32(sk[i][key], sr[i][key], atol=1e-6, rtol=1e-5, name=f"{key}[{i}]")
        if dtype in LOWP:  # both write the rounded master; masters may differ by an ulp → params by one lowp ulp
            diff = (pk[i].float() - pr[i].float()).abs()
            tol = (pr[i].float().abs() * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)).clamp_min(1e-7)
            assert (diff <= tol).all(), f"param[{i}]"
        else:
            assert_close_fp32(pk[i], pr[i], atol=W_ATOL, rtol=W_RTOL, name=f"param[{i}]")


@pytest.mark.cuda
def test_cuda_mixed_dtype_workspace():
    """fp32 + fp16 + bf16 parameters: one buffer and one launch each, one global norm across them."""
    sizes = [7, 1023, 4097, 9, 130, 1]
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]
    ours = [_params([n], dt, "cuda", seed=i)[0] for i, (n, dt) in enumerate(zip(sizes, dtypes))]
    theirs = _to_fp32_twins(ours)
    opt = FusedAdam(_cuda_groups(ours), max_grad_norm=1.0)
    topt = torch.optim.AdamW(_cuda_groups(theirs))
    assert len(opt.workspace.dtypes) == 3
    for step in range(4):
        vals = [v.to(dt).float() for v, dt in zip(_grad_values(sizes, step), dtypes)]
        _set_grads(ours, vals)
        _set_grads(theirs, vals)
        norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        opt.step()
        topt.step()
        assert_close_fp32(opt.grad_norm, norm, atol=1e-6, rtol=1e-5, name="grad_norm")
    st = _state_of(opt, ours)
    for i, (p, q) in enumerate(zip(ours, theirs)):
        w = st[i]["master"] if p.dtype in LOWP else p.detach()
        assert_close_fp32(w, q.detach(), atol=W_ATOL, rtol=W_RTOL, name=f"weight[{i}] ({p.dtype})")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_name)
def test_cuda_clipping_matches_clip_grad_norm(dtype):
    sizes = [1, 7, 1023, 4097, 300]
    ours, weights, theirs, opt, topt = _run_cuda_vs_torch(sizes, dtype, clip=0.5)
    assert float(opt._last_ctrl[3]) < 1.0  # clipping was active
    for i, (w, q) in enumerate(zip(weights, theirs)):
        assert_close_fp32(w, q.detach(), atol=W_ATOL, rtol=W_RTOL, name=f"weight[{i}]")
    _assert_state_close(opt, topt, len(sizes))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_name)
def test_cuda_loss_scale_unscales_in_kernel(dtype):
    sizes = [7, 1023, 4097]
    ours, weights, theirs, opt, topt = _run_cuda_vs_torch(sizes, dtype, scale=1024.0, clip=0.7)
    for i, (w, q) in enumerate(zip(weights, theirs)):
        assert_close_fp32(w, q.detach(), atol=W_ATOL, rtol=W_RTOL, name=f"weight[{i}]")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=_name)
@pytest.mark.parametrize("bad_value", [float("inf"), float("-inf"), float("nan")])
def test_cuda_overflow_skips_step(dtype, bad_value, update_path):
    sizes = [1, 7, 1023, 4097, 3000]
    ours = _params(sizes, dtype, "cuda")
    fresh = _params(sizes, dtype, "cuda")
    opt = FusedAdam(_cuda_groups(ours), lr=1e-2, skip_nonfinite=True)
    fopt = FusedAdam(_cuda_groups(fresh), lr=1e-2)
    vals = _grad_values(sizes, 0)
    for where in ((0, 0), (3, 4096), (4, 1234)):  # first element, last element of an odd tensor, middle
        bad = [v.clone() for v in vals]
        bad[where[0]][where[1]] = bad_value
        _set_grads(ours, bad)
        opt.step()
        assert float(opt.found_inf) == 1.0 and opt.last_step_skipped, where
        for p, q in zip(ours, fresh):
            _assert_equal(p.detach(), q.detach(), f"parameter after a skipped step ({where})")
    st = opt.state_dict()["state"]
    assert all(float(s["step"]) == 0 for s in st.values())
    _set_grads(ours, vals)
    _set_grads(fresh, vals)
    opt.step()
    fopt.step()
    assert float(opt.found_inf) == 0.0
    for i, (p, q) in enumerate(zip(ours, fresh)):
        _assert_equal(p.detach(), q.detach(), f"first real step [{i}]")


@pytest.mark.cuda
def test_cuda_loss_scaler_backoff_on_overflow():
    ours = _params([1023, 4097], torch.float16, "cuda")
    opt = FusedAdam(ours, lr=1e-2)
    scaler = LossScaler(init_scale=2.0 ** 15, growth_interval=2)
    vals = _grad_values([1023, 4097], 0, scale=0.01 * 2.0 ** 15)  # 0.01: stays far from fp16's max
    vals[1][17] = float("inf")
    _set_grads(ours, vals)
    before = [p.detach().clone() for p in ours]
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 14 and scaler.last_step_skipped
    for p, b in zip(ours, before):
        _assert_equal(p.detach(), b)
    for step in range(2):
        _set_grads(ours, _grad_values([1023, 4097], step + 1, scale=0.01 * 2.0 ** 14))
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0 ** 15 and not scaler.last_step_skipped


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_name)
def test_cuda_thousands_of_tiny_tensors(dtype, update_path):
    g = torch.Generator().manual_seed(5)
    sizes = torch.randint(1, 40, (3000,), generator=g).tolist()
    ours, weights, theirs, opt, topt = _run_cuda_vs_torch(sizes, dtype, steps=3, n_groups=3, clip=5.0)
    assert len(opt.workspace) == 3000
    for i, (w, q) in enumerate(zip(weights, theirs)):
        assert_close_fp32(w, q.detach(), atol=W_ATOL, rtol=W_RTOL, name=f"weight[{i}]")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_cuda_large_buffer_grid_stride(dtype, update_path):
    """More elements than one sweep of either kernel's grid (several grid-stride rounds and a tail)."""
    sizes = [5_000_003, 1_000_001]
    ours, weights, theirs, opt, topt = _run_cuda_vs_torch(sizes, dtype, steps=2, n_groups=2, clip=10.0)
    for i, (w, q) in enumerate(zip(weights, theirs)):
        assert_close_fp32(w, q.detach(), atol=W_ATOL, rtol=W_RTOL, name=f"weight[{i}]")


@pytest.mark.cuda
def test_cuda_grad_norm_matches_fp64():
    sizes = [3_000_017, 7, 123_457]
    ours = _params(sizes, torch.float16, "cuda")
    opt = FusedAdam(ours, max_grad_norm=1.0)
    vals = _grad_values(sizes, 0)
    _set_grads(ours, vals)
    opt.step()
    exact = torch.cat([v.to(torch.float16).double().reshape(-1) for v in vals]).norm()
    # fp32 partial sums over ~3M squares: relative error well below 1e-5 with per-thread + tree order
    assert abs(float(opt.grad_norm) - float(exact)) <= 1e-5 * float(exact)


def _adam_step_raw(param, grad, master, m, v, segs, lr=1e-2, wd=0.1, steps=None, ctrl=None, scale=None):
    ext = lsmini._backend.ext()
    steps = torch.zeros(2, 16, dtype=torch.int32, device="cuda") if steps is None else steps
    ext.adam_step(param, grad, master, m, v, [s[0] for s in segs], [s[1] for s in segs], [s[2] for s in segs],
                  [lr, lr / 2], [0.9, 0.8], [0.999, 0.99], [1e-8, 1e-6], [wd, 0.0], True, steps, 0, True, None, 1.0,
                  scale, ctrl)
    return steps


def _adam_expected(p, g, m, v, lr, b1, b2, eps, wd, t=1):
    p = p.double() * (1 - lr * wd)
    m = m.double() * b1 + (1 - b1) * g.double()
    v = v.double() * b2 + (1 - b2) * g.double() ** 2
    return p - lr / (1 - b1 ** t) * m / (v.sqrt() / (1 - b2 ** t) ** 0.5 + eps), m, v


RAW_LAYOUTS = {
    # segment starts on the 16-byte grid (vector path), odd lengths (scalar tails)
    "vector": (0, [(0, 7, 0), (8, 1031, 1), (1032, 1033, 0), (2000, 6097, 1), (6104, 9000, 0)]),
    # starts off the grid: the whole launch takes the scalar path
    "scalar_segments": (0, [(3, 10, 0), (17, 1040, 1), (1041, 1042, 0), (2000, 6097, 1), (6100, 9000, 0)]),
    # bulk tiles (1024 elements): a whole tile, a tile and a vector, a segment shorter than one vector,
    # three tiles and a short tail, then tiles to the end
    "tiles": (0, [(0, 1024, 0), (1024, 2056, 1), (2056, 2061, 0), (2064, 5139, 1), (5144, 9000, 0)]),
    # aligned starts but base pointers 1 element off 16 bytes: scalar path
    "unaligned_pointer": (1, [(0, 7, 0), (8, 1031, 1), (1032, 1033, 0), (2000, 6097, 1), (6104, 9000, 0)]),
}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=_name)
@pytest.mark.parametrize("layout", list(RAW_LAYOUTS))
def test_cuda_raw_kernel_segments_tails_and_alignment(dtype, layout, update_path):
    """The update over explicit segments vs float64 math; elements outside every segment are never
    touched."""
    offset, segs = RAW_LAYOUTS[layout]
    n = 9000
    gen = torch.Generator().manual_seed(3)
    base_p = torch.randn(n + offset, generator=gen).to("cuda", dtype)
    base_g = torch.randn(n + offset, generator=gen).to("cuda", dtype)
    param, grad = base_p[offset:], base_g[offset:]
    master = param.float() if dtype in LOWP else None
    m = torch.randn(n, generator=gen).to("cuda") * 0.1
    v = torch.rand(n, generator=gen).to("cuda") * 0.01
    p0 = (master if master is not None else param).clone().float()
    m0, v0 = m.clone(), v.clone()
    steps = _adam_step_raw(param, grad, master, m, v, segs)
    assert steps[1, :2].tolist() == [1, 1]
    work = master if master is not None else param
    covered = torch.zeros(n, dtype=torch.bool)
    hyper = {0: (1e-2, 0.9, 0.999, 1e-8, 0.1), 1: (5e-3, 0.8, 0.99, 1e-6, 0.0)}
    for b, e, gi in segs:
        covered[b:e] = True
        ep, em, ev = _adam_expected(p0[b:e], grad[b:e].float(), m0[b:e], v0[b:e], *hyper[gi])
        assert_close_fp32(work[b:e].float(), ep.float(), atol=1e-6, rtol=1e-5, name=f"param {b}:{e}")
        # m = β1·m0 + (1−β1)·g can cancel: its error is ~1 ulp of |g| ≈ 1, hence an absolute atol
        assert_close_fp32(m[b:e], em.float(), atol=1e-6, rtol=1e-5, name=f"m {b}:{e}")
        assert_close_fp32(v[b:e], ev.float(), atol=1e-9, rtol=1e-5, name=f"v {b}:{e}")
        if master is not None:
            _assert_equal(param[b:e], master[b:e].to(dtype), "param = rounded master")
    cov = covered.to("cuda")
    _assert_equal(work[~cov].float(), p0[~cov], "untouched weights")
    _assert_equal(m[~cov], m0[~cov], "untouched m")
    _assert_equal(v[~cov], v0[~cov], "untouched v")
    if offset:  # the element before the view was not written either
        assert torch.isfinite(base_p[:offset].float()).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=_name)
def test_cuda_bulk_and_register_updates_are_bit_identical(dtype):
    """Both update kernels for aligned buffers round the same fp32 expressions: the same bits, over segments
    of every tail length and more tiles than one sweep of the bulk kernel's grid."""
    ext = lsmini._backend.ext()
    if not ext.adam_bulk_available():
        pytest.skip("the bulk-copy update needs a compute capability 9.0 or later device")
    n = 3_000_000
    segs = [(0, 1_000_003, 0), (1_000_008, 1_000_013, 1), (1_000_016, n, 1)]
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(n, generator=gen).to("cuda", dtype)
    g0 = torch.randn(n, generator=gen).to("cuda", dtype)
    m0 = torch.randn(n, generator=gen).to("cuda") * 0.1
    v0 = torch.rand(n, generator=gen).to("cuda") * 0.01
    results = []
    for bulk in (True, False):
        with adam_bulk(bulk):
            param, m, v = p0.clone(), m0.clone(), v0.clone()
            master = p0.float() if dtype in LOWP else None
            steps = _adam_step_raw(param, g0, master, m, v, segs, scale=torch.full((), 4.0, device="cuda"))
            steps = _adam_step_raw(param, g0, master, m, v, segs, steps=steps.flip(0).contiguous())
        results.append({"param": param, "exp_avg": m, "exp_avg_sq": v, "master": master, "steps": steps})
    bulk, registers = results
    for name, a in bulk.items():
        if a is not None:
            _assert_equal(a, registers[name], f"{name}: bulk vs registers")
    assert bulk["steps"][1, :2].tolist() == [2, 2]


@pytest.mark.cuda
def test_cuda_raw_kernel_bad_inputs():
    ext = lsmini._backend.ext()
    p = torch.zeros(64, device="cuda", dtype=torch.float16)
    g = torch.zeros_like(p)
    m = torch.zeros(64, device="cuda")
    v = torch.zeros_like(m)
    steps = torch.zeros(2, 16, dtype=torch.int32, device="cuda")
    args = dict(seg_begin=[0], seg_end=[64], seg_group=[0], lr=[1e-3], beta1=[0.9], beta2=[0.999], eps=[1e-8],
                weight_decay=[0.0], adam_w_mode=True, steps=steps, parity=0, update_steps=True, lr_device=None,
                inv_scale=1.0, scale=None, ctrl=None)
    with pytest.raises(RuntimeError, match="adam_step: master"):
        ext.adam_step(p, g, None, m, v, **args)
    with pytest.raises(RuntimeError, match="adam_step: grad"):
        ext.adam_step(p, g.float(), m.clone(), m, v, **args)
    with pytest.raises(RuntimeError, match="adam_step: segment"):
        ext.adam_step(p, g, m.clone(), m, v, **{**args, "seg_end": [65]})
    with pytest.raises(RuntimeError, match="adam_step: exp_avg"):
        ext.adam_step(p, g, m.clone(), m.half(), v, **args)
    with pytest.raises(RuntimeError, match="adam_step: param"):
        ext.adam_step(p.cpu(), g, m.clone(), m, v, **args)
    with pytest.raises(RuntimeError, match="adam_grad_norm: ctrl"):
        ext.adam_grad_norm([g], [64], 1.0, None, 1.0, True, torch.empty(2, device="cuda"))


@pytest.mark.cuda
def test_cuda_step_never_synchronises():
    model = _net(dtype=torch.float16, device="cuda")
    opt = FusedAdam(_groups(model), lr=1e-3, max_grad_norm=1.0)
    scaler = LossScaler()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    try:
        for step in range(3):
            scaler.scale(_loss(model, step)).backward()  # backward may do its own thing; the step must not
            torch.cuda.set_sync_debug_mode("error")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            sched.step()
            torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not scaler.last_step_skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.cuda
def test_cuda_state_dict_round_trip_bit_identical():
    """fp16 parameters + LossScaler + clipping: resuming from a checkpoint gives the same bits. Gradients are
    synthetic (not from backward) so the comparison does not depend on backward being deterministic."""
    sizes = [1, 7, 1023, 4097, 300]

    def make(seed):
        ps = _params(sizes, torch.float16, "cuda", seed)
        return ps, FusedAdam(_cuda_groups(ps), max_grad_norm=0.5), LossScaler(init_scale=2.0 ** 12, growth_interval=3)

    def run(ps, opt, scaler, steps):
        for step in steps:
            opt.zero_grad()
            s = scaler.get_scale()
            vals = _grad_values(sizes, step, scale=0.1 * s)
            if step == 6:
                vals[2][5] = float("inf")  # one overflow after the checkpoint
            _set_grads(ps, vals)
            scaler.step(opt)
            scaler.update()

    ps, opt, scaler = make(0)
    run(ps, opt, scaler, range(4))
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in ps], "opt": opt.state_dict(), "scaler": scaler.state_dict()},
               buf)
    run(ps, opt, scaler, range(4, 9))
    buf.seek(0)
    ckpt = torch.load(buf)
    ps2, o2, s2 = make(5)
    with torch.no_grad():
        for p, v in zip(ps2, ckpt["params"]):
            p.copy_(v)
    o2.load_state_dict(ckpt["opt"])
    s2.load_state_dict(ckpt["scaler"])
    run(ps2, o2, s2, range(4, 9))
    for i, (p, q) in enumerate(zip(ps, ps2)):
        _assert_equal(p.detach(), q.detach(), f"param[{i}]")
    a, b = opt.state_dict()["state"], o2.state_dict()["state"]
    for k in a:
        for key in a[k]:
            _assert_equal(a[k][key], b[k][key], f"{key}[{k}]")
    assert float(a[0]["step"]) == 8  # nine steps, one skipped
    assert s2.get_scale() == scaler.get_scale()


def test_building_the_optimizer_does_not_import_dynamo():
    """FusedAdam's construction, zero_grad and state_dict leave torch._dynamo unimported (seconds of start-up in
    a run that never compiles): the base class's add_param_group is called without its dynamo-disabling
    wrapper."""
    code = ("import sys, torch; from lsmini.optim import FusedAdam; "
            "opt = FusedAdam(torch.nn.Linear(4, 4)); opt.zero_grad(); opt.state_dict(); "
            "print('torch._dynamo' in sys.modules)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
