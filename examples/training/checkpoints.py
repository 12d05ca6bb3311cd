"""Checkpoints: <save-dir>/checkpoint_last.pt holds the model configuration, the trainer's state (model,
optimizer, schedule, loss scale, position in the data, every rank's RNG streams, so a resumed run continues
exactly) and the flags; written atomically, read on CPU, refused when it holds another model."""
import os

import torch

from .data import DataError

CHECKPOINT_NAME = "checkpoint_last.pt"


def prepare_save_dir(args, log):
    """Create --save-dir; the path of its checkpoint, which --resume needs and a new run overwrites."""
    os.makedirs(args.save_dir, exist_ok=True)
    ckpt = os.path.join(args.save_dir, CHECKPOINT_NAME)
    if args.resume:
        if not os.path.isfile(ckpt):
            raise DataError(f"--resume: no checkpoint at {ckpt}")
    elif os.path.isfile(ckpt):
        log(f"note: {ckpt} exists and will be overwritten (pass --resume to continue from it)")
    return ckpt


def rng_state(device):
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(path, state):
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DataError(f"cannot read checkpoint {path}: {e}") from None


def check_same_model(saved, current, path):
    """Resuming with a different model (or tokenizer) would silently load mismatched weights: refuse."""
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in sorted(set(saved) | set(current))
             if saved.get(k) != current.get(k)]
    if diffs:
        raise DataError(f"--resume: {path} holds a different model; " + "; ".join(diffs) +
                        ". Use the flags of the original run, or another --save-dir")
