"""Data-parallel training on CPU with gloo: lsmini.distributed.GradientReducer and plain DDP (also around a
converted Hugging Face model) against one process with the whole batch, overflow/scale agreement across ranks,
error paths, and the example scripts under torchrun (resume, a failing rank).

Library tests run two processes with torch.multiprocessing (a file rendezvous; gloo connects them over
this machine's loopback); example tests launch `python -m torch.distributed.run --standalone` with
--device cpu (so they test the same thing on a GPU machine). Every launch has a deadline, so a hang fails
the test instead of stalling CI."""
import contextlib
import gc
import os
import subprocess
import sys
import tempfile
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import lsmini
from lsmini.distributed import GradientReducer
from lsmini.optim import FusedAdam, LossScaler, ParameterWorkspace
# the example tests' corpus fixture and helpers (importing them makes `corpus` available here)
from test_examples import (SMALL, DataError, builtin_data, check_metrics, corpus, data_args, run,  # noqa: F401
                           train_lm, train_translation, write_lines)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
STEPS = 5
WORLD = 2
PAD = 0

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

if dist.is_available():
    # Imported now, before any process group exists (in pytest and in every spawned worker, which imports this
    # module first): its functions take `group=group.WORLD` as a default argument, evaluated at import, and
    # torch.optim imports it (through torch._dynamo) when the first optimizer is built. Imported while a group
    # is up, it would keep that group, and gloo's worker threads, alive after destroy_process_group(): _entry.
    import torch.distributed.nn  # noqa: F401


# ---- launching -----------------------------------------------------------------------------------------
def _entry(rank, world, init_file, cuda, fn, args):
    torch.set_num_threads(1)
    init = f"file://{init_file}"
    if cuda == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        if cuda:
            torch.cuda.set_device(0)  # the ranks share one GPU (gloo carries CUDA tensors)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = weakref.ref(dist.group.WORLD)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    if cuda is False:
        # Gone, so its gloo threads were joined here, while the interpreter is whole. A group kept alive takes
        # them into interpreter shutdown: a worker thread that releases a finished collective's tensors needs
        # the GIL for their Python objects, and if it waits for it as shutdown begins, Python ends the thread
        # inside a noexcept destructor: "terminate called without an active exception" (SIGABRT), at random.
        assert group() is None, "the process group outlived destroy_process_group() (something still holds it)"


def spawn(fn, *args, world=WORLD, timeout=120, cuda=False):
    """Run fn(rank, world, *args) in `world` processes; a failure in any re-raises here, a hang fails.
    cuda: False (gloo, CPU), True (gloo, the ranks sharing one GPU) or "nccl" (one GPU per rank)."""
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_entry, args=(world, os.path.join(d, "rendezvous"), cuda, fn, args),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"{fn.__name__}: the processes did not finish within {timeout}s (a hang)")


