"""`batchgen launch`: MLX's own launcher (`mlx.launch`, the same arguments),
ending with the code its ranks ended with.

mlx.launch (MLX 0.32) exits 0 whatever its ranks return; it only warns that a
rank "exited with code N". A run's exit code says whether jobs failed or the
run stopped, so this keeps mlx.launch's process handling as it is and notes
how each rank ended, through the class mlx.launch makes rank processes with
(`RemoteProcess`: the ring, nccl and jaccl backends). Under `--backend mpi`
mpirun reports nothing back: the code is then 0. Were mlx.launch to change
that class, this falls back to running it plainly (the code is then 0).

Stop signals: SIGTERM and SIGHUP sent to the launcher (`timeout`, a
supervisor) are passed on to every rank, which stops as one process would
(mlx.launch alone dies and leaves its ranks running). Ctrl-C on a terminal
reaches every rank from the terminal itself; the launcher does not die of it
but stays to pass on the ranks' last lines and their exit code.

Waiting: mlx.launch's loops wait in `select` for its ranks' output, but count
each rank's stdin pipe (always writable) and its own stdin at end of input
(always readable) as ready, so they spin: a core taken from the ranks (what
that cost on a 2-core machine: bench/RESULTS.md). Its forwarding
of stdin is of no use to a run (a rank's input never ends, so `batchgen run
-` cannot read it), so here the launcher's stdin is an input that never comes
and a rank's stdin counts as writable only after the wait for its output.
"""

from __future__ import annotations

import os
import select
import signal
import sys

from .runner import EXIT_PEER_LOST


def exit_code(ends: list[tuple[int, int]]) -> int:
    """The launch's code from (rank, return code) in the order the ranks
    ended: the first nonzero one (a rank a signal killed: 128 + the signal),
    else 0. A run's other ranks end 0 when rank 0 reports for them, so a
    finished run gets rank 0's code, and a run that a rank broke gets that
    rank's. A rank that ended because another stopped answering (75) only
    echoes that other rank, whose own code comes first, wherever it ends.

    >>> exit_code([(1, 0), (0, 1)]), exit_code([(1, -9), (0, 143)]), exit_code([(0, 0), (1, 0)])
    (1, 137, 0)
    >>> exit_code([(1, 75), (0, 143)]), exit_code([(1, 75)])
    (143, 75)
    """
    codes = [128 - code if code < 0 else code for _rank, code in ends if code]
    return next((c for c in codes if c != EXIT_PEER_LOST), codes[0] if codes else 0)


def launch(argv: list[str]) -> int:
    """Run mlx.launch with `argv`; return the ranks' `exit_code`."""
    from mlx._distributed_utils import launch as mlx_launch

    ends: list[tuple[int, int]] = []
    ranks: list = []
    base = getattr(mlx_launch, "RemoteProcess", None)
    if isinstance(base, type) and isinstance(getattr(base, "exit_status", None), property):

        class Noted(base):
            def __init__(self, rank, *args, **kwargs):
                super().__init__(rank, *args, **kwargs)
                self.batchgen_rank, self.batchgen_noted = rank, False
                ranks.append(self)

            @property
            def exit_status(self):
                status = base.exit_status.fget(self)
                if status[0] is not None and not self.batchgen_noted:
                    self.batchgen_noted = True
                    ends.append((self.batchgen_rank, status[0]))
                return status

        mlx_launch.RemoteProcess = Noted

    def pass_on(signum, _frame):
        for r in ranks:
            try:
                r.process.send_signal(signum)
            except OSError:
                pass  # it has ended

    def patient(r, w, x, timeout=None):
        if not w or not timeout:
            return select.select(r, w, x, timeout)
        readable, _, errors = select.select(r, [], x, timeout)
        return readable, select.select([], w, [], 0)[1], errors

    if getattr(mlx_launch, "select", None) is select.select:
        mlx_launch.select = patient
    quiet_stdin, keep_open = os.pipe()  # nothing is ever written: select waits its whole timeout
    stdin = os.dup(0)
    os.dup2(quiet_stdin, 0)
    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGTERM, signal.SIGHUP)}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, lambda *_: None)
    argv0 = sys.argv
    sys.argv = ["mlx.launch", *argv]
    try:
        mlx_launch.main()
    finally:
        sys.argv = argv0
        for s, handler in previous.items():
            signal.signal(s, handler)
        if base is not None:
            mlx_launch.RemoteProcess = base
        mlx_launch.select = select.select
        os.dup2(stdin, 0)
        for fd in (stdin, quiet_stdin, keep_open):
            os.close(fd)
    return exit_code(ends)
