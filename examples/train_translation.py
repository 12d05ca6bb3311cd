"""Train a Transformer translation model with lsmini, then translate with beam search and score BLEU.

    python examples/train_translation.py                     # the built-in en→zl task, a tiny model
    python examples/train_translation.py --train-src train.de --train-tgt train.en \\
        --valid-src valid.de --valid-tgt valid.en --test-src test.de --test-tgt test.en --arch base
    python examples/train_translation.py --translate < sentences.txt   # with the model in --save-dir
    torchrun --standalone --nproc_per_node=2 examples/train_translation.py   # data-parallel on 2 GPUs

With no data flags it trains on the built-in parallel corpus (examples/builtin_data.py: English to an
invented verb-final language with gender/number/case agreement), written to <save-dir>/data.
Everything the run produces lives in --save-dir: the sentencepiece model (spm.model), the token cache,
checkpoint_last.pt, hypotheses.<split>.txt and metrics.json.
"""
import argparse
import dataclasses
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import builtin_data  # noqa: E402
from training import batching, cli, run, tokenizer  # noqa: E402
from training.data import DataError, decode_lines, encode_cached, read_lines  # noqa: E402
from training.tokenizer import BOS, EOS, PAD, unknown_pieces_note  # noqa: E402
from training.trainer import format_ppl  # noqa: E402

# encoder+decoder layers, hidden, heads, FFN; defaults of --dropout --lr --warmup --max-tokens; the least
# steps (and epochs, where not 3) of a run without --epochs/--max-steps (tiny: 3 epochs, sized for a CPU run)
ARCHS = {
    "tiny": dict(layers=2, hidden=128, heads=4, ffn=512, dropout=0.1, lr=2e-3, warmup=200, max_tokens=2048,
                 min_steps=0),
    "small": dict(layers=6, hidden=512, heads=4, ffn=1024, dropout=0.3, lr=1e-3, warmup=4000, max_tokens=8192,
                  min_steps=1500, min_epochs=6),
    "base": dict(layers=6, hidden=512, heads=8, ffn=2048, dropout=0.1, lr=7e-4, warmup=4000, max_tokens=4096,
                 min_steps=2000),
    "big": dict(layers=6, hidden=1024, heads=16, ffn=4096, dropout=0.3, lr=5e-4, warmup=4000, max_tokens=4096,
                min_steps=2000),
}


# ---- data ---------------------------------------------------------------------------------------------
class ParallelBatches:
    """Token-budget batches of a parallel corpus, built once. get(i) gives (source [b, ls] ending in EOS,
    decoder input [b, lt] = BOS + target, decoder output [b, lt] = target + EOS), PAD-padded to a multiple
    of 8; tokens(i) counts the target tokens (EOS included) of batch i."""

    def __init__(self, src, tgt, max_tokens):
        self.src, self.tgt = src, tgt
        sl, tl = src.lengths + 1, tgt.lengths + 1
        longer = np.maximum(sl, tl)
        self.batches = batching.token_batches(longer, max_tokens, sort_keys=(longer, sl, tl))
        self._tokens = [int(tl[b].sum()) for b in self.batches]
        # (rows, padded source length, padded target length) of every batch
        self.shapes = [(len(b), batching.round_up(int(sl[b].max())), batching.round_up(int(tl[b].max())))
                       for b in self.batches]

    def __len__(self):
        return len(self.batches)

    def tokens(self, i):
        return self._tokens[i]

    def get(self, i, pin=False):
        idx = self.batches[i]
        src_rows = [self.src[j] for j in idx]
        tgt_rows = [self.tgt[j] for j in idx]
        _, ws, wt = self.shapes[i]
        return (batching.padded_tensor(src_rows, ws, pin, suffix=EOS),
                batching.padded_tensor(tgt_rows, wt, pin, prefix=BOS),
                batching.padded_tensor(tgt_rows, wt, pin, suffix=EOS))


