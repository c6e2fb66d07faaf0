"""Progress for logs: a plain line on stderr at a fixed interval, for runs
without a terminal (cron, pipelines, `nohup`), where a tqdm bar would be noise.

    batchgen: progress: 120/1000 jobs (12%), 3 failed, 845.2 tok/s, elapsed 2m10s, ETA 15m53s

`tok/s` is completion tokens over the elapsed time (the run's throughput, the
rate the ETA follows); the ETA assumes the jobs left go at the pace so far.
`ProgressLog.update` runs after every result and only reads the clock unless
the interval has passed, so it costs nothing per job. The clock is injectable
and `format_line` is pure, so both are tested with literal numbers.
"""

from __future__ import annotations

import math
import re
import time
from typing import Callable

DEFAULT_LOG_EVERY = "30s"
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
_INTERVAL = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|h|)\s*$", re.IGNORECASE)


def parse_interval(text: str) -> float | None:
    """'30s', '2m', '1h', '10' (seconds), '0.5s' -> seconds; '0' or 'off' -> None
    (no progress lines). Raises ValueError on anything else."""
    t = str(text).strip().lower()
    if t in ("off", "no", "none", "never"):
        return None
    m = _INTERVAL.match(t)
    if m is None:
        raise ValueError(f"not an interval: {text!r} (try 30s, 2m, 10 or off)")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"not an interval: {text!r} (try 30s, 2m, 10 or off)")
    return seconds if seconds > 0 else None


def format_duration(seconds: float) -> str:
    """45s, 2m10s, 1h02m03s (whole seconds, rounded)."""
    s = max(int(round(seconds)), 0)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def format_line(done: int, total: int, failed: int, tokens_per_s: float, elapsed_s: float, ranks: str = "") -> str:
    """The progress line, without the `batchgen: ` prefix the log adds; a run
    over several ranks adds each rank's figures (`format_ranks`).

    >>> format_line(120, 1000, 3, 845.2, 130.0)
    'progress: 120/1000 jobs (12%), 3 failed, 845.2 tok/s, elapsed 2m10s, ETA 15m53s'
    """
    pct = f" ({100 * done // total}%)" if total > 0 else ""
    if done > 0 and total > done:
        eta = f", ETA {format_duration(elapsed_s / done * (total - done))}"
    elif total > 0 and done >= total:
        eta = ", ETA 0s"
    else:
        eta = ""
    return (f"progress: {done}/{total} jobs{pct}, {failed} failed, {tokens_per_s:.1f} tok/s, "
            f"elapsed {format_duration(elapsed_s)}{eta}" + (f"; {ranks}" if ranks else ""))  # fmt: skip


def format_ranks(rows: list[tuple[int, int | None, int, float]], elapsed_s: float) -> str:
    """Each rank's jobs done of its share and its tok/s (completion tokens
    over the elapsed time), so a lagging rank shows; (rank, jobs done or None
    where rank 0 cannot see that rank's lines until the end, its share,
    completion tokens).

    >>> format_ranks([(0, 40, 50, 3000), (1, 20, 50, 1500), (2, None, 50, 0)], 10.0)
    'ranks: 0 40/50 300.0 tok/s, 1 20/50 150.0 tok/s, 2 ?/50 (another machine)'
    """
    parts = []
    for rank, done, share, tokens in rows:
        if done is None:
            parts.append(f"{rank} ?/{share} (another machine)")
        else:
            parts.append(f"{rank} {done}/{share} {tokens / elapsed_s if elapsed_s > 0 else 0.0:.1f} tok/s")
    return "ranks: " + ", ".join(parts)


class ProgressLog:
    """Writes `format_line` through `emit` at most once per `every_s` seconds.

    `update(done, failed, tokens)` after each result: the jobs finished and
    failed so far in this run, and the completion tokens generated so far.
    """

    def __init__(self, total: int, every_s: float, emit: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.total = total
        self.every_s = every_s
        self.emit = emit
        self.clock = clock
        self.start = clock()
        self.next_at = self.start + every_s
        self.lines = 0

    def update(self, done: int, failed: int, tokens: int, ranks: str = "") -> bool:
        now = self.clock()
        if now < self.next_at:
            return False
        elapsed = now - self.start
        tps = tokens / elapsed if elapsed > 0 else 0.0
        self.emit(format_line(done, self.total, failed, tps, elapsed, ranks))
        self.lines += 1
        # The next line one interval after this one (not after the missed
        # deadlines: a long job gives one line, not a burst of them).
        self.next_at = now + self.every_s
        return True
