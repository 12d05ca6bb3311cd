"""lsmini layers under torch.compile (lsmini/layers/compiled.py): a model of encoder and decoder stacks
compiles with fullgraph=True and computes what it computes eagerly — on the reference path (CPU, in CI)
and through the custom operators lsmini::layer / lsmini::layer_backward on the kernel path (CUDA), where
`torch.library.opcheck` checks the operators' schemas, fake implementations and autograd registration.
Also here: the layers inside torch.utils.checkpoint, and CUDAGraphStep around a step whose embedding and
criterion keep their host-side checks on."""
import copy

import pytest
import torch

from layer_testing import _one_thread, perturb_  # noqa: F401  (fixtures)
from lsmini.layers import (CrossEntropyLoss, TransformerConfig, TransformerDecoder, TransformerEncoder,
                           TransformerEncoderLayer, layer_graph_counts, set_layer_graphs)
from lsmini.layers import compiled
from lsmini.layers.arena import ALIGN
from lsmini.layers.compiled import (BITS, CAST_ALIGN, LSE, MASK, SLOTS, STATE_ALIGN, grad_plan,
                                    layer_backward_op, layer_op, saved_layout, state_plan, state_tail)
from lsmini.layers.precision import cast_plan
from lsmini.layers.spec import LayerOptions
from lsmini.ops import dropout_bits
from util import amp_train_step


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test compiles from scratch: dynamo's per-code caches (and the frames it gave up on after an
    earlier test's deliberate error) must not carry over between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _config(pre=True, act="relu", dropout=0.0, heads=4):
    """heads=2 (head_dim 16) gives the fused attention kernel a head size it has: the kernel path."""
    return TransformerConfig(hidden_size=32, num_heads=heads, ffn_size=64, dropout=dropout, attn_dropout=dropout,
                             activation_dropout=dropout, pre_layer_norm=pre, activation=act, max_batch_tokens=1024,
                             max_seq_len=64)


class Seq2Seq(torch.nn.Module):
    def __init__(self, config, layers=2):
        super().__init__()
        self.encoder = TransformerEncoder(config, layers)
        self.decoder = TransformerDecoder(config, layers)

    def forward(self, src, tgt, src_mask):
        return self.decoder(tgt, self.encoder(src, src_mask), src_mask)


def _inputs(device, dtype, b=3, ls=7, lt=5, h=32):
    g = torch.Generator().manual_seed(1)
    src = torch.randn(b, ls, h, generator=g).to(device, dtype)
    tgt = torch.randn(b, lt, h, generator=g).to(device, dtype)
    mask = torch.zeros(b, ls, dtype=torch.bool)
    mask[1, ls - 2:] = True
    grad = torch.randn(b, lt, h, generator=g).to(device, dtype)
    return src, tgt, mask.to(device), grad


