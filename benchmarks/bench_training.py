"""Whole training steps: lsmini against PyTorch eager AMP and torch.compile, same data, same initial weights.

    python benchmarks/bench_training.py [--configs base big ...] [--variants lsmini eager compiled]
                                        [--steps 30] [--check] [--profile] [--memory] [--out DIR]
                                        [--results DIR | --no-results]
    python benchmarks/bench_training.py --nproc 2 --configs base big     # data-parallel scaling
    python benchmarks/bench_training.py --configs llama                  # the Llama-style model, its variants

Configs (tokens counted on source + target):
    base       encoder-decoder 6+6, hidden 512, 8 heads, FFN 2048, 32000-token vocabularies, 128 × 64 pairs
    base-long  the same with 64 × 256 pairs
    big        6+6, hidden 1024, 16 heads, FFN 4096, 128 × 64 pairs
    lm         decoder-only 12 layers, hidden 768, 12 heads, FFN 3072, vocab 32000, 16 × 512 tokens
    llama      Llama-style decoder-only (~125M parameters): 12 layers, hidden 768, 12 heads, 4 K/V heads
               (grouped-query attention), SwiGLU FFN 2048, vocab 32000, 8 × 1024 tokens; not in the default
               set (--configs llama)
base … lm: pre-LN, ReLU, dropout 0.1 (embedding, attention, activation, residual), label smoothing 0.1, AdamW
(betas 0.9/0.98, weight decay 0.01), output projection tied to the target embedding, fp16.
llama: pre-RMSNorm (eps 1e-6), rotary positions on Q and K (theta 10000, rotate-half, every dimension of a
head), no biases, no dropout, no embedding scale, plain next-token cross-entropy (no label smoothing), an
untied output projection (LlamaForCausalLM's default), bf16 (no loss scaling); the same AdamW.

Variants (base … lm run the first six by default, llama its own list: lsmini, lsmini+graph, lsmini+graph+saved,
lsmini+compile, eager, compiled, compiled-graphs, hf-eager, hf-compiled, hf-compiled+skip-mask, hf-liger):
    lsmini    lsmini.models.Transformer / TransformerLM with fp16 parameters, FusedAdam (fp32 masters, the
              whole update in one launch), LossScaler, the fused label-smoothed criterion, stepped by
              lsmini.train.TrainStep (the training examples' step). llama: bf16 parameters, no LossScaler.
    eager     torch.nn.Transformer (batch_first, norm_first) / nn.TransformerEncoder with a causal mask, fp32
              parameters, torch.autocast(fp16) + GradScaler, AdamW(fused=True), F.cross_entropy. llama: the
              same model written here in plain PyTorch (TorchLlama: nn.RMSNorm, bias-free Q/K/V/O Linears,
              rotate-half rotary, F.scaled_dot_product_attention(is_causal=True, enable_gqa=True), SwiGLU
              MLP of gate/up/down Linears, untied lm_head), torch.autocast(bf16) without a GradScaler.
    lsmini+graph  the lsmini variant with the whole step (forward, backward, FusedAdam, LossScaler) replayed
              as one CUDA graph (TrainStep with cuda_graph=True).
    lsmini+graph+saved  the same with the layers' ``recompute = False``: backward reads saved attention
              probabilities, FFN activations and LayerNorm outputs instead of recomputing them (llama: the
              SwiGLU products and the RMSNorm outputs), for more memory.
    lsmini+lce, lsmini+graph+lce, lsmini+graph+saved+lce  (extra) the output projection and the criterion
              as one op over chunks of tokens (LinearCrossEntropyLoss): the logits are never all in memory, for
              ~0.6–1 ms a step.
    lsmini+compile  (extra but for llama) the lsmini variant with the model and its criterion under
              torch.compile(fullgraph=True); backward as torch.compile produces it, FusedAdam outside.
    compiled  the eager variant with the model and loss under torch.compile.
    compiled-graphs  the same with mode="reduce-overhead": forward and backward replayed as CUDA graphs,
              PyTorch's strongest variant (the optimizer step stays eager, as torch.compile leaves it).
    hf-eager, hf-compiled, hf-liger, hf-compiled+skip-mask  (llama only) transformers' LlamaForCausalLM
              (attn_implementation="sdpa") of the same sizes and weights, trained as a Hugging Face script does:
              model(input_ids, labels=input_ids).loss (the model shifts the labels itself, so the last position
              has no target), fp32 parameters, torch.autocast(bf16), AdamW(fused=True); hf-compiled with the
              loss under torch.compile, hf-liger eager with Liger Kernel's Triton kernels patched in
              (apply_liger_kernel_to_llama: RMSNorm, rotary, SwiGLU, output projection fused with the loss).
              hf-compiled+skip-mask: hf-compiled with transformers' eager mask rule kept while compiling
              (common.skip_masks_as_in_eager says why that is the stronger baseline).
              Skipped, with the reason, where transformers (hf-liger: liger_kernel) does not import.
The lsmini model gets the torch model's initial weights through the layers' from_torch; llama's through
lsmini_llama_state_dict (TorchLlama's parameter names are LlamaForCausalLM's, so the hf variants load its
state_dict as it is). Batches carry no padding, so the PyTorch variants run without key-padding masks (their
fastest attention path).

Each (config, variant) runs in a process of its own, so one variant's allocations, compilation and
autotuning never disturb another's timing. Reported: median ms per step over --steps steps after warm-up
(CUDA events around each step, the host running ahead as in real training, so launch gaps count),
tokens/s, and the peak of torch.cuda.max_memory_allocated from the first step on — warm-up, graph recording
and timed steps — (parameters, gradients, optimizer state and activations). --check trains every variant
200 steps on the same batches and prints the loss curves (mean of each 20-step window) side by side.
--profile adds, per variant, where the time of a step goes: GEMMs, attention, lsmini's fused kernels,
other kernels, the optimizer, and the idle gaps between kernels. --memory adds, per variant, what is
allocated at the peak of the warm-up steps (where graphs record and the peak is reached), summed by the
line of lsmini, this script or torch that allocated it. Results go to stdout, and each (config, variant)'s
ms/step, tokens/s and peak MB are appended to benchmarks/results/training.csv (benchmarks/report.py makes
RESULTS.md from it); --out DIR also writes this run's tables to DIR/training.md and DIR/training.csv.

--nproc N times each lsmini variant on one GPU and data-parallel on N GPUs (torchrun, NCCL,
lsmini.distributed.GradientReducer; every GPU takes the config's batch; with +graph the bucket all-reduces
are part of the recorded step) and reports the throughput ratio (benchmark `training_multi_gpu` in
benchmarks/results/training.csv: the N-GPU rows carry the GPU as "N × name" and the scaling over one GPU).
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402

PAD, BOS = 0, 2
FIRST_TOKEN = 4  # ids below are special (pad, unk, bos, eos)
LABEL_SMOOTHING = 0.1
DROPOUT = 0.1
LR, BETAS, EPS, WEIGHT_DECAY = 5e-4, (0.9, 0.98), 1e-8, 0.01
CHECK_STEPS, CHECK_WINDOW, CHECK_WARMUP = 200, 20, 50
GRAPH_WARMUP = 3  # eager steps before a graph records (the count behind the published numbers)

CONFIGS = {
    "base": dict(kind="seq2seq", layers=6, hidden=512, heads=8, ffn=2048, vocab=32000, batch=128, len=64),
    "base-long": dict(kind="seq2seq", layers=6, hidden=512, heads=8, ffn=2048, vocab=32000, batch=64, len=256),
    "big": dict(kind="seq2seq", layers=6, hidden=1024, heads=16, ffn=4096, vocab=32000, batch=128, len=64),
    "lm": dict(kind="lm", layers=12, hidden=768, heads=12, ffn=3072, vocab=32000, batch=16, len=512),
    # Llama-style: the keys after len override the defaults of the others (DROPOUT, LABEL_SMOOTHING, fp16)
    "llama": dict(kind="llama", layers=12, hidden=768, heads=12, kv_heads=4, ffn=2048, vocab=32000, batch=8,
                  len=1024, dropout=0.0, label_smoothing=0.0, dtype="bf16", norm_eps=1e-6, rope_theta=10000.0),
}
DEFAULT_CONFIGS = ("base", "base-long", "big", "lm")  # llama only when asked for: --configs llama
VARIANTS = ("lsmini", "lsmini+graph", "lsmini+graph+saved", "eager", "compiled", "compiled-graphs")
# transformers' LlamaForCausalLM: the llama config only
HF_VARIANTS = ("hf-eager", "hf-compiled", "hf-compiled+skip-mask", "hf-liger")
LLAMA_VARIANTS = ("lsmini", "lsmini+graph", "lsmini+graph+saved", "lsmini+compile", "eager", "compiled",
                  "compiled-graphs") + HF_VARIANTS
# recompute off without a graph (e.g. for --nproc); the output projection and criterion over chunks of tokens
# (LinearCrossEntropyLoss), never all the logits in memory; the lsmini model and criterion under torch.compile
EXTRA_VARIANTS = ("lsmini+saved", "lsmini+lce", "lsmini+graph+lce", "lsmini+graph+saved+lce", "lsmini+compile")
ALL_VARIANTS = tuple(dict.fromkeys(VARIANTS + LLAMA_VARIANTS + EXTRA_VARIANTS))
COLUMNS = ["config", "variant", "ms_step", "tokens_s", "peak_mb", "x_eager", "x_compiled", "x_compiled_graphs",
           "mem_vs_eager"]
MULTI_COLUMNS = ["config", "variant", "gpus", "ms_step", "tokens_s", "peak_mb", "scaling"]


def tokens_per_step(cfg):
    return cfg["batch"] * cfg["len"] * (2 if cfg["kind"] == "seq2seq" else 1)


def default_variants(config):
    return LLAMA_VARIANTS if CONFIGS[config]["kind"] == "llama" else VARIANTS


def label_smoothing(cfg):
    return cfg.get("label_smoothing", LABEL_SMOOTHING)


def dropout(cfg):
    return cfg.get("dropout", DROPOUT)


def half_dtype(cfg):
    """The 16-bit dtype of a config: lsmini's parameters, the PyTorch variants' autocast."""
    return torch.bfloat16 if cfg.get("dtype") == "bf16" else torch.float16


class SkipVariant(Exception):
    """A variant this config or this machine cannot run (a missing package): reported as skipped."""


# ---- data: learnable synthetic tasks, so --check shows real learning curves ------------------------------
def make_batches(cfg, count, seed=0):
    """`count` batches of CPU tensors, identical for every variant. seq2seq: the target is the source reversed
    and mapped through a fixed permutation of the vocabulary (Zipf-distributed source tokens);
    lm and llama: a sparse first-order Markov chain (each token has 4 possible successors)."""
    g = torch.Generator().manual_seed(seed)
    v, b, n = cfg["vocab"], cfg["batch"], cfg["len"]
    real = v - FIRST_TOKEN
    if cfg["kind"] == "seq2seq":
        weights = 1.0 / (torch.arange(real, dtype=torch.float64) + 10.0)
        perm = torch.randperm(real, generator=g) + FIRST_TOKEN
        out = []
        for _ in range(count):
            src = torch.multinomial(weights, b * n, replacement=True, generator=g).view(b, n) + FIRST_TOKEN
            tgt = perm[src.flip(1) - FIRST_TOKEN]
            tgt_in = torch.cat([torch.full((b, 1), BOS, dtype=torch.long), tgt[:, :-1]], 1)
            out.append((src, tgt_in, tgt))
        return out
    succ = torch.randint(FIRST_TOKEN, v, (v, 4), generator=g)
    out = []
    for _ in range(count):
        seq = torch.empty(b, n + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(FIRST_TOKEN, v, (b,), generator=g)
        choice = torch.randint(0, 4, (b, n), generator=g)
        for t in range(n):
            seq[:, t + 1] = succ[seq[:, t], choice[:, t]]
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


# ---- the PyTorch models -----------------------------------------------------------------------------------
def sinusoidal(max_len, hidden):
    """The same table as lsmini's: sin in the first half of the columns, cos in the second."""
    half = hidden // 2
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
    angle = pos * torch.pow(10000.0, -2.0 * torch.arange(half, dtype=torch.float64) / hidden)
    return torch.cat([torch.sin(angle), torch.cos(angle)], 1).float()


