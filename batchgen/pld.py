"""Prompt-lookup decoding (PLD): draft tokens copied from the context, verified
by the model in one forward pass.

Lossless by construction:
- greedy: a draft token is kept only if it equals the model's own argmax at
  that position, so the text is the text plain greedy decoding gives;
- sampling: a draft token d is kept with probability p(d) under the target
  distribution, else a token is drawn from p with d removed (renormalised).
  For a draft that is a point mass q = δ_d this is the speculative-sampling
  rule min(1, p/q) with residual (p - q)+, so the output distribution is p.

Adaptive: whether to verify a draft, and how long it should be, follows the
measured acceptance rate and the measured cost of a verify pass against a
plain step on this device. When lookup does not pay, the decoder runs plain
pipelined steps (with the next step queued before the current token is read),
and keeps scoring the drafts it skipped against what the model then produced,
so it learns when drafting starts to pay again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from .sampling import pick, target_logits

# How far back a candidate's context is compared when ranking n-gram matches.
_RANK_CONTEXT = 32


def find_draft(tokens: Sequence[int], ngram_size: int, max_lookup: int) -> list[int]:
    """Up to `max_lookup` tokens that followed an earlier occurrence of the
    context's last n-gram.

    Search order: n from `ngram_size` down to 1 (a longer n-gram is a more
    specific match); among the earlier occurrences of that n-gram, the one
    whose preceding tokens agree with the context's for longest (up to 32
    back), the most recent of those on ties (edits move forward through
    their source, so recent matches continue best).

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
    """
    if max_lookup <= 0 or len(tokens) < 2:
        return []
    a = np.asarray(tokens, dtype=np.int64)
    size = len(a)
    for n in range(min(ngram_size, size - 1), 0, -1):
        starts = _ngram_starts(a, n)
        if starts.size:
            return _continuation(a, _best_start(a, starts, n) + n, max_lookup)
    return []


def _continuation(a: np.ndarray, start: int, length: int) -> list[int]:
    """`length` tokens copied from `start`, running on into the copy itself
    when the source reaches the end (LZ77's overlapping copy), so a match
    close behind the suffix still drafts a full, periodic continuation."""
    out = a[start : start + length].tolist()
    period = len(a) - start
    while len(out) < length:
        out.append(out[len(out) - period])
    return out


def _ngram_starts(a: np.ndarray, n: int) -> np.ndarray:
    """Start positions i < len(a) - n of earlier copies of the last n tokens
    that are followed by at least one token."""
    body = a[:-1]
    if body.size < n:
        return np.empty(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(body, n)
    hits = np.nonzero((windows == a[-n:]).all(axis=1))[0]
    return hits[hits + n < len(a)]


def _best_start(a: np.ndarray, starts: np.ndarray, n: int) -> int:
    """The candidate with the longest agreeing context before it, latest on ties."""
    if starts.size == 1:
        return int(starts[0])
    suffix_start = len(a) - n
    agree = np.zeros(starts.size, dtype=np.int64)
    alive = np.ones(starts.size, dtype=bool)
    for back in range(1, _RANK_CONTEXT + 1):
        pos = starts - back
        ok = alive & (pos >= 0) & (suffix_start - back >= 0)
        if suffix_start - back >= 0:
            ok &= a[np.maximum(pos, 0)] == a[suffix_start - back]
        agree += ok
        alive = ok
        if not alive.any():
            break
    top = agree.max()
    return int(starts[agree == top].max())


# ---------------------------------------------------------------------------
# The draft policy: when does a verify pass pay on this device?


@dataclass
class _Ema:
    value: float | None = None
    weight: float = 0.2

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x


@dataclass
class DraftPolicy:
    """Run-wide measurements that decide whether a draft is worth verifying.

    A verify pass of L tokens yields 1 + a + a^2 + ... + a^m tokens on average
    (m drafted, a = per-token acceptance); a plain step yields 1. Verify when
    that, per second of a verify pass, beats plain tokens per second.
    """

    plain_s: _Ema = field(default_factory=_Ema)  # pipelined plain step, per token
    verify_s: dict = field(default_factory=dict)  # verify length L -> _Ema seconds
    accepted: int = 0
    rejected: int = 0
    skipped_since_verify: int = 0
    prior_verify_ratio: float = 1.3  # verify(L)/plain before anything is measured
    explore_every: int = 64  # skipped drafts between forced verifies (re-measure)
    adaptive: bool = True  # False: verify every draft found
    calibrated: bool = False

    def calibrate(self, model, cache: list, token: int, lengths: list[int], steps: int = 6) -> None:
        """Time plain pipelined steps and verify passes of `lengths` tokens on
        a scratch copy of `cache`, so the first job's decisions already rest
        on this device's costs (a few passes, once per run)."""
        from .prompt_cache import clone_cache

        scratch = clone_cache(cache)
        y = mx.array([token])
        for timed in (False, True):  # the first round warms up kernels
            start = time.perf_counter()
            for _ in range(steps):
                y = mx.argmax(model(y[None], cache=scratch)[:, -1, :], axis=-1)
                mx.async_eval(y)
            y.item()
            if timed:
                self.plain_s.add((time.perf_counter() - start) / steps)
            for length in lengths:
                start = time.perf_counter()
                mx.eval(mx.argmax(model(mx.array([token] * length)[None], cache=scratch), axis=-1))
                if timed:
                    self.verify_s.setdefault(length, _Ema()).add(time.perf_counter() - start)
        self.calibrated = True

    def acceptance(self, job_accepted: int = 0, job_rejected: int = 0) -> float:
        # The job's own counts, with the run's rate as a prior worth 8 drafts.
        total = self.accepted + self.rejected
        run_rate = (self.accepted + 1) / (total + 2)
        return (job_accepted + 8 * run_rate) / (job_accepted + job_rejected + 8)

    def verify_cost(self, length: int) -> float | None:
        """Seconds of a verify pass of `length` tokens: measured, else linear
        through the two nearest measured lengths (or one and a plain step)."""
        if length in self.verify_s:
            return self.verify_s[length].value
        plain = self.plain_s.value
        if not self.verify_s:
            return None if plain is None else plain * self.prior_verify_ratio
        points = sorted(self.verify_s, key=lambda L: abs(L - length))[:2]
        (l0, c0) = points[0], self.verify_s[points[0]].value
        if len(points) == 2:
            l1, c1 = points[1], self.verify_s[points[1]].value
        elif plain is not None:
            l1, c1 = 1, plain
        else:
            return c0
        slope = max((c1 - c0) / (l1 - l0), 0.0)
        return max(c0 + slope * (length - l0), 0.0)

    def expected_tokens(self, m: int, rate: float) -> float:
        return 1.0 + sum(rate**i for i in range(1, m + 1))

    def best_length(self, found: int, rate: float, pad_to: int | None) -> int:
        """Draft tokens to verify (0 = a plain step pays better)."""
        plain = self.plain_s.value
        if plain is None or not self.adaptive:
            return found  # nothing measured yet: try drafting
        best_m, best_gain = 0, 1.0 / plain
        for m in range(1, found + 1):
            cost = self.verify_cost(pad_to or (m + 1))
            if cost is None:
                return found
            gain = self.expected_tokens(m, rate) / cost
            if gain > best_gain:
                best_m, best_gain = m, gain
        if best_m == 0:
            self.skipped_since_verify += 1
            if self.skipped_since_verify >= self.explore_every:
                best_m = found  # verify now and then, so costs stay measured
        if best_m:
            self.skipped_since_verify = 0
        return best_m


# ---------------------------------------------------------------------------
# The decoder


def _split_cache(cache: list) -> list[int]:
    """Indices of layers whose cache cannot be trimmed (recurrent state)."""
    return [i for i, c in enumerate(cache) if not c.is_trimmable()]


def _snapshot(cache: list, layers: list[int]) -> dict:
    from .prompt_cache import clone_layer

    return {i: clone_layer(cache[i]) for i in layers}


@dataclass
class _Pass:
    """A queued verify pass."""

    draft: list[int]
    length: int  # tokens fed, pads included
    logits: mx.array  # (len(draft) + 1, vocab)
    targets: mx.array | None  # greedy: argmax per position, being evaluated
    saved: dict | None  # recurrent layers' state from before the pass


@dataclass
class _Shadow:
    """A skipped draft, scored against the tokens the model then produces."""

    draft: list[int]
    matched: int = 0


class PLDDecoder:
    """Yields generated tokens; the consumer stops it at EOS, stop strings or
    max_tokens (`remaining()` keeps drafts from running past the limit)."""

    def __init__(
        self,
        model,
        cache: list,
        prompt: list[int],
        sampling,
        keys: mx.array | None,
        ngram_size: int,
        max_lookup: int,
        stats,
        remaining: Callable[[], int],
        policy: DraftPolicy,
        pad_to: int | None,
        stream,
        pipeline: bool = True,
    ):
        self.model, self.cache, self.sampling, self.keys = model, cache, sampling, keys
        self.ngram_size, self.max_lookup = ngram_size, max_lookup
        self.stats, self.remaining, self.policy = stats, remaining, policy
        self.pad_to = pad_to
        self.stream = stream
        self.ctx = list(prompt)  # prompt + generated; the last token is not in the cache yet
        self.prompt_len = len(prompt)
        self.recurrent = _split_cache(cache)
        self.job_accepted = 0
        self.job_rejected = 0
        self.shadow: _Shadow | None = None
        # Queue the next verify pass before reading the current one: greedy
        # only (a sampled pass's outcome cannot be guessed), and not where
        # recurrent layers need a snapshot per pass.
        self.pipelined = pipeline and sampling.greedy and not self.recurrent

    @property
    def generated(self) -> int:
        return len(self.ctx) - self.prompt_len

    def __iter__(self) -> Iterator[int]:
        with mx.stream(self.stream):
            if self.policy.adaptive and not self.policy.calibrated:
                self.policy.calibrate(self.model, self.cache, self.ctx[-1], self._verify_lengths())
            while True:
                draft = self._choose_draft()
                if draft and self.pipelined:
                    tokens = self._verify_run(draft)
                elif draft:
                    tokens = self._verify(draft)
                else:
                    tokens = self._plain_run()
                for t in tokens:
                    yield t

    def _verify_lengths(self) -> list[int]:
        return [self.pad_to] if self.pad_to else sorted({2, self.max_lookup + 1})

    # -- choosing ---------------------------------------------------------

    def _choose_draft(self) -> list[int]:
        """The draft to verify next ([] for a plain step); a draft that does
        not pay is kept as a shadow, to be scored against the real tokens."""
        limit = min(self.max_lookup, self.remaining() - 1)
        if limit <= 0:
            return []
        found = find_draft(self.ctx, self.ngram_size, limit)
        if not found:
            return []
        rate = self.policy.acceptance(self.job_accepted, self.job_rejected)
        m = self.policy.best_length(len(found), rate, self.pad_to)
        if m == 0:
            self.shadow = _Shadow(found)
        return found[:m]

    def _score_shadow(self, token: int) -> None:
        s = self.shadow
        if s is None:
            return
        if token == s.draft[s.matched]:
            s.matched += 1
            if s.matched < len(s.draft):
                return
            self._count(s.matched, 0)
        else:
            self._count(s.matched, 1)
        self.shadow = None

    def _count(self, accepted: int, rejected: int) -> None:
        self.job_accepted += accepted
        self.job_rejected += rejected
        self.policy.accepted += accepted
        self.policy.rejected += rejected

    # -- plain steps --------------------------------------------------------

    def _step(self, y: mx.array) -> mx.array:
        logits = self.model(y[None], cache=self.cache)[:, -1, :]
        t = self.generated + self._queued
        self._queued += 1
        self.stats.forward_passes += 1
        return pick(logits, self.sampling, None if self.keys is None else self.keys[t])

    def _plain_run(self) -> Iterator[int]:
        """Pipelined plain steps until a draft is found (or the job ends)."""
        self._queued = 0
        start, emitted = time.perf_counter(), 0
        cur = self._step(mx.array([self.ctx[-1]]))
        mx.async_eval(cur)
        while True:
            nxt = self._step(cur)
            mx.async_eval(nxt)
            token = cur.item()
            self._queued -= 1
            emitted += 1
            self._score_shadow(token)
            self.ctx.append(token)
            yield token
            if self.shadow is None and self._choose_draft():
                break  # a draft that pays: verify it once `nxt` is in
            cur = nxt
        # `nxt` is already running with `token` as input: finish it, so the
        # cache holds every emitted token but the last, as a draft step needs.
        token = nxt.item()
        self._queued -= 1
        emitted += 1
        self._score_shadow(token)
        self.ctx.append(token)
        self.policy.plain_s.add((time.perf_counter() - start) / emitted)
        yield token

    # -- verify -------------------------------------------------------------

    def _queue(self, first: int, draft: list[int]) -> "_Pass":
        """Queue one forward pass over [first, *draft] (padded to the static
        length where that is on); nothing is read back yet."""
        m = len(draft)
        length = self.pad_to if self.pad_to and self.pad_to > m + 1 else m + 1
        inputs = [first] + draft + [draft[-1]] * (length - m - 1)  # pads: ignored
        saved = _snapshot(self.cache, self.recurrent) if self.recurrent else None
        logits = self.model(mx.array(inputs)[None], cache=self.cache)[0, : m + 1, :]
        targets = None
        if self.sampling.greedy:
            targets = mx.argmax(logits, axis=-1)
            mx.async_eval(targets)
        self.stats.forward_passes += 1
        return _Pass(draft, length, logits, targets, saved)

    def _resolve(self, p: "_Pass") -> tuple[int, int]:
        """(accepted draft tokens, the model's token after them): the one host sync."""
        if p.targets is not None:
            targets = p.targets.tolist()
            n = 0
            while n < len(p.draft) and p.draft[n] == targets[n]:
                n += 1
            bonus = targets[n]
        else:
            n, bonus = self._accept_sampled(p.logits, p.draft)
        self.stats.pld_drafted += len(p.draft)
        self.stats.pld_accepted += n
        self._count(n, 1 if n < len(p.draft) else 0)
        return n, bonus

    def _verify(self, draft: list[int]) -> list[int]:
        """One forward pass over [last, *draft]; returns the accepted drafts
        plus the model's own next token, with the cache rolled back to match."""
        start = time.perf_counter()
        p = self._queue(self.ctx[-1], draft)
        n, bonus = self._resolve(p)
        self.policy.verify_s.setdefault(p.length, _Ema()).add(time.perf_counter() - start)
        self._rollback(p.length, n, draft, p.saved)
        out = draft[:n] + [bonus]
        self.ctx.extend(out)
        return out

    def _verify_run(self, draft: list[int]) -> Iterator[int]:
        """Greedy verify passes, each next one queued before the current one
        is read back, on the guess that the current draft is accepted whole
        and the model's next token is the one the lookup source has next.

        The guess costs nothing to check: on a hit the queued pass is exactly
        the pass we would have run, and the host sync overlaps it; on a miss
        its cache entries are trimmed and one pass of device time is lost.
        """
        cur = self._queue(self.ctx[-1], draft)
        last_read = time.perf_counter()
        while True:
            nxt, guess = self._speculate(cur)
            n, bonus = self._resolve(cur)
            now = time.perf_counter()
            self.policy.verify_s.setdefault(cur.length, _Ema()).add(now - last_read)
            last_read = now
            hit = nxt is not None and n == len(cur.draft) and bonus == guess
            extra = cur.length - (n + 1) + (nxt.length if nxt is not None and not hit else 0)
            if extra:
                for c in self.cache:
                    c.trim(extra)
            out = cur.draft[:n] + [bonus]
            self.ctx.extend(out)
            for token in out:
                yield token
            if not hit:
                return
            cur = nxt

    def _speculate(self, cur: "_Pass") -> tuple["_Pass | None", int | None]:
        """Queue the pass that follows `cur` if `cur` is accepted whole."""
        if cur.length != len(cur.draft) + 1:
            return None, None  # padded: the next pass would sit behind pad entries
        limit = min(self.max_lookup, self.remaining() - len(cur.draft) - 2)
        if limit <= 0:
            return None, None
        guess = find_draft(self.ctx + cur.draft, self.ngram_size, limit + 1)
        if len(guess) < 2:
            return None, None
        rate = self.policy.acceptance(self.job_accepted, self.job_rejected)
        m = self.policy.best_length(len(guess) - 1, rate, self.pad_to)
        if m == 0:
            return None, None
        return self._queue(guess[0], guess[1 : 1 + m]), guess[0]

    def _accept_sampled(self, logits: mx.array, draft: list[int]) -> tuple[int, int]:
        # Position i draws from keys[t + i]: one half decides acceptance of
        # draft[i] (u < p(draft[i])), the other samples the residual (p without
        # draft[i], renormalised) or, past the last draft, p itself.
        m, t = len(draft), self.generated
        target = target_logits(logits, self.sampling)  # (m + 1, vocab)
        probs = mx.softmax(target, axis=-1)
        accept_u, samples = [], []
        for i in range(m + 1):
            k_accept, k_sample = mx.random.split(self.keys[t + i])
            row = target[i]
            if i < m:
                accept_u.append(mx.random.uniform(key=k_accept) < probs[i, draft[i]])
                row = mx.where(mx.arange(row.shape[-1]) == draft[i], -mx.inf, row)
            samples.append(mx.random.categorical(row, key=k_sample))
        accepted = mx.stack(accept_u).tolist() if m else []
        samples = mx.stack(samples).tolist()
        n = 0
        while n < m and accepted[n]:
            n += 1
        return n, samples[n]

    def _rollback(self, length: int, n: int, draft: list[int], saved: dict | None) -> None:
        """Leave the cache holding [last, *draft[:n]] from this pass."""
        extra = length - (n + 1)
        if extra == 0:
            return
        if not saved:
            for c in self.cache:
                c.trim(extra)
            return
        # Recurrent layers cannot be trimmed: restore their state from before
        # the pass and replay the kept tokens through the whole model.
        for c in self.cache:
            if c.is_trimmable():
                c.trim(length)
        for i, c in saved.items():
            self.cache[i] = c
        keep = [self.ctx[-1]] + draft[:n]
        self.model(mx.array(keep)[None], cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.stats.forward_passes += 1


def pld_tokens(model, cache, prompt, sampling, keys, decode, stats, *, remaining, policy, pad_to, stream) -> Iterator[int]:
    stats.draft = "pld"
    decoder = PLDDecoder(
        model, cache, list(prompt), sampling, keys, decode.pld_ngram_size,
        decode.pld_max_lookup, stats, remaining, policy, pad_to, stream,
        pipeline=decode.pld_pipeline,
    )  # fmt: skip
    return iter(decoder)