@pytest.fixture
def single_process_group(tmp_path):
    """A gloo group of one process, in this process (for the error paths)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# ---- a tiny translation model and its batches ------------------------------------------------------------
def tiny_model(seed=0, device="cpu", dtype=torch.float32):
    from lsmini.layers import TransformerConfig
    from lsmini.models import Transformer

    torch.manual_seed(seed)
    config = TransformerConfig(hidden_size=32, num_heads=4, ffn_size=64, dropout=0.0, attn_dropout=0.0,
                               activation_dropout=0.0, max_seq_len=32, max_batch_tokens=1024)
    model = Transformer(40, 40, config, num_encoder_layers=2, num_decoder_layers=2, padding_idx=PAD,
                        share_embeddings=True, tie_output=True)
    return model.to(device=device, dtype=dtype)


def full_batch(step, rows=8, length=8, device="cpu"):
    """(src, tgt_in, tgt_out) of one step; targets end in PAD runs of different lengths."""
    g = torch.Generator().manual_seed(1000 + step)
    src = torch.randint(4, 40, (rows, length), generator=g)
    tgt = torch.randint(4, 40, (rows, length + 1), generator=g)
    for r in range(rows):
        cut = int(torch.randint(2, length + 1, (1,), generator=g))
        tgt[r, cut:] = PAD
    src[rows // 2:, -2:] = PAD
    return tuple(t.to(device) for t in (src, tgt[:, :-1], tgt[:, 1:].contiguous()))


def rows_of(batch, part, parts):
    n = batch[0].size(0) // parts
    return tuple(t[part * n:(part + 1) * n] for t in batch)


def token_loss_sum(model, batch):
    from lsmini.ops import cross_entropy

    src, tgt_in, tgt_out = batch
    return cross_entropy(model(src, tgt_in), tgt_out, label_smoothing=0.1, ignore_index=PAD, reduction="sum")


def tokens(batch):
    return int(batch[2].ne(PAD).sum())


def make_optimizer(model, clip):
    # eps 1e-4, not 1e-8: some gradients are zero in exact arithmetic (the attention key bias: softmax ignores
    # a shift of a whole row) and hold only rounding noise (~1e-9) that depends on the summation order; with a
    # tiny eps Adam turns that noise into lr-sized steps that differ between any two ways of batching
    return FusedAdam(model, lr=3e-3, betas=(0.9, 0.98), eps=1e-4, weight_decay=0.01, max_grad_norm=clip)


def single_process_run(update_freq, clip, steps=STEPS, device="cpu"):
    """The oracle: one process, the whole batch of every step (all micro-batches of all ranks)."""
    model = tiny_model(device=device)
    opt = make_optimizer(model, clip)
    norms = []
    for step in range(steps):
        micro = [full_batch(step * update_freq + u, device=device) for u in range(update_freq)]
        total = sum(tokens(b) for b in micro)
        for b in micro:
            (token_loss_sum(model, b) / total).backward()
        opt.step()
        norms.append(opt.grad_norm.item() if opt.grad_norm is not None else None)
        opt.zero_grad()
    return model, norms


def assert_same_params(model, ref, rtol=1e-5, atol=1e-6, what=""):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what}: parameter {name} differs from the one-process run: {m}")


def assert_equal_across_ranks(t, what):
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t.contiguous())
    for r, x in enumerate(every):
        assert torch.equal(x, every[0]), f"{what}: rank {r} differs from rank 0"


# ---- workers (run in each process) ------------------------------------------------------------------------
def _train_with_reducer(rank, world, update_freq, clip, set_to_none, device="cpu", rtol=1e-5, atol=1e-6,
                        keep_reference=True):
    """Each rank takes its rows of every micro-batch; losses are normalised by the step's global token
    count times the world size (the reducer averages). Ends equal to the one-process run."""
    import lsmini.distributed as ld

    sent = []
    all_reduce = ld.dist.all_reduce
    ld.dist.all_reduce = lambda t, *a, **k: sent.append(t.numel()) or all_reduce(t, *a, **k)  # count them
    model = tiny_model(seed=rank, device=device)  # different per rank: the reducer broadcasts rank 0's
    opt = make_optimizer(model, clip)
    reducer = GradientReducer(opt, bucket_mb=0.004)  # ~1000 floats: many buckets
    buckets = reducer.buckets
    assert len(buckets) > 5
    if not keep_reference:  # built as a statement and dropped: the workspace keeps it reducing
        del reducer
        gc.collect()
        reducer = opt.workspace.reducer
        assert reducer is not None
    norms = []
    for step in range(STEPS):
        micro = [full_batch(step * update_freq + u, device=device) for u in range(update_freq)]
        denom = sum(tokens(b) for b in micro) / world
        for u, b in enumerate(micro):
            ctx = reducer.no_sync() if u < update_freq - 1 else contextlib.nullcontext()
            with ctx:
                (token_loss_sum(model, rows_of(b, rank, world)) / denom).backward()
            if u < update_freq - 1:
                assert not sent, "an accumulating micro-batch communicated"
        opt.step()  # finishes the reduction itself
        # every bucket once per step, in order
        assert sent == [end - start for _, start, end, _ in buckets], sent
        sent.clear()
        norms.append(opt.grad_norm.item() if opt.grad_norm is not None else None)
        if set_to_none:
            model.zero_grad(set_to_none=True)  # the next backward allocates fresh gradients outside the buffer
        else:
            opt.zero_grad()
    ref, ref_norms = single_process_run(update_freq, clip, device=device)
    assert_same_params(model, ref, rtol=rtol, atol=atol, what=f"reducer, update_freq {update_freq}")
    if clip:
        # the clip used the norm of the whole batch's gradient, on every rank
        assert norms == pytest.approx(ref_norms, rel=max(rtol, 1e-5))
        assert any(n > clip for n in ref_norms), "the test should clip"
    for dt in opt.workspace.dtypes:
        assert_equal_across_ranks(opt.workspace.param_buffer(dt), "parameters")


def _train_with_ddp(rank, world):
    """torch's DistributedDataParallel around an lsmini model with FusedAdam (the copying path), with DDP's
    own buckets and with gradient_as_bucket_view (p.grad then points into DDP's buckets between steps)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lsmini.ops import cross_entropy

    ref, _ = single_process_run(1, 0.05)
    for bucket_view in (False, True):
        model = tiny_model()
        opt = make_optimizer(model, 0.05)
        ddp = DDP(model, gradient_as_bucket_view=bucket_view)
        for step in range(STEPS):
            b = full_batch(step)
            src, tgt_in, tgt_out = rows_of(b, rank, world)
            loss = cross_entropy(ddp(src, tgt_in), tgt_out, label_smoothing=0.1, ignore_index=PAD, reduction="sum")
            (loss / (tokens(b) / world)).backward()
            opt.step()
            opt.zero_grad()
        assert_same_params(model, ref, what=f"DDP(gradient_as_bucket_view={bucket_view})")


def _hf_llama_ddp(rank, world, device="cpu"):
    """A Hugging Face LlamaForCausalLM converted by lsmini.convert (grouped K/V heads, the fused loss) in torch's
    DistributedDataParallel: two ranks, each with half the rows of every batch, take the steps one process
    takes with the whole batch (no padding, so every rank's mean is over as many tokens).
    On CUDA the layers run the fused kernels (bf16 autocast, head_dim 16) and the comparison is of the whole
    gradient and parameter change as vectors: the half and the whole batch round differently in bf16, and
    plain SGD keeps those differences proportional (Adam would turn a near-zero gradient's sign into a full
    step)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import LlamaConfig, LlamaForCausalLM

    from lsmini.layers import runtime

    cuda = device != "cpu"
    hidden = 64 if cuda else 32

    def build():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=50, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
        report = lsmini.convert(model)
        assert len(report) == 3 and not report.kept, report  # the loss and both decoder layers
        return model.to(device)

    paths = []
    kernel_path = runtime.kernel_path
    runtime.kernel_path = lambda *a: paths.append(kernel_path(*a)) or paths[-1]  # the path each layer call takes

    def train(model, forward, rows):
        opt = torch.optim.SGD(model.parameters(), lr=0.1) if cuda else torch.optim.AdamW(model.parameters(), lr=1e-2)
        start = torch.cat([p.detach().flatten() for p in model.parameters()])
        first_grads = None
        for step in range(STEPS):
            ids = torch.randint(1, 50, (4, 10), generator=torch.Generator().manual_seed(100 + step))[rows]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = forward(ids.to(device), labels=ids.to(device), use_cache=False).loss
            loss.backward()
            if first_grads is None:
                first_grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        return first_grads, torch.cat([p.detach().flatten() for p in model.parameters()]) - start

    ref = build()
    ref_grads, ref_change = train(ref, ref, slice(None))
    model = build()
    grads, change = train(model, DDP(model), slice(2 * rank, 2 * rank + 2))
    if not cuda:
        assert_same_params(model, ref, rtol=1e-4, atol=1e-5, what="converted LlamaForCausalLM in DDP")
        return
    assert paths and all(paths), f"a layer call left the kernel path: {paths}"
    for what, ours, want in (("the first step's gradients", grads, ref_grads), ("the parameter change", change,
                                                                                   ref_change)):
        err = ((ours - want).norm() / want.norm()).item()
        assert err < 3e-2, f"converted LlamaForCausalLM in DDP on {device}: {what} differ by {err:.3g} (relative)"


def _overflow_agrees(rank, world, device, dtypes):
    for dtype in dtypes:
        _overflow_agrees_in(rank, world, device, dtype)


def _overflow_agrees_in(rank, world, device, dtype):
    """A non-finite gradient on rank 1 only: every rank skips the step and backs the scale off alike."""
    model = tiny_model(device=device, dtype=dtype)
    opt = make_optimizer(model, 1.0)
    reducer = GradientReducer(opt)
    scaler = LossScaler(init_scale=1024.0, growth_interval=1000)
    victim = next(p for p in model.encoder.parameters() if p.dim() == 1)
    poison = {"on": False}

    def inject(grad):
        if poison["on"] and rank == 1:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    victim.register_hook(inject)
    skipped, scales = [], []
    for step in range(3):
        poison["on"] = step == 1
        before = opt.workspace.param_buffer(dtype).clone()
        b = rows_of(full_batch(step, device=device), rank, world)
        scaler.scale(token_loss_sum(model, b) / tokens(b)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        skipped.append(scaler.last_step_skipped)
        scales.append(scaler.get_scale())
        if step == 1:
            assert torch.equal(before, opt.workspace.param_buffer(dtype)), "the skipped step changed parameters"
    assert skipped == [False, True, False], skipped
    assert scales == [1024.0, 512.0, 512.0], scales
    assert_equal_across_ranks(torch.tensor(scales), "loss scales")
    assert_equal_across_ranks(opt.workspace.param_buffer(dtype), "parameters")
    del reducer


class Odd(nn.Module):
    """A weight used twice (tied), a parameter that gets no gradient, a frozen one, and odd sizes."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Parameter(torch.randn(11, 7))
        self.mid = nn.Linear(7, 7)
        self.unused = nn.Parameter(torch.randn(5))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, ids):
        h = torch.tanh(self.mid(self.emb[ids]))
        return h @ self.emb.t()  # the tied weight again: one accumulation, one hook call