class TorchEmbedding(nn.Module):
    def __init__(self, vocab, hidden, max_len):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, hidden) * hidden ** -0.5)
        with torch.no_grad():
            self.weight[PAD].zero_()
        self.register_buffer("pos", sinusoidal(max_len, hidden), persistent=False)
        self.scale = math.sqrt(hidden)

    def forward(self, tokens):
        x = F.embedding(tokens, self.weight, PAD) * self.scale + self.pos[:tokens.shape[1]]
        return F.dropout(x, DROPOUT, self.training)


class TorchSeq2Seq(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg["hidden"]
        self.src_embed = TorchEmbedding(cfg["vocab"], h, cfg["len"])
        self.tgt_embed = TorchEmbedding(cfg["vocab"], h, cfg["len"])
        self.transformer = nn.Transformer(h, cfg["heads"], cfg["layers"], cfg["layers"], cfg["ffn"], DROPOUT,
                                          batch_first=True, norm_first=True)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(cfg["len"]), persistent=False)

    def forward(self, src, tgt_in):
        y = self.transformer(self.src_embed(src), self.tgt_embed(tgt_in), tgt_mask=self.causal, tgt_is_causal=True)
        return F.linear(y, self.tgt_embed.weight)


class TorchLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg["hidden"]
        self.embed = TorchEmbedding(cfg["vocab"], h, cfg["len"])
        layer = nn.TransformerEncoderLayer(h, cfg["heads"], cfg["ffn"], DROPOUT, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerEncoder(layer, cfg["layers"], norm=nn.LayerNorm(h), enable_nested_tensor=False)
        for p in self.decoder.parameters():  # the layers start as copies of one: initialise each (as nn.Transformer)
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(cfg["len"]), persistent=False)

    def forward(self, tokens):
        y = self.decoder(self.embed(tokens), mask=self.causal, is_causal=True)
        return F.linear(y, self.embed.weight)


