"""Prompt-lookup decoding in a batch: each row drafts from its own context, one
forward pass verifies every row's draft, and each row keeps what it accepted.

The batch's layout stays as the rest of batching expects it (`batch`: rows
right-aligned at one shared write position). A verify pass writes T = K + 1
positions in every row ([last token, *draft], padded); row b keeps its first
n_b + 1 and its other r_b = T - 1 - n_b are cut by rolling the row r_b
positions to the right, so that its kept positions end at the write position
again and its left padding grows by r_b. The plain compiled step, its window,
entering rows and compaction then see the layout they always see. The roll
reads and writes each row's KV once per verify pass.

Greedy rows draft; a sampling row rides along with no draft (its token from
the pass's first position and its own key, as in a plain step), so its
samples stay those it draws alone with plain decoding.

Off unless asked for (`DecodeConfig.pld_in_batch`): on an H200 a pass (built
in Python, read back before the next can be chosen, then the cut) cost
several pipelined compiled steps, so batched rows with drafts ran at
0.60-0.99x plain batched rows even with 99% of drafts kept
(bench/results/2026-11-30-h200-u).

    >>> accepted_prefix([5, 6, 7], [5, 6, 9, 2])  # 7 rejected: 9 is the model's own
    2
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx

from ..decode.pld import Ema


def accepted_prefix(draft: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading draft tokens equal the model's greedy tokens, where
    targets[i] is its token after the input and draft[:i].

    >>> accepted_prefix([], [4])
    0
    >>> accepted_prefix([4, 4], [4, 4, 1])
    2
    """
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n


def verify_inputs(firsts: Sequence[int], drafts: Sequence[Sequence[int]], width: int) -> list[list[int]]:
    """One row of `width` inputs per batch row: its first input, its draft,
    then the first input repeated (positions whose outputs are not read).

    >>> verify_inputs([3, 8], [[1, 2], []], 4)
    [[3, 1, 2, 3], [8, 8, 8, 8]]
    """
    return [[f, *d, *[f] * (width - 1 - len(d))] for f, d in zip(firsts, drafts)]


def cut_rejected(cache: list, rejected: Sequence[int]) -> None:
    """After a pass that wrote width positions in every row, drop row b's last
    rejected[b] of them: roll the row right by that much (the dropped ones
    pass the write position, the row's padding grows by as much).

    The roll gathers whole (head, position) vectors by one flat index: a
    gather of single elements (`take_along_axis` over every element) took 7
    ms a pass at 32 rows of 1,024 positions on the 0.5B shape (H200,
    bench/batch_verify_probe.py), as long as the pass itself."""
    if not any(rejected):
        return
    shifts = mx.array(rejected, mx.int32)
    index = {}  # one gather index per buffer shape: (rows * heads * positions,)
    for c in cache:
        for name in ("keys", "values"):
            a = getattr(c, name)
            B, H, S, D = a.shape
            if (B, H, S) not in index:
                source = (mx.arange(S)[None] - shifts[:, None]) % S  # (B, S): the column each comes from
                rows = (mx.arange(B)[:, None] * H + mx.arange(H)[None]) * S  # (B, H): each (row, head)'s first
                index[B, H, S] = (rows[:, :, None] + source[:, None, :]).reshape(-1)
            setattr(c, name, a.reshape(B * H * S, D)[index[B, H, S]].reshape(B, H, S, D))
        c.left_padding = c.left_padding + shifts
        c.offset = c.offset - shifts


@dataclass
class BatchDraftPolicy:
    """Whether a verify pass over the batch pays, from what this run measured:
    seconds per plain step (pipelined), seconds per verify pass (drafting,
    the pass, the read-back, the cut) and the fraction of draft tokens kept.

    A plain step gives each live row one token; a verify pass gives each row
    one plus its kept drafts. Verify while live + kept / verify_s beats
    live / plain_s by `margin`. Looking at drafts drains the step pipeline,
    so after a skipped pass the batch steps plainly `min_plain_steps` times
    before it looks again, twice as many after each further skip (up to
    `max_plain_steps`), and every `explore_every`-th skip verifies anyway (its
    costs stay measured). The first pass's seconds are not counted: it builds
    the pass's kernels."""

    adaptive: bool = True  # False: verify whenever a row has a draft
    margin: float = 1.05
    min_plain_steps: int = 4
    max_plain_steps: int = 64
    explore_every: int = 16
    plain_step_s: Ema = field(default_factory=Ema)
    verify_pass_s: Ema = field(default_factory=Ema)
    kept: Ema = field(default_factory=lambda: Ema(weight=0.1))  # draft tokens kept / drafted
    plain_since_look: int = 0
    skipped: int = 0
    skipped_in_a_row: int = 0
    passes: int = 0

    def look_now(self) -> bool:
        wait = min(self.min_plain_steps << max(self.skipped_in_a_row - 1, 0), self.max_plain_steps)
        return not self.adaptive or self.plain_since_look >= wait

    def worth(self, live: int, drafted: int) -> bool:
        """Verify a pass over `live` rows holding `drafted` draft tokens?"""
        if drafted and (not self.adaptive or self._pays(live, drafted)):
            return True
        if drafted:
            self.skipped += 1
            if self.skipped % self.explore_every == 0:
                return True
        self.plain_since_look = 0
        self.skipped_in_a_row += 1
        return False

    def _pays(self, live: int, drafted: int) -> bool:
        plain, verify, kept = self.plain_step_s.value, self.verify_pass_s.value, self.kept.value
        if plain is None or verify is None or kept is None:
            return True  # nothing measured yet: try
        return (live + kept * drafted) / verify > self.margin * live / plain

    def verified(self, seconds: float, drafted: int, accepted: int) -> None:
        self.passes += 1
        self.skipped_in_a_row = 0
        if self.passes > 1:
            self.verify_pass_s.add(seconds)
        if drafted:
            self.kept.add(accepted / drafted)

    def stepped(self, seconds: float | None) -> None:
        """A plain step (its seconds where it ran pipelined, else None)."""
        self.plain_since_look += 1
        if seconds is not None:
            self.plain_step_s.add(seconds)
