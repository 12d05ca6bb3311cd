"""What train_translation.py and train_lm.py share, one module per concern:

    data         text files (UTF-8 checks naming line and byte), DataError, TokenArray, the token cache
    tokenizer    the sentencepiece model: training, loading, the special ids PAD/UNK/BOS/EOS
    batching     token-budget batches padded to a multiple of 8, the seeded order of each epoch
    cli          the command-line options both scripts take, their defaults from the --arch table, checks
    runtime      device and precision, process-wide settings of a run, torchrun (one process per GPU)
    checkpoints  saving and loading checkpoints (with the RNG streams, for an exact resume, and the tokenizer);
                 the save directory of one run (--overwrite, stale *.tmp files, the tokenizer check)
    trainer      the Trainer: optimizer, learning-rate schedule, the training loop, validation, early stopping
                 (--patience, --max-time), the divergence check, checkpoint_best.pt and --keep-last
    interrupt    SIGINT/SIGTERM while training: stop after the step, save it, exit 130/143 (every rank at one step)
    trainlog     train_log.jsonl (one JSON record per log window and per validation) and its plot
    run          Task (what an example adds: its data, model, loss, decoding) and the one main() driving it

The loop follows the rules that keep a GPU fed on real data: text is tokenized once and the ids are
cached on disk; batches are built up front (length-bucketed, padded to a multiple of 8) and only their
order changes per epoch; host tensors are pinned and copied with non_blocking=True; nothing inside a step
reads a value back from the device (losses are summed on the device and read every --log-every steps);
the model's workspace is sized once, for the largest batch (--max-tokens) and the longest sequence.

Under torchrun (WORLD_SIZE > 1) every process trains on its share of each step's batches: the epoch's
batch order is the same on every rank (seeded), each optimizer step takes the next world × --update-freq
batches of it and rank r takes every world-th of them, so every rank does the same number of steps (the
remainder of an epoch that does not fill a step is left out of that epoch, a different remainder each
epoch). Gradients are averaged by lsmini.distributed.GradientReducer while backward runs. Each rank's loss
is its summed token losses divided by (the step's tokens on all ranks / world): after averaging this is
exactly the gradient of the whole step's mean token loss, whatever the ranks' batch sizes. Rank 0 alone
writes files (data, tokenizer, token cache, checkpoints, metrics.json) and prints; the others wait for it
and read what it wrote.

The package is imported as `training`, with examples/ on sys.path (the scripts put it there); batching
takes its seeded random numbers from examples/builtin_data.py.
"""
