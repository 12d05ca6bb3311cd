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
import math
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import builtin_data  # noqa: E402
from train_common import (BOS, CHECKPOINT_NAME, EOS, PAD, SPM_NAME, DataError, Distributed, RunSettings,  # noqa: E402
                          add_common_args, add_layer_args, build_layer_config, decode_lines, describe_backend,
                          encode_cached, layer_config, load_checkpoint, load_sentencepiece, make_criteria,
                          padded_tensor, place_model, prepare_save_dir, read_lines, resolve_common_args, round_up,
                          run_main, run_metrics, start_distributed, start_trainer, token_batches, train_and_validate,
                          train_sentencepiece, write_metrics)

DEFAULT_SAVE_DIR = os.path.join("checkpoints", "translation")

# encoder+decoder layers, hidden, heads, FFN; defaults of --dropout --lr --warmup --max-tokens
ARCHS = {
    "tiny": dict(layers=2, hidden=128, heads=4, ffn=512, dropout=0.1, lr=2e-3, warmup=200, max_tokens=2048),
    "small": dict(layers=6, hidden=512, heads=4, ffn=1024, dropout=0.3, lr=5e-4, warmup=4000, max_tokens=4096),
    "base": dict(layers=6, hidden=512, heads=8, ffn=2048, dropout=0.1, lr=7e-4, warmup=4000, max_tokens=4096),
    "big": dict(layers=6, hidden=1024, heads=16, ffn=4096, dropout=0.3, lr=5e-4, warmup=4000, max_tokens=4096),
}
DEFAULT_EPOCHS = 3


def build_parser():
    p = argparse.ArgumentParser(
        description="Train an lsmini Transformer translation model (no arguments: the built-in en→zl task).")
    g = p.add_argument_group("data (plain UTF-8 text, one sentence per line; none given: the built-in task)")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-src", help=f"{split} source sentences")
        g.add_argument(f"--{split}-tgt", help=f"{split} target sentences, line by line parallel to --{split}-src")
    g.add_argument("--max-len", type=int, default=256,
                   help="longest sentence in tokens (EOS included; default 256); longer training pairs are skipped "
                        "(and counted)")

    g = p.add_argument_group("model")
    g.add_argument("--arch", choices=sorted(ARCHS), default="tiny",
                   help="model size (default tiny): tiny: 2+2 layers 128 hidden; small: 6+6, 512, 4 heads, FFN 1024; "
                        "base: 6+6, 512, 8 heads, FFN 2048; big: 6+6, 1024, 16 heads, FFN 4096")
    g.add_argument("--share-embeddings", action=argparse.BooleanOptionalAction, default=True,
                   help="one embedding matrix for source, target and output projection (default on: the "
                        "vocabulary is joint)")
    add_layer_args(g, label_smoothing=0.1)

    add_common_args(p, DEFAULT_SAVE_DIR)

    g = p.add_argument_group("translation")
    g.add_argument("--beam", type=int, default=4, help="beam size (default 4; 1: greedy)")
    g.add_argument("--lenpen", type=float, default=1.0,
                   help="length penalty: hypotheses rank by score / length**lenpen (default 1.0)")
    g.add_argument("--max-len-a", type=float, default=1.2,
                   help="output length limit: a * source length + b (default a=1.2)")
    g.add_argument("--max-len-b", type=int, default=10, help="(default 10)")
    g.add_argument("--translate", action="store_true",
                   help="translate sentences read from stdin with the model in --save-dir (no training)")
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)
    real = [getattr(args, f"{s}_{side}") for s in ("train", "valid") for side in ("src", "tgt")]
    test = [args.test_src, args.test_tgt]
    args.builtin = not any(real + test)
    if not args.builtin and not args.translate:
        if not all(real):
            p.error("real data needs all four of --train-src --train-tgt --valid-src --valid-tgt")
        if any(test) and not all(test):
            p.error("--test-src and --test-tgt go together")
    resolve_common_args(p, args, DEFAULT_SAVE_DIR, args.builtin, ARCHS[args.arch], DEFAULT_EPOCHS)
    if args.beam < 1:
        p.error(f"--beam must be >= 1, got {args.beam}")
    if args.max_len < 2:
        p.error(f"--max-len must be >= 2, got {args.max_len}")
    if args.max_tokens < round_up(args.max_len):
        p.error(f"--max-tokens ({args.max_tokens}) must hold one sentence of --max-len ({args.max_len}) tokens")
    return args


