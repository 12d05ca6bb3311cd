"""lsmini.graph.CUDAGraphStep: argument checks (CPU); on CUDA, a whole training step (model with dropout,
criterion, LossScaler, FusedAdam, LR schedule) replayed as a graph follows the eager run step for step —
losses, parameters, optimizer step counts and the loss scale, skipped (overflow) steps included — and
every replay draws fresh dropout masks."""
import pytest
import torch

from lsmini.graph import CUDAGraphStep
from lsmini.layers import CrossEntropyLoss, TransformerConfig
from lsmini.models import Transformer
from lsmini.ops import bias_dropout_residual
from lsmini.optim import FusedAdam, LossScaler
from util import amp_train_step


def test_arguments():
    with pytest.raises(TypeError, match="callable"):
        CUDAGraphStep(3)
    with pytest.raises(ValueError, match="warmup"):
        CUDAGraphStep(lambda: None, warmup=0)
    with pytest.raises(TypeError, match="FusedAdam"):
        CUDAGraphStep(lambda: None, optimizers=[torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)])
    step = CUDAGraphStep(lambda x: x)
    with pytest.raises(ValueError, match="CUDA device"):
        step(torch.zeros(2))
    with pytest.raises(TypeError, match="tensor"):
        step(3)


def _trainer(p, lr=1e-3, init_scale=2.0 ** 16, graph=False, seed=0, data_parallel=False):
    torch.manual_seed(seed)
    cfg = TransformerConfig(64, 4, 128, dropout=p, attn_dropout=p, activation_dropout=p, pre_layer_norm=True,
                            max_batch_tokens=8 * 16, max_seq_len=16)
    model = Transformer(50, 50, cfg, 2, 2).cuda().half()
    for m in model.modules():
        if hasattr(m, "check_tokens"):
            m.check_tokens = False
    crit = CrossEntropyLoss(0.1, ignore_index=0, inplace_backward=True, check_targets=False)
    opt = FusedAdam(model, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 4))
    scaler = LossScaler(init_scale=init_scale, growth_interval=3)
    if data_parallel:  # small buckets: several all-reduces per step, in a fixed order
        from lsmini.distributed import GradientReducer
        GradientReducer(opt, bucket_mb=0.1)

    train_step = amp_train_step(model, crit, opt, scaler)
    run = CUDAGraphStep(train_step, optimizers=[opt], warmup=2) if graph else train_step

    def step(*batch):
        loss = run(*batch).clone()
        sched.step()
        return loss

    return model, opt, scaler, step, run


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        src = torch.randint(3, 50, (8, 16), generator=g)
        tgt = torch.randint(3, 50, (8, 16), generator=g)
        src[1, -3:] = 0  # padding: masks are part of the recorded step
        out.append(tuple(t.cuda() for t in (src, torch.roll(tgt, 1, 1), tgt)))
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("init_scale", [2.0 ** 16, 2.0 ** 40])  # 2^40 overflows fp16: skipped steps on replay
def test_graph_follows_eager(init_scale):
    batches = _batches(10)
    results = []
    for graph in (False, True):
        model, opt, scaler, step, run = _trainer(0.1, init_scale=init_scale, graph=graph)
        torch.cuda.manual_seed(7)
        losses = torch.stack([step(*b) for b in batches])
        torch.cuda.synchronize()
        if graph:
            assert run.captured and run.calls == len(batches)
        results.append((losses, [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"],
                        scaler.get_scale()))
    (l0, p0, s0, sc0), (l1, p1, s1, sc1) = results
    # The same kernels on the same data with the same random streams: GEMM algorithm choices may differ
    # under capture, so fp16 rounding (not more) is allowed.
    torch.testing.assert_close(l1, l0, rtol=2e-3, atol=1e-3)
    for a, b in zip(p1, p0):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-3)
    assert sc1 == sc0
    assert [s["step"] for s in s1.values()] == [s["step"] for s in s0.values()]
    if init_scale > 2.0 ** 30:  # the first steps overflowed and were skipped in both runs
        assert next(iter(s0.values()))["step"] < len(batches)


@pytest.mark.cuda
def test_graph_dropout_fresh_each_replay():
    model, opt, scaler, step, run = _trainer(0.5, lr=0.0, graph=True)
    batch = _batches(1)[0]
    losses = torch.stack([step(*batch) for _ in range(6)])  # lr 0: only the dropout masks change
    assert run.captured
    assert len(set(losses[2:].tolist())) == 4, losses


@pytest.mark.cuda
def test_first_replay_draws_from_the_generator_state():
    """The first replay of each fresh recording draws the masks that an eager call from the same generator
    state draws. With torch 2.11 it reads stale seed/offset words now and then (every differing first replay
    equals an eager step from the previous recording's seed: that recording's words can be the same memory),
    unless the device is idle between the recording and that replay. CUDAGraphStep synchronises there;
    without that synchronisation this test fails now and then."""
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(64, 1024, generator=g).cuda() for _ in range(2))
    bias = torch.zeros(1024, device="cuda")

    def fn(t):
        return bias_dropout_residual(t, bias, residual, 0.5)

    for i in range(100):  # each recording's words may be the memory of the previous one's, holding its state
        torch.cuda.manual_seed(100 + i)
        run = CUDAGraphStep(fn, warmup=1)
        run(x)
        replayed = run(x).clone()
        assert run.captured
        torch.cuda.manual_seed(100 + i)
        fn(x)
        assert torch.equal(replayed, fn(x)), f"recording {i}: the first replay's masks differ from eager"
        del run


@pytest.mark.cuda
def test_graph_shapes_fixed():
    model, opt, scaler, step, run = _trainer(0.1, graph=True)
    b = _batches(1)[0]
    for _ in range(3):
        step(*b)
    with pytest.raises(ValueError, match="fixed shapes"):
        step(b[0][:, :8], b[1], b[2])
    run.reset()  # drops the recording: the next calls warm up and record the new shape
    assert not run.captured and run.calls == 0
    for _ in range(3):
        step(b[0][:, :8], b[1], b[2])
    assert run.captured


@pytest.mark.cuda
def test_fused_adam_capture_needs_preparation():
    p = torch.nn.Parameter(torch.randn(64, device="cuda"))
    opt = FusedAdam([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    opt.step()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prepare_graph_replay"):
        with torch.cuda.graph(g):
            opt.step()


def test_fused_adam_prepared_for_graphs_keeps_counting_eagerly():
    """After prepare_graph_replay the step-count rows stop alternating (a recorded step reads a fixed row);
    eager steps in between replays must still count, so training equals torch's AdamW step for step."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(33)), torch.nn.Parameter(torch.randn(4, 5))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    twin = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for step in range(6):
        if step == 2:
            opt.prepare_graph_replay()
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        twin.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert all(s["step"] == 6 for s in opt.state_dict()["state"].values())