def filter_valid(src, tgt, lines, max_len, path, log):
    """Keep validation pairs within max_len tokens (with EOS) on both sides, as training does: the model is
    built for that length. Says how many went (and the first of them, by file and line); returns
    (src, tgt, (source lines, target lines)) of the pairs kept."""
    sl, tl = src.lengths + 1, tgt.lengths + 1
    keep = np.nonzero((sl <= max_len) & (tl <= max_len))[0]
    dropped = len(sl) - len(keep)
    if not dropped:
        return src, tgt, lines
    first = int(np.nonzero((sl > max_len) | (tl > max_len))[0][0])
    if len(keep) == 0:
        raise DataError(f"no validation pair is within --max-len {max_len} tokens ({path[0]}, {path[1]}); raise "
                        "--max-len")
    log(f"valid: skipped {dropped} of {len(sl)} pairs longer than --max-len {max_len} tokens (the first: line "
        f"{first + 1} of {path[0]} / {path[1]})")
    return src.subset(keep), tgt.subset(keep), tuple([side[i] for i in keep] for side in lines)


def check_test_sources(src, max_len, path):
    """A test source line longer than the model takes is refused before training (its translation could
    not be scored fairly), naming the file and the line."""
    too_long = np.nonzero(src.lengths + 1 > max_len)[0]
    if len(too_long):
        i = int(too_long[0])
        raise DataError(f"--test-src: {path} line {i + 1} has {int(src.lengths[i])} tokens, more than the "
                        f"{max_len - 1} the model takes (--max-len {max_len}, EOS included); {len(too_long)} "
                        "line(s) are that long: raise --max-len or shorten them")


def filter_train(src, tgt, max_len, log):
    """Keep training pairs with both sides non-empty and within max_len tokens (with EOS); say how many went."""
    sl, tl = src.lengths + 1, tgt.lengths + 1
    keep = np.nonzero((sl <= max_len) & (tl <= max_len) & (sl > 1) & (tl > 1))[0]
    dropped = len(sl) - len(keep)
    if dropped:
        log(f"train: skipped {dropped} of {len(sl)} pairs (an empty side, or longer than --max-len {max_len} tokens)")
    if len(keep) == 0:
        raise DataError(f"no training pair left (all empty or longer than --max-len {max_len})")
    return (src, tgt) if not dropped else (src.subset(keep), tgt.subset(keep))



# ---- decoding -----------------------------------------------------------------------------------------
def _next_log_probs(model, last, enc, enc_mask, cache, limit_reached):
    """log p(next token) [rows, V] in fp32; PAD/BOS never come next; rows at their length limit may only end."""
    logits = model.decode(last, enc, enc_mask, cache)[:, -1]
    lprobs = torch.log_softmax(logits.float(), dim=-1)
    lprobs[:, PAD] = -math.inf
    lprobs[:, BOS] = -math.inf
    if limit_reached.any():
        eos = lprobs[:, EOS].clone()
        lprobs[limit_reached] = -math.inf
        lprobs[:, EOS] = eos
    return lprobs


# A decoding batch holds as many sentences as this many training batches: a decoding step's time is mostly
# the host's (one token a sentence, launches and one read-back a step), so fewer, larger batches take fewer
# steps; finished sentences leave the batch, so sentences of other lengths cost little.
DECODE_BATCHES = 4


@torch.no_grad()
def greedy_search(model, src, max_lens):
    """Greedy decoding. src [b, ls] (EOS-terminated, PAD-padded); max_lens[i]: the most tokens sentence i may
    produce before its EOS. Returns token-id lists without EOS."""
    b, device = src.size(0), src.device
    enc, enc_mask = model.encode(src)
    cache = {}
    last = torch.full((b, 1), BOS, dtype=torch.long, device=device)
    limits = torch.tensor(max_lens, device=device)
    out = [[] for _ in range(b)]
    done = [False] * b
    for t in range(max(max_lens) + 1):
        lprobs = _next_log_probs(model, last, enc, enc_mask, cache, limits <= t)
        enc = None  # its keys/values are in the cache now
        tok = lprobs.argmax(dim=-1)
        for i, x in enumerate(tok.tolist()):
            if not done[i]:
                if x == EOS:
                    done[i] = True
                else:
                    out[i].append(x)
        if all(done):
            break
        last = tok[:, None]
    return out


