"""From logits to a token when a job needs more than the argmax of the raw
logits: its processors (penalties, bias), its grammar mask, its sampler, and
its logprobs, in that order (logprobs read the raw logits).

`SamplePicker` serves one sample decoded on its own (the engine's one-at-a-time
path); `RowPicking` serves the rows of a batch step together. Both keep the
grammar's host work (consume the token read back, fill the next mask) off the
device's path: the next forward pass is queued first, then the mask is made.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import mlx.core as mx
import numpy as np

from ..jobs import Job
from .grammar import apply_masks
from .logprobs import Entries, token_logprobs
from .passes import generation_stream
from .processors import LogitsState, processed
from .sampling import key_rows, make_filters, pick, sample_rows


def sample_jobs(job: Job) -> list[Job]:
    """A job of n samples as n jobs of one, sample i seeded `seed + i` where a
    seed is given (each keeps its own random seed otherwise).

    >>> from batchgen.config import SamplingConfig
    >>> j = Job("a", 1, "native", None, "p", 8, SamplingConfig(temperature=1.0, seed=7), n=3)
    >>> [(s.sample, s.n, s.sampling.seed) for s in sample_jobs(j)]
    [(0, 1, 7), (1, 1, 8), (2, 1, 9)]
    """
    if job.n == 1:
        return [job]
    seed = job.sampling.seed
    return [replace(job, n=1, sample=i, sampling=replace(job.sampling, seed=None if seed is None else (seed + i) % (1 << 32)))
            for i in range(job.n)]  # fmt: skip


def wants_picker(job: Job) -> bool:
    """One at a time, plain sampling needs no picker (`sampling.pick` on the raw logits)."""
    return job.logprobs or job.json_schema is not None or job.logits.active


class SamplePicker:
    """One sample's token picking (`wants_picker`); `matcher`: its grammar
    matcher (llguidance) or None, `grammars` the engine's `Grammars`."""

    def __init__(self, job: Job, prompt: list[int], keys, matcher=None, grammars=None, text=None):
        self.job, self.keys, self.matcher, self.grammars = job, keys, matcher, grammars
        self.context = list(prompt)
        self.generated: list[int] = []
        self.entries = Entries(text, job.top_logprobs) if job.logprobs else None
        self.mask = grammars.masks(1) if matcher is not None else None

    @property
    def stateful(self) -> bool:
        """Whether picking depends on the tokens so far (not only logprobs)."""
        return self.matcher is not None or self.job.logits.active

    def process(self, logits: mx.array, draft: list[int] = ()) -> mx.array:
        """Logits (len(draft) + 1, vocab) after the processors and the grammar
        mask, row i as if draft[:i] had been generated (a verify pass's rows).
        The matcher walks the draft as far as the grammar allows it (a row
        past a disallowed draft token is never read: acceptance stops there)
        and is put back where it was."""
        x = processed(logits, self.job.logits, self.context, self.generated, draft)
        if self.matcher is None:
            return x
        draft = list(draft)[: logits.shape[0] - 1]
        masks = self.mask if not draft else self.grammars.masks(len(draft) + 1)
        self.grammars.fill([(self.matcher, 0)], masks)
        walk = self.matcher.validate_tokens(draft) if draft else 0
        for i in range(walk):
            self.matcher.consume_token(draft[i])
            self.grammars.fill([(self.matcher, i + 1)], masks)
        if walk:
            self.matcher.rollback(walk)
        return apply_masks(x, masks)

    def pick(self, logits: mx.array, t: int) -> tuple[mx.array, tuple | None]:
        """Token t (1,) from logits (1, vocab), and its logprob arrays; lazy."""
        x = self.process(logits)
        s = self.job.sampling
        token = pick(x, s, None if s.greedy else self.keys[t])
        lp = token_logprobs(logits, token, self.job.top_logprobs) if self.entries is not None else None
        return token, lp

    def accept(self, token: int, lp: tuple | None) -> None:
        """The token as read back: the state the next pick starts from."""
        self.context.append(token)
        self.generated.append(token)
        if self.matcher is not None and not self.matcher.is_stopped():
            self.matcher.consume_token(token)
        if lp is not None:
            self.entries.add_rows([token], lp)

    def first(self, logits: mx.array, stats) -> int:
        """The first token, from the prompt pass's logits."""
        stats.forward_passes += 1
        with mx.stream(generation_stream):
            token, lp = self.pick(logits, 0)
            value = token.item()
        self.accept(value, lp)
        return value

    def logprobs(self, eos: set) -> list | None:
        return None if self.entries is None else self.entries.result(eos)