def _odd_module(rank, world):
    def run(distributed):
        torch.manual_seed(0)
        m = Odd()
        opt = FusedAdam(m, lr=1e-2, weight_decay=0.0)
        reducer = GradientReducer(opt, bucket_mb=1e-4) if distributed else None
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 11, (4, 3), generator=g)
            part = ids[rank * 2:(rank + 1) * 2] if distributed else ids
            out = m(part)
            (out.square().sum() / (ids.numel() / (world if distributed else 1))).backward()
            opt.step()
            m.zero_grad(set_to_none=True)
        if reducer is not None:
            reducer.remove()
        return m

    got, ref = run(True), run(False)
    assert_same_params(got, ref, what="tied/unused/frozen parameters")
    assert torch.equal(got.unused.detach(), ref.unused.detach())


# ---- library tests ---------------------------------------------------------------------------------------
def test_reducer_matches_one_process_with_clipping():
    spawn(_train_with_reducer, 1, 0.05, False)


def test_reducer_update_freq_2_and_set_to_none():
    spawn(_train_with_reducer, 2, 0.05, True)


def test_reducer_keeps_working_when_the_caller_drops_it():
    spawn(_train_with_reducer, 1, 0.0, False, "cpu", 1e-5, 1e-6, False)


def test_plain_ddp_matches_one_process():
    spawn(_train_with_ddp)


