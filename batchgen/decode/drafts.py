"""Prompt lookup's drafting: the n-gram search over the context (pure functions over
token lists, tested with literal arrays) and the adaptive policy that decides whether a
draft is worth a verify pass on this device (decode/pld.py runs the verify loop).
"""

from __future__ import annotations

import difflib
import time
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx

# How far back a candidate's context is compared when ranking n-gram matches.
_RANK_CONTEXT = 32
# The prompt's last tokens put before a predicted output's (decode/pld.py): the
# output's first tokens then match the prediction's start, ranked by that lead.
PREDICTION_CONTEXT = _RANK_CONTEXT


def find_draft(tokens: Sequence[int], ngram_size: int, max_lookup: int) -> list[int]:
    """Up to `max_lookup` tokens that followed an earlier occurrence of the
    context's last n-gram.

    Search order: n from `ngram_size` down to 1 (a longer n-gram is a more
    specific match); among the (at most 64 most recent) earlier occurrences of
    that n-gram, the one whose preceding tokens agree with the context's for
    longest (up to 32 back), the most recent of those on ties (edits move
    forward through their source, so recent matches continue best).

    Worked example, ngram_size=3, max_lookup=3:

        tokens = [5, 1, 2, 3, 9, 7, 1, 2, 3, 4, 6, 8, 1, 2, 3]
                     ^^^^^^^           ^^^^^^^           ^^^^^^^ the 3-gram
        Earlier [1, 2, 3] occur at 1 and 6. Context before them: tokens[0]=5
        and tokens[5]=7; before the suffix: tokens[11]=8. Neither agrees, so
        both rank 0 and the most recent (6) wins: draft = [4, 6, 8].

    >>> find_draft([5, 1, 2, 3, 9, 7, 1, 2, 3, 4, 6, 8, 1, 2, 3], 3, 3)
    [4, 6, 8]
    >>> find_draft([1, 2, 3], 2, 5)  # no earlier occurrence of [2, 3] or [3]
    []

    A match right behind the suffix continues periodically into the draft:

    >>> find_draft([8, 1, 2, 1, 2], 2, 5)  # [1, 2] at 1, then the copy repeats
    [1, 2, 1, 2, 1]

    `NgramIndex` gives the same answers incrementally, for decoding loops.
    """
    if max_lookup <= 0 or len(tokens) < 2:
        return []
    a = list(tokens)
    for n in range(min(ngram_size, len(a) - 1), 0, -1):
        suffix = a[-n:]
        starts = [i for i in range(len(a) - n) if a[i : i + n] == suffix]
        if starts:
            return _continuation(a, _best_start(a, starts[-_MAX_CANDIDATES:], n)[0] + n, max_lookup)
    return []


_MAX_CANDIDATES = 64  # the most recent occurrences of an n-gram that are ranked


def _best_start(a: list[int], starts: list[int], n: int, src: list[int] | None = None) -> tuple[int, int]:
    """(start, agreement): the candidate (a start in `src`, default `a` itself) with the
    longest context before it agreeing with the context before `a`'s last n tokens
    (up to `_RANK_CONTEXT` tokens: that length), latest on ties."""
    src = a if src is None else src
    suffix_start = len(a) - n
    context = a[suffix_start - _RANK_CONTEXT : suffix_start] if suffix_start >= _RANK_CONTEXT else None
    best, best_agree = starts[-1], -1
    for s in reversed(starts):  # latest first, so ties keep the latest
        if context is not None and s >= _RANK_CONTEXT and src[s - _RANK_CONTEXT : s] == context:
            return s, _RANK_CONTEXT  # agrees as far back as ranking looks: no earlier one can beat it
        agree = 0
        while (agree < _RANK_CONTEXT and s - agree - 1 >= 0 and suffix_start - agree - 1 >= 0
               and src[s - agree - 1] == a[suffix_start - agree - 1]):  # fmt: skip
            agree += 1
        if agree > best_agree:
            best, best_agree = s, agree
    return best, best_agree


def _continuation(a: list[int], start: int, length: int) -> list[int]:
    """`length` tokens copied from `start`, running on into the copy itself
    when the source reaches the end (LZ77's overlapping copy), so a match
    close behind the suffix still drafts a full, periodic continuation."""
    out = a[start : start + length]
    period = len(a) - start
    while len(out) < length:
        out.append(out[len(out) - period])
    return out


