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
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx

from .drafts import PREDICTION_CONTEXT, DraftPolicy, NgramIndex, Survival, predicted_draft
from .logprobs import token_logprobs
from .sampling import pick, target_logits

# ---------------------------------------------------------------------------
# The decoder


def _split_cache(cache: list) -> list[int]:
    """Indices of layers whose cache cannot be trimmed (recurrent state)."""
    return [i for i, c in enumerate(cache) if not c.is_trimmable()]


def _snapshot(cache: list, layers: list[int]) -> dict:
    from ..cache.pool import clone_layer

    return {i: clone_layer(cache[i]) for i in layers}


@dataclass
class _Pass:
    """A queued verify pass."""

    draft: list[int]
    length: int  # tokens fed, pads included
    logits: mx.array  # (len(draft) + 1, vocab), the model's
    targets: mx.array | None  # greedy: argmax per position, being evaluated
    saved: dict | None  # recurrent layers' state from before the pass
    picked: mx.array | None = None  # the logits tokens are picked from: `logits`, or the picker's processed rows


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
        context: list[int],
        prompt_len: int,
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
        entries=None,
        picker=None,
        prediction: list[int] | None = None,
    ):
        self.model, self.cache, self.sampling, self.keys = model, cache, sampling, keys
        self.max_lookup = max_lookup
        self.stats, self.remaining, self.policy = stats, remaining, policy
        self.pad_to = pad_to
        self.stream = stream
        # `logprobs.Entries` where the job asks for logprobs: each emitted token's
        # from the raw logits of the pass (plain step or verify row) that produced it
        self.entries = entries
        self._step_logprobs: deque = deque()
        # `picking.SamplePicker` of a job whose tokens depend on those so far (a
        # grammar, penalties, a bias): each position's logits go through it, a
        # verify pass's rows as if the draft before them were generated, and
        # every emitted token is handed to it. Its plain steps pick after the
        # token before is read back (the next pass queued first).
        self.picker = picker
        # prompt + generated; the last token is not in the cache yet
        self.index = NgramIndex(context, ngram_size)
        self.prompt_len = prompt_len
        # The job's predicted output (its tokens), a second source of drafts, led by
        # the prompt's last tokens so that the output's start lines up with its start.
        self.prediction = None
        if prediction:
            lead = list(context[:prompt_len][-PREDICTION_CONTEXT:])
            self.prediction = NgramIndex(lead + list(prediction), ngram_size)
        self.recurrent = _split_cache(cache)
        self.shadow: _Shadow | None = None
        # This job's verify record (shadows included): kept tokens by draft position.
        self.survival = Survival()
        self.skipped = 0
        self.plain_left = 0  # plain tokens to go before drafts are considered again
        # Queue the next verify pass before reading the current one: greedy
        # only (a sampled pass's outcome cannot be guessed), and not where
        # recurrent layers need a snapshot per pass.
        self.pipelined = pipeline and sampling.greedy and not self.recurrent and picker is None

    @property
    def ctx(self) -> list[int]:
        return self.index.tokens

    @property
    def generated(self) -> int:
        return len(self.ctx) - self.prompt_len

    def __iter__(self) -> Iterator[int]:
        with mx.stream(self.stream):
            if self.policy.adaptive and not self.policy.calibrated:
                self.policy.calibrate(self.model, self.cache, self.ctx, self._verify_lengths())
            while True:
                draft = self._choose_draft()
                if draft and self.pipelined:
                    tokens = self._verify_run(draft)
                elif draft:
                    tokens = self._verify(draft)
                elif self.picker is not None:
                    tokens = self._picked_run()
                else:
                    tokens = self._plain_run()
                for t in tokens:
                    yield t

    def _verify_lengths(self) -> list[int]:
        """Pass lengths calibration times: the one static length, or a spread
        (a pass's cost need not be a straight line in its tokens, and the short
        drafts a CPU verifies get points of their own, not an interpolation)."""
        if self.pad_to:
            return [self.pad_to]
        return sorted({n for n in (2, 3, 5, 9, self.max_lookup + 1) if n <= self.max_lookup + 1})

    # -- choosing ---------------------------------------------------------

    def _choose_draft(self) -> list[int]:
        """The draft to verify next ([] for a plain step); a draft that does
        not pay is kept as a shadow, to be scored against the real tokens."""
        limit = min(self.max_lookup, self.remaining() - 1)
        if limit <= 0:
            return []
        found = self._lookup(limit)
        if not found:
            return []
        n = self.policy.draft_length(self.survival, len(found), self.skipped, self.pad_to)
        if n:
            return found[:n]
        self.skipped += 1
        self.shadow = _Shadow(found)
        # Stay plain for a stretch: a switch costs a pipeline drain and refill,
        # which deciding token by token would pay again and again.
        self.plain_left = self.policy.min_plain_tokens
        return []

    def _lookup(self, limit: int) -> list[int]:
        """Up to `limit` tokens drafted from the context, or from the prediction."""
        own = self.index.match(limit)
        return own[1] if self.prediction is None else predicted_draft(own, self.prediction.follow(self.ctx, limit))

    def _record(self, length: int, accepted: int) -> None:
        """What a verify pass kept of a draft (or would have: shadows)."""
        self.policy.record(self.survival, length, accepted)

    def _score_shadow(self, token: int) -> None:
        s = self.shadow
        if s is None:
            return
        if token == s.draft[s.matched]:
            s.matched += 1
            if s.matched < len(s.draft):
                return
        self._record(len(s.draft), s.matched)  # a verify would have kept these
        self.shadow = None

    # -- plain steps --------------------------------------------------------

    def _step(self, y: mx.array) -> mx.array:
        logits = self.model(y[None], cache=self.cache)[:, -1, :]
        t = self.generated + self._queued
        self._queued += 1
        self.stats.forward_passes += 1
        token = pick(logits, self.sampling, None if self.keys is None else self.keys[t])
        if self.entries is not None:
            self._step_logprobs.append(token_logprobs(logits, token, self.entries.k))
        return token

    def _picked_run(self) -> Iterator[int]:
        """`_plain_run` for a job with a picker: each step's pass is queued before
        the token it follows is read, then its token is picked from the
        picker's logits (the grammar's mask made meanwhile)."""
        self._queued = 0

        def forward(y: mx.array) -> mx.array:
            self.stats.forward_passes += 1
            return self.model(y[None], cache=self.cache)[:, -1, :]

        def picked(logits: mx.array) -> mx.array:
            y = pick(self.picker.process(logits), self.sampling, None if self.keys is None else self.keys[self.generated])
            if self.entries is not None:
                self._step_logprobs.append(token_logprobs(logits, y, self.entries.k))
            mx.async_eval(y)
            return y

        cur = picked(forward(mx.array([self.ctx[-1]])))
        last_read = None
        while True:
            logits = forward(cur)
            mx.async_eval(logits)
            token = self._read_step(cur)
            last_read = self._time_plain(last_read)
            self._emit_picked(token)
            yield token
            if self.plain_left > 0:
                self.plain_left -= 1
            elif self.shadow is None and self._choose_draft():
                break  # the pass after `token` is queued: finish it, as `_plain_run` does
            cur = picked(logits)
        token = self._read_step(picked(logits))
        self._emit_picked(token)
        yield token

    def _emit_picked(self, token: int) -> None:
        self.picker.accept(token, None)
        self._score_shadow(token)
        self.index.extend((token,))

    def _read_step(self, y: mx.array) -> int:
        """A plain step's token read back (its logprobs with it, in queue order)."""
        token = y.item()
        if self.entries is not None:
            self.entries.add_rows([token], self._step_logprobs.popleft())
        return token

    def _record_pass(self, p: "_Pass", out: list[int]) -> None:
        """Logprobs of a verify pass's emitted tokens: row i of its logits for token i."""
        if self.entries is not None:
            self.entries.add_rows(out, token_logprobs(p.logits[: len(out)], mx.array(out), self.entries.k))

    def _plain_run(self) -> Iterator[int]:
        """Pipelined plain steps until a draft that pays is found (or the job ends).

        A plain token's cost is the steady interval between two reads: the
        first read of a run also waits for the pipeline to fill, which a run
        that stayed plain would not pay per token."""
        self._queued = 0
        cur = self._step(mx.array([self.ctx[-1]]))
        mx.async_eval(cur)
        last_read = None
        while True:
            nxt = self._step(cur)
            mx.async_eval(nxt)
            token = self._read_step(cur)
            last_read = self._time_plain(last_read)
            self._queued -= 1
            self._score_shadow(token)
            self.index.extend((token,))
            yield token
            if self.plain_left > 0:
                self.plain_left -= 1
            elif self.shadow is None and self._choose_draft():
                break  # a draft that pays: verify it once `nxt` is in
            cur = nxt
        # `nxt` is already running with `token` as input: finish it, so the
        # cache holds every emitted token but the last, as a draft step needs.
        token = self._read_step(nxt)
        self._queued -= 1
        self._score_shadow(token)
        self.index.extend((token,))
        yield token

    def _time_plain(self, last_read: float | None) -> float:
        now = time.perf_counter()
        if last_read is not None:
            self.policy.plain_token_s.add(now - last_read)
        return now

    # -- verify -------------------------------------------------------------

    def _queue(self, first: int, draft: list[int]) -> "_Pass":
        """Queue one forward pass over [first, *draft] (padded to the static
        length where that is on); nothing is read back yet."""
        m = len(draft)
        length = self.pad_to if self.pad_to and self.pad_to > m + 1 else m + 1
        inputs = [first] + draft + [draft[-1]] * (length - m - 1)  # pads: ignored
        saved = _snapshot(self.cache, self.recurrent) if self.recurrent else None
        logits = self.model(mx.array(inputs)[None], cache=self.cache)[0, : m + 1, :]
        picked = logits
        if self.picker is not None:
            mx.async_eval(logits)  # the pass runs while the picker's masks are made
            picked = self.picker.process(logits, draft)
        targets = None
        if self.sampling.greedy:
            targets = mx.argmax(picked, axis=-1)
            mx.async_eval(targets)
        self.stats.forward_passes += 1
        return _Pass(draft, length, logits, targets, saved, picked)

    def _resolve(self, p: "_Pass") -> tuple[int, int]:
        """(accepted draft tokens, the model's token after them): the one host sync."""
        if p.targets is not None:
            targets = p.targets.tolist()
            n = 0
            while n < len(p.draft) and p.draft[n] == targets[n]:
                n += 1
            bonus = targets[n]
        else:
            n, bonus = self._accept_sampled(p.picked, p.draft)
        self.stats.pld_drafted += len(p.draft)
        self.stats.pld_accepted += n
        self.policy.drafted += len(p.draft)
        self.policy.accepted += n
        return n, bonus

    def _verify(self, draft: list[int]) -> list[int]:
        """One forward pass over [last, *draft]; returns the accepted drafts
        plus the model's own next token, with the cache rolled back to match."""
        start = time.perf_counter()
        p = self._queue(self.ctx[-1], draft)
        n, bonus = self._resolve(p)
        self._rollback(p.length, n, draft, p.saved)
        self.policy.add_pass(p.length, time.perf_counter() - start)  # a replay's included
        self._record(len(draft), n)
        out = draft[:n] + [bonus]
        self._record_pass(p, out)
        if self.picker is not None:
            for t in out:
                self.picker.accept(t, None)
        self.index.extend(out)
        return out

    def _verify_run(self, draft: list[int]) -> Iterator[int]:
        """Greedy verify passes, each next one queued before the current one
        is read back, on the guess that the current draft is accepted whole
        and the model's next token is the one the lookup source has next.

        The guess costs nothing to check: on a hit the queued pass is exactly
        the pass we would have run, and the host sync overlaps it; on a miss
        its cache entries are trimmed and one pass of device time is lost.
        """
        start, passes, fed = time.perf_counter(), 0, 0
        cur = self._queue(self.ctx[-1], draft)
        while True:
            nxt, guess = self._speculate(cur)
            n, bonus = self._resolve(cur)
            hit = nxt is not None and n == len(cur.draft) and bonus == guess
            wasted = nxt is not None and not hit
            passes += 1 + wasted
            fed += cur.length + (nxt.length if wasted else 0)
            extra = cur.length - (n + 1) + (nxt.length if wasted else 0)
            if extra:
                for c in self.cache:
                    c.trim(extra)
            self._record(len(cur.draft), n)
            out = cur.draft[:n] + [bonus]
            self._record_pass(cur, out)
            self.index.extend(out)
            if not hit:
                if wasted:
                    mx.eval(nxt.targets)  # its device time belongs to this run
                self.policy.add_pass(round(fed / passes), (time.perf_counter() - start) / passes)
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
        before = len(self.index)
        self.index.extend(cur.draft)
        guess = self._lookup(limit + 1)
        self.index.truncate(before)
        n = self.policy.draft_length(self.survival, len(guess) - 1, 0, self.pad_to)
        if n < 1:
            return None, None
        return self._queue(guess[0], guess[1 : 1 + n]), guess[0]

    def _accept_sampled(self, logits: mx.array, draft: list[int]) -> tuple[int, int]:
        return accept_sampled(logits, draft, self.sampling, self.keys, self.generated)

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