# ---- data ---------------------------------------------------------------------------------------------
class ParallelBatches:
    """Token-budget batches of a parallel corpus, built once. get(i) gives (source [b, ls] ending in EOS,
    decoder input [b, lt] = BOS + target, decoder output [b, lt] = target + EOS), PAD-padded to a multiple
    of 8; tokens(i) counts the target tokens (EOS included) of batch i."""

    def __init__(self, src, tgt, max_tokens):
        self.src, self.tgt = src, tgt
        sl, tl = src.lengths + 1, tgt.lengths + 1
        self.batches = token_batches(np.maximum(sl, tl), max_tokens, sort_keys=(np.maximum(sl, tl), sl, tl))
        self._tokens = [int(tl[b].sum()) for b in self.batches]
        # (rows, padded source length, padded target length) of every batch
        self.shapes = [(len(b), round_up(int(sl[b].max())), round_up(int(tl[b].max()))) for b in self.batches]

    def __len__(self):
        return len(self.batches)

    def tokens(self, i):
        return self._tokens[i]

    def get(self, i, pin=False):
        idx = self.batches[i]
        src_rows = [self.src[j] for j in idx]
        tgt_rows = [self.tgt[j] for j in idx]
        _, ws, wt = self.shapes[i]
        return (padded_tensor(src_rows, ws, pin, suffix=EOS), padded_tensor(tgt_rows, wt, pin, prefix=BOS),
                padded_tensor(tgt_rows, wt, pin, suffix=EOS))


def load_data(args, log, dist=None):
    """Read and check every file (DataError before any training), then return {split: (src, tgt) lines}
    and {split: (src_path, tgt_path)}. The built-in corpus is written by rank 0 alone."""
    dist = dist or Distributed()
    if args.builtin:
        data_dir = os.path.join(args.save_dir, "data")
        paths = dist.from_main(lambda: builtin_data.write_translation_corpus(data_dir))
        log(f"data: built-in en→zl corpus in {data_dir}")
    else:
        paths = {"train": (args.train_src, args.train_tgt), "valid": (args.valid_src, args.valid_tgt)}
        if args.test_src:
            paths["test"] = (args.test_src, args.test_tgt)
    lines = {}
    for split, (sp, tp) in paths.items():
        src = read_lines(sp, f"--{split}-src")
        tgt = read_lines(tp, f"--{split}-tgt")
        if len(src) != len(tgt):
            raise DataError(f"{split} data: {sp} has {len(src)} lines but {tp} has {len(tgt)}; the files of a parallel "
                            "corpus must have one target line per source line")
        lines[split] = (src, tgt)
    return lines, paths


def tokenize(args, lines, paths, log, train=True):
    """(sentencepiece processor, its path, {split: (src ids, tgt ids)}); `train`: train the tokenizer
    (unless resuming) rather than load the one in --save-dir."""
    spm_path = os.path.join(args.save_dir, SPM_NAME)
    if args.resume or not train:
        log(f"tokenizer: {spm_path} (from the checkpoint's run)")
    else:
        t0 = time.perf_counter()
        train_sentencepiece(lines["train"][0] + lines["train"][1], spm_path, args.vocab_size, args.spm_type, args.seed)
        log(f"tokenizer: sentencepiece {args.spm_type} trained in {time.perf_counter() - t0:.1f}s -> {spm_path}")
    sp = load_sentencepiece(spm_path)
    cache_dir = os.path.join(args.save_dir, "cache")
    ids = {split: tuple(encode_cached(sp, spm_path, ls, p, cache_dir) for ls, p in zip(lines[split], paths[split]))
           for split in lines}
    return sp, spm_path, ids


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