def test_converted_hugging_face_model_in_ddp_matches_one_process():
    pytest.importorskip("transformers")
    spawn(_hf_llama_ddp)


@pytest.mark.cuda
def test_converted_hugging_face_model_in_ddp_on_cuda_matches_one_process():
    """The kernel path in DDP: two ranks on one GPU (gloo carrying the CUDA buckets)."""
    pytest.importorskip("transformers")
    spawn(_hf_llama_ddp, "cuda", cuda=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL, one GPU per rank)")
def test_converted_hugging_face_model_in_ddp_on_two_gpus_matches_one_process():
    pytest.importorskip("transformers")
    spawn(_hf_llama_ddp, "cuda", cuda="nccl", timeout=300)


def test_overflow_on_one_rank_skips_on_every_rank():
    spawn(_overflow_agrees, "cpu", (torch.float32, torch.float16))  # fp16: FusedAdam's masters, fp16 buckets


def test_tied_unused_and_frozen_parameters():
    spawn(_odd_module)


@pytest.mark.cuda
def test_reducer_on_cuda_matches_one_process():
    """The CUDA path (fused kernels; hooks on autograd's device thread; waits that order streams): two ranks
    on one GPU, gloo carrying the CUDA buckets. rtol 1e-4: cuBLAS picks different kernels for the half and
    the whole batch, and the GPU's summation orders differ more than the CPU's."""
    spawn(_train_with_reducer, 2, 0.05, True, "cuda", 1e-4, 1e-5, cuda=True)


