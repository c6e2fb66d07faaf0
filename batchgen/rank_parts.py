"""The pieces a run over several ranks (ranks.py) is made of besides its protocol: rank
0's fold of the other ranks' part files into the output, the part files themselves, a
stop watchdog for ranks waiting in a collective, what a rank logs, and the figures each
rank reports at the start. Nothing here talks to another rank.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .output import OutputFileError, PartTail, ResultWriter, fold, fold_parts, line_figures, part_path
from .progress import format_ranks
from .runner import EXIT_SIGNAL, StopSignals
from .shares import rank_layout
from .stats import RunSummary

if TYPE_CHECKING:  # the run hands itself in; imports run down, from it to here
    from .ranks import RankRun, Share

# How long rank 0 sleeps between looks at the parts once its own share is done.
POLL_S = 0.25
# Rank 0 folds the parts it sees at most this often while it runs jobs.
FOLD_EVERY_S = 0.5


def transport_error(result) -> bool:
    """A job's error that is a collective failing (a tensor-parallel peer
    gone), not the job's own: it must stop the run, never become its line.

    >>> from batchgen.stats import JobFailure, Result
    >>> transport_error(Result("a", 1, "native", error=JobFailure("generation_error",
    ...                 "RuntimeError: [ring] connection to a peer was lost", 1)))
    True
    """
    e = result.error
    return e is not None and e.type == "generation_error" and bool(_TRANSPORT.match(e.message))


_TRANSPORT = re.compile(r"(RuntimeError|PeerLost): \[(ring|nccl|jaccl|mpi)\]")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weight_bytes(spec: str) -> int:
    """Bytes of a local model's weight files (0 for a hub id: not known before download)."""
    path = Path(spec).expanduser()
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0


class StopWatchdog:
    """Ends the process on a stop signal the main thread cannot take.

    A rank waiting in a collective is inside MLX (the GIL released), where
    Python's signal handler runs only once the peers answer, which they may
    never do. The signal's number still reaches a wakeup pipe at once: if the
    main thread has not taken the stop (`StopSignals.received`) within
    `grace` seconds, this thread ends the process with the stop's exit code.
    The main thread is then not writing a line (a write never waits on a
    peer), and every finished line is already on disk.
    """

    def __init__(self, stops: StopSignals, who: str, grace: float = 2.0):
        self.stops, self.who, self.grace = stops, who, grace
        self._fds: tuple[int, int] | None = None
        self._previous = -1

    def __enter__(self):
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._fds = (r, w)
        self._previous = signal.set_wakeup_fd(w)
        self._thread = threading.Thread(target=self._watch, args=(r,), daemon=True, name="batchgen-stop-watchdog")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        signal.set_wakeup_fd(self._previous)
        os.write(self._fds[1], b"\0")  # wakes the thread, which ends
        self._thread.join(timeout=self.grace + 1)
        for fd in self._fds:
            os.close(fd)

    def _watch(self, fd: int) -> None:
        codes = {int(s): c for s, c in EXIT_SIGNAL.items()}
        while True:
            try:
                data = os.read(fd, 1)
            except OSError:
                return
            if not data or data[0] == 0:
                return
            if data[0] in codes and not self.stops.received.wait(self.grace):
                sys.stderr.write(f"batchgen: {self.who}stopped ({signal.Signals(data[0]).name}) while waiting for "
                                 "another rank; every finished line is kept\n")  # fmt: skip
                sys.stderr.flush()
                os._exit(codes[data[0]])


class RankPrefix(logging.Filter):
    """A rank other than 0 logs only its warnings and errors, named."""

    def __init__(self, rank: int):
        super().__init__()
        self.prefix = f"rank {rank}: "

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        record.msg = self.prefix + str(record.msg)
        return True




