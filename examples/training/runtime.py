"""Where and how a run executes: the device and parameter precision (--device, --fp16/--bf16/--fp32,
--cuda-graph's requirements), the model placed there, the process-wide settings of a run (--reference,
denormal flushing), and the torchrun job: one process per GPU, rank 0 first where files are written,
collectives for what the ranks share."""
import contextlib
import datetime
import os

import torch
import torch.distributed

from .data import DataError


def setup_device(args, local_rank=None):
    """(device, parameter dtype) from --device and --fp16/--bf16/--fp32. In a torchrun job (`local_rank`
    given) a CUDA device is the GPU of the process's LOCAL_RANK."""
    if args.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            raise DataError(f"--device {args.device!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DataError(f"--device {args.device}: no CUDA device is available (torch {torch.__version__})")
    if device.type == "cuda" and local_rank is not None:
        if device.index is not None:
            raise DataError(f"--device {args.device}: under torchrun each process uses the GPU of its LOCAL_RANK; "
                            "pass --device cuda (or nothing)")
        if local_rank >= torch.cuda.device_count():
            raise DataError(f"LOCAL_RANK {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                            "start at most that many processes per node")
        device = torch.device("cuda", local_rank)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if args.precision is None:
        args.precision = "fp16" if device.type == "cuda" else "fp32"
    if args.precision == "fp16" and device.type != "cuda":
        raise DataError("--fp16 needs a CUDA device (fp16 loss scaling targets GPUs); use --bf16 or --fp32 on "
                        f"{device.type}")
    if hasattr(args, "cuda_graph"):
        import lsmini

        use, why = cuda_graph_decision(args.cuda_graph, device.type, args.reference, args.update_freq,
                                       str(lsmini.backend()))
        if args.cuda_graph and not use:
            raise DataError(f"--cuda-graph needs {why}")
        # the one line a run prints about CUDA graphs
        args.cuda_graph_note = ("CUDA graphs: on (one graph per batch shape)" if use else
                                "CUDA graphs: off (--no-cuda-graph)" if args.cuda_graph is False else
                                f"CUDA graphs: off, they need {why}")
        args.cuda_graph = use
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    return device, dtype


def cuda_graph_decision(requested, device_type, reference, update_freq, backend):
    """(use CUDA graphs?, what they need that this run lacks, or None). `requested`: True (--cuda-graph),
    False (--no-cuda-graph) or None (the default: on wherever they apply). They apply on a CUDA device with
    the fused kernels (lsmini.backend() == "cuda", not --reference: the reference path's ops were not made
    capture-safe) and one batch per step (--update-freq 1)."""
    if device_type != "cuda":
        why = "a CUDA device"
    elif reference:
        why = "the fused kernels, not --reference"
    elif backend != "cuda":
        why = "the fused kernels (lsmini's backend here is the reference path)"
    elif update_freq != 1:
        why = "--update-freq 1"
    else:
        why = None
    if requested is False:
        return False, None
    return why is None, why


def place_model(model, device, dtype):
    """The model moved to the run's device and parameter dtype."""
    model = model.to(device=device, dtype=dtype)
    for m in model.modules():  # ids come from our own tokenizer: skip the per-call check (a host sync)
        if hasattr(m, "check_tokens"):
            m.check_tokens = False
    return model


# Rank 0 prepares the data, tokenizer and token cache while the others wait at a barrier; on a large corpus
# that outlasts NCCL's default 10-minute collective timeout.
DIST_TIMEOUT = datetime.timedelta(minutes=60)


class Distributed:
    """This process's place in a torchrun job. A plain run is rank 0 of 1, where every method is trivial."""

    def __init__(self, rank=0, world=1, local_rank=0, stop_group=None):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        # the process group of the ranks' per-step agreement to stop on a signal (interrupt.StopSignals): a
        # gloo group, so the flag stays in host memory; None: the default group (gloo already, on CPU)
        self.stop_group = stop_group

    @property
    def active(self):
        return self.world > 1

    @property
    def is_main(self):
        return self.rank == 0

    def barrier(self):
        if self.active:
            torch.distributed.barrier()

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (it writes files: tokenizer, token cache), the others after it
        (they read them). An error in the block ends that rank, and torchrun then stops the others."""
        if self.active and not self.is_main:
            torch.distributed.barrier()
        yield
        if self.active and self.is_main:
            torch.distributed.barrier()

    def from_main(self, make):
        """make() on rank 0, its (picklable) result on every rank."""
        if not self.active:
            return make()
        box = [make() if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj):
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def sum_(self, tensor):
        """Sum a device tensor over the ranks, in place."""
        if self.active:
            torch.distributed.all_reduce(tensor)
        return tensor

    def close(self):
        """End of a successful run: wait for rank 0's last files, then leave the process group."""
        if self.active and torch.distributed.is_initialized():
            torch.distributed.barrier()
            # no reference may outlive the groups: a live gloo group takes its threads into interpreter shutdown
            self.stop_group = None
            torch.distributed.destroy_process_group()


def start_distributed(args, single_process_mode=None):
    """(Distributed, device, dtype). Under torchrun (WORLD_SIZE > 1) this joins the process group: NCCL
    with the GPU of LOCAL_RANK, or gloo on CPU. `single_process_mode` names a flag that cannot run under
    torchrun (--translate, --generate)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        device, dtype = setup_device(args)
        return Distributed(), device, dtype
    if single_process_mode is not None:
        raise DataError(f"{single_process_mode} runs in one process: start it with python, not torchrun")
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    except KeyError as e:
        raise DataError(f"WORLD_SIZE is {world} but {e.args[0]} is not set: start multi-process runs with torchrun") \
            from None
    device, dtype = setup_device(args, local_rank=local_rank)
    stop_group = None
    if device.type == "cuda":
        torch.distributed.init_process_group("nccl", timeout=DIST_TIMEOUT, device_id=device)
        # a host-side group for the per-step stop flag: over NCCL it would be a device tensor read back
        # each step, a wait for the device that the training loop otherwise never has
        stop_group = torch.distributed.new_group(backend="gloo", timeout=DIST_TIMEOUT)
    else:
        torch.distributed.init_process_group("gloo", timeout=DIST_TIMEOUT)
    return Distributed(rank, world, local_rank, stop_group), device, dtype


def rank_seed(seed, rank):
    """The dropout seed of `rank` in a multi-process run (initialisation uses `seed` on every rank)."""
    return seed * 1_000_003 + 7919 * (rank + 1)


class RunSettings:
    """Process-wide settings of one run, undone on exit (so main() can be called in-process, e.g. by tests):
    lsmini.config.reference with --reference, and flushing denormal floats to zero on the CPU: tiny
    gradients and Adam moments decay into denormals, which x86 CPUs process ~10x slower, so CPU training
    steps would stall at random; flushing them changes nothing that matters for training."""

    def __init__(self, force_reference):
        self.force_reference = force_reference
        self.saved_reference = None

    def __enter__(self):
        import lsmini

        self.saved_reference = lsmini.config.reference
        if self.force_reference:
            lsmini.config.reference = True
        torch.set_flush_denormal(True)
        return self

    def __exit__(self, *exc):
        import lsmini

        torch.set_flush_denormal(False)
        lsmini.config.reference = self.saved_reference


def describe_backend(device):
    import lsmini

    b = lsmini.backend()
    if device.type != "cuda":
        return f"reference (PyTorch ops on {device.type})"
    return f"{b} ({b.reason})"
