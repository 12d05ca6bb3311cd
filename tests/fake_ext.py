"""A CPU stand-in for the CUDA extension ``lsmini._C``, and the ``fake_kernels`` fixture that installs it.

``FakeExt`` implements in plain PyTorch the bindings of csrc/bindings/*.cpp that the CPU tests drive —
layernorm, bias_dropout_residual, bias_act_dropout (incl. from_output), split/merge heads,
attention_softmax, embedding and philox_seed_offset — with the bindings' contracts: argument names and
order, their checks (the same exception types, messages naming the op and the argument), fp32 math
rounded once to the output dtype, the optional output arguments (checked, written, returned), the
returned tuples (None where a binding returns no tensor) and their aliasing: bias_dropout_residual_bwd
hands back grad_out itself when p == 0, attention_softmax_fwd returns one tensor twice when p == 0,
attention_softmax_bwd with inplace=True writes into grad_probs and returns it. The kernels' size limits
are not modelled (the Python ops check those themselves).

Dropout masks are regenerated from the call's ``rng`` with util's Philox oracle, over the flat element
index as the kernels do, in either form the bindings take: eager ``(seed, offset, 0, 0)``, or captured
``(0, offset within the graph, seed_ptr, offset_ptr)`` with the pointers resolved in the fake's own
"device words" (``captured = True`` makes ``philox_seed_offset`` hand out that form, as torch's generator
does while a CUDA graph is captured). Beyond the bindings, a dropout call with p == 0 must get
``_backend.NO_RNG``: lsmini's convention that such calls draw nothing.

Every binding call is logged in ``calls`` as ``(name, {argument: value})``, rng included.
"""
import functools
import inspect

import pytest
import torch
import torch.nn.functional as F

from lsmini import _backend
from util import philox_keep_mask

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
_UINT64 = (1 << 64) - 1


def _check(ok, op, message, error=RuntimeError):
    """A binding's argument check: TORCH_CHECK raises RuntimeError, TORCH_CHECK_VALUE ValueError and
    TORCH_CHECK_TYPE TypeError, each message starting with the op's name."""
    if not ok:
        raise error(f"{op}: {message}")


