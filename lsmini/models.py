"""Ready Transformer models built from lsmini.layers: an encoder-decoder (translation) and a decoder-only
causal language model. Both run on CPU (reference path) and CUDA (fused kernels), with float32
parameters (also under torch.autocast), float16 or bfloat16."""
import torch
from torch import nn

from lsmini.layers import TransformerConfig, TransformerDecoder, TransformerEmbedding, TransformerEncoder
from lsmini.layers.runtime import output_projection


def _check_common(owner, config, padding_idx, vocabs):
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"{owner}: config must be a TransformerConfig, got {type(config).__name__}")
    for name, v in vocabs:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{owner}: {name} must be an int >= 1, got {v!r}")
    if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, int)):
        raise TypeError(f"{owner}: padding_idx must be an int or None, got {type(padding_idx).__name__}")


def _check_positions(owner, config, learned_positions):
    if learned_positions and config.rotary is not None:
        raise ValueError(f"{owner}: learned_positions=True with config.rotary = {config.rotary}: a rotary model takes "
                         f"its positions in the attention, not from the embedding")


def _output_projection(hidden, vocab, tie_output, device, dtype):
    if tie_output:
        return None
    proj = nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
    nn.init.normal_(proj.weight, mean=0.0, std=hidden ** -0.5)
    return proj


def _check_tokens(owner, name, tokens):
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32) or tokens.dim() != 2:
        raise TypeError(f"{owner}: {name} must be an int64 [batch, len] tensor, got "
                        f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}")


class Transformer(nn.Module):
    """Encoder-decoder Transformer (e.g. translation).

    forward(src_tokens [b, ls], tgt_tokens [b, lt], features_only=False) → logits [b, lt, tgt_vocab_size];
    tgt_tokens is the decoder input (targets shifted right). With features_only=True: the decoder's output
    [b, lt, H] before the output projection (``output_weight()``), for ``LinearCrossEntropyLoss``. Source
    positions equal to ``padding_idx`` are masked out of attention; the decoder's self-attention is causal.

    encode(src_tokens) → (encoder_out [b, ls, H], encoder_padding_mask [b, ls] bool or None)
    decode(tgt_tokens, encoder_out, encoder_padding_mask, cache=None, features_only=False) → logits. With
    cache (a dict, start with {}), tgt_tokens holds the newest token(s) [b, 1]; their position is the number
    of steps already in the cache. reorder_cache(cache, new_order) for beam search.

    share_embeddings: one embedding table for source and target (needs src_vocab_size ==
    tgt_vocab_size). tie_output: the output projection is the target embedding table (no bias);
    otherwise a separate ``output_projection`` Linear without bias.
    """

    def __init__(self, src_vocab_size, tgt_vocab_size, config, num_encoder_layers=6, num_decoder_layers=6,
                 padding_idx=0, share_embeddings=False, tie_output=True, learned_positions=False, device=None,
                 dtype=None):
        super().__init__()
        owner = "Transformer"
        _check_common(owner, config, padding_idx, (("src_vocab_size", src_vocab_size),
                                                   ("tgt_vocab_size", tgt_vocab_size)))
        _check_positions(owner, config, learned_positions)
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(f"{owner}: share_embeddings=True needs src_vocab_size == tgt_vocab_size, got "
                             f"{src_vocab_size} and {tgt_vocab_size}")
        kw = {"device": device, "dtype": dtype}
        self.config = config
        self.padding_idx = padding_idx
        h = config.hidden_size

        def embed(vocab):
            return TransformerEmbedding(vocab, h, padding_idx, config.max_seq_len, config.dropout, learned_positions,
                                        positions=config.rotary is None, **kw)

        self.src_embed = embed(src_vocab_size)
        self.tgt_embed = self.src_embed if share_embeddings else embed(tgt_vocab_size)
        self.encoder = TransformerEncoder(config, num_encoder_layers, **kw)
        self.decoder = TransformerDecoder(config, num_decoder_layers, **kw)
        self.output_projection = _output_projection(h, tgt_vocab_size, tie_output, device, dtype)

    def output_weight(self):
        return self.tgt_embed.weight if self.output_projection is None else self.output_projection.weight

    def encode(self, src_tokens):
        _check_tokens("Transformer.encode", "src_tokens", src_tokens)
        mask = None if self.padding_idx is None else src_tokens.eq(self.src_embed.padding_idx)
        return self.encoder(self.src_embed(src_tokens), mask), mask

    def decode(self, tgt_tokens, encoder_out, encoder_padding_mask, cache=None, features_only=False):
        _check_tokens("Transformer.decode", "tgt_tokens", tgt_tokens)
        step = cache.get("step", 0) if cache is not None else 0
        y = self.decoder(self.tgt_embed(tgt_tokens, step), encoder_out, encoder_padding_mask, cache)
        return y if features_only else output_projection(y, self.output_weight())

    def forward(self, src_tokens, tgt_tokens, features_only=False):
        encoder_out, mask = self.encode(src_tokens)
        return self.decode(tgt_tokens, encoder_out, mask, features_only=features_only)

    def reorder_cache(self, cache, new_order):
        return self.decoder.reorder_cache(cache, new_order)


class TransformerLM(nn.Module):
    """Decoder-only causal language model: embedding, ``num_layers`` causal self-attention layers
    (TransformerEncoder with causal=True), output projection.

    forward(tokens [b, l], cache=None, features_only=False) → logits [b, l, vocab_size] (with features_only:
    the last layer's output [b, l, H] before the output projection ``output_weight()``, for
    ``LinearCrossEntropyLoss``). Tokens equal to ``padding_idx`` are masked out as keys. With cache (a dict,
    start with {}): incremental decoding, tokens holds the newest token(s) [b, 1]. reorder_cache(cache,
    new_order) for beam search.
    """

    def __init__(self, vocab_size, config, num_layers, padding_idx=0, tie_output=True, learned_positions=False,
                 device=None, dtype=None):
        super().__init__()
        _check_common("TransformerLM", config, padding_idx, (("vocab_size", vocab_size),))
        _check_positions("TransformerLM", config, learned_positions)
        kw = {"device": device, "dtype": dtype}
        self.config = config
        self.padding_idx = padding_idx
        h = config.hidden_size
        self.embed = TransformerEmbedding(vocab_size, h, padding_idx, config.max_seq_len, config.dropout,
                                          learned_positions, positions=config.rotary is None, **kw)
        self.decoder = TransformerEncoder(config, num_layers, **kw)
        self.output_projection = _output_projection(h, vocab_size, tie_output, device, dtype)

    def output_weight(self):
        return self.embed.weight if self.output_projection is None else self.output_projection.weight

    def forward(self, tokens, cache=None, features_only=False):
        _check_tokens("TransformerLM", "tokens", tokens)
        mask = None if self.padding_idx is None else tokens.eq(self.embed.padding_idx)
        if cache is None:
            h = self.decoder(self.embed(tokens), mask, causal=True)
        else:
            if not isinstance(cache, dict):
                raise TypeError(f"TransformerLM: cache must be a dict (start with {{}}) or None, got "
                                f"{type(cache).__name__}")
            past_mask = cache.get("padding_mask")
            if mask is not None and past_mask is not None:
                mask = torch.cat([past_mask, mask], 1)
            h = self.decoder(self.embed(tokens, cache.get("step", 0)), mask, causal=True, cache=cache)
            if mask is not None:
                cache["padding_mask"] = mask
        return h if features_only else output_projection(h, self.output_weight())

    def reorder_cache(self, cache, new_order):
        return self.decoder.reorder_cache(cache, new_order)
