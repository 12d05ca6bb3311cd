"""The fused dropout ops under CUDA graph capture.

Captured, torch's generator hands out device words for the seed and the base offset (refilled before
every replay) plus a constant offset within the graph; the kernels read the words at run time. So each
replay draws fresh masks, and a replay started from a generator state gives exactly what an eager run
from that state gives: at replay torch writes the generator's current (seed, offset) into the words and
then advances the offset by the graph's whole increment, the sum of the increments its calls drew
during capture, which is what the same calls advance it by in eager mode.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lsmini import _backend
from lsmini.ops import attention_softmax, bias_act_dropout, bias_dropout_residual, embedding, sinusoidal_positions
from util import assert_dropout_keep_stats

P = 0.5


# ------------------------------------------------------------------------- the four ops, one step ---
class Case:
    """One op's training step on fixed inputs: step() → (output, input gradient); keep(output) → the
    bool keep mask [rows, cols] read off the output; dropped_grad_is_zero: the input gradient is zero
    exactly where the output was dropped (the backward regenerated the forward's mask)."""

    def __init__(self, step, keep, dropped_grad_is_zero):
        self.step, self.keep, self.dropped_grad_is_zero = step, keep, dropped_grad_is_zero


def _gen():
    return torch.Generator(device="cpu").manual_seed(0)


def _embedding_case(hidden, p):
    g = _gen()
    batch, length, vocab = 8, 33, 50
    tokens = torch.randint(0, vocab, (batch, length), generator=g).cuda()
    weight = torch.randn(vocab, hidden, generator=g).cuda().requires_grad_()
    pos = sinusoidal_positions(length, hidden).cuda()
    grad = torch.randn(batch, length, hidden, generator=g).cuda()

    def step():
        # check_tokens=False: the id check reads the ids on the host, which a capture cannot do
        out = embedding(tokens, weight, pos, dropout_p=p, check_tokens=False)
        (gw,) = torch.autograd.grad(out, weight, grad)
        return out.detach(), gw  # detached: a static output must not keep the captured autograd graph alive

    return Case(step, lambda out: (out != 0).view(-1, hidden), False)


def _attention_softmax_case(k_len, p):
    g = _gen()
    scores = torch.randn(4, 2, 16, k_len, generator=g).cuda().requires_grad_()
    grad = torch.randn(4, 2, 16, k_len, generator=g).cuda()

    def step():
        probs = attention_softmax(scores, None, False, p)
        (gs,) = torch.autograd.grad(probs, scores, grad)
        return probs.detach(), gs

    return Case(step, lambda probs: (probs != 0).view(-1, k_len), False)


def _bias_dropout_residual_case(hidden, p):
    g = _gen()
    x = (1 + torch.rand(64, hidden, generator=g)).cuda().requires_grad_()  # x + bias ≥ 1: kept ≠ residual
    bias = torch.rand(hidden, generator=g).cuda().requires_grad_()
    residual = torch.randn(64, hidden, generator=g).cuda()
    grad = torch.randn(64, hidden, generator=g).cuda()

    def step():
        out = bias_dropout_residual(x, bias, residual, p)
        (gx,) = torch.autograd.grad(out, x, grad)
        return out.detach(), gx

    return Case(step, lambda out: out != residual, True)


def _bias_act_dropout_case(hidden, p):
    g = _gen()
    x = (1 + torch.rand(64, hidden, generator=g)).cuda().requires_grad_()  # gelu(x + bias) > 0: kept ≠ 0
    bias = torch.rand(hidden, generator=g).cuda().requires_grad_()
    grad = torch.randn(64, hidden, generator=g).cuda()

    def step():
        out = bias_act_dropout(x, bias, "gelu", p)
        (gx,) = torch.autograd.grad(out, x, grad)
        return out.detach(), gx

    return Case(step, lambda out: out != 0, True)


# op → (make_case, size on the 16-byte vector path, size on the one-element path)
CASES = {
    "embedding": (_embedding_case, 64, 6),
    "attention_softmax": (_attention_softmax_case, 128, 127),
    "bias_dropout_residual": (_bias_dropout_residual_case, 1024, 1023),
    "bias_act_dropout": (_bias_act_dropout_case, 1024, 1023),
}


def _case(op, path, p):
    make, vec_size, scalar_size = CASES[op]
    return make(vec_size if path == "vector" else scalar_size, p)


def _capture(step):
    """Warm step() up on a side stream (as torch's CUDA graph docs do), then capture one call of it.
    Returns the graph and the static tensors that each replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    # torch 2.11: without this the first replay now and then reads the generator's words before their refill
    # (torch's own dropout too; test_graph.py::test_first_replay_draws_from_the_generator_state)
    torch.cuda.synchronize()
    return graph, static


def _replay(graph, static):
    graph.replay()
    return [t.clone() for t in static]


# ------------------------------------------------------------------------------------------- CUDA ---
@pytest.mark.cuda
@pytest.mark.parametrize("path", ["vector", "scalar"])
@pytest.mark.parametrize("op", list(CASES))
def test_replays_draw_fresh_masks_at_the_keep_rate(op, path):
    case = _case(op, path, P)
    graph, static = _capture(case.step)
    (out1, grad1), (out2, grad2) = _replay(graph, static), _replay(graph, static)
    keep1, keep2 = case.keep(out1), case.keep(out2)
    for keep, grad, name in ((keep1, grad1, "replay 1"), (keep2, grad2, "replay 2")):
        assert_dropout_keep_stats(keep, P, name=f"{op} {path} {name}")
        if case.dropped_grad_is_zero:  # forward and backward of one replay read the same words
            assert torch.equal(grad == 0, ~keep), f"{op} {path} {name}: backward mask differs from forward"
    # independent masks agree on a fraction p² + (1 − p)² = 0.5 of the elements; equal masks on all
    agree = (keep1 == keep2).double().mean().item()
    assert abs(agree - 0.5) < 0.05, f"{op} {path}: two replays agree on {agree:.3f} of the mask"


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.0, P])
@pytest.mark.parametrize("path", ["vector", "scalar"])
@pytest.mark.parametrize("op", list(CASES))
def test_replay_matches_eager_from_the_same_generator_state(op, path, p):
    case = _case(op, path, p)
    graph, static = _capture(case.step)
    for seed in (11, 12):
        torch.cuda.manual_seed(seed)
        replayed = [_replay(graph, static), _replay(graph, static)]
        torch.cuda.manual_seed(seed)
        eager = [case.step() for _ in range(2)]
        for i, (r, e) in enumerate(zip(replayed, eager)):
            assert torch.equal(r[0], e[0]), f"{op} {path} p={p} seed {seed}: replay {i + 1} output != eager"
            assert torch.equal(r[1], e[1]), f"{op} {path} p={p} seed {seed}: replay {i + 1} gradient != eager"
    if p > 0:
        assert not torch.equal(replayed[0][0], replayed[1][0])


@pytest.mark.cuda
def test_pointer_form_reads_the_same_seed_and_offset():
    # What a replay hands the kernels, without a graph: the seed and a base offset in device words plus
    # the call's offset within the graph, against the same (seed, offset) passed as values. The seed
    # uses all 64 bits (stored as int64, read back as uint64) and the offset both 32-bit halves.
    from lsmini._backend import ext
    seed, offset, in_graph = 0x9E3779B97F4A7C15, (1 << 33) + 44, 8
    seed_word = torch.tensor([seed - (1 << 64)], dtype=torch.int64, device="cuda")
    offset_word = torch.tensor([offset - in_graph], dtype=torch.int64, device="cuda")
    values, words = (seed, offset, 0, 0), (0, in_graph, seed_word.data_ptr(), offset_word.data_ptr())
    g = _gen()
    x = torch.randn(37, 1032, generator=g).cuda()
    bias, grad = torch.randn(1032, generator=g).cuda(), torch.randn(37, 1032, generator=g).cuda()
    tokens, weight = torch.randint(0, 40, (37, 24), generator=g).cuda(), torch.randn(40, 1032, generator=g).cuda()
    pos = sinusoidal_positions(24, 1032).cuda()
    scores = torch.randn(3, 2, 37, 1032, generator=g).cuda()
    calls = {
        "embedding_fwd": lambda rng: ext().embedding_fwd(tokens, weight, pos, 2.0, -1, 0, P, rng),
        "embedding_bwd": lambda rng: ext().embedding_bwd(grad.view(37, 1, 1032).expand(37, 24, 1032), tokens, 40,
                                                         24, True, True, 2.0, -1, 0, P, rng),
        "attention_softmax_fwd": lambda rng: ext().attention_softmax_fwd(scores, None, True, P, rng),
        "attention_softmax_bwd": lambda rng: ext().attention_softmax_bwd(scores, scores.softmax(-1), P, rng, False),
        "bias_dropout_residual_fwd": lambda rng: ext().bias_dropout_residual_fwd(x, bias, grad, P, rng),
        "bias_dropout_residual_bwd": lambda rng: ext().bias_dropout_residual_bwd(grad, P, rng, True),
        "bias_act_dropout_fwd": lambda rng: ext().bias_act_dropout_fwd(x, bias, "gelu", P, rng),
        "bias_act_dropout_bwd": lambda rng: ext().bias_act_dropout_bwd(grad, x, bias, "gelu", P, rng),
    }
    for name, call in calls.items():
        a, b = call(values), call(words)
        a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
        for u, v in zip(a, b):
            assert torch.equal(u, v), name
    with pytest.raises(RuntimeError, match="rng must be"):
        ext().bias_act_dropout_fwd(x, bias, "gelu", P, (0, in_graph, seed_word.data_ptr(), 0))


@pytest.mark.cuda
def test_philox_seed_offset_eager_and_captured_forms():
    torch.cuda.manual_seed(5)
    seed, offset, seed_ptr, offset_ptr = _backend.philox_seed_offset()
    assert (seed, offset, seed_ptr, offset_ptr) == (5, 0, 0, 0)
    assert _backend.philox_seed_offset() == (5, 4, 0, 0)  # each call advances torch's offset by 4
    work = torch.zeros(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first, second = _backend.philox_seed_offset(), _backend.philox_seed_offset()
        work.add_(1)  # a graph needs at least one node
    assert first[0] == 0 and first[2] != 0 and first[3] != 0
    assert second[2:] == first[2:] and second[1] == first[1] + 4
    assert _backend.dropout_rng(0.0, torch.device("cuda")) == _backend.NO_RNG


@pytest.mark.cuda
def test_philox_seed_offset_of_a_device():
    """A draw for a given device comes from that device's generator; "cuda" without an index, the current one."""
    torch.cuda.manual_seed(5)
    here = torch.device("cuda", torch.cuda.current_device())
    assert _backend.philox_seed_offset(here) == (5, 0, 0, 0)
    assert _backend.dropout_rng(0.1, here) == (5, 4, 0, 0)
    assert _backend.dropout_rng(0.1, torch.device("cuda")) == (5, 8, 0, 0)
    assert _backend.philox_seed_offset() == (5, 12, 0, 0)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (a draw for the other one)")
def test_philox_seed_offset_of_another_device():
    torch.cuda.set_device(0)
    torch.cuda.manual_seed_all(5)
    assert _backend.dropout_rng(0.1, torch.device("cuda", 1)) == (5, 0, 0, 0)
    assert _backend.dropout_rng(0.1, torch.device("cuda", 1)) == (5, 4, 0, 0)
    assert _backend.dropout_rng(0.1, torch.device("cuda", 0)) == (5, 0, 0, 0)  # device 0's own offset
    assert torch.cuda.current_device() == 0
    x = torch.randn(64, 32, device="cuda:1")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(1), torch.cuda.graph(graph):  # captured on device 1: its generator's device words
        rng = _backend.dropout_rng(0.1, x.device)
        x.add_(1)
    assert rng[0] == 0 and rng[2] != 0


# -------------------------------------------------------------------------------------- CPU (CI) ---
def _cpu_forward(op, p):
    """A forward of the public op on small CPU tensors (its registered operator); returns the output."""
    g = _gen()
    if op == "embedding":
        weight = torch.randn(10, 8, generator=g).requires_grad_()
        return embedding(torch.randint(0, 10, (2, 3), generator=g), weight, sinusoidal_positions(3, 8),
                         dropout_p=p)
    if op == "attention_softmax":
        return attention_softmax(torch.randn(2, 2, 3, 5, generator=g).requires_grad_(), None, False, p)
    x = torch.randn(6, 8, generator=g).requires_grad_()
    bias = torch.randn(8, generator=g).requires_grad_()
    if op == "bias_dropout_residual":
        return bias_dropout_residual(x, bias, torch.randn(6, 8, generator=g), p)
    return bias_act_dropout(x, bias, "relu", p)


class DropoutStates(TorchDispatchMode):
    """Records the dropout state of each lsmini operator call: what a forward returns (its last output)
    and what a backward operator gets (its argument ``state``), as (operator name, state)."""

    def __init__(self):
        super().__init__()
        self.states = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "lsmini":
            if func._opname.endswith("_backward"):
                names = [a.name for a in func._schema.arguments]
                self.states.append((func._opname, args[names.index("state")]))
            else:
                self.states.append((func._opname, out[-1]))
        return out


@pytest.mark.parametrize("p", [0.0, P])
@pytest.mark.parametrize("op", list(CASES))
def test_ops_hand_the_forward_state_to_the_backward(op, p):
    """The autograd glue of every dropout op on its registered operators: the dropout state the forward
    operator returns (on CPU, the keep-mask it drew from torch's generator, shaped like its output) goes
    unchanged to the backward operator; p == 0 draws nothing and hands over an empty state."""
    rng = torch.get_rng_state()
    with DropoutStates() as seen:
        out = _cpu_forward(op, p)
        out.backward(torch.ones_like(out))
    assert [name for name, _ in seen.states] == [op, f"{op}_backward"]
    (_, drawn), (_, handed) = seen.states
    assert handed is drawn or (handed.data_ptr() == drawn.data_ptr() and torch.equal(handed, drawn))
    assert drawn.dtype == torch.bool
    if p > 0:
        assert drawn.numel() == out.numel() and not torch.equal(torch.get_rng_state(), rng)
    else:
        assert drawn.numel() == 0 and torch.equal(torch.get_rng_state(), rng)
