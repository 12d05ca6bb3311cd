"""TransformerEmbedding: token lookup·sqrt(hidden) + positions + dropout in one fused kernel."""
import math

import torch
from torch import nn

from lsmini.ops.embedding import embedding, sinusoidal_positions


class TransformerEmbedding(nn.Module):
    """Token + position embedding of a Transformer.

        out[b, j] = dropout(sqrt(hidden) · weight[tokens[b, j]] + pos[step + j]);  pad tokens → 0

    ``weight`` [vocab_size, hidden_size] is an ordinary Parameter (share it between modules or tie it
    to an output projection). Positions: a fixed sinusoidal table (buffer ``pos_table``, not in the
    state_dict), with ``learned_positions=True`` a trained Parameter ``pos_embedding`` [max_seq_len,
    hidden_size], or with ``positions=False`` none (models whose layers apply rotary positions; pos_table
    is then zeros, which the fused kernel adds). ``padding_idx`` rows are zero and get no gradient (None: no padding).

    forward(tokens [batch, len] int64/int32, step=0) → [batch, len, hidden] in weight's dtype; ``step``
    is the position of the first column (incremental decoding). step + len must be ≤ max_seq_len.
    ``check_tokens`` (attribute, default True) validates the ids with one host sync per call; set it
    False in a training loop once the data is known to be clean (bad ids then give zero rows, never an
    out-of-bounds read).
    """

    def __init__(self, vocab_size, hidden_size, padding_idx, max_seq_len, dropout, learned_positions=False,
                 device=None, dtype=None, positions=True):
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("hidden_size", hidden_size), ("max_seq_len", max_seq_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TransformerEmbedding: {name} must be an int >= 1, got {v!r}")
        if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, int)
                                        or not -vocab_size <= padding_idx < vocab_size):
            raise ValueError(f"TransformerEmbedding: padding_idx must be None or an int in [-{vocab_size}, "
                             f"{vocab_size}), got {padding_idx!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"TransformerEmbedding: dropout must be a float in [0, 1), got {dropout!r}")
        if not isinstance(positions, bool):
            raise TypeError(f"TransformerEmbedding: positions must be a bool, got {type(positions).__name__}")
        if not positions and learned_positions:
            raise ValueError("TransformerEmbedding: learned_positions=True needs positions=True")
        if positions and not learned_positions and hidden_size % 2:
            raise ValueError(f"TransformerEmbedding: sinusoidal positions need an even hidden_size, got {hidden_size} "
                             f"(or use learned_positions=True)")
        kw = {"device": device, "dtype": dtype}
        self.vocab_size, self.hidden_size, self.max_seq_len = vocab_size, hidden_size, max_seq_len
        self.padding_idx = None if padding_idx is None else padding_idx % vocab_size
        self.dropout = float(dropout)
        self.learned_positions = bool(learned_positions)
        self.positions = positions
        self.scale = math.sqrt(hidden_size)
        self.check_tokens = True
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, **kw))
        if self.learned_positions:
            self.pos_embedding = nn.Parameter(torch.empty(max_seq_len, hidden_size, **kw))
        else:
            table = sinusoidal_positions(max_seq_len, hidden_size, device=device) if positions else \
                torch.zeros(max_seq_len, hidden_size, device=device)
            self.register_buffer("pos_table", table.to(dtype or torch.get_default_dtype()), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        # N(0, 1/hidden): after the sqrt(hidden) scale the token part has unit variance
        with torch.no_grad():
            nn.init.normal_(self.weight, mean=0.0, std=self.hidden_size ** -0.5)
            if self.padding_idx is not None:
                self.weight[self.padding_idx].zero_()
            if self.learned_positions:
                nn.init.normal_(self.pos_embedding, mean=0.0, std=self.hidden_size ** -0.5)

    def forward(self, tokens, step=0):
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
            raise ValueError(f"TransformerEmbedding: tokens must be a [batch, len] tensor, got "
                             f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"TransformerEmbedding: step must be an int >= 0, got {step!r}")
        if step + tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"TransformerEmbedding: step + len = {step} + {tokens.shape[1]} = "
                             f"{step + tokens.shape[1]} > max_seq_len = {self.max_seq_len}")
        pos = self.pos_embedding if self.learned_positions else self.pos_table
        return embedding(tokens, self.weight, pos, self.scale, self.padding_idx, step, self.dropout, self.training,
                         learned_positions=self.learned_positions, check_tokens=self.check_tokens)

    def extra_repr(self):
        return (f"{self.vocab_size}, {self.hidden_size}, padding_idx={self.padding_idx}, "
                f"max_seq_len={self.max_seq_len}, dropout={self.dropout}, learned_positions={self.learned_positions}"
                f"{'' if self.positions else ', positions=False'}")
