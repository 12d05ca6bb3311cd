"""What the example tests share: the examples directory on sys.path, running a script's main in-process
without touching the caller's RNG, and small parallel corpora from the built-in grammar."""
import os
import sys

import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import builtin_data  # noqa: E402


def run(main, argv):
    """main(argv) without touching the caller's RNG state."""
    with torch.random.fork_rng():
        return main(argv)


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(s + "\n" for s in lines)
    return str(path)


def builtin_pairs(splits):
    """{split: (sources, targets)} for splits ((name, pairs, seed), ...), no sentence in two splits."""
    lex = builtin_data.Lexicon()
    out, used = {}, set()
    for split, n, seed in splits:
        pairs = builtin_data.generate_pairs(n, seed, lex, exclude=used)
        used.update(s for s, _ in pairs)
        out[split] = ([s for s, _ in pairs], [t for _, t in pairs])
    return out


def write_corpus(d, pairs):
    """The files of builtin_pairs' result in directory d: {split: (src_path, tgt_path)}."""
    return {split: (write_lines(d / f"{split}.en", src), write_lines(d / f"{split}.zl", tgt))
            for split, (src, tgt) in pairs.items()}