@pytest.mark.cuda
def test_fp16_overflow_on_one_rank_skips_on_every_rank_cuda():
    spawn(_overflow_agrees, "cuda", (torch.float16,), cuda=True)


def _graph_follows_eager(rank, world):
    """The whole data-parallel step (bucket all-reduces included) recorded by CUDAGraphStep and replayed does
    what the eager data-parallel step does, on every rank, and the ranks stay identical."""
    from test_graph import _batches, _trainer

    batches = _batches(8, seed=1 + rank)  # each rank its own data: only the all-reduce keeps them equal
    results = []
    for graph in (False, True):
        model, opt, scaler, step, run = _trainer(0.1, graph=graph, data_parallel=True)
        torch.cuda.manual_seed(7 + rank)
        losses = torch.stack([step(*b) for b in batches])
        torch.cuda.synchronize()
        if graph:
            assert run.captured and run.calls == len(batches)
        assert len(opt.workspace.reducer.buckets) > 3
        for dt in opt.workspace.dtypes:
            assert_equal_across_ranks(opt.workspace.param_buffer(dt), f"parameters (graph={graph})")
        results.append((losses, [p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    (l0, p0, sc0), (l1, p1, sc1) = results
    torch.testing.assert_close(l1, l0, rtol=2e-3, atol=1e-3)  # as in test_graph: GEMM choices under capture
    for a, b in zip(p1, p0):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-3)
    assert sc1 == sc0


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL, one GPU per rank)")
def test_graph_step_with_reducer_follows_eager_on_two_gpus():
    spawn(_graph_follows_eager, cuda="nccl", timeout=300)


def test_graph_step_refuses_a_gloo_reducer(single_process_group):
    from lsmini.graph import CUDAGraphStep

    opt = FusedAdam(nn.Linear(3, 3))
    reducer = GradientReducer(opt)
    with pytest.raises(ValueError, match="gloo.*cannot be recorded"):
        CUDAGraphStep(lambda: None, optimizers=[opt])
    reducer.remove()


def test_reducer_without_process_group_is_an_error():
    assert not dist.is_initialized()
    opt = FusedAdam(nn.Linear(3, 3))
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        GradientReducer(opt)


def test_reducer_argument_errors(single_process_group):
    model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="module's parameters must all live in one ParameterWorkspace"):
        GradientReducer(model)
    with pytest.raises(TypeError, match="expected a FusedAdam"):
        GradientReducer([1, 2])
    opt = FusedAdam(model)
    for bad in (0, -1, "25", True):
        with pytest.raises(ValueError, match="bucket_mb must be a number > 0"):
            GradientReducer(opt, bucket_mb=bad)
    r = GradientReducer(model)  # the module works once its parameters live in a workspace
    assert opt.workspace.reducer is r
    with pytest.raises(RuntimeError, match="already has a GradientReducer"):
        GradientReducer(opt)
    r.remove()
    assert opt.workspace.reducer is None
    GradientReducer(opt.workspace).remove()


def test_second_backward_outside_no_sync_is_refused(single_process_group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = FusedAdam(model)
    reducer = GradientReducer(opt, bucket_mb=1e-5)  # one bucket per parameter: sent as soon as it is ready
    x = torch.randn(3, 4)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="accumulated again after its bucket was sent"):
        model(x).sum().backward()
    reducer.finish()
    with pytest.raises(RuntimeError, match="already started the reduction"):
        model(x).sum().backward()
        with reducer.no_sync():
            pass
    opt.step()
    # the accumulation pattern is fine, and finish() twice is a no-op
    for u in range(3):
        with reducer.no_sync() if u < 2 else contextlib.nullcontext():
            model(x).sum().backward()
    reducer.finish()
    reducer.finish()
    opt.step()
    with reducer.no_sync():
        model(x).sum().backward()
        with pytest.raises(RuntimeError, match="inside no_sync"):
            reducer.finish()


