"""MLX's own distributed engine, as a run over several ranks uses it.

`mx.distributed` with the backend the launcher set up (`mlx.launch`: ring over
TCP, jaccl over Thunderbolt, nccl on CUDA, mpi) carries everything: the
model's collectives under tensor parallelism (mlx-lm's `model.shard`), and the
run's few messages between ranks, which are bytes in uint8 arrays passed
through `all_gather`. Nothing here opens a socket of its own.

The run's messages go at its start and its end only, never per job: a
collective waits for every rank, so one per job would hold each rank to the
slowest one's pace.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..decode.passes import generation_stream

# Bytes a rank contributes to one all_gather round: every rank receives
# ranks x this, so it bounds the memory a round takes (a part file of any
# size goes in several rounds).
CHUNK_BYTES = 16 << 20


class PeerLost(Exception):
    """A collective failed: another rank stopped answering."""


def init():
    """The launch's group of every rank, or None for a launch of one rank
    (`mlx.launch -n 1` hands the ring backend an empty host file, which it
    cannot parse)."""
    try:
        group = mx.distributed.init()
    except RuntimeError:
        if alone():
            return None
        raise
    return group if group.size() > 1 else None


def alone() -> bool:
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile is not None:
        try:
            return not Path(hostfile).read_text().strip()
        except OSError:
            return False
    return os.environ.get("MLX_WORLD_SIZE") == "1"


def exchange(group, payload: bytes, chunk: int = CHUNK_BYTES) -> list[bytes]:
    """Every rank's `payload`, in rank order, on every rank (one all_gather of
    the lengths, then rounds of at most `chunk` bytes from each rank)."""
    lengths = _gather(group, np.array([len(payload)], dtype=np.int64)).tolist()
    longest = max(lengths)
    out = [bytearray() for _ in lengths]
    for start in range(0, longest, chunk):
        width = min(chunk, longest - start)
        piece = np.zeros(width, dtype=np.uint8)
        mine = payload[start : start + width]
        piece[: len(mine)] = np.frombuffer(mine, dtype=np.uint8)
        rows = _gather(group, piece).reshape(len(lengths), width)
        for r, n in enumerate(lengths):
            out[r] += rows[r, : max(0, min(width, n - start))].tobytes()
    return [bytes(b) for b in out]


def exchange_json(group, obj) -> list:
    """Every rank's `obj` (JSON-able), in rank order, on every rank."""
    return [json.loads(b) for b in exchange(group, json.dumps(obj).encode())]


def _gather(group, values: np.ndarray) -> np.ndarray:
    # On the stream the model's passes run on, behind them: a pass queued
    # ahead (a pipelined step) holds collectives of its own under tensor
    # parallelism, and every rank must run its collectives in one order.
    try:
        gathered = mx.distributed.all_gather(mx.array(values), group=group, stream=generation_stream)
        mx.eval(gathered)
    except RuntimeError as e:
        raise PeerLost(str(e)) from None
    return np.array(gathered)


def least(group, value: int) -> int:
    """The smallest of every rank's `value` (figures every rank of a model
    copy must agree on: memory budgets decide which passes run)."""
    return min(int(v) for v in exchange_json(group, int(value)))


def split(group, copies: int, copy: int, rank: int):
    """The group of the ranks holding model copy `copy` (of `copies`); the
    whole group when there is one copy. Raises RuntimeError where the backend
    cannot split a group (ring and jaccl in MLX 0.32; nccl and mpi can)."""
    if copies == 1:
        return group
    return group.split(copy, rank)