# ---- model --------------------------------------------------------------------------------------------
def model_config(args, vocab_size, max_seq_len):
    a = ARCHS[args.arch]
    return {"arch": args.arch, "vocab_size": vocab_size, "encoder_layers": a["layers"], "decoder_layers": a["layers"],
            "share_embeddings": args.share_embeddings,
            "config": layer_config(args, a, "relu", max_seq_len)}


def build_model(mc, max_batch_tokens, device, dtype):
    from lsmini.models import Transformer

    config = build_layer_config(mc, max_batch_tokens)
    model = Transformer(mc["vocab_size"], mc["vocab_size"], config, num_encoder_layers=mc["encoder_layers"],
                        num_decoder_layers=mc["decoder_layers"], padding_idx=PAD,
                        share_embeddings=mc["share_embeddings"], tie_output=True)
    return place_model(model, device, dtype)


def reserve_scratch(model, shapes, device, dtype):
    """Size the layers' shared scratch arena once, for the most demanding batch, so it never regrows
    (and never reallocates device memory) during training."""
    from lsmini.layers import arena

    need = max(max(model.encoder.scratch_numel(b, ls), model.decoder.scratch_numel(b, lt, ls)) for b, ls, lt in shapes)
    arena.reserve(device, dtype, need)
    return need


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


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
    for t in range(max(max_lens) + 1):
        limit = torch.tensor([max_lens[s] <= t for s in alive], device=device).repeat_interleave(beam)
        lprobs = _next_log_probs(model, last, enc, enc_mask, cache, limit)
        enc = None  # its keys/values are in the cache now
        vocab = lprobs.size(1)
        n = len(alive)
        cand = (scores.view(-1, 1) + lprobs.double()).view(n, beam * vocab)
        top_scores, top_index = (x.cpu() for x in cand.topk(2 * beam, dim=1))  # the step's one read-back
        keep_rows, keep_tok, keep_scores, still = [], [], [], []
        for j, s in enumerate(alive):
            picked = []
            for r in range(2 * beam):
                sc = top_scores[j, r].item()
                if sc == -math.inf:
                    break
                row = j * beam + top_index[j, r].item() // vocab
                tok = top_index[j, r].item() % vocab
                if tok == EOS:
                    if r < beam:
                        finished[s].append((sc / (t + 1) ** lenpen, history[row].tolist()))
                elif len(picked) < beam:
                    picked.append((row, tok, sc))
            if len(finished[s]) >= beam or not picked:
                best[s] = max(finished[s], key=lambda h: h[0])[1] if finished[s] else []
                continue
            while len(picked) < beam:  # fewer live extensions than beams: pad with dead copies
                picked.append((picked[0][0], picked[0][1], -math.inf))
            still.append(s)
            for row, tok, sc in picked:
                keep_rows.append(row)
                keep_tok.append(tok)
                keep_scores.append(sc)
        if not still:
            break
        order_cpu = torch.tensor(keep_rows)
        order = order_cpu.to(device)
        model.reorder_cache(cache, order)
        enc_mask = enc_mask.index_select(0, order)
        tok_cpu = torch.tensor(keep_tok)
        history = torch.cat([history.index_select(0, order_cpu), tok_cpu[:, None]], dim=1)
        last = tok_cpu.to(device)[:, None]
        scores = torch.tensor(keep_scores, dtype=torch.float64).view(len(still), beam).to(device)
        alive = still
    for s in alive:  # only reachable if the loop ran out of steps, which the forced EOS prevents
        if best[s] is None:
            best[s] = max(finished[s], key=lambda h: h[0])[1] if finished[s] else []
    return best