def test_reducer_follows_a_relaid_workspace(single_process_group):
    """Built before the optimizer (which reorders the workspace): the buckets follow the new layout."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ws = ParameterWorkspace(model)
    reducer = GradientReducer(ws, bucket_mb=1e-5)
    before = reducer.buckets
    opt = FusedAdam([{"params": [model[1].weight]}, {"params": [p for n, p in model.named_parameters()
                                                                if n != "1.weight"]}], weight_decay=0.0)
    assert opt.workspace is ws
    assert reducer.buckets != before
    model(torch.randn(3, 4)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, g in zip(model.parameters(), grads):
        assert p.grad is not None and torch.equal(p.grad, g)
    reducer.remove()


def test_lsmini_exports_the_reducer():
    assert lsmini.distributed.GradientReducer is GradientReducer


# ---- the example scripts under torchrun ----------------------------------------------------------------
def torchrun(args, timeout=240, nproc=WORLD):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--monitor-interval=0.5"] + args
    # the checkout first on the path: the workers import lsmini and the examples from it, installed or not
    path = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"torchrun {' '.join(args)} did not finish within {timeout}s (a hang?)\n{err.stderr}")


def checkpoint(save_dir):
    return torch.load(os.path.join(save_dir, "checkpoint_last.pt"), map_location="cpu", weights_only=True)


def assert_ok(proc):
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_translation_two_processes_resume(corpus, tmp_path):  # noqa: F811 (the imported fixture)
    """2 processes: 4 steps straight == 2 steps, stop, --resume for 2 more (dropout on: every rank's RNG
    stream is restored); rank 0 alone prints and writes, the test set is translated by both."""
    script = os.path.join(EXAMPLES, "train_translation.py")
    common = data_args(corpus) + SMALL + ["--beam", "1", "--eval-every", "2", "--dropout", "0.3", "--max-tokens",
                                          "1024", "--device", "cpu"]
    straight, halves = str(tmp_path / "straight"), str(tmp_path / "halves")
    proc = torchrun([script] + common + ["--save-dir", straight, "--max-steps", "4"])
    assert_ok(proc)
    assert proc.stdout.count("done: 4 steps") == 1, proc.stdout  # one rank prints
    assert_ok(torchrun([script] + common + ["--save-dir", halves, "--max-steps", "2"]))
    proc = torchrun([script] + common + ["--save-dir", halves, "--max-steps", "4", "--resume"])
    assert_ok(proc)
    assert "resumed from" in proc.stdout and "note:" not in proc.stdout
    a, b = checkpoint(straight)["trainer"], checkpoint(halves)["trainer"]
    assert a["step"] == b["step"] == 4 and len(a["rng_per_rank"]) == WORLD
    assert a["batch_in_epoch"] == 4 * WORLD  # batches consumed by both ranks
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{k} differs after resume under two processes"
    m = check_metrics(halves, 4)
    assert m["world_size"] == WORLD
    with open(os.path.join(halves, "hypotheses.test.txt"), encoding="utf-8") as f:
        assert len(f.read().split("\n")) - 1 == 12  # every sentence translated once, by one of the ranks


def test_lm_two_processes_equal_one_process_with_update_freq_2(tmp_path):
    """Each step of 2 processes x 1 batch covers the same batches as 1 process x --update-freq 2: the same
    parameters (dropout off; fp32 sums in another order)."""
    lines = [s for s, _ in builtin_data.generate_pairs(200, 202)]
    train = write_lines(tmp_path / "train.txt", lines[:180])
    valid = write_lines(tmp_path / "valid.txt", lines[180:])
    common = ["--train", train, "--valid", valid, "--vocab-size", "300", "--block-size", "32", "--max-tokens", "256",
              "--log-every", "2", "--no-progress", "--num-samples", "0", "--dropout", "0", "--max-steps", "4",
              "--device", "cpu"]
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    proc = torchrun([os.path.join(EXAMPLES, "train_lm.py")] + common + ["--save-dir", two])
    assert_ok(proc)
    m1 = run(train_lm.main, common + ["--save-dir", one, "--update-freq", "2"])
    m2 = check_metrics(two, 4)
    assert m2["world_size"] == 2 and m1["update_freq"] == 2
    assert m2["train_loss"] == pytest.approx(m1["train_loss"], rel=1e-5)
    assert m2["valid_loss"] == pytest.approx(m1["valid_loss"], rel=1e-5)
    a, b = checkpoint(two)["trainer"]["model"], checkpoint(one)["trainer"]["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL, one GPU per rank)")
def test_translation_two_gpus_cuda_graph_follows_eager(corpus, tmp_path):  # noqa: F811
    """torchrun on 2 GPUs with --cuda-graph: the ranks record one step per batch shape each (at different
    steps, as their shapes differ), their all-reduces still pair up, and training follows the eager run."""
    script = os.path.join(EXAMPLES, "train_translation.py")
    common = data_args(corpus, test=False) + SMALL + ["--beam", "1", "--max-steps", "24", "--eval-every", "24",
                                                       "--dropout", "0.1"]
    out = {}
    for name, extra in (("eager", []), ("graph", ["--cuda-graph"])):
        save = str(tmp_path / name)
        assert_ok(torchrun([script] + common + ["--save-dir", save] + extra, timeout=300))
        out[name] = check_metrics(save, 24)
    assert out["graph"]["world_size"] == 2
    # as the one-GPU test in test_examples: the loss normalisation rounds differently under a graph
    assert out["graph"]["valid_loss"] == pytest.approx(out["eager"]["valid_loss"], rel=0.02)
    assert out["graph"]["train_loss"] == pytest.approx(out["eager"]["train_loss"], rel=0.02)


FAILING = """
import os, sys
sys.path.insert(0, {examples!r})
import train_lm
from training import run, trainer

