"""Shared pieces of the encoder and decoder layers: parameter containers with torch.nn's names, input
checks, the compute dtype under autocast, torch.nn interop helpers and cache reordering."""
import math

import torch
import torch.nn.functional as F
from torch import nn

from lsmini import _backend
from lsmini.layers.arena import align
from lsmini.ops.attention_softmax import check_key_padding_mask

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PARAMS_PER_BLOCK = 6  # (W_in, b_in, W_out, b_out, ln_w, ln_b) of each sub-block, see _fused.py


def uniform_(t, fan_in, fan_out):
    """Xavier-uniform with explicit fans (a slice of a fused projection keeps the fused init)."""
    a = math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        return t.uniform_(-a, a)


class SelfAttentionParams(nn.Module):
    """Parameters of a self-attention block, named as in torch.nn.MultiheadAttention: in_proj_weight
    [3H, H] (rows: Q, K, V), in_proj_bias [3H], out_proj (Linear H → H). Holds weights only; the layer
    computes with them."""

    def __init__(self, hidden, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden, **kw))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * hidden, **kw))
        self.out_proj = nn.Linear(hidden, hidden, **kw)
        self.reset_parameters()

    def reset_parameters(self):
        h = self.out_proj.in_features
        uniform_(self.in_proj_weight, h, 3 * h)
        nn.init.zeros_(self.in_proj_bias)
        uniform_(self.out_proj.weight, h, h)
        nn.init.zeros_(self.out_proj.bias)


class CrossAttentionParams(nn.Module):
    """Parameters of a cross-attention block: q_proj_weight [H, H], q_proj_bias, out_proj, and — unless
    the layer belongs to a TransformerDecoder, which holds the K/V projections of all its layers in one
    parameter — kv_proj_weight [2H, H] (rows: K, V) and kv_proj_bias [2H]."""

    def __init__(self, hidden, own_kv=True, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.q_proj_weight = nn.Parameter(torch.empty(hidden, hidden, **kw))
        self.q_proj_bias = nn.Parameter(torch.empty(hidden, **kw))
        if own_kv:
            self.kv_proj_weight = nn.Parameter(torch.empty(2 * hidden, hidden, **kw))
            self.kv_proj_bias = nn.Parameter(torch.empty(2 * hidden, **kw))
        else:
            self.register_parameter("kv_proj_weight", None)
            self.register_parameter("kv_proj_bias", None)
        self.out_proj = nn.Linear(hidden, hidden, **kw)
        self.reset_parameters()

    @property
    def owns_kv(self):
        return self.kv_proj_weight is not None

    def reset_parameters(self):
        h = self.out_proj.in_features
        # fans of torch.nn.MultiheadAttention's fused [3H, H] in_proj, which these rows replace
        uniform_(self.q_proj_weight, h, 3 * h)
        nn.init.zeros_(self.q_proj_bias)
        if self.owns_kv:
            uniform_(self.kv_proj_weight, h, 3 * h)
            nn.init.zeros_(self.kv_proj_bias)
        uniform_(self.out_proj.weight, h, h)
        nn.init.zeros_(self.out_proj.bias)


def reset_ffn(linear1, linear2):
    uniform_(linear1.weight, linear1.in_features, linear1.out_features)
    nn.init.zeros_(linear1.bias)
    uniform_(linear2.weight, linear2.in_features, linear2.out_features)
    nn.init.zeros_(linear2.bias)


# ---- checks -------------------------------------------------------------------------------------------
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


def check_mask(owner, name, mask, b, l, device):
    """None, or a bool [b, l] tensor on device (True = pad)."""
    check_key_padding_mask(owner, mask, b, l, device, "the input", name=name, dims="batch, len")


def compute_dtype(owner, x, weight):
    """The dtype the layer computes in: under torch.autocast with float32 parameters, the autocast dtype
    (the GEMM weights are cast per call, biases and LayerNorm parameters stay float32: the kernels read
    them as they are); with low-precision parameters, theirs; without autocast x must match them."""
    dev = x.device.type
    autocast = dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev)
    if autocast and weight.dtype == torch.float32:
        return torch.get_autocast_dtype(dev)
    if autocast:
        return weight.dtype
    if x.dtype != weight.dtype:
        raise TypeError(f"{owner}: input dtype {x.dtype} does not match the parameters' dtype {weight.dtype}; "
                        f"convert one of them, or run under torch.autocast")
    return weight.dtype


def _needs_cast(i, p, dtype):
    return p is not None and p.dtype != dtype and (i in (0, 2) or p.dtype != torch.float32)


def cast_block(block, dtype):
    """(W_in, b_in, W_out, b_out, ln_w, ln_b) with the GEMM weights in dtype; vectors cast only when they
    are neither float32 nor dtype (the kernels take float32 or the activations' dtype)."""
    return [p.to(dtype) if _needs_cast(i, p, dtype) else p for i, p in enumerate(block)]