def translate_ids(model, src_ids, args, device, max_seq_len, shard=(0, 1)):
    """Translate sentences given as token-id lists (no EOS); returns output id lists, in input order.
    shard=(r, n): translate only batches r, r+n, ... (the other entries stay None)."""
    lengths = np.array([len(x) + 1 for x in src_ids], dtype=np.int64)
    max_lens = np.minimum(max_seq_len - 1, (args.max_len_a * (lengths - 1) + args.max_len_b).astype(np.int64))
    max_lens = np.maximum(max_lens, 1)
    # rows × beam × the wider of source and output must fit the model's batch budget
    width = np.maximum(lengths, max_lens + 1)
    batches = token_batches(width, max(args.max_tokens // args.beam, round_up(int(width.max()))), sort_keys=(width,))
    out = [None] * len(src_ids)
    for idx in batches[shard[0]::shard[1]]:
        rows = [src_ids[i] for i in idx]
        src = padded_tensor(rows, round_up(max(len(r) for r in rows) + 1), False, suffix=EOS).to(device)
        limits = [int(max_lens[i]) for i in idx]
        hyps = greedy_search(model, src, limits) if args.beam == 1 else beam_search(model, src, args.beam, limits,
                                                                                     args.lenpen)
        for i, h in zip(idx, hyps):
            out[i] = h
    return out


def check_lengths(src_ids, max_seq_len, what):
    for i, ids in enumerate(src_ids):
        if len(ids) + 1 > max_seq_len:
            raise DataError(f"{what}: line {i + 1} has {len(ids)} tokens; this model takes at most {max_seq_len - 1}")


def corpus_bleu(hyps, refs):
    """sacrebleu's corpus BLEU, or None when sacrebleu is not installed."""
    try:
        import sacrebleu
    except ImportError:
        return None
    return float(sacrebleu.corpus_bleu(hyps, [refs]).score)


# ---- modes --------------------------------------------------------------------------------------------
def load_for_inference(args, device, dtype):
    ckpt_path = os.path.join(args.save_dir, CHECKPOINT_NAME)
    if not os.path.isfile(ckpt_path):
        raise DataError(f"--translate: no trained model at {ckpt_path}; train one first (same --save-dir)")
    ckpt = load_checkpoint(ckpt_path)
    sp = load_sentencepiece(os.path.join(args.save_dir, SPM_NAME))
    mc = ckpt["model_config"]
    model = build_model(mc, max(args.max_tokens, args.beam * mc["config"]["max_seq_len"]), device, dtype)
    model.load_state_dict(ckpt["trainer"]["model"])
    model.eval()
    return model, sp, mc["config"]["max_seq_len"]


def translate_stdin(args, device, dtype, log):
    model, sp, max_seq_len = load_for_inference(args, device, dtype)
    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    interactive = sys.stdin.isatty()
    if interactive:
        log("type a sentence and press Enter (Ctrl-D to quit)")
        for n, raw in enumerate(iter(stdin.readline, b""), 1):
            try:
                (line,) = decode_lines(raw, f"stdin line {n}") or [""]
                ids = sp.encode([line])
                check_lengths(ids, max_seq_len, "stdin")
            except DataError as e:
                print(f"error: {e}", file=sys.stderr)
                continue
            print(sp.decode(translate_ids(model, ids, args, device, max_seq_len)[0]), flush=True)
        return
    lines = decode_lines(stdin.read(), "stdin")
    if not lines:
        return
    ids = sp.encode(lines)
    check_lengths(ids, max_seq_len, "stdin")
    for h in translate_ids(model, ids, args, device, max_seq_len):
        sys.stdout.write(sp.decode(h) + "\n")
    sys.stdout.flush()


def main(argv=None):
    """Run the example; returns the metrics dict (None with --translate). Under torchrun every rank runs
    it; rank 0 prints and writes the files."""
    start = time.perf_counter()
    args = parse_args(argv)

    with RunSettings(args.reference):
        dist, device, dtype = start_distributed(args, "--translate" if args.translate else None)

        def log(msg):
            if dist.is_main:
                tqdm.write(msg)

        if args.translate:
            translate_stdin(args, device, dtype, lambda m: print(m, file=sys.stderr))
            return None
        torch.manual_seed(args.seed)
        ckpt_path = prepare_save_dir(args, log)
        lines, paths = load_data(args, log, dist)
        with dist.main_first():  # rank 0 trains the tokenizer and fills the token cache, the others read them
            sp, spm_path, ids = tokenize(args, lines, paths, log, train=dist.is_main)
        vocab = sp.get_piece_size()
        train_src, train_tgt = filter_train(*ids["train"], args.max_len, log)
        eval_split = "test" if "test" in ids else "valid"
        longest = max(int(a.lengths.max()) + 1 for split in ids if split != "train" for a in ids[split])
        max_seq_len = round_up(max(args.max_len, longest))
        train_batches = ParallelBatches(train_src, train_tgt, args.max_tokens)
        valid_batches = ParallelBatches(*ids["valid"], max(args.max_tokens, round_up(longest)))
        log(f"data: {len(train_src)} training pairs in {len(train_batches)} batches of <= {args.max_tokens} tokens, "
            f"{len(ids['valid'][0])} valid" + (f", {len(ids['test'][0])} test" if "test" in ids else "") +
            f"; joint vocabulary {vocab}")

        mc = model_config(args, vocab, max_seq_len)
        # the batch limit also covers beam search's rows (sentences x beam) of up to max_seq_len positions
        model = build_model(mc, max(args.max_tokens, round_up(longest), args.beam * max_seq_len), device, dtype)
        log(f"model: {args.arch} Transformer, {count_parameters(model) / 1e6:.2f}M parameters, {args.precision} on "
            f"{device}; backend {describe_backend(device)}" +
            (f"; {dist.world} processes" if dist.active else ""))
        reserve_scratch(model, train_batches.shapes + valid_batches.shapes, device, dtype)
        trainer = start_trainer(args, model, mc, ckpt_path, device, dtype, log, dist)
        criterion, nll_criterion = make_criteria(args.label_smoothing)

        def loss_fn(model, batch):
            src, tgt_in, tgt_out = batch
            return criterion(model(src, tgt_in), tgt_out, return_nll=True)

        train_and_validate(trainer, args, model, mc, ckpt_path, train_batches, valid_batches, loss_fn,
                           lambda model, batch: (model(batch[0], batch[1]), batch[2]), nll_criterion, device, log)

        # translate the test set (or the validation set), each rank a share of the batches, and score it
        model.eval()
        t0 = time.perf_counter()
        src_lines, ref_lines = lines[eval_split]
        src_ids = [list(map(int, ids[eval_split][0][i])) for i in range(len(src_lines))]
        shares = dist.gather(translate_ids(model, src_ids, args, device, max_seq_len, (dist.rank, dist.world)))
        out_ids = [next(h for h in column if h is not None) for column in zip(*shares)]
        metrics = None
        if dist.is_main:
            hyps = [sp.decode(h) for h in out_ids]
            hyp_path = os.path.join(args.save_dir, f"hypotheses.{eval_split}.txt")
            with open(hyp_path, "w", encoding="utf-8") as f:
                f.writelines(h + "\n" for h in hyps)
            bleu = corpus_bleu(hyps, ref_lines)
            search = "greedy" if args.beam == 1 else f"beam {args.beam}"
            if bleu is None:
                log(f"{eval_split}: translations in {hyp_path}; sacrebleu is not installed, so no BLEU (pip install "
                    "sacrebleu); reporting loss only")
            else:
                log(f"{eval_split}: BLEU {bleu:.2f} ({search}, sacrebleu, {len(hyps)} sentences, "
                    f"{time.perf_counter() - t0:.1f}s); translations in {hyp_path}")

            metrics = run_metrics(trainer, args, device, start, bleu, bleu_split=eval_split)
            path = write_metrics(args.save_dir, metrics)
            tps = metrics["tokens_per_s"]
            log(f"done: {trainer.step} steps, train loss {metrics['train_loss']:.3f}, valid loss "
                f"{trainer.valid_loss:.3f} (ppl {metrics['valid_ppl']:.2f})" +
                (f", BLEU {bleu:.2f}" if bleu is not None else "") +
                (f", {tps:,.0f} target tokens/s" if tps else "") + f", {metrics['wall_s']:.0f}s -> {path}")
        dist.close()
        return metrics


if __name__ == "__main__":
    run_main(main)