mode, argv = sys.argv[1], sys.argv[2:]
if os.environ["RANK"] == "1":
    if mode == "missing-data":  # the validation file does not exist for rank 1
        argv = [a + ".missing" if a.endswith("valid.txt") else a for a in argv]
    else:  # rank 1 fails in its third batch, while rank 0 waits for it in the gradient all-reduce
        train = trainer.Trainer.train

        def failing_train(self, batches, loss_fn, *rest):
            calls = []

            def loss(model, batch):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("injected failure on rank 1")
                return loss_fn(model, batch)
            return train(self, batches, loss, *rest)
        trainer.Trainer.train = failing_train
run.run_main(lambda: train_lm.main(argv))
"""


@pytest.mark.parametrize("mode, message", [("missing-data", "rank 1: error: --valid: file not found"),
                                           ("crash", "RuntimeError: injected failure on rank 1")])
def test_a_failing_rank_ends_the_job(tmp_path, mode, message):
    lines = [s for s, _ in builtin_data.generate_pairs(200, 202)]
    train = write_lines(tmp_path / "train.txt", lines[:180])
    valid = write_lines(tmp_path / "valid.txt", lines[180:])
    launcher = tmp_path / "launch.py"
    launcher.write_text(FAILING.format(examples=EXAMPLES))
    start = time.monotonic()
    proc = torchrun([str(launcher), mode, "--train", train, "--valid", valid, "--vocab-size", "300", "--block-size",
                     "32", "--max-tokens", "256", "--no-progress", "--num-samples", "0", "--max-steps", "20",
                     "--device", "cpu", "--save-dir", str(tmp_path / "run")], timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-4000:]
    assert time.monotonic() - start < 120
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_single_process_modes_refuse_torchrun(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DataError, match="--generate runs in one process"):
        run(train_lm.main, ["--save-dir", str(tmp_path), "--generate", "The"])
    with pytest.raises(DataError, match="--translate runs in one process"):
        run(train_translation.main, ["--save-dir", str(tmp_path), "--translate"])