# The Llama-style model in plain PyTorch. Module and parameter names are those of transformers'
# LlamaForCausalLM (model.embed_tokens, model.layers.i.self_attn.q_proj, ..., lm_head), so the hf variants
# load this model's state_dict unchanged and lsmini_llama_state_dict reads the same names.
def rotary_tables(length, head_dim, theta):
    """cos, sin [length, head_dim] float32 of rotate-half rotary over the whole head: dimension i and
    i + head_dim/2 turn by the angle pos · theta^(−2i/head_dim) (angles in float64, as lsmini's tables)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = torch.arange(length, dtype=torch.float64).unsqueeze(1) * inv_freq
    angle = torch.cat([angle, angle], 1)
    return torch.cos(angle).float(), torch.sin(angle).float()


def apply_rotary(x, cos, sin):
    """Rotate-half rotary on x [b, heads, n, head_dim]: x·cos + cat(−x2, x1)·sin, in float32 (the tables are
    float32, so the products promote) and rounded once to x's dtype, as lsmini's rotary computes it."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, self.heads, self.kv_heads = cfg["hidden"], cfg["heads"], cfg["kv_heads"]
        self.head_dim = h // self.heads
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)

    def forward(self, x, cos, sin):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # enable_gqa: query head j reads K/V head j // (heads / kv_heads), without repeating K and V in memory
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, f = cfg["hidden"], cfg["ffn"]
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class LlamaBlock(nn.Module):
    """Pre-norm: x + attention(RMSNorm(x)), then + MLP(RMSNorm(·))."""

    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg["hidden"], eps=cfg["norm_eps"])
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg["hidden"], eps=cfg["norm_eps"])
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab"], cfg["hidden"])  # no padding row, no scale
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg["layers"]))
        self.norm = nn.RMSNorm(cfg["hidden"], eps=cfg["norm_eps"])
        cos, sin = rotary_tables(cfg["len"], cfg["hidden"] // cfg["heads"], cfg["rope_theta"])
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        n = tokens.shape[1]
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, self.cos[:n], self.sin[:n])
        return self.norm(x)