def _step(fn, model, src, tgt, mask, grad, seed=0):
    """(output, src grad, tgt grad, {name: param grad}) of one forward + backward with a fixed output
    gradient (so the loss's own backward cannot differ between eager and compiled)."""
    model.zero_grad(set_to_none=True)
    src, tgt = src.detach().requires_grad_(), tgt.detach().requires_grad_()
    torch.manual_seed(seed)
    out = fn(src, tgt, mask)
    out.backward(grad)
    return out.detach(), src.grad, tgt.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_close(a, b, atol, rtol=0.0):
    for x, y in zip(a[:3], b[:3]):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)
    for name, g in a[3].items():
        torch.testing.assert_close(g, b[3][name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ---- reference path (CPU) ----------------------------------------------------------------------------------
@pytest.mark.parametrize("pre,act", [(True, "relu"), (False, "gelu")])
def test_fullgraph_reference_path_matches_eager(pre, act):
    torch.manual_seed(0)
    model = Seq2Seq(_config(pre, act)).double()
    perturb_(model)
    src, tgt, mask, grad = _inputs("cpu", torch.float64)
    eager = _step(model, model, src, tgt, mask, grad)
    compiled = _step(torch.compile(model, fullgraph=True, backend="aot_eager"), model, src, tgt, mask, grad)
    # the references compute in float32 whatever the input dtype; the compiled graph composes them
    # differently from the eager layer's hand-written backward, so they agree to float32 rounding
    _assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_bad_input_under_compile_names_the_problem():
    """Shapes outside a layer's limits: the layer's own ValueError (compile falls back to running the
    check eagerly); with fullgraph=True the compiler reports that same error as the reason it stopped."""
    torch.manual_seed(0)
    enc = TransformerEncoder(TransformerConfig(hidden_size=32, num_heads=4, ffn_size=64, dropout=0.0,
                                               max_batch_tokens=512, max_seq_len=8), 1)
    ok = torch.randn(2, 8, 32)
    compiled = torch.compile(enc, backend="aot_eager")
    assert compiled(ok).shape == ok.shape
    with pytest.raises(ValueError, match="len 9 > config.max_seq_len = 8"):
        compiled(torch.randn(2, 9, 32))
    strict = torch.compile(enc, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="max_seq_len = 8"):
        strict(torch.randn(2, 9, 32))


def test_saved_layout_repeats_and_inputs():
    """The layout of a pre-LN encoder layer with recompute: block 0 keeps x itself (twice: LayerNorm input
    and the block input), block 1 keeps the block-0 output once and refers back to it."""
    o = LayerOptions.of(("self", "ffn"), _config(), True, False, True)
    layout = saved_layout(o, 2, 5, True, False, torch.float16)
    block0, block1 = layout[:SLOTS], layout[SLOTS:]
    assert block0[0] == ("input", "x") and block0[1] == ("input", "x")
    assert block0[MASK] == ("input", "key_padding_mask")
    assert block1[0][0] == "new" and block1[1] == ("same", SLOTS)
    assert block0[4] is None and block1[4] is None  # the core input is recomputed
    assert block0[LSE] == ("new", (2, 4, 5), torch.float32)
    assert block0[BITS] is None  # no attention dropout: no keep bits


def test_saved_layout_keep_bits():
    """With attention dropout the self- and cross-attention blocks keep their dropout bits (one int32 word
    per lane of each 16 × 64 tile), except where the keys are longer than 16·head_dim (drawn again)."""
    o = LayerOptions.of(("self", "cross", "ffn"), _config(dropout=0.1), True, False, True)  # head_dim 8
    layout = saved_layout(o, 2, 5, False, False, torch.float16, src_len=70)
    assert layout[BITS] == ("new", (2 * 4 * 4 * 1 * 32,), torch.int32)
    assert layout[SLOTS + BITS] == ("new", (2 * 4 * 4 * 2 * 32,), torch.int32)
    assert layout[2 * SLOTS + BITS] is None
    assert saved_layout(o, 2, 5, False, False, torch.float16, src_len=129)[SLOTS + BITS] is None


@pytest.mark.parametrize("pre", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("recompute", [True, False])
def test_saved_layout_refers_back_to_made_tensors(pre, act, recompute):
    """Every ("same", j) of a decoder layer's layout names an earlier slot holding a tensor the call made."""
    o = LayerOptions.of(("self", "cross", "ffn"), _config(pre, act), True, False, True, recompute)
    layout = saved_layout(o, 2, 5, True, True, torch.float16)
    assert len(layout) == 3 * SLOTS
    for i, entry in enumerate(layout):
        if entry is not None and entry[0] == "same":
            assert entry[1] < i and layout[entry[1]][0] == "new"


def test_state_plan_places_each_made_tensor_once():
    """The state buffer holds each tensor the call makes once, aligned, without overlap; a repeated slot
    shares its tensor's offset; inputs and empty slots have none."""
    o = LayerOptions.of(("self", "cross", "ffn"), _config(True, "gelu", dropout=0.1), True, False, True, True)
    layout = saved_layout(o, 2, 5, True, True, torch.float16, src_len=7)
    offsets, nbytes = state_plan(layout)
    regions = []
    for entry, offset in zip(layout, offsets):
        if entry is None or entry[0] == "input":
            assert offset == -1
        elif entry[0] == "same":
            assert offset == offsets[entry[1]] >= 0
        else:
            assert offset % STATE_ALIGN == 0
            regions.append((offset, offset + torch.Size(entry[1]).numel() * entry[2].itemsize))
    regions.sort()
    assert all(end <= start for (_, end), (start, _) in zip(regions, regions[1:]))
    assert regions[-1][1] <= nbytes == -(-regions[-1][1] // STATE_ALIGN) * STATE_ALIGN
    # then the dropout states (int64 [2·blocks, 2]) and the cast weights, aligned, after them
    rng_at, cast_at, total = state_tail(o, nbytes, 1000, torch.float16)
    assert rng_at == nbytes and rng_at % 8 == 0
    assert cast_at >= rng_at + 2 * 3 * 16 and cast_at % CAST_ALIGN == 0 and total == cast_at + 2000


def test_grad_plan_places_each_gradient_once():
    """The backward operator's one gradient tensor holds every gradient of params[0]'s dtype once, aligned,
    without overlap, in parameter order; a parameter of another dtype has none there (-1)."""
    params = [torch.empty(6, 4, dtype=torch.float16), torch.empty(5, dtype=torch.float16),
              torch.empty(3, dtype=torch.float32), torch.empty(7, 2, dtype=torch.float16)]
    offsets, numel = grad_plan(params)
    assert offsets[2] == -1
    step = ALIGN
    assert offsets[0] == 0 and offsets[1] == step and offsets[3] == 2 * step and numel == 3 * step
    assert grad_plan(params[:2])[1] == 2 * step


# ---- kernel path (CUDA) --------------------------------------------------------------------------------
def _cuda_model(pre, act, dtype, dropout=0.1, recompute=True):
    torch.manual_seed(0)
    model = Seq2Seq(_config(pre, act, dropout, heads=2)).cuda().to(dtype)
    perturb_(model)
    for m in model.modules():
        if hasattr(m, "recompute"):
            m.recompute = recompute
    return model


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pre,act,recompute", [(True, "relu", True), (False, "gelu", True), (True, "gelu", False),
                                               (False, "relu", False)])
def test_fullgraph_kernel_path_matches_eager(pre, act, recompute, dtype):
    """Same seed, same dropout draws, same kernels: the compiled model equals the eager one. The encoder
    output is bit-equal; the decoder's cross-attention K/V GEMM is the compiler's own while compiling, so
    results downstream of it agree to within a rounding or two."""
    model = _cuda_model(pre, act, dtype, recompute=recompute)
    src, tgt, mask, grad = _inputs("cuda", dtype)
    eager = _step(model, model, src, tgt, mask, grad)
    compiled = _step(torch.compile(model, fullgraph=True), model, src, tgt, mask, grad)
    encoder = copy.deepcopy(model.encoder)
    torch.manual_seed(0)
    enc_eager = encoder(src, mask)
    torch.manual_seed(0)
    enc_compiled = torch.compile(encoder, fullgraph=True)(src, mask)
    assert torch.equal(enc_eager, enc_compiled)
    _assert_close(compiled, eager, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_dropout_bits_policy_changed_after_the_plan():
    """The compiled layers keep the dropout-bits choice of their first call at each shape (their plan keeps the
    bits' slot): under a later "never" they still write the bits their backward reads, so the result is the
    eager layer's, which draws the mask again, with the same seed."""
    encoder = _cuda_model(True, "gelu", torch.float16).encoder
    src, _, mask, _ = _inputs("cuda", torch.float16)
    grad = torch.randn_like(src)
    compiled = torch.compile(encoder, fullgraph=True)

    def step(fn, seed):
        encoder.zero_grad(set_to_none=True)
        x = src.detach().requires_grad_()
        torch.manual_seed(seed)
        fn(x, mask).backward(grad)
        return [x.grad] + [p.grad.clone() for p in encoder.parameters()]

    step(compiled, 0)  # planned under "auto": 7 keys keep their bits
    with dropout_bits("never"):
        got, want = step(compiled, 1), step(encoder, 1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_fullgraph_autocast_and_dynamic_shapes():
    """fp32 parameters under autocast (bf16), then a second batch shape (the compiler goes dynamic)."""
    model = _cuda_model(True, "gelu", torch.float32, dropout=0.0)
    compiled = torch.compile(model, fullgraph=True)
    for b, ls, lt in ((3, 7, 5), (4, 9, 6), (2, 11, 3)):
        src, tgt, mask, grad = _inputs("cuda", torch.float32, b, ls, lt)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eager = _step(model, model, src, tgt, mask, grad.bfloat16())
            comp = _step(compiled, model, src, tgt, mask, grad.bfloat16())
        assert all(g.dtype == torch.float32 for g in comp[3].values())
        _assert_close(comp, eager, atol=3e-2, rtol=3e-2)


@pytest.mark.cuda
def test_gradients_accumulate_without_zero_grad():
    """Three backwards with no zero_grad between them: under compile each parameter's .grad starts as a view
    into its layer's one gradient tensor, and autograd then adds the next backwards into it in place. The
    sums equal eager's (output gradients 1x, 2x, 3x: keeping only one backward's share cannot pass).
    Default mode only: under mode="reduce-overhead" PyTorch 2.11 refuses to accumulate into a .grad that a
    graph replay made, for torch.nn modules too ("accessing tensor output of CUDAGraphs that has been
    overwritten", pytorch/pytorch#169545)."""
    model = _cuda_model(True, "gelu", torch.float16, dropout=0.0)
    src, tgt, mask, grad = _inputs("cuda", torch.float16)

    def accumulated(fn):
        model.zero_grad(set_to_none=True)
        for i in range(3):
            fn(src, tgt, mask).backward(grad * (i + 1))
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    eager = accumulated(model)
    comp = accumulated(torch.compile(model, fullgraph=True))
    for name, g in eager.items():  # atol: 2.5x the one-backward tests' 2e-2, for sums up to 6x one gradient
        torch.testing.assert_close(comp[name], g, atol=5e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.cuda
def test_reduce_overhead_draws_fresh_masks():
    """Compiled with CUDA graphs (a training step's forward and loss, as a training loop compiles them):
    every replay draws new dropout masks (the states are read on the device), so the losses of the same
    batch differ from replay to replay, and every replay's backward runs and gives finite gradients."""
    model = _cuda_model(True, "relu", torch.float16, dropout=0.3)
    enc = model.encoder
    compiled = torch.compile(lambda x, m: enc(x, m).float().square().mean(), mode="reduce-overhead",
                             fullgraph=True)
    src, _, mask, _ = _inputs("cuda", torch.float16)
    losses = []
    for _ in range(6):
        enc.zero_grad(set_to_none=True)
        loss = compiled(src, mask)
        loss.backward()
        losses.append(loss.item())
        assert all(torch.isfinite(p.grad).all() for p in enc.parameters())
    assert len(set(losses)) == len(losses), losses


def _op_args(kinds, pre, act, recompute, dtype, masked, cross, param_dtype=None):
    torch.manual_seed(0)
    b, l, ls, h, heads, ffn = 2, 5, 7, 32, 2, 64
    params = []
    for kind in kinds:
        rows = {"self": 3 * h, "cross": h, "ffn": ffn}[kind]
        cols_out = ffn if kind == "ffn" else h
        params += [torch.randn(rows, h) * 0.2, torch.randn(rows) * 0.1, torch.randn(h, cols_out) * 0.2,
                   torch.randn(h) * 0.1, 1 + 0.1 * torch.randn(h), 0.1 * torch.randn(h)]
    # "mixed": the LayerNorm parameters float32, the others in the activations' dtype
    dtypes = [torch.float32 if param_dtype == "mixed" and i % 6 >= 4 else
              dtype if param_dtype in (None, "mixed") else param_dtype for i in range(len(params))]
    params = [p.cuda().to(dt).requires_grad_() for p, dt in zip(params, dtypes)]
    x = torch.randn(b, l, h, device="cuda", dtype=dtype, requires_grad=True)
    mask = torch.zeros(b, l, dtype=torch.bool, device="cuda")
    mask[0, -1] = True
    enc_mask = torch.zeros(b, ls, dtype=torch.bool, device="cuda")
    enc_mask[1, -3:] = True
    ek = ev = None
    if cross:
        kv = torch.randn(b, ls, 2, h, device="cuda", dtype=dtype)  # [b, ls, H] column blocks, as the decoder's
        ek, ev = (t.requires_grad_() for t in kv.unbind(2))
    return (x, mask if masked else None, ek, ev, enc_mask if (cross and masked) else None, params, ",".join(kinds), h,
            ffn, heads, (h // heads) ** -0.5, 1e-5, pre, act, 0.1, 0.1, 0.1, not cross, recompute)


@pytest.mark.cuda
@pytest.mark.parametrize("param_dtype", [None, torch.float32, "mixed"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kinds,pre,act,recompute,masked", [
    (("self", "ffn"), True, "relu", True, True), (("self", "ffn"), False, "gelu", False, False),
    (("self", "cross", "ffn"), True, "gelu", True, True), (("self", "cross", "ffn"), False, "relu", True, False)])
def test_opcheck_layer_ops(kinds, pre, act, recompute, masked, dtype, param_dtype):
    """Schema, fake implementation (shapes, dtypes, strides of every output) and autograd registration of
    lsmini::layer, and of lsmini::layer_backward with the state a forward returned; parameters in the
    activations' dtype, or float32 as under autocast (the operators cast them, gradients come back float32),
    or mixed (the gradients of the float32 ones come back on their own, the others in one tensor)."""
    args = _op_args(kinds, pre, act, recompute, dtype, masked, "cross" in kinds, param_dtype)
    # dropout differs between the calls opcheck makes; its comparisons are of metadata and registration
    torch.library.opcheck(layer_op, args, test_utils=("test_schema", "test_faketensor",
                                                      "test_autograd_registration"))
    with torch.no_grad():
        y, state = layer_op(*args)
    x, mask, ek, ev, enc_mask, params = args[:6]
    # float32 parameters: the GEMM weights' copies at the end of the state (in the activations' dtype: none)
    o = compiled._options(*args[6:])
    cast_numel = cast_plan(params, dtype)[1][-1]
    assert (cast_numel > 0) == (param_dtype == torch.float32)
    nbytes = compiled._plan_of(o, x, mask, ek, enc_mask)[2]
    assert state.numel() == state_tail(o, nbytes, cast_numel, dtype)[2]
    bwd_args = (torch.randn_like(y), state, x.detach(), mask, None if ek is None else ek.detach(),
                None if ev is None else ev.detach(), enc_mask, [p.detach() for p in params], *args[6:])
    torch.library.opcheck(layer_backward_op, bwd_args)
    # every gradient where grad_plan puts it: the one tensor's slices and the rest, against what autograd
    # hands on (the views the registered backward makes) from the same forward
    y, state = layer_op(*args)
    grad = torch.randn_like(y)
    expected = torch.autograd.grad(y, params, grad)
    with torch.no_grad():
        _, grads, others, _ = layer_backward_op(grad, state, *bwd_args[2:])
    offsets, numel = grad_plan(params)
    assert grads.shape == (numel,) and grads.dtype == params[0].dtype
    assert len(others) == sum(at < 0 for at in offsets) == (2 * len(kinds) if param_dtype == "mixed" else 0)
    others = iter(others)
    for p, at, e in zip(params, offsets, expected):
        got = next(others) if at < 0 else grads[at:at + p.numel()].view(p.shape)
        assert got.dtype == p.dtype and torch.equal(got, e)


@pytest.mark.cuda
def test_layer_op_errors_name_the_problem():
    """The operators' C++ kernels ask compiled.cpp_plan for a call's layout: a planner that fails, or none,
    is a RuntimeError naming it (and nothing is cached from it); a state that is not the forward's is one
    naming the state."""
    from lsmini import _backend
    args = _op_args(("self", "ffn"), True, "relu", True, torch.float16, True, False)
    x = args[0][:, :3].contiguous()  # a shape no other test plans, so no cached plan answers it
    args = (x, args[1][:, :3].contiguous(), *args[2:])

    def broken(*_):
        raise ValueError("planner broke")

    try:
        _backend.ext().set_layer_planner(broken)
        with pytest.raises(RuntimeError, match="lsmini::layer: the layer planner failed: .*planner broke"):
            layer_op(*args)
        _backend.ext().set_layer_planner(None)
        with pytest.raises(RuntimeError, match="no layer planner"):
            layer_op(*args)
    finally:
        _backend.ext().set_layer_planner(compiled.cpp_plan)
    with torch.no_grad():
        y, state = layer_op(*args)
    bwd = (torch.randn_like(y), state, x.detach(), *args[1:5], [p.detach() for p in args[5]], *args[6:])
    with pytest.raises(RuntimeError, match="lsmini::layer_backward: state must be the contiguous uint8"):
        layer_backward_op(bwd[0], state[:-1], *bwd[2:])


def _graph_calls(layers, graphs, steps, keep=None):
    """steps steps of the operators (no autograd) for each layer in `layers` (their kinds; inputs and
    parameters from _op_args): forward through them in order, backward in reverse, from seed 1, with layer
    graphs on or off. Returns per step, per layer, clones of (y, grad_x, the gradients..., dK/dV...); the
    change in (captures, replays, blocked); and the first layer's tensors that `keep` names, held across the
    steps: "outputs" (its forward's y and state, and its backward's outputs) or "gradients" (its backward's)."""
    calls = []
    for kinds in layers:
        args = _op_args(kinds, True, "gelu", False, torch.float16, True, "cross" in kinds)
        calls.append(tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args[:5]) + (
            [p.detach() for p in args[5]],) + args[6:])
    grad = torch.randn_like(calls[0][0])
    before, counts = set_layer_graphs(graphs), layer_graph_counts()
    try:
        torch.manual_seed(1)
        results, kept = [], []
        with torch.no_grad():
            for _ in range(steps):
                forwards = [layer_op(*call) for call in calls]
                step = [None] * len(calls)
                for i in reversed(range(len(calls))):
                    y, state = forwards[i]
                    grad_x, grads, others, kv = layer_backward_op(grad, state, *calls[i])
                    step[i] = [t.clone() for t in (y, grad_x, grads, *others, *kv)]
                    if i == 0 and keep == "outputs":
                        kept.append((y, grad_x, grads, *others, *kv, state))
                    if i == 0 and keep == "gradients":
                        kept.append((grad_x, grads, *others, *kv))
                results.append(step)
                del forwards, y, state, grad_x, grads, others, kv
    finally:
        set_layer_graphs(before)
    after = layer_graph_counts()
    return results, tuple(a - b for a, b in zip(after, counts)), kept


def test_layer_graph_switch_and_counts():
    """The switch returns the previous setting; without the CUDA extension there is nothing to switch (always
    False) and nothing counted."""
    from lsmini import _backend
    built = _backend.ext_or_none() is not None
    before = set_layer_graphs(False)
    try:
        assert before is built and set_layer_graphs(True) is False and set_layer_graphs(True) is built
    finally:
        set_layer_graphs(before)
    counts = layer_graph_counts()
    assert len(counts) == 3 and all(isinstance(c, int) and c >= 0 for c in counts)
    if not built:
        assert counts == (0, 0, 0)


def _assert_same_steps(steps, expected):
    for s, (step, twin) in enumerate(zip(steps, expected)):
        for i, (outputs, twins) in enumerate(zip(step, twin)):
            for j, (a, b) in enumerate(zip(outputs, twins)):
                assert torch.equal(a, b), f"step {s}, layer {i}, output {j}"


@pytest.mark.cuda
@pytest.mark.parametrize("kinds", [("self", "ffn"), ("self", "cross", "ffn")])
def test_layer_graphs_replay_what_eager_computes(kinds):
    """Once a call site repeats its plan the operators capture a CUDA graph and replay it. Forward: call 1
    eager, call 2 captures and replays, calls 3-6 replay. Backward reads the state in place, so its graph
    is kept for one state: it sees the forward graph's from call 2 on, and captures at call 3. Outputs
    released between calls, as in a training loop. Every call equals the same call with graphs off, bit for
    bit (same seed: the replays draw the dropout masks the eager calls draw)."""
    eager, eager_counts, _ = _graph_calls([kinds], False, 6)
    graphed, counts, _ = _graph_calls([kinds], True, 6)
    assert eager_counts == (0, 0, 0) and counts == (2, 9, 0)
    _assert_same_steps(graphed, eager)


@pytest.mark.cuda
def test_layer_graphs_after_other_parameters_are_gone():
    """The graphs of a stream share one memory pool. Once every graph in it is gone (their parameters freed,
    their sites dropped by the next capture), the allocator releases the pool, and the next capture must take a
    new one: a second model's sites capture and replay as the first's did, and the CUDA calls after them run."""
    for _ in range(2):  # each run's parameters are new; the second run's capture drops the first's sites
        _, counts, _ = _graph_calls([("self", "ffn")], True, 6)
        assert counts == (2, 9, 0)
    torch.cuda.synchronize()
    assert torch.ones(4, device="cuda").sum().item() == 4


@pytest.mark.cuda
def test_layer_graphs_off_drops_them():
    """Turning layer graphs off drops every graph: the memory of their outputs, temporaries and input copies goes
    back to the allocator, and once on again a site captures anew."""
    def cycle():
        _, counts, _ = _graph_calls([("self", "ffn")], True, 6)
        assert counts == (2, 9, 0)
        held = torch.cuda.memory_allocated()
        set_layer_graphs(False)
        set_layer_graphs(True)
        return held, torch.cuda.memory_allocated()

    cycle()  # what a first capture sets up for good (the capture stream's cuBLAS workspaces)
    base = torch.cuda.memory_allocated()
    held, after = cycle()
    assert after <= base < held, (base, held, after)


@pytest.mark.cuda
def test_layer_graphs_leave_held_outputs_alone():
    """A replay overwrites its site's outputs, so while they are held (here: every call's outputs, kept to
    the end) the site runs eagerly. Forward: call 2 captures and replays, calls 3 and 4, with call 2's
    outputs held, run eagerly (blocked); backward never gets the same state twice. Nothing kept changes
    afterwards, and each call equals its graphs-off twin."""
    eager, _, _ = _graph_calls([("self", "ffn")], False, 4)
    graphed, counts, kept = _graph_calls([("self", "ffn")], True, 4, keep="outputs")
    assert counts == (1, 1, 2)
    _assert_same_steps(graphed, eager)
    for s, outputs in enumerate(kept):
        for j, (held, first) in enumerate(zip(outputs, graphed[s][0])):
            assert torch.equal(held, first), f"step {s}, output {j}"


@pytest.mark.cuda
def test_layer_graphs_leave_other_graphs_held_outputs_alone():
    """The bytes a capture allocates and frees again (its temporaries) are free for the graphs captured after
    it, outputs included, and each replay writes them again. Two layers (a decoder layer, then an encoder
    layer; backward in reverse: the encoder layer's backward graph is captured before the decoder layer's),
    every step's decoder-layer gradients kept to the end, as gradient accumulation keeps param.grad: a graph
    whose temporaries hold kept outputs must not replay. Nothing kept changes afterwards, every step equals
    its graphs-off twin, and the graphs whose temporaries hold nothing kept go on replaying."""
    layers = [("self", "cross", "ffn"), ("self", "ffn")]
    eager, _, _ = _graph_calls(layers, False, 6)
    graphed, counts, kept = _graph_calls(layers, True, 6, keep="gradients")
    assert counts[0] >= 2 and counts[2] >= 3  # at least the decoder layer's backward, its outputs kept: blocked
    _assert_same_steps(graphed, eager)
    for s, outputs in enumerate(kept):
        for j, (held, first) in enumerate(zip(outputs, graphed[s][0][1:])):
            assert torch.equal(held, first), f"step {s}, output {j}"


@pytest.mark.cuda
def test_checkpoint_around_a_layer_keeps_gradients():
    """torch.utils.checkpoint (non-reentrant) around lsmini layers: the recomputed forward draws the same
    dropout masks (checkpoint restores the RNG state), so the gradients equal those without it."""
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(_config(dropout=0.1, heads=2)).cuda().half()
    x0 = torch.randn(3, 7, 32, device="cuda", dtype=torch.float16)
    grad = torch.randn_like(x0)
    results = []
    for use_checkpoint in (False, True):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        torch.manual_seed(5)
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
        out.backward(grad)
        results.append((out.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]))
    (o1, g1, p1), (o2, g2, p2) = results
    assert torch.equal(o1, o2) and torch.equal(g1, g2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))


@pytest.mark.cuda
def test_graph_step_with_host_checks_left_on():
    """CUDAGraphStep around a step whose embedding and criterion keep check_tokens / check_targets on (their
    defaults): the checks skip themselves while the step is captured, so capture succeeds, and the replays
    train (the loss goes down on a fixed batch)."""
    from lsmini.graph import CUDAGraphStep
    from lsmini.models import Transformer
    from lsmini.optim import FusedAdam, LossScaler

    torch.manual_seed(0)
    model = Transformer(50, 50, _config(dropout=0.1, heads=2), 1, 1).cuda().half()
    crit = CrossEntropyLoss(0.1, ignore_index=0)
    assert crit.check_targets and all(m.check_tokens for m in model.modules() if hasattr(m, "check_tokens"))
    opt = FusedAdam(model, lr=1e-3)
    scaler = LossScaler()
    src = torch.randint(1, 50, (4, 9), device="cuda")
    tgt = torch.randint(1, 50, (4, 9), device="cuda")

    graph_step = CUDAGraphStep(amp_train_step(model, crit, opt, scaler), optimizers=[opt], warmup=2)
    losses = [graph_step(src, torch.roll(tgt, 1, 1), tgt).item() for _ in range(8)]
    assert graph_step.graph is not None
    assert losses[-1] < losses[0]