@torch.no_grad()
def beam_search(model, src, beam, max_lens, lenpen=1.0):
    """Beam search with incremental decoding through the decoder cache. Each step keeps `beam` live
    hypotheses per sentence out of the 2·beam best extensions; an EOS extension among the best `beam`
    finishes a hypothesis (ranked by score / length**lenpen, length counting the EOS); a sentence is done
    when it has `beam` finished hypotheses, and leaves the batch (its cache rows are dropped).
    Arguments as greedy_search; beam 1 gives greedy_search's output."""
    b, device = src.size(0), src.device
    enc, enc_mask = model.encode(src)
    rows = torch.arange(b, device=device).repeat_interleave(beam)
    enc, enc_mask = enc.index_select(0, rows), enc_mask.index_select(0, rows)
    cache = {}
    alive = list(range(b))  # sentence of each group of `beam` rows
    history = torch.full((b * beam, 0), PAD, dtype=torch.long)  # tokens so far (CPU), BOS excluded
    last = torch.full((b * beam, 1), BOS, dtype=torch.long, device=device)
    # float64 scores: adding a long prefix's score must not round away the gap between two extensions
    scores = torch.zeros(b, beam, dtype=torch.float64, device=device)
    scores[:, 1:] = -math.inf  # all beams start identical: extend only the first
    finished = [[] for _ in range(b)]
    best = [None] * b
    max_lens = np.asarray(max_lens)
    for t in range(int(max_lens.max()) + 1):
        limit = torch.from_numpy(max_lens[alive] <= t).to(device).repeat_interleave(beam)
        lprobs = _next_log_probs(model, last, enc, enc_mask, cache, limit)
        enc = None  # its keys/values are in the cache now
        vocab = lprobs.size(1)
        n = len(alive)
        cand = (scores.view(-1, 1) + lprobs.double()).view(n, beam * vocab)
        top_scores, top_index = (x.cpu().numpy() for x in cand.topk(2 * beam, dim=1))  # the step's one read-back
        # candidates in score order: an EOS among the best `beam` finishes a hypothesis, the first `beam`
        # others extend the live ones; -inf candidates (extensions of dead copies) are neither
        tok = top_index % vocab
        row = np.arange(n)[:, None] * beam + top_index // vocab
        real = top_scores > -math.inf
        eos = real & (tok == EOS)
        for j, r in zip(*np.nonzero(eos[:, :beam])):
            finished[alive[j]].append((float(top_scores[j, r]) / (t + 1) ** lenpen, history[int(row[j, r])].tolist()))
        extend = real & ~eos
        picked = extend & (np.cumsum(extend, axis=1) <= beam)
        count = picked.sum(axis=1)
        done = (count == 0) | (np.array([len(finished[s]) for s in alive]) >= beam)
        for j in np.nonzero(done)[0]:
            s = alive[j]
            best[s] = max(finished[s], key=lambda h: h[0])[1] if finished[s] else []
        go = np.nonzero(~done)[0]
        if not len(go):
            break
        # the picked columns in score order; fewer than `beam`: padded with dead copies of the first
        col = np.argsort(~picked[go], axis=1, kind="stable")[:, :beam]
        real_slot = np.arange(beam)[None, :] < count[go][:, None]
        col = np.where(real_slot, col, col[:, :1])
        order_cpu = torch.from_numpy(np.take_along_axis(row[go], col, 1).reshape(-1))
        order = order_cpu.to(device)
        model.reorder_cache(cache, order)
        enc_mask = enc_mask.index_select(0, order)
        tok_cpu = torch.from_numpy(np.take_along_axis(tok[go], col, 1).reshape(-1))
        history = torch.cat([history.index_select(0, order_cpu), tok_cpu[:, None]], dim=1)
        last = tok_cpu.to(device)[:, None]
        scores = torch.from_numpy(np.where(real_slot, np.take_along_axis(top_scores[go], col, 1), -math.inf)).to(device)
        alive = [alive[j] for j in go]
    for s in alive:  # only reachable if the loop ran out of steps, which the forced EOS prevents
        if best[s] is None:
            best[s] = max(finished[s], key=lambda h: h[0])[1] if finished[s] else []
    return best