def picked_tokens(model, cache, last: int, picker: SamplePicker, stats, t: int = 1) -> Iterator[int]:
    """Plain decoding through a `SamplePicker` after token `last` (the cache
    holds everything before it). Each step's forward pass is queued before the
    token it follows is read back; the pick (processors, the grammar mask made
    on the host meanwhile) then runs on the queued logits."""

    def forward(y: mx.array) -> mx.array:
        stats.forward_passes += 1
        return model(y[None], cache=cache)[:, -1, :]

    with mx.stream(generation_stream):
        y, lp = picker.pick(forward(mx.array([last])), t)
        mx.async_eval(y)
        while True:
            logits = forward(y)
            mx.async_eval(logits)
            token = y.item()
            picker.accept(token, lp)
            yield token
            t += 1
            y, lp = picker.pick(logits, t)
            mx.async_eval(y)


class RowPicking:
    """A batch's picking for rows that need logits (`Job.needs_logits`): one
    `LogitsState` for the rows' processors, one host buffer of grammar masks,
    per-row samplers and logprobs. `finish(step)` turns a step's logits into
    its tokens; `read(step)` hands back each row's logprob numbers."""

    def __init__(self, rows: int, vocab: int, grammars=None):
        self.rows, self.vocab = rows, vocab
        self.state = LogitsState(rows, vocab)
        self.grammars = grammars  # the engine's `Grammars`, set by the first row with a schema
        self.masks: np.ndarray | None = None

    def select(self, keep: list[int]) -> None:
        """Keep these rows only (the batch shrank)."""
        self.rows = len(keep)
        self.state.select(keep)
        if self.masks is not None:
            self.masks = np.ascontiguousarray(self.masks[keep])

    def finish(self, rows: list, tokens: mx.array, logits: mx.array, valid: list[bool], t: list[int]) -> tuple:
        """(tokens (B,), `token_logprobs` arrays or None) of a step over `rows`
        (its rows at queue time): the greedy `tokens` for rows that need no
        logits, the others' picked from their processed and masked logits, a
        sampling row's with its key for token `t[i]`. `valid`: rows whose slot
        is still theirs (a row placed since the step was queued is not)."""
        needs = [(i, r) for i, r in enumerate(rows) if r is not None and valid[i] and not r.done and r.job.needs_logits]
        if not needs:
            return tokens, None
        x = self.state.apply(logits) if self.state.active else logits
        constrained = [(r.picker.matcher, i) for i, r in needs if r.picker is not None and r.picker.matcher is not None]
        if constrained:
            if self.masks is None:
                self.masks = self.grammars.masks(self.rows)
            self.masks.fill(-1)
            self.grammars.fill(constrained, self.masks)
            x = apply_masks(x, self.masks)
        B = tokens.shape[0]
        argmax_rows = {i for i, r in needs if r.job.sampling.greedy and r.picker is not None and r.picker.stateful}
        if argmax_rows:
            on = mx.array([i in argmax_rows for i in range(B)])
            tokens = mx.where(on, mx.argmax(x, axis=-1).astype(tokens.dtype), tokens)
        sampled = [(i, r) for i, r in needs if not r.job.sampling.greedy]
        if sampled:  # one draw over every sampling row: their settings and keys as arrays
            idx = [i for i, _ in sampled]
            keys = key_rows([r.seed for _, r in sampled], [min(t[i], r.keys.shape[0] - 1) for i, r in sampled])
            filters = make_filters([r.job.sampling for _, r in sampled], x.shape[-1])
            drawn = sample_rows(x[mx.array(idx)], filters, keys).astype(tokens.dtype)
            if len(idx) == B:
                tokens = drawn
            else:
                slot = {i: j for j, i in enumerate(idx)}  # row i's place among the drawn rows
                on = mx.array([i in slot for i in range(B)])
                tokens = mx.where(on, drawn[mx.array([slot.get(i, 0) for i in range(B)])], tokens)
        self.state.push(tokens, valid)
        k = max((r.job.top_logprobs for _, r in needs if r.job.logprobs), default=-1)
        return tokens, (token_logprobs(logits, tokens, k) if k >= 0 else None)