class TorchLlama(nn.Module):
    """tokens [b, n] → logits [b, n, vocab]: LlamaBody, then the untied lm_head."""

    def __init__(self, cfg):
        super().__init__()
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)
        for m in self.modules():  # Llama's initialisation: N(0, 0.02) for every matrix, RMSNorm weights 1
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, tokens):
        return self.lm_head(self.model(tokens))


def build_torch_model(cfg):
    torch.manual_seed(1234)  # the same initial weights in every process
    models = {"seq2seq": TorchSeq2Seq, "lm": TorchLM, "llama": TorchLlama}
    return models[cfg["kind"]](cfg)


def lsmini_llama_state_dict(sd, layers):
    """TorchLlama's (= LlamaForCausalLM's) state_dict `sd` under lsmini.models.TransformerLM's names. Per layer,
    lsmini holds the Q, K and V projections as one in_proj_weight, rows [Q | K | V] ([(heads + 2·kv_heads)·
    head_dim, hidden]), and the gate and up projections as one linear1.weight, rows [gate | up] ([2·ffn,
    hidden]); the rest is renamed. ValueError if a parameter of `sd` is left unused."""
    out, used = {}, set()

    def take(name):
        used.add(name)
        return sd[name]

    out["embed.weight"] = take("model.embed_tokens.weight")
    for i in range(layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + "self_attn.in_proj_weight"] = torch.cat([take(src + f"self_attn.{p}_proj.weight") for p in "qkv"])
        out[dst + "self_attn.out_proj.weight"] = take(src + "self_attn.o_proj.weight")
        out[dst + "linear1.weight"] = torch.cat([take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")])
        out[dst + "linear2.weight"] = take(src + "mlp.down_proj.weight")
        out[dst + "norm1.weight"] = take(src + "input_layernorm.weight")
        out[dst + "norm2.weight"] = take(src + "post_attention_layernorm.weight")
    out["decoder.norm.weight"] = take("model.norm.weight")
    out["output_projection.weight"] = take("lm_head.weight")
    unused = sorted(set(sd) - used)
    if unused:
        raise ValueError(f"lsmini_llama_state_dict: parameters with no place in the lsmini model: {unused}")
    return out


def build_lsmini_llama(cfg, tm):
    """The lsmini TransformerLM computing TorchLlama tm's function with its weights (lsmini_llama_state_dict;
    load_state_dict(strict) checks that every lsmini parameter got one)."""
    from lsmini.layers import TransformerConfig
    from lsmini.models import TransformerLM

    n = cfg["len"]
    p = dropout(cfg)
    config = TransformerConfig(cfg["hidden"], cfg["heads"], cfg["ffn"], dropout=p, attn_dropout=p, activation_dropout=p,
                               activation="swiglu", pre_layer_norm=True, layer_norm_eps=cfg["norm_eps"],
                               max_batch_tokens=cfg["batch"] * n, max_seq_len=n, norm="rmsnorm", bias=False,
                               num_kv_heads=cfg["kv_heads"], rotary=cfg["rope_theta"])
    # no padding token (as Llama: nothing masked, no zero row); untied output projection
    model = TransformerLM(cfg["vocab"], config, cfg["layers"], padding_idx=None, tie_output=False)
    model.load_state_dict({k: v.detach() for k, v in lsmini_llama_state_dict(tm.state_dict(), cfg["layers"]).items()})
    # lsmini's embedding multiplies the rows by sqrt(hidden) (its `scale`, read at every call); Llama does not
    model.embed.scale = 1.0
    return model


def build_lsmini_model(cfg, tm):
    """The lsmini model holding tm's weights (through the layers' from_torch)."""
    from lsmini.layers import TransformerConfig, TransformerDecoder, TransformerDecoderLayer, TransformerEncoderLayer
    from lsmini.models import Transformer, TransformerLM

    if cfg["kind"] == "llama":
        model = build_lsmini_llama(cfg, tm)
        model.embed.check_tokens = False  # the batches are clean: skip the id check (a host sync)
        return model
    h, n = cfg["hidden"], cfg["len"]
    tokens = cfg["batch"] * n
    config = TransformerConfig(h, cfg["heads"], cfg["ffn"], dropout=DROPOUT, attn_dropout=DROPOUT,
                               activation_dropout=DROPOUT, activation="relu", pre_layer_norm=True,
                               max_batch_tokens=tokens, max_seq_len=n)

    def encoder_layers(prefix, layers):
        sd = {}
        for i, t in enumerate(layers):
            for k, v in TransformerEncoderLayer.from_torch(t, tokens, n).state_dict().items():
                sd[f"{prefix}.layers.{i}.{k}"] = v
        return sd

    if cfg["kind"] == "seq2seq":
        model = Transformer(cfg["vocab"], cfg["vocab"], config, cfg["layers"], cfg["layers"], padding_idx=PAD,
                            tie_output=True)
        t = tm.transformer
        sd = encoder_layers("encoder", t.encoder.layers)
        dec = TransformerDecoder.from_layers([TransformerDecoderLayer.from_torch(l, tokens, n)
                                              for l in t.decoder.layers])
        sd.update({f"decoder.{k}": v for k, v in dec.state_dict().items() if not k.startswith("norm.")})
        for side, norm in (("encoder", t.encoder.norm), ("decoder", t.decoder.norm)):
            sd[f"{side}.norm.weight"], sd[f"{side}.norm.bias"] = norm.weight, norm.bias
        sd["src_embed.weight"], sd["tgt_embed.weight"] = tm.src_embed.weight, tm.tgt_embed.weight
    else:
        model = TransformerLM(cfg["vocab"], config, cfg["layers"], padding_idx=PAD, tie_output=True)
        sd = encoder_layers("decoder", tm.decoder.layers)
        sd["decoder.norm.weight"], sd["decoder.norm.bias"] = tm.decoder.norm.weight, tm.decoder.norm.bias
        sd["embed.weight"] = tm.embed.weight
    model.load_state_dict({k: v.detach() for k, v in sd.items()})
    for m in model.modules():  # the batches are clean: skip the id checks (each one a host sync)
        if hasattr(m, "check_tokens"):
            m.check_tokens = False
    return model


# ---- one training step per variant ------------------------------------------------------------------------
def lsmini_loss_fn(cfg, model, lce=False):
    """loss_fn(*batch) of the lsmini variants: the model and lsmini's fused criterion (the config's label
    smoothing), or with lce the output projection and criterion as one op."""
    from lsmini.layers import CrossEntropyLoss, LinearCrossEntropyLoss

    if lce:
        crit = LinearCrossEntropyLoss(label_smoothing(cfg), ignore_index=PAD, check_targets=False)
    else:
        crit = CrossEntropyLoss(label_smoothing(cfg), ignore_index=PAD, inplace_backward=True, check_targets=False)

    def loss_fn(*batch):
        if lce:
            return crit(model(*batch[:-1], features_only=True), model.output_weight(), batch[-1])
        return crit(model(*batch[:-1]), batch[-1])

    return loss_fn


def lsmini_trainer(cfg, tm, lr_lambda=None, graph=False, saved=False, data_parallel=False, lce=False, compiled=False):
    from lsmini.optim import FusedAdam, LossScaler
    from lsmini.train import TrainStep

    dtype = half_dtype(cfg)
    model = build_lsmini_model(cfg, tm).cuda().to(dtype).train()
    del tm
    if saved:  # backward reads saved activations instead of recomputing them: faster, more memory
        for m in model.modules():
            if hasattr(m, "recompute"):
                m.recompute = False
    opt = FusedAdam(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adam_w_mode=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    if data_parallel:  # buckets of the flat gradient buffer all-reduced while backward runs
        from lsmini.distributed import GradientReducer
        GradientReducer(opt)  # the workspace keeps it

    loss_fn = lsmini_loss_fn(cfg, model, lce)
    if compiled:  # forward and criterion traced whole (a graph break fails loudly); FusedAdam stays outside
        loss_fn = torch.compile(loss_fn, fullgraph=True)
    scaler = LossScaler() if dtype == torch.float16 else None  # bf16 needs no loss scaling (None: TrainStep's off)
    train_step = TrainStep(loss_fn, opt, scaler, cuda_graph=graph, graph_warmup=GRAPH_WARMUP)

    def step(*batch):
        loss = train_step(batch)
        if sched is not None:
            sched.step()
        return loss

    step.optimizer = opt  # for the data-parallel check in run_worker
    step.train_step = train_step  # reset before the process group is destroyed
    return step


class TorchLoss(nn.Module):
    def __init__(self, model, label_smoothing=LABEL_SMOOTHING):
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing

    def forward(self, *batch):
        logits = self.model(*batch[:-1])
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), batch[-1].reshape(-1), ignore_index=PAD,
                               label_smoothing=self.label_smoothing)


def amp_trainer(cfg, model, loss_fn, compile_mode, lr_lambda=None):
    """The step of the PyTorch variants: loss_fn under torch.autocast in the config's 16-bit dtype, fp32
    parameters, AdamW(fused=True); a GradScaler for fp16 only. compile_mode: None (eager), "default" or
    "reduce-overhead" (torch.compile's CUDA graphs)."""
    if compile_mode is not None:
        loss_fn = torch.compile(loss_fn, mode=compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    dtype = half_dtype(cfg)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)  # disabled: scale/step/update pass through

    def step(*batch):
        if compile_mode == "reduce-overhead":  # a new iteration: the graphs may reuse the last one's outputs
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=dtype):
            loss = loss_fn(*batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
        return loss.detach()

    return step


def torch_trainer(cfg, tm, compile_mode, lr_lambda=None):
    """compile_mode: None (eager), "default" or "reduce-overhead" (torch.compile's CUDA graphs)."""
    model = tm.cuda().train()
    return amp_trainer(cfg, model, TorchLoss(model, label_smoothing(cfg)), compile_mode, lr_lambda)


# ---- transformers' LlamaForCausalLM (the hf variants) -----------------------------------------------------
def build_hf_model(cfg, tm, liger=False):
    """transformers' LlamaForCausalLM (attn_implementation="sdpa") of the llama config's sizes, holding
    TorchLlama tm's weights (same parameter names: its state_dict loads as it is). liger: Liger Kernel's
    Triton kernels are patched into transformers' Llama modules first (this process only: each variant has
    its own). SkipVariant where transformers or liger_kernel does not import."""
    try:
        import transformers
    except Exception as e:  # ImportError, or a broken install failing otherwise
        raise SkipVariant(f"transformers does not import ({type(e).__name__}: {e})")
    if liger:
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except Exception as e:
            raise SkipVariant(f"liger_kernel does not import ({type(e).__name__}: {e})")
        # Liger's RMSNorm, rotary and SwiGLU kernels, and the output projection with the loss over chunks of
        # tokens (used when the forward gets labels, as HFLoss passes them)
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=cfg["len"], rms_norm_eps=cfg["norm_eps"], rope_theta=cfg["rope_theta"],
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, attention_dropout=dropout(cfg),
        use_cache=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(tm.state_dict())  # strict: every parameter of either side matched
    return model


class HFLoss(nn.Module):
    """A Hugging Face training script's loss: model(input_ids, labels=input_ids).loss. The model shifts the
    labels itself (position t predicts input t + 1), so the batch's targets go unused and the last position
    has no target: the loss is the mean over the first n − 1 of the n positions the other variants use."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs, targets):
        return self.model(input_ids=inputs, labels=inputs).loss


def hf_trainer(cfg, tm, variant, lr_lambda=None):
    model = build_hf_model(cfg, tm, liger=variant == "hf-liger").cuda().train()
    del tm
    if variant == "hf-compiled+skip-mask":
        common.skip_masks_as_in_eager()
    compiled = variant.startswith("hf-compiled")
    return amp_trainer(cfg, model, HFLoss(model), "default" if compiled else None, lr_lambda)


def make_trainer(cfg, variant, lr_lambda=None, data_parallel=False):
    if variant in HF_VARIANTS and cfg["kind"] != "llama":
        raise SkipVariant(f"{variant} is transformers' LlamaForCausalLM: the llama config only")
    tm = build_torch_model(cfg)
    if variant.startswith("lsmini"):
        flags = variant.split("+")[1:]
        return lsmini_trainer(cfg, tm, lr_lambda, graph="graph" in flags, saved="saved" in flags,
                              data_parallel=data_parallel, lce="lce" in flags, compiled="compile" in flags)
    if data_parallel:
        raise ValueError("--nproc runs the lsmini variants only")
    if variant in HF_VARIANTS:
        return hf_trainer(cfg, tm, variant, lr_lambda)
    modes = {"eager": None, "compiled": "default", "compiled-graphs": "reduce-overhead"}
    return torch_trainer(cfg, tm, modes[variant], lr_lambda)


# ---- memory: what is allocated at the peak ------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEMORY_TRACE_ENTRIES = 2_000_000  # allocator events kept; a big step makes ~20k


def _site(frames):
    """Where an allocation was made: the innermost frame in lsmini or this benchmark, else the innermost
    Python frame (a torch module, or the optimizer)."""
    python = [f for f in frames if f["filename"].endswith(".py")]
    for f in python:
        if "/lsmini/" in f["filename"] or f["filename"].endswith("bench_training.py"):
            return f"{os.path.relpath(f['filename'], ROOT)}:{f['line']} ({f['name']})"
    if python:
        f = python[0]
        return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} ({f['name']})"
    return "(no Python frame)"


def peak_breakdown(trace, top=20):
    """From the allocator's event trace (torch.cuda.memory._snapshot()["device_traces"][device], recorded from
    before the model was built): the bytes allocated at the moment the most were, summed by allocation
    site, largest first, as [(site, MB, blocks)], and that peak in MB."""
    live, total, peak, peak_at = {}, 0, 0, -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev["size"]
            total += ev["size"]
            if total > peak:
                peak, peak_at = total, i
        elif ev["action"] in ("free_requested", "free_completed"):
            total -= live.pop(ev["addr"], 0)
    live = {}
    for ev in trace[:peak_at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] in ("free_requested", "free_completed"):
            live.pop(ev["addr"], None)
    sites = {}
    for ev in live.values():
        site = sites.setdefault(_site(ev.get("frames", [])), [0, 0])
        site[0] += ev["size"]
        site[1] += 1
    rows = sorted(((k, v[0] / 2 ** 20, v[1]) for k, v in sites.items()), key=lambda r: -r[1])
    return rows[:top], peak / 2 ** 20


# ---- the worker: one (config, variant) in this process ------------------------------------------------------
def run_worker(config, variant, steps, warmup, check, profile, memory=False):
    cfg = CONFIGS[config]
    if check:
        lr_lambda = lambda i: min(1.0, (i + 1) / CHECK_WARMUP)  # noqa: E731
        batches = [tuple(t.cuda() for t in b) for b in make_batches(cfg, CHECK_STEPS, seed=1)]
        step = make_trainer(cfg, variant, lr_lambda)
        losses = torch.stack([step(*b).clone() for b in batches]).float().cpu()  # a graph reuses its output
        return {"config": config, "variant": variant, "losses": losses.tolist()}

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # one process per GPU under torchrun; each rank trains on its own batches
        rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(rank)
        torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", rank))
    batches = [tuple(t.cuda() for t in b) for b in make_batches(cfg, 4, seed=torch.cuda.current_device())]
    if memory:  # from before the model exists, so parameters and optimizer state are in the trace too
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_TRACE_ENTRIES, stacks="python")
    step = make_trainer(cfg, variant, data_parallel=world > 1)
    torch.cuda.reset_peak_memory_stats()  # from the first step: a graph allocates its memory while recording
    t0 = time.perf_counter()
    for i in range(warmup):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    if memory:  # the warm-up reaches the peak (graphs record in it); recording would slow the timed steps
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        torch.cuda.memory._record_memory_history(enabled=None)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for i, (s, e) in enumerate(events):
        s.record()
        step(*batches[i % len(batches)])
        e.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in events)
    r = {"config": config, "variant": variant, "ms_step": ms, "tokens_s": world * tokens_per_step(cfg) / ms * 1e3,
         "peak_mb": torch.cuda.max_memory_allocated() / 2 ** 20, "warmup_s": warm_s, "gpus": world}
    if memory:
        r["memory_sites"], r["memory_trace_peak_mb"] = peak_breakdown(trace)
    if profile:
        r["profile"] = common.profile_step(step, batches)
    if world > 1:
        # Different data on every rank: only a working all-reduce leaves the replicas identical.
        ws = step.optimizer.workspace
        mine = torch.stack([ws.param_buffer(dt).double().sum() for dt in ws.dtypes])
        every = [torch.empty_like(mine) for _ in range(world)]
        torch.distributed.all_gather(every, mine)
        if any(not torch.equal(e, every[0]) for e in every):
            raise RuntimeError("data-parallel run: the ranks' parameters differ after training; the gradients "
                               "were not all-reduced")
        step.train_step.reset()  # a live graph with recorded collectives keeps the group from shutting down
        torch.distributed.destroy_process_group()
    return r


def spawn_worker(config, variant, args, nproc=1):
    launcher = [sys.executable] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = launcher + [os.path.abspath(__file__), "--worker", config, variant, "--steps", str(args.steps),
                      "--warmup", str(args.warmup)]
    cmd += ["--check"] if args.check else []
    cmd += ["--profile"] if args.profile else []
    cmd += ["--memory"] if args.memory else []
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]  # under torchrun: every rank's line
    if p.returncode != 0 or not lines:
        tail = "\n".join((p.stderr or p.stdout).splitlines()[-15:])
        print(f"# {config}/{variant} FAILED (exit {p.returncode}):\n{tail}", flush=True)
        return None
    return json.loads(lines[-1])


# ---- reports ---------------------------------------------------------------------------------------------
def speed_rows(results):
    rows = []
    by = {(r["config"], r["variant"]): r for r in results}
    for r in results:
        row = dict(r)
        for detail in ("profile", "memory_sites", "memory_trace_peak_mb"):
            row.pop(detail, None)
        for base, col in (("eager", "x_eager"), ("compiled", "x_compiled"), ("compiled-graphs", "x_compiled_graphs")):
            b = by.get((r["config"], base))
            if b is not None and r["variant"] != base:
                row[col] = b["ms_step"] / r["ms_step"]
        e = by.get((r["config"], "eager"))
        if e is not None:
            row["mem_vs_eager"] = r["peak_mb"] / e["peak_mb"]
        rows.append(row)
    return rows


def memory_report(results):
    out = []
    for r in results:
        if "memory_sites" not in r:
            continue
        out.append(f"### {r['config']} / {r['variant']}: peak {r['peak_mb']:,.0f} MB (allocator trace: "
                   f"{r['memory_trace_peak_mb']:,.0f} MB), what is allocated at that moment\n")
        out.append("| allocated at | MB | blocks |\n|---|---|---|")
        for site, mb, blocks in r["memory_sites"]:
            out.append(f"| `{site}` | {mb:,.1f} | {blocks} |")
        out.append("")
    return "\n".join(out)


def check_report(results):
    """Window means of each variant's loss curve side by side, and the largest relative gap to eager."""
    by = {}
    for r in results:
        by.setdefault(r["config"], {})[r["variant"]] = r["losses"]
    out = []
    for config, curves in by.items():
        names = list(curves)
        out.append(f"### {config}: loss, mean of each {CHECK_WINDOW}-step window\n")
        out.append("| steps | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        means = {n: [statistics.fmean(c[i:i + CHECK_WINDOW]) for i in range(0, len(c), CHECK_WINDOW)]
                 for n, c in curves.items()}
        for w in range(len(next(iter(means.values())))):
            out.append(f"| {w * CHECK_WINDOW + 1}–{(w + 1) * CHECK_WINDOW} | "
                       + " | ".join(f"{means[n][w]:.4f}" for n in names) + " |")
        if "eager" in means:
            for n in names:
                if n != "eager":
                    gap = max(abs(a - b) / b for a, b in zip(means[n][1:], means["eager"][1:]))
                    out.append(f"\n{n} vs eager: largest relative gap between window means after the first "
                               f"window {100 * gap:.2f}%")
        out.append("")
    return "\n".join(out)