def _check_float(t, op, name):
    _check(t.dtype in FLOAT_DTYPES, op, f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_like(t, like, op, name, like_name):
    """t on like's device, with like's dtype and shape."""
    _check(t.device == like.device, op, f"{name} is on {t.device} but {like_name} is on {like.device}")
    _check(t.dtype == like.dtype, op, f"{name} must be {like.dtype}, got {t.dtype}")
    _check(t.shape == like.shape, op, f"{name} must have shape {list(like.shape)}, got {list(t.shape)}")


def _check_2d(t, op, name):
    _check(t.dim() == 2, op, f"{name} must be 2-D [rows, hidden], got shape {list(t.shape)}", ValueError)


def _check_p(p, op, error=ValueError):
    _check(0.0 <= p <= 1.0, op, f"p must be in [0, 1], got {p}", error)


def _check_bias(bias, x, op):
    """bias: [hidden] on x's device, in x's dtype or float32 (common.h's check_column_bias)."""
    _check(bias.device == x.device, op, f"bias is on {bias.device} but x is on {x.device}")
    _check(bias.shape == (x.shape[-1],), op, f"bias must have shape [{x.shape[-1]}], got {list(bias.shape)}")
    _check(bias.dtype in (x.dtype, torch.float32), op,
           f"bias must be {x.dtype} (x's dtype) or float32, got {bias.dtype}", TypeError)


def _overlap(written, read):
    """"none", "full" (exactly the same elements) or "partial", as at::get_overlap_status tells them."""
    if (written.numel() == 0 or read.numel() == 0
            or written.untyped_storage().data_ptr() != read.untyped_storage().data_ptr()):
        return "none"
    if written.data_ptr() == read.data_ptr() and written.shape == read.shape and written.stride() == read.stride():
        return "full"

    def byte_span(t):
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (w0, w1), (r0, r1) = byte_span(written), byte_span(read)
    return "partial" if w0 < r1 and r0 < w1 else "none"


def _written(out, values, like, op, name, reads=(), same_ok=False):
    """A binding's optional output argument: values (fp32) rounded to like's dtype, into out when given
    (checked as common.h's check_written / check_overlap), else into a fresh tensor."""
    if out is None:
        return values.to(like.dtype)
    _check_like(out, like, op, name, "x")
    _check(out.is_contiguous(), op, f"{name} must be contiguous, got strides {list(out.stride())}")
    for read, read_name in reads:
        status = _overlap(out, read)
        _check(status == "none" or (same_ok and status == "full"), op,
               f"{name} {'partially overlaps' if same_ok else 'overlaps'} {read_name}")
    return out.copy_(values)


def _fresh(t):
    """A new contiguous tensor holding t, as the bindings' outputs always are (never a view of an input)."""
    return t.clone(memory_format=torch.contiguous_format)


def _keep_scale(p):
    """What a kept element is multiplied by: 1/(1 − p), 0 for p = 1 (every element dropped)."""
    return 1.0 / (1.0 - p) if p < 1 else 0.0


def _column_sums(values, dtype):
    """Column sums of a [rows, n] fp32 tensor, exact (float64) and rounded once to dtype."""
    return values.double().sum(0).to(dtype)


def _activation(v, act):
    if act == "relu":
        return torch.relu(v)
    return F.gelu(v, approximate="tanh" if act == "gelu_tanh" else "none")


def _activation_grad(v, act, grad):
    """grad · act'(v) through torch's autograd (relu: threshold_backward, so a NaN v passes grad)."""
    v = v.detach().requires_grad_(True)
    with torch.enable_grad():
        (out,) = torch.autograd.grad(_activation(v, act), v, grad)
    return out


def _parse_act(act, op):
    """The bindings take an activation by name or by id (0 relu, 1 gelu, 2 gelu_tanh)."""
    if isinstance(act, str):
        _check(act in ACTIVATIONS, op, f"unknown activation '{act}', expected one of 'relu', 'gelu', 'gelu_tanh'",
               ValueError)
        return act
    _check(isinstance(act, int) and not isinstance(act, bool), op,
           f"act must be a str ('relu', 'gelu', 'gelu_tanh') or an int id, got {type(act).__name__}", TypeError)
    _check(0 <= act < len(ACTIVATIONS), op, f"unknown activation id {act}, expected 0 (relu), 1 (gelu) or 2 "
           "(gelu_tanh)", ValueError)
    return ACTIVATIONS[act]


def _masked_softmax(scores, key_padding_mask, causal):
    """fp32 softmax over the keys with padded keys and (bottom-right aligned) future keys masked; a row
    whose every key is masked gives zeros."""
    batch, _, q_len, k_len = scores.shape
    masked = torch.zeros(batch, 1, q_len, k_len, dtype=torch.bool, device=scores.device)
    if key_padding_mask is not None:
        masked |= key_padding_mask.view(batch, 1, 1, k_len)
    if causal:
        masked |= ~torch.ones(q_len, k_len, dtype=torch.bool, device=scores.device).tril(diagonal=k_len - q_len)
    dead = masked.all(-1, keepdim=True)
    x = scores.float().masked_fill(masked, float("-inf")).masked_fill(dead, 0.0)  # a dead row: no 0/0
    return torch.softmax(x, -1).masked_fill(dead, 0.0)


def _binding(method):
    """Logs every call as (name, {argument: value}); arguments bind as the binding's keywords do."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def logged(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        self.calls.append((method.__name__, arguments))
        return method(self, *args, **kwargs)

    return logged


class FakeExt:
    """The bindings lsmini's Python calls, in plain PyTorch on CPU (see the module docstring)."""

    # Where the captured form's seed and base offset "live" (torch's generator words on a real device).
    SEED_WORD, OFFSET_WORD = 0x7F0000001000, 0x7F0000001008

    def __init__(self, seed=1234):
        self.seed = seed
        self.offset = 0  # the generator's offset: the next eager draw gets it, then it advances by 4
        self.captured = False  # philox_seed_offset hands out the captured form (as during a graph capture)
        self.offset_in_graph = 0
        self.drawn = []  # every rng philox_seed_offset handed out, in order
        self.calls = []  # (binding name, {argument: value}) of every binding call, in order

    # ---- dropout rng -------------------------------------------------------------------------------
    def philox_seed_offset(self, device_index=-1):
        """(seed, offset, 0, 0) eager; captured: (0, offset within the graph, seed_ptr, offset_ptr) with
        the pointers at the fake's words, which hold the generator's seed and offset when read."""
        if self.captured:
            rng = (0, self.offset_in_graph, self.SEED_WORD, self.OFFSET_WORD)
            self.offset_in_graph += 4
        else:
            rng = (self.seed, self.offset, 0, 0)
            self.offset += 4
        self.drawn.append(rng)
        return rng

    def _check_rng(self, rng, op):
        """common.h's philox_args: both pointers set or neither."""
        _check(isinstance(rng, tuple) and len(rng) == 4 and all(isinstance(v, int) for v in rng), op,
               f"rng must be a tuple of 4 ints (seed, offset, seed_ptr, offset_ptr), got {rng!r}", TypeError)
        _, _, seed_ptr, offset_ptr = rng
        _check((seed_ptr == 0) == (offset_ptr == 0), op,
               "rng must be (seed, offset, 0, 0) or (0, offset, seed_ptr, offset_ptr) with both pointers set, "
               f"got seed_ptr = {seed_ptr} and offset_ptr = {offset_ptr}")

    def _resolve(self, rng, op):
        """common.cuh's resolve_philox: eager values as given; captured, the seed and the base offset read
        from the words the pointers address, plus the call's offset within the graph."""
        seed, offset, seed_ptr, offset_ptr = rng
        if seed_ptr == 0:
            return seed, offset
        words = {self.SEED_WORD: self.seed, self.OFFSET_WORD: self.offset}
        _check(seed_ptr in words and offset_ptr in words, op, f"rng points at no word of this device: {rng!r}")
        return words[seed_ptr] & _UINT64, (words[offset_ptr] + offset) & _UINT64

    def _dropout(self, values, p, rng, op):
        """values (fp32) with one call's dropout: element i (flat index) kept by the Philox oracle and
        scaled by 1/(1 − p), else zero."""
        if p == 0:
            assert rng == _backend.NO_RNG, f"{op}: a call with p == 0 got rng {rng!r}, not NO_RNG"
            return values
        seed, offset = self._resolve(rng, op)
        keep = philox_keep_mask(values.numel(), p, seed, offset).view(values.shape)
        return torch.where(keep, values * _keep_scale(p), torch.zeros((), dtype=values.dtype))

    # ---- layernorm ---------------------------------------------------------------------------------
    @staticmethod
    def _layernorm_params(x, weight, bias, op):
        """The parameters' dtype: float32 or x's, the same for both (x's when there are none)."""
        dtype = None
        for t, name in ((weight, "weight"), (bias, "bias")):
            if t is None:
                continue
            _check(t.device == x.device, op, f"{name} is on {t.device} but x is on {x.device}")
            _check(t.shape == (x.shape[1],), op, f"{name} must have shape [{x.shape[1]}], got {list(t.shape)}")
            _check(t.dtype in (torch.float32, x.dtype), op,
                   f"{name} must be float32 or the dtype of x ({x.dtype}), got {t.dtype}")
            _check(dtype is None or t.dtype == dtype, op,
                   f"weight and bias must have the same dtype, got {dtype} and {t.dtype}")
            dtype = t.dtype
        return x.dtype if dtype is None else dtype

    @staticmethod
    def _check_rows(x, op, name):
        _check_float(x, op, name)
        _check(x.dim() == 2, op, f"{name} must be 2-D [rows, hidden], got {x.dim()} dims")

    @_binding
    def layernorm_fwd(self, x, weight, bias, eps, out=None):
        """(y, mean, rstd): mean and rstd float32 [rows]; y into out when given."""
        op = "layernorm_fwd"
        self._check_rows(x, op, "x")
        _check(eps >= 0, op, f"eps must be >= 0, got {eps}")
        self._layernorm_params(x, weight, bias, op)
        xf = x.float()
        mean = xf.mean(1)
        rstd = (xf.var(1, unbiased=False) + eps).rsqrt()
        y = (xf - mean[:, None]) * rstd[:, None]
        if weight is not None:
            y = y * weight.float()
        if bias is not None:
            y = y + bias.float()
        return [_written(out, y, x, op, "out", reads=[(x, "x")]), mean, rstd]

    @_binding
    def layernorm_bwd(self, dy, x, weight, bias, mean, rstd, add=None, out=None):
        """(dx, dweight or None, dbias or None); with add, dx = input gradient + add, rounded once; dx into
        out when given, which may be add itself."""
        op = "layernorm_bwd"
        self._check_rows(x, op, "x")
        _check_like(dy, x, op, "dy", "x")
        for t, name in ((mean, "mean"), (rstd, "rstd")):
            _check(t.dtype == torch.float32, op, f"{name} must be float32, got {t.dtype}")
            _check(t.shape == (x.shape[0],), op, f"{name} must have shape [{x.shape[0]}], got {list(t.shape)}")
        param_dtype = self._layernorm_params(x, weight, bias, op)
        if add is not None:
            _check_like(add, x, op, "add", "x")
        xhat = (x.float() - mean[:, None]) * rstd[:, None]
        g = dy.float() if weight is None else dy.float() * weight.float()
        dx = rstd[:, None] * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))
        if add is not None:
            dx = dx + add.float()
        reads = [(dy, "dy"), (x, "x")]
        if out is not None and add is not None and _overlap(out, add) != "full":
            reads.append((add, "add"))
        dx = _written(out, dx, x, op, "out", reads=reads)
        dweight = None if weight is None else _column_sums(dy.float() * xhat, param_dtype)
        dbias = None if bias is None else _column_sums(dy.float(), param_dtype)
        return [dx, dweight, dbias]

    # ---- bias_dropout_residual ---------------------------------------------------------------------
    @_binding
    def bias_dropout_residual_fwd(self, x, bias, residual, p, rng):
        """out = residual + dropout(x + bias)."""
        op = "bias_dropout_residual_fwd"
        _check_2d(x, op, "x")
        _check_float(x, op, "x")
        _check_like(residual, x, op, "residual", "x")
        if bias is not None:
            _check_bias(bias, x, op)
        _check_p(p, op)
        self._check_rng(rng, op)
        y = x.float() if bias is None else x.float() + bias.float()
        return (residual.float() + self._dropout(y, p, rng, op)).to(x.dtype)

    @_binding
    def bias_dropout_residual_bwd(self, grad_out, p, rng, has_bias, bias_dtype=None, grad_x=None):
        """(grad_x, grad_bias or None). p == 0: grad_x IS grad_out (made contiguous), grad_x untouched;
        p > 0: the dropped gradient, into grad_x when given. grad_bias in bias_dtype (grad_out's dtype
        when None)."""
        op = "bias_dropout_residual_bwd"
        _check_2d(grad_out, op, "grad_out")
        _check_float(grad_out, op, "grad_out")
        _check_p(p, op)
        self._check_rng(rng, op)
        bias_dtype = grad_out.dtype if bias_dtype is None else bias_dtype
        _check(bias_dtype in (grad_out.dtype, torch.float32), op,
               f"bias_dtype must be {grad_out.dtype} (grad_out's dtype) or float32, got {bias_dtype}", TypeError)
        g = grad_out.contiguous()
        if p > 0:
            dropped = self._dropout(g.float(), p, rng, op)
            g = _written(grad_x, dropped, g, op, "grad_x", reads=[(g, "grad_out")])
        else:
            self._dropout(g, p, rng, op)  # checks the rng of a call without dropout
            dropped = g.float()
        return g, (_column_sums(dropped, bias_dtype) if has_bias else None)

    # ---- bias_act_dropout --------------------------------------------------------------------------
    @_binding
    def bias_act_dropout_fwd(self, x, bias, act, p, rng, out=None):
        """out = dropout(act(x + bias)), into out when given (which may be x itself)."""
        op = "bias_act_dropout_fwd"
        _check_2d(x, op, "x")
        _check_float(x, op, "x")
        if bias is not None:
            _check_bias(bias, x, op)
        act = _parse_act(act, op)
        _check_p(p, op)
        self._check_rng(rng, op)
        y = x.float() if bias is None else x.float() + bias.float()
        return _written(out, self._dropout(_activation(y, act), p, rng, op), x, op, "out", reads=[(x, "x")],
                        same_ok=True)

    @_binding
    def bias_act_dropout_bwd(self, grad_out, x, bias, act, p, rng, grad_x=None, from_output=False):
        """(grad_x, grad_bias or None): act'(x + bias) times the dropped gradient; with from_output (relu
        only) x is the forward's output, > 0 exactly where the gradient passes (scaled by 1/(1 − p)),
        and neither bias's values nor rng are read. grad_x into grad_x when given (which may be grad_out
        or x itself); grad_bias in bias's dtype."""
        op = "bias_act_dropout_bwd"
        _check_2d(grad_out, op, "grad_out")
        _check_float(grad_out, op, "grad_out")
        _check_like(x, grad_out, op, "x", "grad_out")
        if bias is not None:
            _check_bias(bias, x, op)
        act = _parse_act(act, op)
        _check(not from_output or act == "relu", op,
               f"from_output=True needs act 'relu' (its derivative is readable from the output), got '{act}'",
               ValueError)
        _check_p(p, op)
        self._check_rng(rng, op)
        g = grad_out.float()
        if from_output:
            values = torch.where(x.float() <= 0, 0.0, g * _keep_scale(p))  # NaN passes, as relu's derivative
        else:
            y = x.float() if bias is None else x.float() + bias.float()
            values = _activation_grad(y, act, self._dropout(g, p, rng, op))
        grad_bias = None if bias is None else _column_sums(values, bias.dtype)
        out = _written(grad_x, values, grad_out, op, "grad_x", reads=[(grad_out, "grad_out"), (x, "x")],
                       same_ok=True)
        return out, grad_bias

    # ---- split / merge heads -----------------------------------------------------------------------
    @_binding
    def split_heads_fwd(self, x, bias, num_heads, parts):
        """x [batch, len, parts·hidden] (+ bias) → [parts, batch, num_heads, len, head_dim]."""
        op = "split_heads_fwd"
        _check_float(x, op, "x")
        _check(x.dim() == 3, op, f"x must be 3-D [batch, len, parts·hidden], got shape {list(x.shape)}")
        _check(num_heads >= 1, op, f"num_heads must be >= 1, got {num_heads}")
        _check(parts >= 1, op, f"parts must be >= 1, got {parts}")
        batch, length, width = x.shape
        _check(width % (parts * num_heads) == 0, op, f"the last dimension of x ({width}) must be divisible by "
               f"parts·num_heads = {parts}·{num_heads} = {parts * num_heads}")
        y = x
        if bias is not None:
            _check(bias.device == x.device, op, f"bias is on {bias.device} but x is on {x.device}")
            _check(bias.dtype in (torch.float32, x.dtype), op,
                   f"bias must be float32 or x's dtype ({x.dtype}), got {bias.dtype}")
            _check(bias.shape == (width,), op, f"bias must have shape [{width}], got {list(bias.shape)}")
            y = (x.float() + bias.float()).to(x.dtype)
        head_dim = width // (parts * num_heads)
        return _fresh(y.reshape(batch, length, parts, num_heads, head_dim).permute(2, 0, 3, 1, 4))

    @_binding
    def split_heads_bwd(self, grad, has_bias, bias_fp32=False):
        """grad [parts, batch, num_heads, len, head_dim] → (grad_x [batch, len, parts·hidden], grad_bias or
        None): grad_bias float32 when bias_fp32, else grad's dtype."""
        op = "split_heads_bwd"
        _check_float(grad, op, "grad")
        _check(grad.dim() == 5, op,
               f"grad must be 5-D [parts, batch, num_heads, len, head_dim], got shape {list(grad.shape)}")
        parts, batch, num_heads, length, head_dim = grad.shape
        grad_x = _fresh(grad.permute(1, 3, 0, 2, 4)).view(batch, length, parts * num_heads * head_dim)
        grad_bias = None
        if has_bias:
            grad_bias = _column_sums(grad_x.reshape(batch * length, -1).float(),
                                     torch.float32 if bias_fp32 else grad.dtype)
        return grad_x, grad_bias

    @_binding
    def merge_heads_fwd(self, x):
        """x [batch, num_heads, len, head_dim] → [batch, len, num_heads·head_dim]."""
        op = "merge_heads_fwd"
        _check_float(x, op, "x")
        _check(x.dim() == 4, op, f"x must be 4-D [batch, num_heads, len, head_dim], got shape {list(x.shape)}")
        batch, num_heads, length, head_dim = x.shape
        return _fresh(x.transpose(1, 2)).view(batch, length, num_heads * head_dim)

    @_binding
    def merge_heads_bwd(self, grad, num_heads):
        """grad [batch, len, num_heads·head_dim] → [batch, num_heads, len, head_dim]."""
        op = "merge_heads_bwd"
        _check_float(grad, op, "grad")
        _check(grad.dim() == 3, op,
               f"grad must be 3-D [batch, len, num_heads·head_dim], got shape {list(grad.shape)}")
        _check(num_heads >= 1, op, f"num_heads must be >= 1, got {num_heads}")
        batch, length, width = grad.shape
        _check(width % num_heads == 0, op,
               f"the last dimension of grad ({width}) must be divisible by num_heads ({num_heads})")
        return _fresh(grad.reshape(batch, length, num_heads, width // num_heads).transpose(1, 2))

    # ---- attention_softmax -------------------------------------------------------------------------
    @staticmethod
    def _check_scores(t, op, name):
        _check_float(t, op, name)
        _check(t.dim() == 4, op, f"{name} must be 4-D [batch, heads, q_len, k_len], got shape {list(t.shape)}")

    @_binding
    def attention_softmax_fwd(self, scores, key_padding_mask, causal, p, rng):
        """(probs, softmax): the dropped probabilities and the pre-dropout softmax; the same tensor twice
        when p == 0."""
        op = "attention_softmax_fwd"
        self._check_scores(scores, op, "scores")
        _check_p(p, op, RuntimeError)
        self._check_rng(rng, op)
        batch, _, _, k_len = scores.shape
        if key_padding_mask is not None:
            mask = key_padding_mask
            _check(mask.device == scores.device, op, f"key_padding_mask is on {mask.device} but scores is on "
                   f"{scores.device}")
            _check(mask.dtype == torch.bool, op, f"key_padding_mask must be torch.bool, got {mask.dtype}")
            _check(mask.shape == (batch, k_len), op,
                   f"key_padding_mask must have shape {[batch, k_len]}, got {list(mask.shape)}")
        y = _masked_softmax(scores, key_padding_mask, causal)
        softmax = y.to(scores.dtype)
        if p == 0:
            self._dropout(y, p, rng, op)  # checks the rng of a call without dropout
            return softmax, softmax
        return self._dropout(y, p, rng, op).to(scores.dtype), softmax

    @_binding
    def attention_softmax_bwd(self, grad_probs, softmax, p, rng, inplace=False):
        """grad_scores = y · (g − Σ y·g) with g the dropped grad_probs; inplace: written into grad_probs
        (which must be contiguous), and grad_probs returned."""
        op = "attention_softmax_bwd"
        self._check_scores(softmax, op, "softmax")
        _check_like(grad_probs, softmax, op, "grad_probs", "softmax")
        _check_p(p, op, RuntimeError)
        self._check_rng(rng, op)
        _check(not inplace or grad_probs.is_contiguous(), op, "inplace=True writes into grad_probs, which must "
               f"then be contiguous, got strides {list(grad_probs.stride())}")
        g = self._dropout(grad_probs.float(), p, rng, op)
        y = softmax.float()
        grad_scores = y * (g - (y * g).sum(-1, keepdim=True))
        if inplace:
            return grad_probs.copy_(grad_scores)
        return grad_scores.to(softmax.dtype)

    # ---- embedding ---------------------------------------------------------------------------------
    @staticmethod
    def _check_tokens(tokens, op):
        _check(tokens.dtype in (torch.int64, torch.int32), op, f"tokens must be int64 or int32, got {tokens.dtype}")
        _check(tokens.dim() == 2, op, f"tokens must be 2-D [batch, len], got shape {list(tokens.shape)}")

    @staticmethod
    def _check_embedding_params(op, vocab, padding_idx, dropout_p, step, length, max_positions):
        _check(-1 <= padding_idx < vocab, op, f"padding_idx must be -1 (none) or in [0, {vocab}), got {padding_idx}")
        _check(0.0 <= dropout_p <= 1.0, op, f"dropout_p must be in [0, 1], got {dropout_p}")
        _check(step >= 0, op, f"step must be >= 0, got {step}")
        _check(step + length <= max_positions, op, f"step + len = {step} + {length} = {step + length} exceeds "
               f"max_positions = {max_positions} (rows of pos_table)")

    @staticmethod
    def _counted(tokens, vocab, padding_idx):
        """Tokens that get an embedding (and a gradient): in [0, vocab) and not the padding token."""
        return (tokens >= 0) & (tokens < vocab) & (tokens != padding_idx)

    @_binding
    def embedding_fwd(self, tokens, weight, pos_table, scale, padding_idx, step, dropout_p, rng):
        """out [batch, len, hidden] = dropout(scale · weight[tokens] + pos_table[step + j]); zero rows for
        padding and out-of-range tokens."""
        op = "embedding_fwd"
        self._check_tokens(tokens, op)
        _check_float(weight, op, "weight")
        _check(weight.dim() == 2, op, f"weight must be 2-D [vocab, hidden], got shape {list(weight.shape)}")
        _check(pos_table.dtype == weight.dtype, op, f"pos_table must be {weight.dtype}, got {pos_table.dtype}")
        _check(pos_table.dim() == 2 and pos_table.shape[1] == weight.shape[1], op,
               f"pos_table must have shape [max_positions, {weight.shape[1]}], got {list(pos_table.shape)}")
        _check(tokens.device == weight.device, op, f"tokens is on {tokens.device} but weight is on {weight.device}")
        _check(pos_table.device == weight.device, op,
               f"pos_table is on {pos_table.device} but weight is on {weight.device}")
        vocab, length = weight.shape[0], tokens.shape[1]
        self._check_embedding_params(op, vocab, padding_idx, dropout_p, step, length, pos_table.shape[0])
        self._check_rng(rng, op)
        counted = self._counted(tokens, vocab, padding_idx)
        rows = weight.float()[tokens.long().clamp(0, max(vocab - 1, 0))] * scale
        rows = torch.where(counted[..., None], rows + pos_table[step:step + length].float(), 0.0)
        return self._dropout(rows, dropout_p, rng, op).to(weight.dtype)

    @_binding
    def embedding_bwd(self, grad_out, tokens, vocab, max_positions, need_weight_grad, need_pos_grad, scale,
                      padding_idx, step, dropout_p, rng):
        """(grad_weight [vocab, hidden] or None, grad_pos [max_positions, hidden] or None): counted tokens
        only, in grad_out's dtype."""
        op = "embedding_bwd"
        self._check_tokens(tokens, op)
        _check_float(grad_out, op, "grad_out")
        _check(grad_out.device == tokens.device, op,
               f"grad_out is on {grad_out.device} but tokens is on {tokens.device}")
        batch, length = tokens.shape
        _check(grad_out.dim() == 3 and grad_out.shape[:2] == (batch, length), op,
               f"grad_out must have shape [{batch}, {length}, hidden], got {list(grad_out.shape)}")
        _check(vocab >= 0, op, f"vocab must be >= 0, got {vocab}")
        self._check_embedding_params(op, vocab, padding_idx, dropout_p, step, length, max_positions)
        self._check_rng(rng, op)
        hidden = grad_out.shape[2]
        counted = self._counted(tokens, vocab, padding_idx)
        g = torch.where(counted[..., None], self._dropout(grad_out.float(), dropout_p, rng, op), 0.0)
        grad_weight = grad_pos = None
        if need_weight_grad:
            sums = torch.zeros(vocab, hidden, dtype=torch.float64)
            ids = tokens.long().clamp(0, max(vocab - 1, 0)).reshape(-1)
            sums.index_add_(0, ids, (g * scale).double().reshape(-1, hidden))
            grad_weight = sums.to(grad_out.dtype)
        if need_pos_grad:
            grad_pos = torch.zeros(max_positions, hidden, dtype=grad_out.dtype)
            grad_pos[step:step + length] = g.double().sum(0).to(grad_out.dtype)
        return grad_weight, grad_pos


@pytest.fixture
def fake_kernels(monkeypatch):
    """Installs a FakeExt for one test and returns it: ``_backend.ext()`` is the fake and
    ``_backend.use_kernels`` says yes for CPU tensors, so the ops and the layers take their kernel path on
    CPU; ``_backend.dropout_rng`` draws from the fake."""
    fake = FakeExt()
    use_kernels = _backend.use_kernels

    def use_kernels_on_cpu(*tensors):
        return all(t is None or t.device.type == "cpu" for t in tensors) or use_kernels(*tensors)

    monkeypatch.setattr(_backend, "ext", lambda: fake)
    monkeypatch.setattr(_backend, "use_kernels", use_kernels_on_cpu)
    return fake
