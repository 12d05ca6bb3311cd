"""Stopping a training run on SIGINT (Ctrl-C) or SIGTERM (what schedulers and preemptible machines send)
without losing it: the first signal asks the training loop to stop after the optimizer step it is in, write
a resumable checkpoint_last.pt and exit with status 128 + the signal's number (130 for SIGINT, 143 for
SIGTERM, the shell's convention for a process ended by that signal); a second one acts as it would have
without this module (KeyboardInterrupt, or the process ends at once), for a run that must stop now.

Under torchrun each rank installs the handlers (torchrun passes a SIGINT or SIGTERM it receives on to
every worker once, then waits --shutdown-timeout seconds, 30 by default, before it kills them), and after
every step the ranks agree whether any of them received one (StopSignals.received_by_any: one all-reduce of
one integer over a gloo group, which waits for no device), so all of them stop after the same step."""
import os
import signal
import threading

import torch
import torch.distributed

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum):
    """The exit status of a run stopped by the signal `signum`."""
    return 128 + int(signum)


class StopSignals:
    """A context manager that handles SIGINT and SIGTERM while a training loop runs and puts back the
    handlers it found on exit. The first signal is recorded (`received`) and the earlier handlers are put
    back at once, so a second signal is not caught here. Handlers can only be installed from the main
    thread: elsewhere (and for a signal the process was started to ignore, as `cmd &` in a script ignores
    SIGINT) nothing is installed and the signal does what it did before.

    `dist`: the run's runtime.Distributed (its stop_group carries the agreement); `announce`: None, or the
    start of a line printed to stderr when a signal arrives ("\n" below a progress bar), so a user sees that
    the run heard it while the step finishes."""

    def __init__(self, dist, announce=""):
        self.dist, self.announce = dist, announce
        self.received = None  # the first signal received (a signal.Signals), or None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                previous = signal.getsignal(sig)
                if previous is signal.SIG_IGN:
                    continue
                self._previous[sig] = previous
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        self._restore()

    def _restore(self):
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                # None: the handler was set outside Python and cannot be put back; the default is the nearest
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum)
        self._restore()
        if self.announce is not None:
            name = signal.Signals(signum).name
            again = "a second Ctrl-C" if signum == signal.SIGINT else f"a second {name}"
            # os.write: the handler may run while the main thread is inside a print() to the same stream
            os.write(2, f"{self.announce}{name} received: stopping after the current step to write a checkpoint "
                        f"({again} stops at once, without one)\n".encode())

    def received_by_any(self):
        """The signal this rank received, or under torchrun the one any rank received (the higher number
        when ranks received different ones), or None. Under torchrun every rank must call it at the same
        point of each step."""
        if not self.dist.active:
            return self.received
        flag = torch.tensor([int(self.received or 0)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.dist.stop_group)
        signum = int(flag.item())
        return signal.Signals(signum) if signum else None
