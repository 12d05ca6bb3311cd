"""What the encoder and decoder share: a base for their layers (config check, self-attention and FFN
parameters, norms, the input checks, the rotary tables, the options of a call, ``recompute``, extra_repr,
reorder_cache) and a base for their stacks (layer count, final norm, reorder_cache)."""
import dataclasses

import torch
from torch import nn

from lsmini.layers.config import TransformerConfig
from lsmini.layers.layernorm import LayerNorm, RMSNorm
from lsmini.layers.params import SelfAttentionParams, reset_ffn
from lsmini.layers.spec import LayerOptions
from lsmini.ops.checks import check_key_padding_mask
from lsmini.ops.rotary import rotary_cos_sin


def make_norm(config, device=None, dtype=None):
    """The config's norm over hidden_size: LayerNorm (without bias when config.bias is False) or RMSNorm."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.hidden_size, eps=config.layer_norm_eps, device=device, dtype=dtype)
    return LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.bias, device=device, dtype=dtype)


def norm_params(norm):
    """(weight, bias) of a LayerNorm or RMSNorm (bias None)."""
    return norm.weight, getattr(norm, "bias", None)


def rotary_tables(config, length, offset, device):
    """The (cos, sin) float32 [length, rotary_dim] tables of positions offset … offset + length − 1, or None
    without rotary."""
    if not config.rotary_dims:
        return None
    return rotary_cos_sin(length, config.rotary_dims, config.rotary, offset=offset, device=device)


def layer_rotary(owner, config, rotary, x, past):
    """The (cos, sin) tables a layer call uses: those given (checked: float32 [len, rotary_dim] or [batch, len,
    rotary_dim] on x's device), else made for positions past … past + len − 1; None without rotary."""
    if rotary is None:
        return rotary_tables(config, x.shape[1], past, x.device)
    if not config.rotary_dims:
        raise ValueError(f"{owner}: rotary tables were given but the config has no rotary (rotary=None)")
    b, l, r = x.shape[0], x.shape[1], config.rotary_dims
    if not (isinstance(rotary, (tuple, list)) and len(rotary) == 2
            and all(isinstance(t, torch.Tensor) for t in rotary)):
        raise TypeError(f"{owner}: rotary must be None or a (cos, sin) pair of tensors")
    for name, t in zip(("cos", "sin"), rotary):
        if tuple(t.shape) not in ((l, r), (b, l, r)) or t.dtype != torch.float32 or t.device != x.device:
            raise ValueError(f"{owner}: rotary {name} must be float32 [len, rotary_dim] = [{l}, {r}] or [batch, len, "
                             f"rotary_dim] = [{b}, {l}, {r}] on {x.device}, got {t.dtype} {tuple(t.shape)} on "
                             f"{t.device}")
    return tuple(rotary)


def check_config(owner, config):
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"{owner}: config must be a TransformerConfig, got {type(config).__name__}")