def translate_ids(model, src_ids, args, device, max_seq_len, shard=(0, 1)):
    """Translate sentences given as token-id lists (no EOS); returns output id lists, in input order.
    shard=(r, n): translate only batches r, r+n, ... (the other entries stay None)."""
    if not src_ids:
        return []
    lengths = np.array([len(x) + 1 for x in src_ids], dtype=np.int64)
    max_lens = np.minimum(max_seq_len - 1, (args.max_len_a * (lengths - 1) + args.max_len_b).astype(np.int64))
    max_lens = np.maximum(max_lens, 1)
    # rows × the wider of source and output within DECODE_BATCHES × --max-tokens; the model's batch budget
    # covers the `beam` copies of such a batch that decoding runs (decoding_rows)
    width = np.maximum(lengths, max_lens + 1)
    batch_tokens = max(DECODE_BATCHES * args.max_tokens, batching.round_up(int(width.max())))
    batches = batching.token_batches(width, batch_tokens, sort_keys=(width,))
    out = [None] * len(src_ids)
    for idx in batches[shard[0]::shard[1]]:
        rows = [src_ids[i] for i in idx]
        src_width = batching.round_up(max(len(r) for r in rows) + 1)
        src = batching.padded_tensor(rows, src_width, False, suffix=EOS).to(device)
        limits = [int(max_lens[i]) for i in idx]
        hyps = greedy_search(model, src, limits) if args.beam == 1 else beam_search(model, src, args.beam, limits,
                                                                                     args.lenpen)
        for i, h in zip(idx, hyps):
            out[i] = h
    return out


def fit_to_model(ids, max_seq_len, what, warn, first_line=1):
    """Cut token-id lists longer than the model takes (max_seq_len - 1 tokens, plus EOS) to that length,
    warning once per line cut (`what` line N, numbered from first_line)."""
    limit = max_seq_len - 1
    out = []
    for n, x in enumerate(ids, first_line):
        if len(x) > limit:
            warn(f"warning: {what} line {n} has {len(x)} tokens; this model takes at most {limit}: "
                 f"translating its first {limit}")
            x = x[:limit]
        out.append(x)
    return out


def translate_lines(lines, args, model, sp, max_seq_len, device, what, warn, first_line=1, check_unknown=False):
    """Translations of `lines` (str): a blank line gives a blank line, a line longer than the model takes
    is cut to it (with a warning naming the line). check_unknown: warn when many of the lines' tokens are
    unknown to the tokenizer (tokenizer.unknown_pieces_note)."""
    ids = sp.encode(lines)
    note = unknown_pieces_note(ids, sp, lines) if check_unknown else None
    if note:
        warn(f"warning: {what}" + (f" line {first_line}" if len(lines) == 1 else "") + f": {note}")
    ids = fit_to_model(ids, max_seq_len, what, warn, first_line)
    todo = [i for i, line in enumerate(lines) if line.strip() and ids[i]]
    out = [""] * len(lines)
    if todo:
        for i, h in zip(todo, translate_ids(model, [ids[i] for i in todo], args, device, max_seq_len)):
            out[i] = sp.decode(h)
    return out


def corpus_bleu(hyps, refs):
    """sacrebleu's corpus BLEU, or None when sacrebleu is not installed."""
    try:
        import sacrebleu
    except ImportError:
        return None
    return float(sacrebleu.corpus_bleu(hyps, [refs]).score)


def translate_stdin(args, model, sp, max_seq_len, device, log):
    """--translate: translate stdin line by line when it is a terminal, else all of it in batches. Blank
    lines stay blank; a line longer than the model takes is translated cut to that length, with a warning."""
    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    interactive = sys.stdin.isatty()
    if interactive:
        log("type a sentence and press Enter (Ctrl-D to quit)")
        for n, raw in enumerate(iter(stdin.readline, b""), 1):
            try:
                lines = decode_lines(raw, f"stdin line {n}") or [""]
            except DataError as e:
                print(f"error: {e}", file=sys.stderr)
                continue
            print(translate_lines(lines, args, model, sp, max_seq_len, device, "stdin", log, first_line=n,
                                  check_unknown=True)[0], flush=True)
        return
    lines = decode_lines(stdin.read(), "stdin")
    if not lines:
        return
    for h in translate_lines(lines, args, model, sp, max_seq_len, device, "stdin", log, check_unknown=True):
        sys.stdout.write(h + "\n")
    sys.stdout.flush()


