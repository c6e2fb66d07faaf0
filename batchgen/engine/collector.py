"""Python's cyclic garbage collector during a run.

A batch step makes thousands of small containers on the host (a logprobs row's
entries, each row's token lists, the grammar's masks bookkeeping), and most of them
live until their job ends. With CPython's default thresholds (a young collection
every 700 new containers) those collections ran several times a step and, as the
survivors piled up, scanned the whole heap: the loaded model's modules, the
tokenizer, every live job's entries. Nothing the engine makes holds reference
cycles it relies on the collector to free, so during a run the startup heap is
frozen out of collections (`gc.freeze`) and young collections wait for
`YOUNG_THRESHOLD` new containers. Figures: bench/RESULTS.md "Python's collector
during a run". What would change this: a run that leaks cycles (memory would grow
between collections by at most that many containers' worth), or a CPython whose
collector no longer rescans the survivors (3.14's incremental one scans less).
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

# New containers between young collections during a run (CPython's default: 700),
# and how many young (then middle) collections come before the next older one.
YOUNG_THRESHOLD = 50_000
OLDER_EVERY = 20

_lock = threading.Lock()
_depth = 0
_saved: tuple | None = None


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Within: the heap as it stands frozen out of collections, and young
    collections every `YOUNG_THRESHOLD` new containers. Nested and concurrent
    uses share one setting; the last to leave restores the thresholds and
    unfreezes. With the collector disabled (`gc.disable()`) nothing changes.

    >>> before = gc.get_threshold()
    >>> with fewer_collections():
    ...     gc.get_threshold()[0] == YOUNG_THRESHOLD
    True
    >>> gc.get_threshold() == before
    True
    """
    global _depth, _saved
    with _lock:
        _depth += 1
        if _depth == 1 and gc.isenabled():
            _saved = gc.get_threshold()
            gc.freeze()
            gc.set_threshold(YOUNG_THRESHOLD, OLDER_EVERY, OLDER_EVERY)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                gc.set_threshold(*_saved)
                gc.unfreeze()
                _saved = None