def accept_sampled(logits: mx.array, draft: list[int], sampling, keys: mx.array, t: int) -> tuple[int, int]:
    """Speculative sampling of a point-mass draft: (accepted drafts, next token).

    Row i of `logits` is the model's distribution after draft[:i]. Position i
    draws from keys[t + i]: one half decides acceptance of draft[i]
    (u < p(draft[i])), the other samples the residual (p without draft[i],
    renormalised) or, past the last draft, p itself.
    """
    m = len(draft)
    target = target_logits(logits, sampling)  # (m + 1, vocab)
    probs = mx.softmax(target, axis=-1)
    accept_u, samples = [], []
    for i in range(m + 1):
        k_accept, k_sample = mx.random.split(keys[t + i])
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


def pld_tokens(model, cache, context, prompt_len, sampling, keys, decode, stats, *, remaining, policy, pad_to,
               stream, entries=None, picker=None, prediction=None) -> Iterator[int]:  # fmt: skip
    """Tokens after `context` (the prompt and what was generated after its
    first `prompt_len` tokens; the cache holds all of it but the last token).
    `entries`: a `logprobs.Entries` to fill, where the job asks for logprobs;
    `picker`: a `picking.SamplePicker` whose state the tokens depend on;
    `prediction`: the tokens of the job's predicted output, drafted from too."""
    stats.draft = "pld"
    decoder = PLDDecoder(
        model, cache, list(context), prompt_len, sampling, keys, decode.pld_ngram_size,
        decode.pld_max_lookup, stats, remaining, policy, pad_to, stream,
        pipeline=decode.pld_pipeline, entries=entries, picker=picker, prediction=prediction,
    )  # fmt: skip
    return iter(decoder)