def translate_split(args, model, data, src_lines, source_ids, device, dist):
    """Translations (str) of a split's source lines, each rank translating a share of the batches; the
    full list on rank 0 (None elsewhere). Blank source lines give blank translations."""
    src_ids = [list(map(int, source_ids[i])) for i in range(len(src_lines))]
    todo = [i for i, x in enumerate(src_ids) if x]
    shares = dist.gather(translate_ids(model, [src_ids[i] for i in todo], args, device, data.max_seq_len,
                                       (dist.rank, dist.world)))
    if not dist.is_main:
        return None
    out = [""] * len(src_ids)
    for i, column in zip(todo, zip(*shares)):
        out[i] = data.tokenizer.decode(next(h for h in column if h is not None))
    return out


# ---- the task -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class TranslationData(run.TaskData):
    """The batches, and what is translated and scored after training: the test split (the validation split
    when there is none), its (source, reference) lines and its source ids."""
    eval_split: str
    eval_lines: tuple
    eval_source_ids: object
    valid_lines: tuple  # the (source, reference) lines of the validation pairs kept, for --eval-bleu
    valid_source_ids: object


class TranslationTask(run.Task):
    name = "translation"
    description = "Train an lsmini Transformer translation model (no arguments: the built-in en→zl task)."
    archs = ARCHS
    arch_sizes = ("tiny: 2+2 layers 128 hidden; small: 6+6, 512, 4 heads, FFN 1024; base: 6+6, 512, 8 heads, "
                  "FFN 2048; big: 6+6, 1024, 16 heads, FFN 4096")
    label_smoothing = 0.1
    default_save_dir = os.path.join("checkpoints", "translation")
    best_metrics = ("valid_loss", "bleu")

    def add_data_args(self, parser):
        g = parser.add_argument_group("data (plain UTF-8 text, one sentence per line; none given: the built-in task)")
        for split in ("train", "valid", "test"):
            g.add_argument(f"--{split}-src", help=f"{split} source sentences")
            g.add_argument(f"--{split}-tgt", help=f"{split} target sentences, line by line parallel to --{split}-src")
        g.add_argument("--max-len", type=int, default=256,
                       help="longest sentence in tokens (EOS included; default 256); longer training pairs are "
                            "skipped (and counted)")

    def add_model_args(self, group):
        group.add_argument("--share-embeddings", action=argparse.BooleanOptionalAction, default=True,
                           help="one embedding matrix for source, target and output projection (default on: the "
                                "vocabulary is joint)")

    def add_mode_args(self, parser):
        g = parser.add_argument_group("translation")
        g.add_argument("--beam", type=int, default=4, help="beam size (default 4; 1: greedy)")
        g.add_argument("--lenpen", type=float, default=1.0,
                       help="length penalty: hypotheses rank by score / length**lenpen (default 1.0)")
        g.add_argument("--max-len-a", type=float, default=1.2,
                       help="output length limit: a * source length + b (default a=1.2)")
        g.add_argument("--max-len-b", type=int, default=10, help="(default 10)")
        g.add_argument("--eval-bleu", action="store_true",
                       help="also translate the validation set at every validation (with --beam and --lenpen) and "
                            "report its BLEU (needs sacrebleu)")
        g.add_argument("--translate", action="store_true",
                       help="translate sentences read from stdin with the model in --save-dir (no training)")

    def check_data_flags(self, parser, args):
        real = [getattr(args, f"{s}_{side}") for s in ("train", "valid") for side in ("src", "tgt")]
        test = [args.test_src, args.test_tgt]
        builtin = not any(real + test)
        if not builtin and not args.translate:
            if not all(real):
                parser.error("real data needs all four of --train-src --train-tgt --valid-src --valid-tgt")
            if any(test) and not all(test):
                parser.error("--test-src and --test-tgt go together")
        return builtin

    def check_args(self, parser, args):
        if args.beam < 1:
            parser.error(f"--beam must be >= 1, got {args.beam}")
        if args.max_len < 2:
            parser.error(f"--max-len must be >= 2, got {args.max_len}")
        # decoding: a hypothesis may run to max_len_a · source length + max_len_b tokens (at least one word and
        # the end of sentence), ranked by score / length**lenpen (a negative lenpen would favour the shortest)
        if not (math.isfinite(args.lenpen) and args.lenpen >= 0):
            parser.error(f"--lenpen must be a finite number >= 0, got {args.lenpen}")
        if not (math.isfinite(args.max_len_a) and args.max_len_a >= 0):
            parser.error(f"--max-len-a must be a finite number >= 0, got {args.max_len_a}")
        if args.max_len_b < 2:
            parser.error(f"--max-len-b must be >= 2 (a word and the end of sentence), got {args.max_len_b}")
        if args.best_metric == "bleu" and not args.eval_bleu:
            parser.error("--best-metric bleu needs --eval-bleu (validation BLEU is computed only then)")
        if args.eval_bleu and not args.translate:
            try:
                import sacrebleu  # noqa: F401
            except ImportError:
                parser.error("--eval-bleu needs sacrebleu, which is not installed: pip install sacrebleu (or the "
                             "lsmini[bleu] extra)")
        if args.max_tokens < batching.round_up(args.max_len):
            parser.error(f"--max-tokens ({args.max_tokens}) must hold one sentence of --max-len ({args.max_len}) "
                         "tokens")

    def inference_mode(self, args):
        return "--translate" if args.translate else None

    def decoding_rows(self, args):
        return args.beam * DECODE_BATCHES

    def infer(self, args, model, sp, max_seq_len, device):
        translate_stdin(args, model, sp, max_seq_len, device, lambda m: print(m, file=sys.stderr))

    def read_data(self, args, log, dist):
        """{split: (src, tgt) lines} and {split: (src_path, tgt_path)}; the line counts of a split must match."""
        if args.builtin:
            data_dir = os.path.join(args.save_dir, "data")
            paths = dist.from_main(lambda: builtin_data.write_translation_corpus(data_dir))
            log(f"data: built-in en→zl corpus in {data_dir}")
        else:
            paths = {"train": (args.train_src, args.train_tgt), "valid": (args.valid_src, args.valid_tgt)}
            if args.test_src:
                paths["test"] = (args.test_src, args.test_tgt)
        lines = {}
        for split, (src_path, tgt_path) in paths.items():
            src = read_lines(src_path, f"--{split}-src")
            tgt = read_lines(tgt_path, f"--{split}-tgt")
            if len(src) != len(tgt):
                raise DataError(f"{split} data: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; the "
                                "files of a parallel corpus must have one target line per source line")
            lines[split] = (src, tgt)
        return lines, paths

    def tokenize(self, args, lines, paths, log, train):
        """One joint vocabulary, learnt from both sides of the training data; ids {split: (src, tgt)}."""
        if args.resume:
            log(f"tokenizer: {os.path.join(args.save_dir, tokenizer.SPM_NAME)} (from the checkpoint's run)")
        sources = [(f"--train-{side}", path, side_lines)
                   for side, path, side_lines in zip(("src", "tgt"), paths["train"], lines["train"])]
        sp, spm_path = tokenizer.train_or_load(args, sources, log, train)
        cache_dir = os.path.join(args.save_dir, "cache")
        ids = {split: tuple(encode_cached(sp, spm_path, ls, p, cache_dir) for ls, p in zip(lines[split], paths[split]))
               for split in lines}
        return sp, ids

    def data_files(self, paths, ids):
        return [(f"--{split}-{side}", path, arr.flat) for split in paths
                for side, path, arr in zip(("src", "tgt"), paths[split], ids[split])]

    def make_batches(self, args, lines, paths, sp, ids, log):
        if "test" in ids:
            check_test_sources(ids["test"][0], args.max_len, paths["test"][0])
        train_src, train_tgt = filter_train(*ids["train"], args.max_len, log)
        valid_src, valid_tgt, valid_lines = filter_valid(*ids["valid"], lines["valid"], args.max_len, paths["valid"],
                                                         log)
        ids = dict(ids, valid=(valid_src, valid_tgt))
        lines = dict(lines, valid=valid_lines)
        eval_split = "test" if "test" in ids else "valid"
        # what the model reads (valid pairs, test sources) is within --max-len now; test references are only
        # compared with the output
        longest = max(int(a.lengths.max()) + 1 for a in (valid_src, valid_tgt) + ((ids["test"][0],) if "test" in ids
                                                                                   else ()))
        max_seq_len = batching.round_up(max(args.max_len, longest))
        train_batches = ParallelBatches(train_src, train_tgt, args.max_tokens)
        valid_batches = ParallelBatches(*ids["valid"], max(args.max_tokens, batching.round_up(longest)))
        log(f"data: {len(train_src)} training pairs in {len(train_batches)} batches of <= {args.max_tokens} tokens, "
            f"{len(ids['valid'][0])} valid" + (f", {len(ids['test'][0])} test" if "test" in ids else "") +
            f"; joint vocabulary {sp.get_piece_size()}")
        return TranslationData(sp, train_batches, valid_batches, max_seq_len, eval_split, lines[eval_split],
                               ids[eval_split][0], lines["valid"], ids["valid"][0])

    def model_config(self, args, vocab_size, max_seq_len):
        arch = ARCHS[args.arch]
        return {"arch": args.arch, "vocab_size": vocab_size, "encoder_layers": arch["layers"],
                "decoder_layers": arch["layers"], "share_embeddings": args.share_embeddings,
                "config": cli.layer_config(args, arch, "relu", max_seq_len)}

    def make_model(self, mc, config):
        from lsmini.models import Transformer

        return Transformer(mc["vocab_size"], mc["vocab_size"], config, num_encoder_layers=mc["encoder_layers"],
                           num_decoder_layers=mc["decoder_layers"], padding_idx=PAD,
                           share_embeddings=mc["share_embeddings"], tie_output=True)

    def logits_and_target(self, model, batch):
        src, tgt_in, tgt_out = batch
        return model(src, tgt_in), tgt_out

    def validation_scorer(self, args, data, device, dist):
        if not args.eval_bleu:
            return None

        def valid_bleu(model):
            model.eval()
            hyps = translate_split(args, model, data, data.valid_lines[0], data.valid_source_ids, device, dist)
            # rank 0 scores; every rank needs the value (--best-metric bleu, --patience decide on it)
            return dist.from_main(lambda: corpus_bleu(hyps, data.valid_lines[1]))

        return valid_bleu

    def after_training(self, args, model, data, device, dist, log):
        """Translate the test set (or the validation set), each rank a share of the batches, and score it."""
        return self.score(args, model, data, device, dist, log, None)

    def score(self, args, model, data, device, dist, log, label):
        """Translate and score the test set (or the validation set) with the parameters in `model`; the
        translations go to hypotheses.<split>.txt (hypotheses.<split>.<label>.txt for "best", "average")."""
        model.eval()
        t0 = time.perf_counter()
        src_lines, ref_lines = data.eval_lines
        hyps = translate_split(args, model, data, src_lines, data.eval_source_ids, device, dist)
        if not dist.is_main:
            return {}
        name = f"hypotheses.{data.eval_split}.txt" if label is None else f"hypotheses.{data.eval_split}.{label}.txt"
        hyp_path = os.path.join(args.save_dir, name)
        with open(hyp_path, "w", encoding="utf-8") as f:
            f.writelines(h + "\n" for h in hyps)
        bleu = corpus_bleu(hyps, ref_lines)
        search = "greedy" if args.beam == 1 else f"beam {args.beam}"
        what = data.eval_split + ("" if label is None else f" ({label} checkpoint)")
        if bleu is None:
            log(f"{what}: translations in {hyp_path}; sacrebleu is not installed, so no BLEU (pip install "
                "sacrebleu); reporting loss only")
        else:
            log(f"{what}: BLEU {bleu:.2f} ({search}, sacrebleu, {len(hyps)} sentences, "
                f"{time.perf_counter() - t0:.1f}s); translations in {hyp_path}")
        return {"bleu": bleu, "bleu_split": data.eval_split}

    def summary(self, metrics):
        bleu, tps = metrics["bleu"], metrics["tokens_per_s"]
        return (f"train loss {metrics['train_loss']:.3f}, valid loss {metrics['valid_loss']:.3f} "
                f"(ppl {format_ppl(metrics['valid_loss'])})" + (f", BLEU {bleu:.2f}" if bleu is not None else "") +
                (f", {tps:,.0f} target tokens/s (average over all training steps)" if tps else ""))


TASK = TranslationTask()


def main(argv=None):
    """Run the example; returns the metrics dict (None with --translate). Under torchrun every rank runs
    it; rank 0 prints and writes the files."""
    return run.run_task(TASK, argv)


if __name__ == "__main__":
    run.run_main(main)
