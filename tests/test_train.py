"""lsmini.train: TrainStep on CPU — accumulation over micro-batches equals one step on the whole batch (with
and without a data-parallel reducer), loss_weight scales the gradient, reports sum, argument errors —
and the inverse-sqrt schedule with its LambdaLR state_dict. On CUDA: the graph step follows the eager
step over two batch shapes, and records with the layers' host checks left on."""
import pickle

import pytest
import torch
import torch.distributed as dist

from lsmini.distributed import GradientReducer
from lsmini.layers import CrossEntropyLoss, TransformerConfig
from lsmini.models import Transformer, TransformerLM
from lsmini.optim import FusedAdam, LossScaler
from lsmini.train import InverseSqrt, TrainStep, inverse_sqrt_schedule
from test_graph import _batches

VOCAB, PAD = 20, 0


def _language_model(seed=0):
    torch.manual_seed(seed)
    config = TransformerConfig(16, 2, 32, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0,
                               max_batch_tokens=64, max_seq_len=8)
    return TransformerLM(VOCAB, config, 1, padding_idx=PAD)


def _summed_loss(model):
    """loss_fn(tokens, target) -> (summed smoothed loss, summed NLL): the examples' criterion."""
    criterion = CrossEntropyLoss(0.1, ignore_index=PAD, reduction="sum")

    def loss_fn(tokens, target):
        loss, nll = criterion(model(tokens), target, return_nll=True)
        return loss, nll

    return loss_fn


def _lm_batch(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, VOCAB, (rows, 9), generator=g)
    seq[0, -2:] = PAD
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _trained_parameters(split, steps=3, reducer=False):
    """Parameters after `steps` TrainSteps on a 4-row batch given whole or as micro-batches of `split` rows,
    each micro-batch's summed loss divided by the step's tokens."""
    model = _language_model()
    # attention ignores the key bias: its gradient is rounding noise, which Adam with a tiny eps would
    # magnify to full-size steps that differ between the runs
    optimizer = FusedAdam(model, lr=1e-3, betas=(0.9, 0.98), eps=1e-6)
    if reducer:
        GradientReducer(optimizer, bucket_mb=1e-5)  # one bucket per parameter: sent as soon as it is ready
    step = TrainStep(_summed_loss(model), optimizer)
    for i in range(steps):
        tokens, target = _lm_batch(4, seed=i)
        weight = 1.0 / int((target != PAD).sum())
        step(*[(tokens[r:r + split], target[r:r + split]) for r in range(0, 4, split)], loss_weight=weight)
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(parameters, expected):
    for p, q in zip(parameters, expected):  # atol: 1% of one step of lr 1e-3
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


def test_accumulation_equals_one_step_on_the_whole_batch():
    whole = _trained_parameters(split=4)
    _assert_same(_trained_parameters(split=2), whole)
    assert any(not torch.equal(p, q) for p, q in zip(whole, [p.detach() for p in _language_model().parameters()]))


@pytest.fixture
def single_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="no torch.distributed gloo")
def test_accumulation_with_a_reducer_communicates_once(single_process_group):
    # a second backward outside no_sync would add to buckets already sent: the reducer refuses that
    _assert_same(_trained_parameters(split=1, reducer=True), _trained_parameters(split=4))


