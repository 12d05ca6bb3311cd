"""The sentencepiece tokenizer of a run: trained on the training text and stored as <save-dir>/spm.model
(lines it would skip for their length, and the errors its training raises, told as DataError naming the
files and what to do), loaded back with a check of the special ids every part of the examples relies on
(PAD 0 pads batches and is ignored by the loss, BOS 2 starts decoding, EOS 3 ends a sentence)."""
import io
import itertools
import os
import re
import time

import numpy as np

from .data import DataError

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPM_NAME = "spm.model"


# Text of the kind the tokenizer was trained on has almost no unknown pieces: the tokenizer covers 99.95% of
# its training text's characters (character_coverage below). Above 1% of the tokens, the text is of another
# kind (another script or language, another source), and the model sees each of its unknown characters as
# one and the same piece, which it also writes back as "⁇".
UNKNOWN_WARN_SHARE = 0.01


def unknown_pieces_note(ids, sp=None, texts=()):
    """None, or what to warn about when more than UNKNOWN_WARN_SHARE of the tokens in `ids` (an int array,
    or lists of ids; PAD/BOS/EOS not counted) are the unknown piece: how many, and with the tokenizer `sp`
    the characters of `texts` (the encoded strings) it does not know."""
    if not isinstance(ids, np.ndarray):
        ids = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64)
    unknown = int(np.count_nonzero(ids == UNK))
    total = unknown + int(np.count_nonzero(ids > EOS))
    if total == 0 or unknown <= UNKNOWN_WARN_SHARE * total:
        return None
    chars = []
    if sp is not None:
        for text in texts:
            for piece, i in zip(sp.encode(text, out_type=str), sp.encode(text)):
                if i == UNK:  # a run of unknown characters is one piece
                    chars.extend(c for c in dict.fromkeys(piece) if c not in chars and c != "\u2581")
            if len(chars) >= 10:
                break
    named = f" ({' '.join(repr(c) for c in chars[:10])}{' ...' if len(chars) > 10 else ''})" if chars else ""
    return (f"{unknown:,} of {total:,} tokens ({100 * unknown / total:.1f}%) are unknown to the tokenizer{named}: "
            "it was not trained on text like this, and the model sees every such character as the same unknown "
            "piece")


# sentencepiece learns its vocabulary from lines of at most this many bytes (UTF-8) and skips longer ones
# (its max_sentence_length, passed explicitly so the checks below name the limit in force)
MAX_LINE_BYTES = 4192
CHARACTER_COVERAGE = 0.9995  # the share of the text's characters the vocabulary must hold as pieces
SPECIAL_PIECES = 4  # pad, unk, bos, eos


def check_line_lengths(sources, log):
    """Lines sentencepiece would skip (longer than MAX_LINE_BYTES) in the training text `sources`, [(flag,
    path, lines)]: DataError when they are all of a file's lines (it would learn nothing from that file, or
    fail with an internal error when no line is left), a note when they are some of them."""
    for flag, path, lines in sources:
        text, too_long, longest = 0, 0, (0, 0)  # (bytes, line number) of the longest line
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            text += 1
            # a character is at most 4 bytes: only lines this long can be over the limit
            if len(line) > MAX_LINE_BYTES // 4:
                size = len(line.encode("utf-8"))
                if size > MAX_LINE_BYTES:
                    too_long += 1
                    longest = max(longest, (size, -number))
        if too_long and too_long == text:
            size, number = longest
            raise DataError(f"{flag}: {path} has no line short enough to learn the tokenizer from: sentencepiece "
                            f"skips lines longer than {MAX_LINE_BYTES} bytes, and every line here is (line {-number}: "
                            f"{size:,} bytes). Split the text into lines, e.g. one sentence or paragraph per line")
        if too_long:
            log(f"note: {flag} {path}: {too_long:,} of {text:,} lines are longer than {MAX_LINE_BYTES} bytes; the "
                "tokenizer learns its vocabulary without them")


def sentencepiece_error(e, vocab_size, what):
    """sentencepiece's RuntimeError `e`, raised training on `what` (the training files, in words), as a DataError
    saying what to do; its own text is kept for errors not known here."""
    text = str(e)
    m = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", text)
    if m:
        needed = int(m.group(2))
        chars = needed - SPECIAL_PIECES
        return DataError(f"--vocab-size {vocab_size} is too small for {what}: the vocabulary holds a piece for each "
                         f"character that makes up {100 * CHARACTER_COVERAGE:g}% of the text, {chars:,} characters "
                         f"here, plus {SPECIAL_PIECES} special pieces. Raise --vocab-size to at least {needed} "
                         "(more, so that it also learns pieces of several characters)")
    if "!sentences_.empty()" in text:
        return DataError(f"sentencepiece found no line to learn the tokenizer from in {what} (it skips lines longer "
                         f"than {MAX_LINE_BYTES} bytes): split the text into lines, e.g. one sentence per line")
    return DataError(f"sentencepiece could not build a vocabulary of at most {vocab_size} pieces from {what}: {text}")


def train_sentencepiece(lines, model_path, vocab_size, model_type, seed, max_sentences=2_000_000,
                        what="the training text"):
    """Train a sentencepiece model on `lines` (any iterable of str) and write it to `model_path`. Ids: pad 0,
    unk 1, bos 2, eos 3. `vocab_size` is an upper bound: a small corpus gets the vocabulary it supports. A
    failure is a DataError naming `what` (the files `lines` come from) and what to do."""
    import sentencepiece as spm

    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(seed)
    proto = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=(s for s in lines if s.strip()), model_writer=proto, vocab_size=vocab_size,
            model_type=model_type, hard_vocab_limit=False, character_coverage=CHARACTER_COVERAGE,
            max_sentence_length=MAX_LINE_BYTES, pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS,
            input_sentence_size=max_sentences, shuffle_input_sentence=True,
            num_threads=max(1, min(16, os.cpu_count() or 1)), minloglevel=2)
    except RuntimeError as e:
        raise sentencepiece_error(e, vocab_size, what) from None
    tmp = model_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(proto.getvalue())
    os.replace(tmp, model_path)


def load_sentencepiece(model_path):
    import sentencepiece as spm

    if not os.path.isfile(model_path):
        raise DataError(f"tokenizer model not found: {model_path}")
    sp = spm.SentencePieceProcessor(model_file=model_path)
    if (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) != (PAD, UNK, BOS, EOS):
        raise DataError(f"{model_path}: expected special ids pad={PAD} unk={UNK} bos={BOS} eos={EOS}")
    return sp


def train_or_load(args, sources, log, train):
    """(processor, path) of the run's tokenizer <--save-dir>/spm.model. With `train` (rank 0) and without
    --resume it is first trained on the lines of `sources`, [(flag, path, lines)] (the training files), with
    --vocab-size, --spm-type and --seed; otherwise it is the one already there (the resumed run's, or the one
    rank 0 just wrote)."""
    path = os.path.join(args.save_dir, SPM_NAME)
    if train and not args.resume:
        check_line_lengths(sources, log)
        start = time.perf_counter()
        what = "the training text (" + ", ".join(f"{flag} {p}" for flag, p, _ in sources) + ")"
        train_sentencepiece(itertools.chain.from_iterable(lines for _, _, lines in sources), path, args.vocab_size,
                            args.spm_type, args.seed, what=what)
        log(f"tokenizer: sentencepiece {args.spm_type} trained in {time.perf_counter() - start:.1f}s -> {path}")
    return load_sentencepiece(path), path