def check_states(owner, name, x, config, ref_param, past=0):
    """x [batch, len, hidden] floating, on the parameters' device, within the config's limits."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{owner}: {name} must be a floating-point tensor, got {x.dtype}")
    if x.dim() != 3 or x.shape[-1] != config.hidden_size:
        raise ValueError(f"{owner}: {name} must have shape [batch, len, hidden_size={config.hidden_size}], "
                         f"got {tuple(x.shape)}")
    b, l = x.shape[0], x.shape[1]
    if b == 0 or l == 0:
        raise ValueError(f"{owner}: {name} must have batch >= 1 and len >= 1, got shape {tuple(x.shape)}")
    if x.device != ref_param.device:
        raise ValueError(f"{owner}: {name} is on {x.device} but the parameters are on {ref_param.device}")
    if past + l > config.max_seq_len:
        what = f"len {l}" if not past else f"cached {past} + new {l} = {past + l} positions"
        raise ValueError(f"{owner}: {name} has {what} > config.max_seq_len = {config.max_seq_len}")
    if b * l > config.max_batch_tokens:
        raise ValueError(f"{owner}: {name} has batch*len = {b}*{l} = {b * l} tokens > config.max_batch_tokens = "
                         f"{config.max_batch_tokens}")


def check_mask(owner, name, mask, batch, length, device):
    """None, or a bool [batch, length] tensor on device (True = pad)."""
    check_key_padding_mask(owner, mask, batch, length, device, "the input", name=name, dims="batch, len")


def check_cache(owner, cache):
    if cache is not None and not isinstance(cache, dict):
        raise TypeError(f"{owner}: cache must be a dict (start with {{}}) or None, got {type(cache).__name__}")


def check_new_order(owner, new_order):
    if not isinstance(new_order, torch.Tensor) or new_order.dtype not in (torch.int64, torch.int32) \
            or new_order.dim() != 1:
        raise TypeError(f"{owner}: new_order must be a 1-D int64 tensor of batch indices, got "
                        f"{getattr(new_order, 'dtype', type(new_order).__name__)} "
                        f"{tuple(getattr(new_order, 'shape', ()))}")


def reorder(obj, new_order):
    """Index dim 0 (batch) of every tensor in a nested cache of dicts/lists/tuples, in place for dicts."""
    if isinstance(obj, torch.Tensor):
        return obj.index_select(0, new_order.to(obj.device))
    if isinstance(obj, dict):
        for k in list(obj):
            obj[k] = reorder(obj[k], new_order)
        return obj
    if isinstance(obj, list):
        obj[:] = [reorder(v, new_order) for v in obj]
        return obj
    if isinstance(obj, tuple):
        return tuple(reorder(v, new_order) for v in obj)
    return obj


def reorder_cache(owner, cache, new_order):
    """Reorder/select the batch entries of a cache (beam search): new_order [batch'] indices."""
    check_new_order(f"{owner}.reorder_cache", new_order)
    return reorder(cache, new_order)


class TransformerLayerBase(nn.Module):
    """A layer with self-attention (``self_attn``), an FFN (``linear1``, ``linear2``) and one LayerNorm per
    sub-block (``norm1``...); subclasses add their own blocks in between and say which ones they run
    (``KINDS``, in order).

    Its dropout probabilities live where a torch.nn user looks for them, as in torch.nn's layers, and every
    call reads them there: ``dropout1``, ``dropout2``... (nn.Dropout, after each sub-block: the config's
    ``dropout``; the layer applies one probability to all of them, so they must be equal), ``dropout`` (the
    FFN's, after its activation: ``activation_dropout``) and each attention's ``dropout`` attribute
    (``self_attn.dropout``...: ``attn_dropout``). ``current_config()`` is the config with these values."""

    KINDS = ()

    def __init__(self, config, device=None, dtype=None):
        super().__init__()
        check_config(type(self).__name__, config)
        self.config = config
        self.self_attn = SelfAttentionParams(config.hidden_size, dropout=config.attn_dropout, heads=config.num_heads,
                                             kv_heads=config.kv_heads, bias=config.bias, qk_norm=config.qk_norm,
                                             device=device, dtype=dtype)

    def _add_ffn_and_norms(self, device, dtype):
        """linear1/linear2, then norm1..normN (one per block): after the attention parameters, so the
        parameter order (and the optimizer's layout) stays that of torch.nn's layers."""
        c, kw = self.config, {"device": device, "dtype": dtype}
        # a gated FFN's first GEMM gives [gate | up]: 2·ffn rows
        self.linear1 = nn.Linear(c.hidden_size, (2 if c.gated else 1) * c.ffn_size, bias=c.bias, **kw)
        self.linear2 = nn.Linear(c.ffn_size, c.hidden_size, bias=c.bias, **kw)
        for i in range(len(self.KINDS)):
            self.add_module(f"norm{i + 1}", make_norm(c, **kw))
        reset_ffn(self.linear1, self.linear2)
        self.dropout = nn.Dropout(c.activation_dropout)
        for i in range(len(self.KINDS)):
            self.add_module(f"dropout{i + 1}", nn.Dropout(c.dropout))
        # Backward recomputes the FFN activation (gelu) and the pre-LN outputs (less memory); False saves them
        # instead (a little faster).
        self.recompute = True

    def _self_block(self):
        sa = self.self_attn
        return (sa.in_proj_weight, sa.in_proj_bias, sa.out_proj.weight, sa.out_proj.bias, *norm_params(self.norm1))

    def _ffn_block(self):
        norm = getattr(self, f"norm{len(self.KINDS)}")
        return (self.linear1.weight, self.linear1.bias, self.linear2.weight, self.linear2.bias, *norm_params(norm))

    def blocks(self):
        """Per sub-block its parameters in spec.BLOCK_PARAMS order, in the order the layer runs them."""
        raise NotImplementedError

    def _attentions(self):
        return (self.self_attn,)

    def dropouts(self):
        """(residual, attention, activation) dropout probabilities as the layer's modules hold them now;
        ValueError when the per-block ones differ or one is outside [0, 1). (Read on every training call: the
        messages are built only on an error.)"""
        residual = [getattr(self, f"dropout{i + 1}").p for i in range(len(self.KINDS))]
        attention = [m.dropout for m in self._attentions()]
        activation = self.dropout.p
        if any(p != residual[0] for p in residual) or any(p != attention[0] for p in attention):
            self._refuse_differing(residual, attention)
        for p in (residual[0], attention[0], activation):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                self._refuse_probability(residual[0], attention[0], activation)
        return residual[0], attention[0], activation

    def _refuse_differing(self, residual, attention):
        owner = type(self).__name__
        for names, values, what in (([f"dropout{i + 1}.p" for i in range(len(residual))], residual,
                                     "residual dropout after every sub-block"),
                                    (["self_attn.dropout", "multihead_attn.dropout"], attention,
                                     "attention dropout in every attention")):
            if any(p != values[0] for p in values):
                listed = ", ".join(f"{name} = {p}" for name, p in zip(names, values))
                raise ValueError(f"{owner}: {listed} differ; the layer applies one {what}: set them equal")

    def _refuse_probability(self, residual, attention, activation):
        for name, p in (("dropout1.p", residual), ("self_attn.dropout", attention), ("dropout.p", activation)):
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise ValueError(f"{type(self).__name__}: {name} must be a probability in [0, 1), got {p!r}")

    def current_config(self):
        """The config with the dropout probabilities the layer holds now (``dropouts``)."""
        dropout, attn, act = self.dropouts()
        return dataclasses.replace(self.config, dropout=float(dropout), attn_dropout=float(attn),
                                   activation_dropout=float(act))

    def options(self, causal):
        """The LayerOptions of a call of this layer now (training mode, dropouts, recompute)."""
        return LayerOptions.of(self.KINDS, self.config, self.training, causal, self.recompute,
                               self.dropouts() if self.training else (0.0, 0.0, 0.0))

    def layer_params(self):
        """Every block's parameters in one list, as the layer passes them; then, with qk_norm, the Q and K
        norm weights (spec.QK_NORM_PARAMS)."""
        params = [p for block in self.blocks() for p in block]
        if self.config.qk_norm:
            params += [self.self_attn.q_norm_weight, self.self_attn.k_norm_weight]
        return params

    def reorder_cache(self, cache, new_order):
        """Reorder/select the batch entries of a cache (beam search): new_order [batch'] indices."""
        return reorder_cache(type(self).__name__, cache, new_order)

    def extra_repr(self):
        c = self.config
        extra = "".join(f", {name}={getattr(c, name)}" for name, default in
                        (("norm", "layernorm"), ("bias", True), ("num_kv_heads", None), ("rotary", None),
                         ("rotary_dim", None), ("qk_norm", False)) if getattr(c, name) != default)
        return (f"hidden={c.hidden_size}, heads={c.num_heads}, ffn={c.ffn_size}, activation={c.activation}, "
                f"pre_layer_norm={c.pre_layer_norm}{extra}")


class TransformerStackBase(nn.Module):
    """``num_layers`` layers of one class sharing a config, plus a final norm (the config's: LayerNorm or
    RMSNorm) when pre_layer_norm."""

    def __init__(self, config, num_layers, make_layer):
        super().__init__()
        owner = type(self).__name__
        check_config(owner, config)
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"{owner}: num_layers must be an int >= 1, got {num_layers!r}")
        self.config = config
        self.layers = nn.ModuleList(make_layer() for _ in range(num_layers))

    def _add_final_norm(self, device, dtype):
        """After the stack's own parameters, as the stacks have always registered it."""
        self.norm = make_norm(self.config, device, dtype) if self.config.pre_layer_norm else None

    def _final_norm(self, x):
        return x if self.norm is None else self.norm(x)

    def reorder_cache(self, cache, new_order):
        """Reorder/select the batch entries of a cache (beam search): new_order [batch'] indices."""
        return reorder_cache(type(self).__name__, cache, new_order)