def _gradient_of(loss_weight, fn_returns_report=True):
    """The gradient the output layer's parameter received in one step of a tiny model, and the report."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    seen = []
    model[2].weight.register_hook(lambda grad: seen.append(grad.clone()))

    def loss_fn(x, y):
        loss = ((model(x) - y) ** 2).sum()
        return (loss, loss.detach() + 1.0) if fn_returns_report else loss

    x, y = torch.randn(5, 4), torch.randn(5, 1)
    report = TrainStep(loss_fn, FusedAdam(model, lr=1e-2))((x, y), loss_weight=loss_weight)
    return seen[0], report


def test_loss_weight_scales_the_gradient():
    plain, report = _gradient_of(None)
    for weight in (0.25, torch.tensor(0.25), torch.tensor(0.25, dtype=torch.float64), 4):
        scaled, scaled_report = _gradient_of(weight)
        torch.testing.assert_close(scaled, plain * float(weight))
        torch.testing.assert_close(scaled_report, report)  # reports are not weighted


def test_report_sums_over_micro_batches():
    model = _language_model()
    loss_fn = _summed_loss(model)
    batches = [_lm_batch(2, seed=s) for s in (1, 2, 3)]
    with torch.no_grad():
        expected = [loss_fn(*b) for b in batches]
    report = TrainStep(loss_fn, FusedAdam(model))(*batches, loss_weight=0.01)
    torch.testing.assert_close(report, sum(nll for _, nll in expected))
    assert not report.requires_grad
    # a loss_fn returning only the loss reports the (unweighted) loss itself
    model = _language_model()
    loss_only = _summed_loss(model)
    report = TrainStep(lambda *b: loss_only(*b)[0], FusedAdam(model))(*batches[:2], loss_weight=0.01)
    torch.testing.assert_close(report, expected[0][0] + expected[1][0])
    assert not report.requires_grad


def test_loss_scaler_scales_and_unscales():
    """An enabled scaler multiplies the loss and FusedAdam divides it out: the same step as without one."""
    steps = []
    for scaler in (None, LossScaler(init_scale=1024.0)):
        model = _language_model()
        step = TrainStep(_summed_loss(model), FusedAdam(model, lr=1e-3), scaler)
        step(_lm_batch(4), loss_weight=0.05)
        steps.append([p.detach().clone() for p in model.parameters()])
    _assert_same(steps[1], steps[0])


def test_argument_errors():
    model = _language_model()
    loss_fn = _summed_loss(model)
    optimizer = FusedAdam(model)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        TrainStep(3, optimizer)
    with pytest.raises(TypeError, match="optimizer must be lsmini.optim.FusedAdam, got AdamW"):
        TrainStep(loss_fn, torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="scaler must be lsmini.optim.LossScaler"):
        TrainStep(loss_fn, optimizer, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="cuda_graph must be True or False"):
        TrainStep(loss_fn, optimizer, cuda_graph="yes")
    for warmup in (0, 1.5, True):
        with pytest.raises(ValueError, match="graph_warmup must be an int >= 1"):
            TrainStep(loss_fn, optimizer, cuda_graph=True, graph_warmup=warmup)
    step = TrainStep(loss_fn, optimizer)
    batch = _lm_batch(2)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        step()
    with pytest.raises(TypeError, match="micro-batch must be a tuple of tensors.*Tensor for micro-batch 1"):
        step(batch, batch[0])
    with pytest.raises(TypeError, match="loss_weight must be a float or a 0-d tensor, got str"):
        step(batch, loss_weight="0.5")
    with pytest.raises(ValueError, match="loss_weight must be a float or a 0-d floating-point tensor"):
        step(batch, loss_weight=torch.ones(2))
    with pytest.raises(ValueError, match="loss_weight must be a float or a 0-d floating-point tensor"):
        step(batch, loss_weight=torch.tensor(2))
    with pytest.raises(ValueError, match="loss_weight must be finite"):
        step(batch, loss_weight=float("nan"))
    with pytest.raises(TypeError, match=r"loss_fn must return the loss tensor or a tuple \(loss, report\)"):
        TrainStep(lambda *b: 1.0, optimizer)(batch)
    with pytest.raises(ValueError, match="must be a 0-d tensor"):
        TrainStep(lambda tokens, target: model(tokens).sum(-1), optimizer)(batch)


def test_graph_step_takes_one_cuda_micro_batch():
    model = _language_model()
    step = TrainStep(_summed_loss(model), FusedAdam(model), cuda_graph=True)
    batch = _lm_batch(2)
    with pytest.raises(ValueError, match="one micro-batch per step, got 2.*cuda_graph=False.*update_freq 1"):
        step(batch, batch)
    with pytest.raises(ValueError, match="cuda_graph=True needs CUDA tensors, but element 0 of the batch is cpu"):
        step(batch)
    assert not step.graphs
    step.reset()  # nothing recorded: harmless


def test_inverse_sqrt_values():
    schedule = InverseSqrt(4)
    assert [schedule(i) for i in (0, 1, 3)] == [0.25, 0.5, 1.0]  # linear warmup to 1 at step 4
    assert schedule(15) == pytest.approx(0.5)  # then sqrt(4 / 16)
    assert schedule(99) == pytest.approx(0.2)
    for warmup in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match="warmup must be an int >= 1"):
            InverseSqrt(warmup)
    assert pickle.loads(pickle.dumps(schedule)).warmup == 4


def test_inverse_sqrt_cooldown():
    """The last `cooldown` steps of a `total`-step run fall linearly: step total gets 1/cooldown of the
    inverse-sqrt factor, and so does every later step."""
    plain, cooled = InverseSqrt(4), InverseSqrt(4, total=20, cooldown=5)
    for i in range(15):  # steps 1..15: the cooldown has not started
        assert cooled(i) == plain(i)
    for i, fraction in zip(range(15, 25), (1, 0.8, 0.6, 0.4, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2)):
        assert cooled(i) == pytest.approx(plain(i) * fraction)
    assert InverseSqrt(4, total=20)(19) == plain(19)  # cooldown 0: none
    for total, cooldown, match in ((20, -1, "cooldown must be an int >= 0"), (20, 1.5, "cooldown must be an int"),
                                   (20, True, "cooldown must be an int"), (None, 5, "needs total"),
                                   (4, 5, "needs total, the run's steps, as an int >= 5; got 4")):
        with pytest.raises(ValueError, match=match):
            InverseSqrt(4, total=total, cooldown=cooldown)


def test_inverse_sqrt_schedule_state_dict_round_trip(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = FusedAdam(model, lr=1e-3)
    scheduler = inverse_sqrt_schedule(optimizer, warmup=10)
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    for _ in range(14):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    assert state["lr_lambdas"] == [{"warmup": 10, "total": None, "cooldown": 0}]
    torch.save(state, tmp_path / "scheduler.pt")  # checkpoints load with weights_only=True
    state = torch.load(tmp_path / "scheduler.pt", weights_only=True)

    restored_optimizer = FusedAdam(torch.nn.Linear(3, 2), lr=1e-3)
    restored = inverse_sqrt_schedule(restored_optimizer, warmup=3)
    restored.load_state_dict(state)
    assert restored.lr_lambdas[0].warmup == 10
    scheduler.step()
    restored.step()
    assert restored_optimizer.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * (10 / 16) ** 0.5)


# ---- CUDA: the graph step ---------------------------------------------------------------------------------
def _translation_step(graph, check_host=False, seed=0):
    """A small lsmini Transformer (dropout 0.1, fp16) with its TrainStep, LossScaler and schedule."""
    torch.manual_seed(seed)
    config = TransformerConfig(64, 4, 128, dropout=0.1, attn_dropout=0.1, activation_dropout=0.1,
                               pre_layer_norm=True, max_batch_tokens=8 * 16, max_seq_len=16)
    model = Transformer(50, 50, config, 2, 2).cuda().half()
    for m in model.modules():
        if hasattr(m, "check_tokens"):
            m.check_tokens = check_host
    criterion = CrossEntropyLoss(0.1, ignore_index=0, reduction="sum", inplace_backward=True,
                                 check_targets=check_host)
    optimizer = FusedAdam(model, lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01)
    scheduler = inverse_sqrt_schedule(optimizer, warmup=4)

    def loss_fn(src, tgt_in, tgt_out):
        loss, nll = criterion(model(src, tgt_in), tgt_out, return_nll=True)
        return loss, nll

    step = TrainStep(loss_fn, optimizer, LossScaler(growth_interval=3), cuda_graph=graph)
    return model, step, scheduler


def _two_shapes(count):
    """Batches alternating between [8, 16] and [8, 8] tokens: two recordings sharing one pool."""
    return [b if i % 2 == 0 else tuple(t[:, :8].contiguous() for t in b) for i, b in enumerate(_batches(count))]


@pytest.mark.cuda
def test_graph_step_follows_eager_step():
    batches = _two_shapes(10)
    results = []
    for graph in (False, True):
        model, step, scheduler = _translation_step(graph)
        torch.cuda.manual_seed(7)
        reports = []
        for batch in batches:
            # a different weight every step: a graph must not freeze the first one
            reports.append(step(batch, loss_weight=1.0 / int((batch[2] != 0).sum())).clone())
            scheduler.step()
        torch.cuda.synchronize()
        if graph:
            assert len(step.graphs) == 2 and all(g.captured for g in step.graphs.values())
        results.append((torch.stack(reports), [p.detach().clone() for p in model.parameters()],
                        step.scaler.get_scale()))
        step.reset()
        assert not step.graphs
    (reports0, params0, scale0), (reports1, params1, scale1) = results
    # the same kernels on the same data and random streams; GEMM algorithms may differ under capture
    torch.testing.assert_close(reports1, reports0, rtol=2e-3, atol=1e-2)
    for a, b in zip(params1, params0):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-3)
    assert scale1 == scale0


@pytest.mark.cuda
def test_graph_step_records_with_host_checks_on():
    model, step, scheduler = _translation_step(graph=True, check_host=True)
    assert all(m.check_tokens for m in model.modules() if hasattr(m, "check_tokens"))
    batch = _batches(1)[0]
    reports = [step(batch).clone() for _ in range(4)]
    torch.cuda.synchronize()
    assert next(iter(step.graphs.values())).captured
    assert all(torch.isfinite(r) for r in reports)
    # outside the capture the checks still run
    bad = batch[0].clone()
    bad[0, 0] = 50
    with pytest.raises(ValueError, match="token ids must be in"):
        model(bad, batch[1])
    step.reset()