def main_multi_gpu(args):
    """Throughput on one GPU and on args.nproc GPUs (each with the config's batch: the global batch grows
    with the GPUs, as in data-parallel training), and the scaling factor."""
    if torch.cuda.device_count() < args.nproc:
        sys.exit(f"--nproc {args.nproc}: only {torch.cuda.device_count()} CUDA devices")
    variants = {c: [v for v in args.variants or default_variants(c) if v.startswith("lsmini")] for c in args.configs}
    if not any(variants.values()):
        sys.exit("--nproc: choose lsmini variants (the PyTorch baselines are not data-parallel here)")
    env = common.environment()
    header = f"{args.nproc} × {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, NCCL, {env['date']}"
    print(f"# {header}", flush=True)
    rows = []
    for config in args.configs:
        for variant in variants[config]:
            one, many = spawn_worker(config, variant, args), spawn_worker(config, variant, args, args.nproc)
            if one is None or many is None or "skipped" in one or "skipped" in many:
                continue
            for r in (one, many):
                rows.append({"config": config, "variant": variant, "gpus": r["gpus"], "ms_step": r["ms_step"],
                             "tokens_s": r["tokens_s"], "peak_mb": r["peak_mb"],
                             "scaling": r["tokens_s"] / one["tokens_s"]})
            print(common.markdown_table(rows[-2:], MULTI_COLUMNS), flush=True)
    common.append_results(args.results, "training", env, [
        {"benchmark": "training_multi_gpu", "config": r["config"], "variant": r["variant"], "kind": "lsmini",
         "gpu": env["gpu"] if r["gpus"] == 1 else f"{r['gpus']} × {env['gpu']}", "ms": r["ms_step"],
         "tokens_s": r["tokens_s"], "peak_mb": r["peak_mb"], "scaling": r["scaling"] if r["gpus"] > 1 else None}
        for r in rows])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "training_multi_gpu.md"), "w") as f:
            f.write(f"{header}\n\n{common.markdown_table(rows, MULTI_COLUMNS)}\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=list(DEFAULT_CONFIGS), choices=list(CONFIGS),
                    help=f"default: {' '.join(DEFAULT_CONFIGS)}")
    ap.add_argument("--variants", nargs="*", choices=list(ALL_VARIANTS),
                    help=f"default: each config's own list: {' '.join(VARIANTS)}; llama: {' '.join(LLAMA_VARIANTS)}")
    ap.add_argument("--steps", type=int, default=30, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first (compilation happens here)")
    ap.add_argument("--check", action="store_true", help=f"train {CHECK_STEPS} steps per variant, compare losses")
    ap.add_argument("--profile", action="store_true", help="also profile where a step's time goes")
    ap.add_argument("--memory", action="store_true",
                    help="also report what is allocated at the peak, by the line of code that allocated it "
                         "(the allocator's history, recorded from before the model is built)")
    ap.add_argument("--nproc", type=int, default=1,
                    help="data-parallel on this many GPUs (torchrun + lsmini.distributed.GradientReducer), "
                         "reported beside one GPU; lsmini variants only")
    ap.add_argument("--out", metavar="DIR", help="also write this run's tables to DIR")
    common.add_results_arguments(ap)
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_training.py needs a CUDA device")
    if args.worker:
        try:
            r = run_worker(*args.worker, args.steps, args.warmup, args.check, args.profile, args.memory)
        except SkipVariant as e:  # reported by the parent, not a failure
            r = {"config": args.worker[0], "variant": args.worker[1], "skipped": str(e)}
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(r), flush=True)
        return
    if args.nproc > 1:
        return main_multi_gpu(args)
    import lsmini

    if lsmini.backend() != "cuda":
        sys.exit(f"lsmini backend is {lsmini.backend()!r}: {lsmini.backend().reason}")
    env = common.environment()
    header = f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}"
    print(f"# {header}", flush=True)
    results = []
    for config in args.configs:
        for variant in args.variants or default_variants(config):
            r = spawn_worker(config, variant, args)
            if r is not None and "skipped" in r:
                print(f"# {config}/{variant}: skipped: {r['skipped']}", flush=True)
            elif r is not None:
                results.append(r)
                if not args.check:
                    print(f"# {config}/{variant}: {r['ms_step']:.2f} ms/step, {r['tokens_s']:,.0f} tokens/s, "
                          f"peak {r['peak_mb']:.0f} MB (warm-up {r['warmup_s']:.0f} s)", flush=True)
    if args.check:
        text = check_report(results)
        name = "training_check.md"
    else:
        rows = speed_rows(results)
        text = common.markdown_table(rows, COLUMNS) + "\n\n" + common.profile_report(results) + memory_report(results)
        common.append_results(args.results, "training", env, [
            {"benchmark": "training", "config": r["config"], "variant": r["variant"],
             "kind": "lsmini" if r["variant"].startswith("lsmini") else "pytorch", "ms": r["ms_step"],
             "tokens_s": r["tokens_s"], "peak_mb": r["peak_mb"]} for r in rows])
        name = "training.md"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        if not args.check:
            common.write_csv(os.path.join(args.out, "training.csv"), rows, COLUMNS)
        with open(os.path.join(args.out, name), "w") as f:
            f.write(f"{header}\n\n{text}\n")


if __name__ == "__main__":
    main()
