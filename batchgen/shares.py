"""Which rank runs which jobs, and how many ranks hold one model: pure
functions of the job file and the launch, so every rank computes the same
answer on its own and no plan travels between them.

A rank's share is a run of jobs in prefix order (jobs whose text starts alike
sit together, so a rank's prompt pool sees their shared prefix again), cut
into pieces of about equal expected work, each cut moved to where neighbours
share the least prefix when that costs little balance.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

# Prefix lengths (characters) at which a job's text is fingerprinted: two jobs
# whose texts agree on their first 1,024 characters agree on the first three
# digests, so sorting by the digests puts them next to each other. Beyond the
# longest level jobs are only told apart, not clustered (longer shared prefixes
# than 16k characters gain nothing more here).
PREFIX_LEVELS = (64, 256, 1024, 4096, 16384)
_DIGEST_BYTES = 8

# A prompt token costs a fraction of a generated one: prefill runs the whole
# prompt in a few passes, decode one pass a token. 1/8 of a decoded token per
# prompt token and ~4 characters a token; a device whose prefill is relatively
# slower (a CPU) would want a larger share for prompts.
CHARS_PER_TOKEN = 4
PROMPT_TOKEN_COST = 1 / 8


def prefix_digest(text: str) -> bytes:
    """Digests of `text`'s leading characters at each of `PREFIX_LEVELS`,
    concatenated: comparing two of them compares prefixes coarse to fine.

    >>> a, b = prefix_digest("x" * 300 + "a"), prefix_digest("x" * 300 + "b")
    >>> len(a), shared_levels(a, b)
    (40, 2)
    """
    return b"".join(
        hashlib.blake2b(text[:n].encode("utf-8", "surrogatepass"), digest_size=_DIGEST_BYTES).digest()
        for n in PREFIX_LEVELS
    )


def shared_levels(a: bytes, b: bytes) -> int:
    """How many leading prefix levels two `prefix_digest`s share.

    >>> shared_levels(prefix_digest("abc"), prefix_digest("abd")), shared_levels(b"", b"")
    (0, 0)
    """
    n = 0
    while n + _DIGEST_BYTES <= min(len(a), len(b)) and a[n : n + _DIGEST_BYTES] == b[n : n + _DIGEST_BYTES]:
        n += _DIGEST_BYTES
    return n // _DIGEST_BYTES


def expected_work(prompt_chars: int, max_tokens: int) -> float:
    """A job's cost in decoded-token units: its `max_tokens` (the most it can
    generate; a job may stop sooner, but nothing better is known before it
    runs) plus its prompt at `PROMPT_TOKEN_COST` a token.

    >>> expected_work(4000, 256)
    381.0
    """
    return max_tokens + prompt_chars / CHARS_PER_TOKEN * PROMPT_TOKEN_COST


def plan_shares(keys: Sequence[bytes], work: Sequence[float], parts: int, slack: float = 0.05) -> list[list[int]]:
    """Split jobs 0..n-1 into `parts` shares (each in job order) of about
    equal `work`, each a run of jobs in `keys` order.

    The cut between share k-1 and k falls near k/parts of the total work; any
    point whose work is within `slack` of a share's ideal work from there may
    take it instead, and the one between the least similar neighbours does
    (then the nearest): a group of jobs with one prefix stays on one rank
    unless it is larger than the slack.

    Worked example: eight jobs of equal work, two prefix families "a" (jobs
    0, 2, 4) and "b" (1, 3, 5, 6, 7); two ranks. Sorted, the families lie
    a a a b b b b b; the balanced cut (after four jobs) splits family b, a
    slack of a quarter of a share lets the cut move to the family boundary
    (three jobs against five, within slack), strict balance keeps it:

    >>> keys = [prefix_digest(t) for t in "abababbb"]
    >>> plan_shares(keys, [1.0] * 8, 2, slack=0.25)
    [[0, 2, 4], [1, 3, 5, 6, 7]]
    >>> [len(s) for s in plan_shares(keys, [1.0] * 8, 2, slack=0.0)]
    [4, 4]
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    n = len(keys)
    order = sorted(range(n), key=lambda i: (keys[i], i))
    cumulative = [0.0]
    for i in order:
        cumulative.append(cumulative[-1] + max(float(work[i]), 0.0))
    total = cumulative[-1]
    per_share = total / parts
    cuts = [0]
    for k in range(1, parts):
        cuts.append(_cut(order, keys, cumulative, k * per_share, slack * per_share, cuts[-1]))
    cuts.append(n)
    return [sorted(order[cuts[k] : cuts[k + 1]]) for k in range(parts)]


def _cut(order: list[int], keys: Sequence[bytes], cumulative: list[float], target: float, slack: float,
         floor: int) -> int:  # fmt: skip
    """The boundary (an index into `order`, >= floor) for one cut."""
    n = len(order)
    nearest = min(range(floor, n + 1), key=lambda j: (abs(cumulative[j] - target), j))
    window = [j for j in range(floor, n + 1) if abs(cumulative[j] - target) <= slack]
    if not window:
        return nearest

    def similarity(j: int) -> int:  # prefix levels shared across the boundary
        if j == 0 or j == n:
            return -1  # nothing on one side: nothing split
        return shared_levels(keys[order[j - 1]], keys[order[j]])

    return min(window, key=lambda j: (similarity(j), abs(cumulative[j] - target), j))


def tensor_parallel_size(weight_bytes: int, device_bytes: int, world: int, fill: float = 0.8) -> int:
    """Ranks per model copy when the weights may not fit one device: the
    fewest ranks dividing `world` whose devices hold the weights within
    `fill` of their memory (the rest is for the KV cache and activations),
    else all of them.

    >>> tensor_parallel_size(10 << 30, 80 << 30, 4), tensor_parallel_size(100 << 30, 80 << 30, 4)
    (1, 2)
    >>> tensor_parallel_size(500 << 30, 80 << 30, 4)
    4
    """
    for size in range(1, world + 1):
        if world % size == 0 and weight_bytes / size <= fill * device_bytes:
            return size
    return world


def rank_layout(world: int, tensor: int) -> list[tuple[int, int]]:
    """(model copy, rank within the copy) of each rank: ranks next to each
    other (one machine's devices, as launchers number them) share a copy.

    >>> rank_layout(4, 2)
    [(0, 0), (0, 1), (1, 0), (1, 1)]
    """
    if tensor < 1 or world % tensor:
        raise ValueError(f"{tensor} ranks per model copy do not divide {world} ranks")
    return [divmod(r, tensor) for r in range(world)]