class NgramIndex:
    """`find_draft` over a growing token list, without rescanning it: the
    start positions of every n-gram (n <= ngram_size) are kept in a dict, so
    a lookup costs O(candidates), not O(context)."""

    def __init__(self, tokens: Sequence[int], ngram_size: int):
        self.tokens: list[int] = []
        self.ngram_size = ngram_size
        self._starts: list[dict] = [{} for _ in range(ngram_size + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(1, min(self.ngram_size, end) + 1):
                self._starts[n].setdefault(tuple(self.tokens[end - n : end]), []).append(end - n)

    def truncate(self, length: int) -> None:
        """Drop tokens from the end, back to `length` (their n-grams were the
        latest entries of their lists)."""
        while len(self.tokens) > length:
            end = len(self.tokens)
            for n in range(1, min(self.ngram_size, end) + 1):
                key = tuple(self.tokens[end - n : end])
                starts = self._starts[n][key]
                starts.pop()
                if not starts:
                    del self._starts[n][key]
            self.tokens.pop()

    def draft(self, max_lookup: int) -> list[int]:
        return self.match(max_lookup)[1]

    def match(self, max_lookup: int) -> tuple[int, list[int]]:
        """(matched, draft): `find_draft` of this list, and how many tokens before the
        draft agree with the context's last ones (the n-gram and the context that
        ranked it, up to `ngram_size` + 32)."""
        a = self.tokens
        if max_lookup <= 0 or len(a) < 2:
            return 0, []
        for n in range(min(self.ngram_size, len(a) - 1), 0, -1):
            starts = self._starts[n].get(tuple(a[-n:]), [])[-_MAX_CANDIDATES - 1 : -1]
            if starts:  # the list's last entry is the suffix itself
                start, agree = _best_start(a, starts, n)
                return n + agree, _continuation(a, start + n, max_lookup)
        return 0, []

    def follow(self, context: Sequence[int], max_lookup: int) -> tuple[int, list[int]]:
        """(matched, draft): up to `max_lookup` tokens of this list that followed an
        occurrence of `context`'s last n-gram, n as long as found (at most `ngram_size`),
        ranked as `find_draft` ranks, and how many tokens before the draft agree with
        the context's last ones (as `match`); (0, []) where none has a token after it.
        This list is a second source to draft from (a job's predicted output), not the
        context.

        >>> NgramIndex([7, 1, 2, 3, 4, 5, 6], 2).follow([9, 2, 3], 3)  # [2, 3] matched, 1 before disagrees
        (2, [4, 5, 6])
        >>> NgramIndex([7, 1, 2, 3, 4, 5, 6], 2).follow([1, 2, 3], 3)  # [2, 3], and the 1 before
        (3, [4, 5, 6])
        >>> NgramIndex([1, 2, 3], 2).follow([8, 3], 3)  # nothing follows the 3
        (0, [])
        """
        if max_lookup <= 0 or not context:
            return 0, []
        c = list(context[-(_RANK_CONTEXT + self.ngram_size) :])  # all that matching and ranking read
        src = self.tokens
        for n in range(min(self.ngram_size, len(c)), 0, -1):
            starts = [s for s in self._starts[n].get(tuple(c[-n:]), []) if s + n < len(src)][-_MAX_CANDIDATES:]
            if starts:
                start, agree = _best_start(c, starts, n, src)
                return n + agree, src[start + n : start + n + max_lookup]
        return 0, []


def predicted_draft(own: tuple[int, list[int]], predicted: tuple[int, list[int]]) -> list[int]:
    """The draft to verify, from the context's lookup (`NgramIndex.match`) and the
    predicted output's (`NgramIndex.follow`): the one that agrees with more of the
    latest tokens, the prediction on a tie (the user's guess at this very output).

    >>> predicted_draft((3, [4, 5]), (2, [6, 7])), predicted_draft((2, [4, 5]), (2, [6, 7]))
    ([4, 5], [6, 7])
    >>> predicted_draft((1, [4]), (0, []))
    [4]
    """
    return predicted[1] if predicted[1] and predicted[0] >= own[0] else own[1]


def prediction_usage(prediction: Sequence[int], output: Sequence[int]) -> tuple[int, int]:
    """(accepted, rejected) tokens of a predicted output, as OpenAI's usage names
    them: the prediction's tokens that appear in the output, in order (a diff's
    matching blocks, as `difflib` finds them), and the rest. A figure about the
    prediction and the text alone, so the same whether drafts came from it or not.
    Once a job, as it ends: quadratic in the worst case, ~40 ms for two lists of
    3,000 tokens that differ in a tenth (2-core CPU); a batch pays it between steps.

    >>> prediction_usage([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6])  # the 3 was edited out
    (4, 1)
    >>> prediction_usage([], [1, 2]), prediction_usage([7, 8], [])
    ((0, 0), (0, 2))
    """
    blocks = difflib.SequenceMatcher(None, list(prediction), list(output), autojunk=False).get_matching_blocks()
    accepted = sum(b.size for b in blocks)
    return accepted, len(prediction) - accepted


# ---------------------------------------------------------------------------
# The draft policy: when does a verify pass pay on this device?


@dataclass
class Ema:
    """An exponential moving average (None until the first value)."""

    value: float | None = None
    weight: float = 0.2

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x


@dataclass
class Survival:
    """Per draft position i (0-based): drafts that reached it (every token
    before it kept) and, of those, the ones whose token there was kept too."""

    reached: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)

    def add(self, length: int, accepted: int) -> None:
        """A draft of `length` tokens whose first `accepted` were kept.

        >>> s = Survival(); s.add(3, 1); s.add(2, 2); (s.reached, s.kept)
        ([2, 2], [2, 1])
        """
        for i in range(min(accepted + 1, length)):
            if i == len(self.reached):
                self.reached.append(0)
                self.kept.append(0)
            self.reached[i] += 1
            self.kept[i] += i < accepted


def survival_rates(job: Survival, run: Survival, length: int, weight: float) -> list[float]:
    """P(draft token i kept | tokens before it kept), i < length: the job's own
    counts with `weight` drafts' worth of the run's rate as their prior, the
    run's rate Laplace-smoothed (1/2 at a position no draft has reached).

    >>> survival_rates(Survival([4], [4]), Survival([10, 4], [8, 2]), 3, 4.0)
    [0.875, 0.5, 0.5]
    """

    def count(xs: list[int], i: int) -> int:
        return xs[i] if i < len(xs) else 0

    out = []
    for i in range(length):
        prior = (count(run.kept, i) + 1) / (count(run.reached, i) + 2)
        out.append((count(job.kept, i) + weight * prior) / (count(job.reached, i) + weight))
    return out


def expected_tokens(rates: Sequence[float]) -> list[float]:
    """Tokens a verify pass yields for drafts of 0..len(rates) tokens: the
    model's own token, plus each draft token times the chance it is reached
    and kept (the product of the rates up to it).

    >>> expected_tokens([0.9, 0.5])
    [1.0, 1.9, 2.35]
    """
    out, reach = [1.0], 1.0
    for r in rates:
        reach *= r
        out.append(round(out[-1] + reach, 12))
    return out


def pass_cost(measured: dict[int, float], fed: int) -> float:
    """Seconds of a pass feeding `fed` tokens: straight lines between the
    lengths measured, the nearest one's cost outside them.

    >>> pass_cost({2: 0.010, 10: 0.050}, 6), pass_cost({2: 0.010, 10: 0.050}, 17)
    (0.03, 0.05)
    """
    xs = sorted(measured)
    if fed <= xs[0]:
        return measured[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if fed <= hi:
            return measured[lo] + (measured[hi] - measured[lo]) * (fed - lo) / (hi - lo)
    return measured[xs[-1]]


def best_length(expected: Sequence[float], costs: Sequence[float]) -> tuple[int, float]:
    """(draft length L >= 1, tokens per second) maximizing expected[L] / costs[L].

    >>> best_length([1.0, 1.9, 2.35, 2.4], [0.01, 0.011, 0.012, 0.013])
    (2, 195.83333333333334)
    """
    rates = [(expected[n] / costs[n], n) for n in range(1, len(expected))]
    rate, n = max(rates, key=lambda r: (r[0], -r[1]))
    return n, rate


@dataclass
class DraftPolicy:
    """Run-wide measurements that decide whether, and how much of, a draft to verify.

    The rule: verify the first L tokens of the draft found, L chosen to
    maximize expected tokens per second of a pass, E(L) / cost(L), if that
    beats plain decoding's 1 / plain_token_s by `margin`; else a plain step.
    E(L) comes from measured per-position survival (the job's own verifies
    and scored skipped drafts, with the run's as a prior), cost(L) from
    measured passes by the number of tokens fed. So a device where a pass
    costs the same for 2 and 17 tokens (a GPU, static shapes) verifies the
    whole draft, and one where a pass costs by its tokens (a CPU) a short
    prefix or nothing. Drafts it skips are still scored against what the
    model then writes, so the job keeps learning and turns drafting back on
    when it pays.
    """

    plain_token_s: Ema = field(default_factory=Ema)
    pass_s: dict[int, Ema] = field(default_factory=dict)  # tokens fed -> seconds a verify pass took
    survival: Survival = field(default_factory=Survival)  # run-wide
    adaptive: bool = True  # False: verify every draft found, whole
    calibrated: bool = False
    margin: float = 1.05
    job_prior_drafts: float = 4.0  # weight of the run's survival in a job's estimate
    explore_every: int = 64  # skipped drafts between forced verifies (keeps costs measured)
    # After a skipped draft, plain tokens before the next look (a switch drains the
    # pipeline). 4, 8 and 16 measured the same (bench/RESULTS.md#prompt-lookup);
    # 4 looks again soonest.
    min_plain_tokens: int = 4
    accepted: int = 0  # draft tokens accepted, run-wide (for the record)
    drafted: int = 0

    _costs: dict = field(default_factory=dict, repr=False)  # (pad_to, found) -> costs by length

    def add_pass(self, fed: int, seconds: float) -> None:
        self.pass_s.setdefault(fed, Ema()).add(seconds)
        self._costs.clear()

    def _pass_costs(self, found: int, pad_to: int | None) -> list[float]:
        """cost(L) for L = 0..found (a decision per plain token reads these;
        they change only when a pass is timed)."""
        key = (pad_to, found)
        if key not in self._costs:
            measured = {n: e.value for n, e in self.pass_s.items()}
            self._costs[key] = [pass_cost(measured, pad_to or n + 1) for n in range(found + 1)]
        return self._costs[key]

    def record(self, job: Survival, length: int, accepted: int) -> None:
        """A verified (or scored skipped) draft of `length` tokens, `accepted` kept."""
        job.add(length, accepted)
        self.survival.add(length, accepted)

    def draft_length(self, job: Survival, found: int, skipped: int, pad_to: int | None = None) -> int:
        """How many of the `found` draft tokens to verify (0: a plain step).
        `job`: this job's record; `pad_to`: every pass is fed that many tokens."""
        if not self.adaptive or found <= 0:
            return found
        plain = self.plain_token_s.value
        if plain is None or not self.pass_s:
            return found  # nothing measured yet: try
        rates = survival_rates(job, self.survival, found, self.job_prior_drafts)
        n, rate = best_length(expected_tokens(rates), self._pass_costs(found, pad_to))
        if rate > self.margin / plain:
            return n
        return found if skipped > 0 and skipped % self.explore_every == 0 else 0

    def calibrate(self, model, cache: list, context: Sequence[int], lengths: list[int], steps: int = 6) -> None:
        """Time plain pipelined steps and verify passes of `lengths` tokens on
        a scratch copy of `cache`, so the first job's decisions already rest
        on this device's costs (a few passes, once per run). The passes feed
        the context's own last tokens: a mixture-of-experts layer's cost grows
        with the experts its tokens reach, so one token repeated would time a
        verify pass at a plain step's cost."""
        from ..cache.pool import clone_cache

        scratch = clone_cache(cache)
        y = mx.array([context[-1]])
        for timed in (False, True):  # the first round warms up kernels
            start = time.perf_counter()
            for _ in range(steps):
                y = mx.argmax(model(y[None], cache=scratch)[:, -1, :], axis=-1)
                mx.async_eval(y)
            y.item()
            if timed:
                self.plain_token_s.add((time.perf_counter() - start) / steps)
            for length in lengths:
                start = time.perf_counter()
                fed = [context[(i - length) % len(context)] for i in range(length)]  # the last `length`, cycled
                mx.eval(mx.argmax(model(mx.array(fed)[None], cache=scratch), axis=-1))
                if timed:
                    self.add_pass(length, time.perf_counter() - start)
        self.calibrated = True
