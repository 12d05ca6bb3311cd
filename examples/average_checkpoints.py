"""Average the parameters of several checkpoints of one model into one checkpoint.

    python examples/average_checkpoints.py checkpoints/de-en/checkpoint_9000.pt \
        checkpoints/de-en/checkpoint_9500.pt checkpoints/de-en/checkpoint_10000.pt -o averaged.pt
    python examples/average_checkpoints.py --last 5 --save-dir checkpoints/de-en -o averaged.pt

The inputs must hold the same model (configuration, tokenizer, parameter names and shapes); otherwise
nothing is written and the message names the files. The output is the last input with its model
parameters replaced by the element-wise mean (computed in fp32, stored in the checkpoint's dtype), so it
carries the model configuration, the flags and the tokenizer like every checkpoint; put it in a save
directory as checkpoint_last.pt to --translate with it. Averaging the last few checkpoints of a run
usually scores a little better than the last one alone (the training scripts do it with --average-last N).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from training.checkpoints import (SaveError, average_state_dicts, load_checkpoint,  # noqa: E402
                                  periodic_checkpoints, save_checkpoint)
from training.data import DataError  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Average the parameters of checkpoints of one model.")
    parser.add_argument("inputs", nargs="*", help="checkpoint files to average")
    parser.add_argument("--last", type=int, default=None, metavar="N",
                        help="average the last N periodic checkpoints (checkpoint_<step>.pt) of --save-dir")
    parser.add_argument("--save-dir", default=None, help="the run directory --last reads")
    parser.add_argument("-o", "--output", required=True, help="the averaged checkpoint to write (a new file)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    args = parser.parse_args(argv)
    if args.last is not None:
        if args.inputs or args.save_dir is None:
            parser.error("--last N takes --save-dir and no input files")
        if args.last < 1:
            parser.error(f"--last must be >= 1, got {args.last}")
    elif len(args.inputs) < 2:
        parser.error("give at least two checkpoint files (or --last N --save-dir DIR)")
    return args


def main(argv=None):
    """Write the average; returns the list of files averaged."""
    args = parse_args(argv)
    if args.last is not None:
        if not os.path.isdir(args.save_dir):
            raise DataError(f"--save-dir {args.save_dir} is not a directory")
        paths = [p for _, p in periodic_checkpoints(args.save_dir)][-args.last:]
        if len(paths) < args.last:
            raise DataError(f"--last {args.last}: {args.save_dir} holds {len(paths)} periodic checkpoint(s) "
                            "(checkpoint_<step>.pt; train with --keep-last N to keep them)")
    else:
        paths = args.inputs
    for p in paths:
        if not os.path.isfile(p):
            raise DataError(f"checkpoint not found: {p}")
    if os.path.abspath(args.output) in {os.path.abspath(p) for p in paths}:
        raise DataError(f"--output {args.output} is one of the inputs; write the average to another file")
    if os.path.exists(args.output) and not args.overwrite:
        raise DataError(f"--output {args.output} exists; pass --overwrite to replace it, or name another file")
    ckpts = [load_checkpoint(p) for p in paths]
    averaged = average_state_dicts(ckpts, paths)
    out = ckpts[-1]
    out["trainer"]["model"] = averaged
    out["averaged"] = [os.path.basename(p) for p in paths]
    save_checkpoint(args.output, out)
    print(f"averaged {len(paths)} checkpoints ({', '.join(os.path.basename(p) for p in paths)}) -> {args.output}")
    return paths


if __name__ == "__main__":
    try:
        main()
    except (DataError, SaveError) as e:
        sys.exit(f"error: {e}")