class Folding:
    """Rank 0's view of the other ranks' parts: it folds the lines of those
    it can read into the output as they come, and counts them per rank."""

    def __init__(self, run: RankRun, share: Share, run_id: str):
        self.run, self.share = run, share
        self.tails = {k: PartTail(part_path(run.base, run_id, k)) for k in run.visible}
        self.counts = {k: [0, 0, 0] for k in run.visible}  # each rank's lines folded, failed, completion tokens
        self.seen = run.index.done if run.index is not None else set()
        self.last = 0.0
        layout = rank_layout(run.size, share.tensor)
        self.copy_of = {k: layout[k][0] for k in range(run.size)}
        self.writers = [k for k in range(run.size) if layout[k][1] == 0]

    def maybe_take(self) -> None:
        if time.monotonic() - self.last >= FOLD_EVERY_S:
            self.take()

    def take(self) -> None:
        """Fold every whole line the visible parts have gained."""
        self.last = time.monotonic()
        for k, tail in self.tails.items():
            self._fold(k, tail)

    def _fold(self, k: int, tail: PartTail) -> None:
        for obj in fold(self.run.writer, tail.read(), self.seen, tail.path):
            ok, completion = line_figures(obj)
            self.counts[k][0] += 1
            self.counts[k][1] += not ok
            self.counts[k][2] += completion

    @property
    def lines(self) -> int:
        return sum(c[0] for c in self.counts.values())

    @property
    def failed(self) -> int:
        return sum(c[1] for c in self.counts.values())

    @property
    def tokens(self) -> int:
        return sum(c[2] for c in self.counts.values())

    def wait_for_visible(self, after) -> None:
        """Rank 0's own share is done: fold until every visible rank has
        written its share (a rank of this machine that is gone ends the wait)."""
        from .engine.distributed import PeerLost

        here = socket.gethostname()
        while True:
            self.take()
            # one line a job, whether folded or (an id the output holds) not
            left = [k for k in self.tails if self.tails[k].lines < self.share.sizes[self.copy_of[k]]]
            if not left:
                return
            for k in left:
                record = self.run.records[k]
                if record["host"] == here and not alive(record["pid"]):
                    raise PeerLost(f"rank {k} ended before its share was done")
            after(None)
            time.sleep(POLL_S)

    def finish(self, far: list, run_id: str) -> None:
        """The last lines: the rest of the visible parts, then the far ranks'
        (shipped beside the output by now); on disk, then the parts go."""
        self.take()
        shipped = {k: PartTail(part_path(self.run.base, run_id, k)) for k in far}
        for k, tail in shipped.items():
            self.counts[k] = [0, 0, 0]
            self._fold(k, tail)
        fold_parts(self.run.writer, [t.path for t in list(self.tails.values()) + list(shipped.values())], self.seen)

    def ranks_line(self, own: RunSummary) -> str:
        """Each writing rank's progress for the progress line (`own`: rank 0's)."""
        run, rows = self.run, []
        for k in self.writers:
            share = self.share.sizes[self.copy_of[k]]
            if k == 0:
                rows.append((0, own.ok + own.failed, share, own.completion_tokens))
            elif k in self.tails:
                rows.append((k, self.tails[k].lines, share, self.counts[k][2]))
            else:
                rows.append((k, None, share, 0))
        return format_ranks(rows, run.wall.elapsed_s)


class Discard:
    """A tensor-parallel rank that is not its copy's writer: its results are the writer's too."""

    written = 0

    def write(self, _result) -> None:
        self.written += 1


def refuse_transport_errors(results, peer_lost):
    for result in results:
        if transport_error(result):
            raise peer_lost(result.error.message)
        yield result


def open_part(path: Path, fsync: bool) -> ResultWriter:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return ResultWriter(open(path, "ab", buffering=0), fsync)
    except OSError as e:
        raise OutputFileError(f"cannot write part file {path}: {e.strerror}") from None


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def whole_lines(path: Path) -> bytes:
    """A part file up to its last newline (a torn last line left out)."""
    data = path.read_bytes()
    return data[: data.rfind(b"\n") + 1]


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def memory() -> int:
    from .engine.core import memory_limit

    return memory_limit()


def per_rank_memory(records: list, k: int) -> int:
    local = sum(r["host"] == records[k]["host"] for r in records)
    return records[k]["memory"] // (local if shared_device() else 1)


def shared_device() -> bool:
    """Whether ranks on one machine share one device's memory (a CPU, a Mac's
    GPU); on CUDA the launcher gives each rank a GPU of its own."""
    import mlx.core as mx

    return mx.default_device().type == mx.cpu or mx.metal.is_available()