def cast_blocks_batched(params, dtype):
    """cast_block over consecutive blocks, for use without autograd (inside an autograd Function's
    forward): on CUDA the casts run as one multi-tensor copy into one buffer — one launch per layer
    instead of one per weight."""
    todo = [i for i, p in enumerate(params) if _needs_cast(i % PARAMS_PER_BLOCK, p, dtype)]
    out = list(params)
    if len(todo) < 2 or not params[todo[0]].is_cuda:
        for i in todo:
            out[i] = params[i].to(dtype)
        return out
    starts = [0]
    for i in todo:
        starts.append(starts[-1] + align(params[i].numel()))  # each view 128-byte aligned, for the GEMMs
    buf = torch.empty(starts[-1], dtype=dtype, device=params[todo[0]].device)
    for i, s in zip(todo, starts):
        out[i] = buf[s:s + params[i].numel()].view(params[i].shape)
    torch._foreach_copy_([out[i] for i in todo], [params[i] for i in todo])
    return out


def use_kernels(x):
    return x.dtype in KERNEL_DTYPES and _backend.use_kernels(x)


def no_autocast(device_type):
    return torch.autocast(device_type, enabled=False)


# ---- torch.nn interop -----------------------------------------------------------------------------------
def torch_activation_name(layer):
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu:
        return "gelu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    raise ValueError(f"from_torch: unsupported activation {act!r}; lsmini layers support relu, gelu and "
                     f"gelu with approximate='tanh'")


def torch_activation(name):
    return {"relu": "relu", "gelu": "gelu", "gelu_tanh": nn.GELU(approximate="tanh")}[name]


def config_from_torch(layer, max_batch_tokens, max_seq_len):
    """The TransformerConfig of a torch.nn.TransformerEncoderLayer / DecoderLayer. Dropouts map as:
    dropout1 → dropout, self_attn.dropout → attn_dropout, the FFN's inner dropout → activation_dropout."""
    from lsmini.layers.config import TransformerConfig

    sa = layer.self_attn
    return TransformerConfig(
        hidden_size=sa.embed_dim, num_heads=sa.num_heads, ffn_size=layer.linear1.out_features,
        dropout=layer.dropout1.p, attn_dropout=float(sa.dropout), activation_dropout=layer.dropout.p,
        activation=torch_activation_name(layer), pre_layer_norm=bool(layer.norm_first),
        layer_norm_eps=layer.norm1.eps, max_batch_tokens=max_batch_tokens, max_seq_len=max_seq_len)


def torch_layer(torch_cls, config, like):
    """An empty torch_cls (nn.TransformerEncoderLayer / DecoderLayer, batch_first) with config's sizes and
    dropouts, on like's device and dtype."""
    c = config
    t = torch_cls(c.hidden_size, c.num_heads, c.ffn_size, dropout=c.dropout, activation=torch_activation(c.activation),
                  layer_norm_eps=c.layer_norm_eps, batch_first=True, norm_first=c.pre_layer_norm, device=like.device,
                  dtype=like.dtype)
    t.self_attn.dropout = c.attn_dropout
    if hasattr(t, "multihead_attn"):
        t.multihead_attn.dropout = c.attn_dropout
    t.dropout.p = c.activation_dropout
    return t


def describe(config):
    """The extra_repr of a layer with this config."""
    c = config
    return (f"hidden={c.hidden_size}, heads={c.num_heads}, ffn={c.ffn_size}, activation={c.activation}, "
            f"pre_layer_norm={c.pre_layer_norm}, dropout=({c.dropout}, attn {c.attn_dropout}, "
            f"act {c.activation_dropout})")


def check_torch_attention(mha, what):
    if not mha._qkv_same_embed_dim:
        raise ValueError(f"from_torch: {what} must have kdim == vdim == embed_dim")
    if mha.in_proj_bias is None or mha.out_proj.bias is None:
        raise ValueError(f"from_torch: {what} has no biases (bias=False); lsmini layers always have them")
    if getattr(mha, "bias_k", None) is not None or getattr(mha, "add_zero_attn", False):
        raise ValueError(f"from_torch: {what} uses add_bias_kv / add_zero_attn, which lsmini layers do not support")


def check_torch_linear_norm(layer, norms):
    for name in ("linear1", "linear2"):
        if getattr(layer, name).bias is None:
            raise ValueError(f"from_torch: {name} has no bias (bias=False); lsmini layers always have them")
    for name in norms:
        n = getattr(layer, name)
        if n.weight is None or n.bias is None:
            raise ValueError(f"from_torch: {name} has no affine weight/bias; lsmini layers always have them")


def copy_params(dst, src):
    """dst.named_parameters() ← the same names in the dict src (tensors), shapes checked."""
    with torch.no_grad():
        for name, p in dst.named_parameters():
            s = src[name]
            if s.shape != p.shape:
                raise ValueError(f"copy: {name} has shape {tuple(p.shape)}, source {tuple(s.shape)}")
            p.copy_(s)


# ---- caches ------------------------------------------------------------------------------------------------
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


def check_new_order(owner, new_order):
    if not isinstance(new_order, torch.Tensor) or new_order.dtype not in (torch.int64, torch.int32) \
            or new_order.dim() != 1:
        raise TypeError(f"{owner}: new_order must be a 1-D int64 tensor of batch indices, got "
                        f"{getattr(new_order, 'dtype', type(new_order).__name__)} "
                        f"{tuple(getattr(new_order, 'shape', ()))}")
