"""Continuous batching: up to B jobs decode together, one forward pass per step.

Why not mlx-lm's `BatchGenerator` as is: it removes a finished sequence by
gathering every other row's KV cache into a new array (`filter`), adds new
ones by concatenating padded caches (`extend`), and splits each step's
log-probabilities into one array per row, so the per-step cost grows with
churn: per-step overhead, not bandwidth, bounds it on a GPU
(bench/RESULTS.md#whole-file-throughput). Here the batch keeps B fixed rows:

- the KV cache is mlx-lm's `BatchKVCache` (`Fp16BatchCache`: every model's
  attention already understands its per-row offsets and left padding), or
  TurboQuant's codes in the same layout; a step is one compiled
  function over its whole buffers plus a small recent window
  (`compiled_step`: the step is bound by the host, and a recording needs
  fixed shapes), stepping the model uncompiled where that cannot run; on
  CUDA one-query attention is one kernel either way (`attention`);
- jobs are read a few batches ahead and put in prefix order, so that jobs
  sharing a system prompt or few-shot block enter together;
- the jobs entering at one step are prefilled together
  (`entering.start_prompts`: rows of one pass per cached prefix, a shared block
  once, duplicates once), each gets its first token from that pass, and its KV
  is written into a free row, right-aligned to the batch's write position;
- a finished job just frees its row; the row's next steps are ignored, no
  arrays move, and until a job takes the row it starts at the write position
  (its attention reads nothing of the job that left);
- the next step is queued before the current tokens are read back, and the
  tokens of all rows come back in one transfer.

A step of greedy rows returns its B tokens from the compiled step and nothing
else. Rows that need the logits (sampling, a JSON schema, penalties or a bias,
logprobs: `Job.needs_logits`) get them from the same step and pick outside it
(`picking.RowPicking`): penalties as device-side state updated with each
step's tokens, logprobs from the raw logits, read back with the tokens. A
grammar row's mask needs its previous token: such a step is queued without
its pick, the previous step is read back and the matchers take their tokens,
then the masks are made on the host while the GPU runs the
queued forward pass, and the pick is queued behind it. A job of n samples is
n rows of one prompt, prefilled once, merged into one result as the last ends.

Batched rows decode plainly. A verify pass over every row's drafts (prompt
lookup in the batch) was measured slower than plain batched rows on an H200
(bench/RESULTS.md#prompt-lookup-in-a-batch): a step of B rows already reads the weights once for
all of them, so drafts only add compute. PLD is the one-at-a-time path; a
batch whose rows stay few and copy-heavy is where drafting could pay again.

Rows share the left-padded buffer; when every live row has at least
`_COMPACT_PAD` positions of padding, the common padding is cut off. Off the
step kernels' path (where a step's cost follows its rows), once the job stream
is exhausted and at most half the rows are live, the batch shrinks to the live
rows; with the kernels it keeps its rows (`BatchScheduler.shrinks`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import itertools
import logging
from dataclasses import dataclass
from typing import Iterable, Iterator

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..cache.fp16 import Fp16BatchCache
from ..kernels.registry import available as cuda_available
from ..step.compiled import CompiledSteps, held_positions
from ..config import JobPlan
from ..decode.text import TextAssembler, error_result, failed_result, finished_result, pick_first
from ..decode.passes import generation_stream
from .entering import start_prompts
from ..jobs import BadJob, Job
from ..decode.picking import RowPicking, SamplePicker, wants_picker
from ..decode.sampling import job_seed, make_keys
from ..stats import JobStats, Result, Timer
from ..cache.turboquant import TurboQuantKVCache
from ..cache.turboquant_rows import Layout, TurboQuantBatchLayer

if TYPE_CHECKING:  # the engine hands itself in; imports run down, from it to here
    from .core import Engine

log = logging.getLogger("batchgen")

_GROW_STEP = 32  # left growth of the shared buffer, in positions
_COMPACT_PAD = 32  # cut common left padding once it is this long ...
_COMPACT_EVERY = 16  # ... looking every this many steps
_LOOKAHEAD_ROUNDS = 4  # jobs read ahead and put in prefix order: this many batches' worth


def prefix_key(item) -> str:
    """A job's text in prompt order: sorting by it puts jobs that share a system
    prompt, few-shot turns or any leading text next to each other. Bad lines
    sort first (they only need their error line written).

    >>> prefix_key(BadJob("b", 3, "native", "invalid_json", "bad"))
    ''
    """
    if isinstance(item, BadJob):
        return ""
    messages = item.messages
    if messages is not None:
        return "".join(f"\x1e{m.get('role')}\x1f{m.get('content')}" for m in messages)
    return "\x1d" + (item.prompt or "")


def _first_row(lp: tuple) -> tuple:
    """Row 0 of `token_logprobs` arrays, read back: (logprob, top ids, top logprobs)."""
    return tuple(None if a is None else a.tolist()[0] for a in lp)


def read_ahead(source: Iterator, n: int) -> list:
    """The next n items of the job stream, sorted by `prefix_key` (stable).

    Jobs sharing a prefix then enter the batch close together: they share the
    pool's slot while it is fresh and their admission round's prompt pass.
    Reading in chunks of n, each drained before the next is read, keeps any job
    from waiting behind more than n - 1 others."""
    return sorted(itertools.islice(source, n), key=prefix_key)


def supports_batching(cache: list) -> tuple[bool, str]:
    """Batched decoding needs plain KV caches, or TurboQuant's, in every layer."""
    kinds = {type(c).__name__ for c in cache if not isinstance(c, (KVCache, TurboQuantKVCache))}
    if kinds:
        return False, f"cache layers {', '.join(sorted(kinds))} cannot be batched"
    return True, ""


def kv_bytes_per_token(cache: list) -> tuple[int, int]:
    """(bytes of K+V per token over all layers, bytes a batch row holds
    besides: TurboQuant's exact sinks, tail and window), read off a filled cache."""
    per_token = per_row = 0
    for c in cache:
        if isinstance(c, TurboQuantKVCache):
            layout, heads = Layout.of(c), c.sink_keys.shape[1]
            per_token += layout.code_bytes(heads)
            per_row += layout.exact_bytes(heads) * (layout.sink_tokens + layout.tail + layout.window)
        elif getattr(c, "keys", None) is not None:
            k, v = c.keys, c.values
            per_token += k.shape[1] * k.shape[3] * k.dtype.size + v.shape[1] * v.shape[3] * v.dtype.size
    return per_token, per_row


def _map_buffers(c, fn, names: tuple[str, ...] = ()) -> None:
    """Replace each of a batch layer's column buffers (and `names`), a, with fn(a)."""
    for name in c.BUFFERS + names:
        a = getattr(c, name)
        if a is not None:
            setattr(c, name, fn(a))


def _empty(c) -> bool:
    return getattr(c, c.BUFFERS[0]) is None


@dataclass
class Row:
    """One job in the batch."""

    job: Job
    tokens: list[int]  # prompt tokens
    cached: int
    text: TextAssembler
    keys: mx.array | None
    stats: JobStats
    timer: Timer
    job_cache: list | None = None  # its own prefilled cache, until placed in the batch
    pending_input: int | None = None  # fed by the next step: the first generated token, or the prompt's last
    queued: int = 0  # steps queued for this job (the next token's index)
    live_from_step: int = 0  # this row's tokens from earlier steps were someone else's
    first_token_s: float | None = None
    done: bool = False
    picker: SamplePicker | None = None  # where its tokens need more than the raw logits (`wants_picker`)
    needs_logits: bool = False  # `Job.needs_logits`, read every step
    seed: int | None = None  # a sampling job's seed: token t draws with key (seed, t)

    def add(self, token: int, logprobs: tuple | None = None, consume: bool = True) -> bool:
        """Hand the job a generated token (and, where it asked, its logprob, its
        top ids and logprobs); True once it is finished. `consume`: its grammar
        matcher takes the token here (False: the step's matchers took theirs together)."""
        p = self.picker
        if p is not None:
            if consume and p.matcher is not None and not p.matcher.is_stopped():
                p.matcher.consume_token(token)
            if p.entries is not None and logprobs is not None:
                p.entries.add(token, *logprobs)
        return self.text.add(token)

    @property
    def next_input(self) -> int:
        """The token the cache lacks, fed next: entering, or read back since."""
        return self.text.token_ids[-1] if self.pending_input is None else self.pending_input


@dataclass
class _Step:
    tokens: mx.array  # (B,) sampled, being evaluated
    step: int
    rows: list  # the rows at queue time, in batch order
    logits: mx.array | None = None  # (B, vocab) until its rows that need them have picked (`_pick`)
    t: list | None = None  # each row's token index at queue time (its sampling key)
    logprobs: tuple | None = None  # `token_logprobs` arrays, where some row asked


class BatchScheduler:
    """Streams results in completion order; `Engine.run_all` for batch size > 1."""

    def __init__(self, engine: Engine, batch_size: int, kv_budget_bytes: int):
        self.engine = engine
        self.model = engine.model
        self.B = batch_size
        self.budget = kv_budget_bytes
        # Every row's cache is of the run's kind: fp16, or TurboQuant's codes.
        self.kv = engine.config.kv
        self.turbo = self.kv.kind == "turboquant"
        self.per_token, self.per_row = engine.kv_bytes_per_token(self.kv)  # KV bytes per token, and per row
        layers = len(engine.make_cache(self.kv))  # (the model's attention routed to the caches)
        self.rows: list[Row | None] = [None] * batch_size
        if self.turbo:
            self.cache = [TurboQuantBatchLayer(batch_size) for _ in range(layers)]
        else:  # `kernels`: one-query steps through the `batch_decode` kernel, short passes as plain ops
            self.cache = [Fp16BatchCache([0] * batch_size, kernels=engine.short_attention) for _ in range(layers)]
        self.pads = [0] * batch_size  # each row's left padding, as the caches hold it
        self.step = 0
        self.exhausted = False  # the job stream has ended
        self._gather: mx.array | None = None  # row order change for the next step's inputs
        # Where the run's time went, for benchmarks: prompt passes (and their
        # seconds) and decode steps; `Engine.batch_report` after the run.
        self.report = {"steps": 0, "prompt_s": 0.0, "jobs_started": 0}
        self.logged_overrides = False
        self.ahead: list = []  # jobs read ahead of admission, in prefix order
        # Steps through `compiled_step` (the caches' `offset` arrays then go
        # unused: the step derives each row's from the write position and its padding).
        self.compiled = engine.config.compiled_batch_step
        kernel = engine.short_attention and cuda_available()
        self.stepper = CompiledSteps(self.model, kernel, engine.batch_steps, engine.config.batch_step_forward)
        # Whether the batch drops its empty rows near the end (`_shrink`): only
        # where a step's cost follows its rows (the ops path, a CPU). With the
        # step kernels a step of 2 rows costs about what one of 32 does (the
        # weights are read once for all rows; an emptied row's attention reads
        # only what was written after it, `_empty_freed`), and each new row
        # count is a new recording and new kernel builds, which cost seconds
        # (bench/RESULTS.md#rows-kept-to-the-end).
        self.shrinks = not kernel
        self.freed: set[int] = set()  # rows freed since the last step
        # Rows whose tokens need the logits (sampling, a grammar, penalties,
        # logprobs): picked outside the compiled step; a batch of greedy rows
        # without them reads back its B tokens and nothing else.
        self.picking = RowPicking(batch_size, engine.vocab_size)

    @staticmethod
    def auto_size(kv_budget_bytes: int, per_token_bytes: int, tokens_per_job: int, cap: int = 256,
                  per_row: int = 0) -> int:  # fmt: skip
        """Rows whose worst-case KV (each row `tokens_per_job` long) fits the budget."""
        return max(1, min(cap, kv_budget_bytes // max(per_token_bytes * tokens_per_job + per_row, 1)))

    @property
    def live(self) -> int:
        return sum(r is not None for r in self.rows)

    # -- admission ----------------------------------------------------------

    def _worst_len(self, extra: list[Row]) -> int:
        rows = [r for r in self.rows if r is not None] + extra
        return max(len(r.tokens) + r.job.max_tokens for r in rows)

    def _fits(self, row: Row, entering: list[Row]) -> bool:
        if self.live == 0 and not entering:
            return True  # a job that alone exceeds the budget still runs, alone
        # every row's buffers are as long as the longest row's, rounded up as the step holds them
        row_bytes = held_positions(self._worst_len(entering + [row])) * self.per_token + self.per_row
        return self.B * row_bytes <= self.budget

    def _row(self, job: Job) -> Row:
        """A job about to enter: tokenized, its sampling keys drawn."""
        e = self.engine
        timer = Timer()
        job, tokens, capped_from = e.checked_job(job)
        plan = e.plan(job)
        drafts = plan.decode.draft == "pld" and job.sampling.greedy and plan.decode.pld_max_lookup > 0
        if (drafts or plan.kv != self.kv) and not self.logged_overrides:
            log.info(f"batched decoding: jobs run with plain decoding over the batch's {self.kv.kind} KV cache "
                     "(PLD runs at batch size 1)")  # fmt: skip
            self.logged_overrides = True
        seed = None if job.sampling.greedy else job_seed(job.sampling)
        keys = None if seed is None else make_keys(seed, job.max_tokens + 2)
        matcher = e.matcher_for(job)  # a schema that cannot compile fails here, before the job enters
        picker = None
        if wants_picker(job):
            picker = SamplePicker(job, tokens, keys, matcher, e.grammars, e.token_text if job.logprobs else None)
            self.picking.grammars = e.grammars
        text = TextAssembler(e.tokenizer, job.stop, job.max_tokens)
        stats = JobStats(draft="none", kv_cache=self.kv.kind, max_tokens_capped_from=capped_from)
        return Row(job, tokens, 0, text, keys, stats, timer, queued=1, picker=picker, needs_logits=job.needs_logits,
                   seed=seed)

    def _start(self, rows: list[Row]) -> tuple[list[Row], list[Result]]:
        """Prefill entering rows (together where they share a cached prefix) and
        give each its first token; (the rows started, the failures: a shared
        pass that fails is retried row by row, so a bad job fails alone)."""
        e = self.engine
        timer = Timer()
        plan = JobPlan(e.config.decode, self.kv)
        try:
            starts = start_prompts(e, [r.tokens for r in rows], plan, feed_last=True)
        except Exception:
            starts = [self._start_one(r, plan) for r in rows]
        started = [r for r, s in zip(rows, starts) if not isinstance(s, Result)]
        failed = [s for s in starts if isinstance(s, Result)]
        firsts, logprobs = [], []
        for row, start in zip(rows, starts):
            if isinstance(start, Result):
                continue
            row.job_cache, row.cached, logits = start
            if logits is None:  # only the last prompt token is left: the next step feeds it
                row.pending_input, row.queued = row.tokens[-1], 0
            elif row.picker is not None:
                row.stats.forward_passes += 1
                token, lp = row.picker.pick(logits, 0)
                firsts.append(token)
                logprobs.append(lp)
            else:
                firsts.append(pick_first(logits, row.job.sampling, row.keys, row.stats))
                logprobs.append(None)
        values = mx.concatenate(firsts).tolist() if firsts else []
        for row in (r for r in started if r.pending_input is None):
            lp = logprobs.pop(0)
            row.done = row.add(values.pop(0), None if lp is None else _first_row(lp))
            row.first_token_s = row.timer.elapsed_s
        self.report["prompt_s"] += timer.elapsed_s
        self.report["jobs_started"] += len(rows)
        return started, failed

    def _start_one(self, row: Row, plan: JobPlan):
        try:
            return self.engine.start_prompt(row.tokens, plan)
        except Exception as e:
            return error_result(row.job, e)

    def _place(self, index: int, row: Row) -> None:
        """Write the job's prompt KV into batch row `index`, ending at the
        batch's write position (all rows write there next)."""
        n = len(row.tokens) - (row.pending_input is not None)  # the cache lacks a token still to feed
        if n > self.cache[0].write_position:
            self._grow_left(n - self.cache[0].write_position)
        idx = self.cache[0].write_position
        for bc, jc in zip(self.cache, row.job_cache):
            if self.turbo:
                bc.place(index, jc, n, self.B)
                continue
            k, v = jc.keys[..., :n, :], jc.values[..., :n, :]
            if bc.keys is None:
                shape = (self.B, k.shape[1], idx, k.shape[3])
                bc.keys, bc.values = mx.zeros(shape, k.dtype), mx.zeros(shape[:3] + v.shape[3:], v.dtype)
            bc.keys[index : index + 1, :, idx - n : idx, :] = k
            bc.values[index : index + 1, :, idx - n : idx, :] = v
            bc.left_padding[index] = idx - n
            bc.offset[index] = n
        self.pads[index] = idx - n
        row.job_cache = None
        if row.pending_input is None:
            row.pending_input = row.text.token_ids[-1]
        row.live_from_step = self.step
        self.rows[index] = row
        if row.job.logits.active:
            self.picking.state.set_row(index, row.job.logits, row.tokens, row.text.token_ids)

    def _grow_left(self, need: int) -> None:
        grow = -(-need // _GROW_STEP) * _GROW_STEP
        for bc in self.cache:
            _map_buffers(bc, lambda a: mx.pad(a[:, :, : bc.write_position], [(0, 0), (0, 0), (grow, 0)] + [(0, 0)] * (a.ndim - 3)))
            bc.write_position += grow
            bc.left_padding = bc.left_padding + grow
        self.pads = [p + grow for p in self.pads]

    def _compact(self) -> None:
        """Cut the left padding that every live row has."""
        live = [i for i, r in enumerate(self.rows) if r is not None]
        if not live or _empty(self.cache[0]):
            return
        cut = min(self.pads[i] for i in live)  # a host copy: reading the device's would drain the pipeline
        if cut < _COMPACT_PAD:
            return
        self.stepper.flush(self.cache)  # the cut keeps positions up to the write position only
        for bc in self.cache:
            _map_buffers(bc, lambda a: a[:, :, cut : bc.write_position])
            bc.write_position -= cut
            bc.left_padding = mx.maximum(bc.left_padding - cut, 0)
        self.pads = [max(p - cut, 0) for p in self.pads]

    def _shrink(self) -> None:
        """Drop empty rows once no more jobs can come to fill them (`shrinks`)."""
        keep = [i for i, r in enumerate(self.rows) if r is not None]
        if not self.shrinks or not self.exhausted or not keep or len(keep) > self.B // 2:
            return
        self.freed.clear()  # the freed rows go
        index = mx.array(keep)
        for bc in self.cache:
            _map_buffers(bc, lambda a: a[index], bc.ROWS)
            bc.offset, bc.left_padding = bc.offset[index], bc.left_padding[index]
        self.stepper.select(index)
        self.picking.select(keep)
        self.pads = [self.pads[i] for i in keep]
        self.rows = [self.rows[i] for i in keep]
        self.B = len(keep)
        self._gather = index if self._gather is None else self._gather[index]

    def _free(self, i: int) -> None:
        self.rows[i] = None
        self.freed.add(i)
        self.picking.state.clear_row(i)

    def _empty_freed(self) -> None:
        """Start each freed row that no job has taken at the write position: its
        attention then reads no positions of the job that left (until a job is
        placed there, which sets its padding anew)."""
        freed = [i for i in self.freed if self.rows[i] is None]
        self.freed.clear()
        if not freed or _empty(self.cache[0]):
            return
        idx = self.cache[0].write_position
        mask = mx.array([i in freed for i in range(self.B)])
        for bc in self.cache:
            bc.left_padding = mx.where(mask, idx, bc.left_padding)
        for i in freed:
            self.pads[i] = idx

    # -- decoding -----------------------------------------------------------

    def _inputs(self, prev: _Step | None) -> mx.array:
        """Each row's next input: its last sampled token, or (entering) its first."""
        inputs = mx.zeros((self.B,), mx.uint32) if prev is None else prev.tokens.astype(mx.uint32)
        if self._gather is not None and prev is not None:
            inputs = inputs[self._gather]
        self._gather = None
        fresh = [i for i, r in enumerate(self.rows) if r is not None and r.pending_input is not None]
        if fresh:
            values, mask = [0] * self.B, [False] * self.B
            for i in fresh:
                values[i], mask[i] = self.rows[i].pending_input, True
                self.rows[i].pending_input = None
            inputs = mx.where(mx.array(mask), mx.array(values, mx.uint32), inputs)
        return inputs

    def _forward(self, inputs: mx.array) -> tuple[mx.array, mx.array | None]:
        """(greedy tokens, logits or None where no row needs them) of one step."""
        sample = any(r is not None and r.needs_logits for r in self.rows)
        if self.compiled:
            try:
                # the first step is evaluated at once: a kernel that fails to build fails here
                return self.stepper(self.cache, inputs, sample, check=not self.report["steps"])
            except Exception as e:  # a model the recording (or its kernel) cannot take: step by step instead
                log.info("batched decoding: compiled step unavailable (%s: %s); stepping uncompiled", type(e).__name__, e)
                if self.turbo:  # its layers are stepped by the step function alone: unrecorded, then
                    self.stepper.compiled = False
                    return self.stepper(self.cache, inputs, sample)
                self.compiled = False
                self.stepper.flush(self.cache)
                for c in self.cache:  # the offsets the uncompiled step reads
                    c.offset = c.write_position - c.left_padding
        logits = self.model(inputs[:, None], cache=self.cache)[:, -1, :]
        return mx.argmax(logits, axis=-1), logits

    def _queue_step(self, prev: _Step | None) -> _Step:
        """Queue one forward pass over every row; nothing is read back. Where
        a row follows a grammar its pick waits for `_pick` (after the previous
        step's tokens are read back and its matcher has taken them); the
        forward pass runs meanwhile."""
        self._empty_freed()
        tokens, logits = self._forward(self._inputs(prev))
        step = _Step(tokens, self.step, list(self.rows), logits)
        if logits is not None:
            step.t = [0 if r is None else r.queued for r in self.rows]
        for row in self.rows:
            if row is not None:
                row.queued += 1
                row.stats.forward_passes += 1
        if logits is None:
            mx.async_eval(tokens)
        elif any(r is not None and r.picker is not None and r.picker.matcher is not None for r in step.rows):
            mx.async_eval(logits)
        else:
            self._pick(step)
        self.step += 1
        self.report["steps"] += 1
        return step

    def _pick(self, step: _Step) -> None:
        """The step's tokens for rows that need its logits (`RowPicking.finish`), queued."""
        valid = [r is not None and self.rows[i] is r for i, r in enumerate(step.rows)]
        step.tokens, step.logprobs = self.picking.finish(step.rows, step.tokens, step.logits, valid, step.t)
        step.logits = None
        mx.async_eval(step.tokens, *[a for a in step.logprobs or () if a is not None])

    def _read(self, step: _Step) -> list[Result]:
        """Hand each live row its token; return the jobs that finished."""
        values = step.tokens.tolist()
        lp = [None if a is None else a.tolist() for a in step.logprobs] if step.logprobs else None
        live = [(i, r) for i, r in enumerate(step.rows) if r is not None and not r.done and step.step >= r.live_from_step]
        matched = [(r.picker.matcher, values[i]) for i, r in live if r.picker is not None and r.picker.matcher is not None]
        if matched:
            self.engine.grammars.consume(matched)
        done = []
        for i, row in live:
            if row.first_token_s is None:
                row.first_token_s = row.timer.elapsed_s
            row_lp = None if lp is None else (lp[0][i], *(None if a is None else a[i] for a in lp[1:]))
            if row.add(values[i], row_lp, consume=False):
                row.done = True
                done.append(self._finish(row))
                self._free(self.rows.index(row))
        return done

    def _finish(self, row: Row) -> Result:
        row.stats.kv_bytes = (len(row.tokens) + row.text.completion_tokens) * self.per_token + self.per_row
        result = finished_result(row.job, row.text, row.stats, len(row.tokens), row.cached, row.first_token_s,
                                 row.timer.elapsed_s, self.engine.prediction_tokens(row.job))  # fmt: skip
        result.sample = row.job.sample
        if row.picker is not None:
            result.logprobs = row.picker.logprobs(set(self.engine.tokenizer.eos_token_ids))
        return result

    def _next_item(self, waiting: list, source: Iterator):
        if waiting:
            return waiting.pop(0)
        if not self.ahead:
            self.ahead = read_ahead(source, _LOOKAHEAD_ROUNDS * self.B)
        if not self.ahead:
            self.exhausted = True
            return None
        return self.ahead.pop(0)

    def _admit(self, waiting: list, source: Iterator) -> Iterator[Result]:
        """Fill free rows from the job stream, the jobs entering at one step
        prefilled together; yields the results of jobs that fail before
        entering (bad lines, prompts too long) or finish at their first token."""
        while True:
            free = [i for i, r in enumerate(self.rows) if r is None]
            entering = yield from self._take(len(free), waiting, source)
            if not entering:
                return
            started, failed = self._start(entering)
            yield from failed
            if started:
                self.stepper.flush(self.cache)  # rows are placed at the big buffers' write position
            for row in started:
                if row.done:  # finished at its first token
                    yield self._finish(row)
                else:
                    self._place(free.pop(0), row)

    def _take(self, n: int, waiting: list, source: Iterator):
        """Up to n jobs that fit the memory budget beside the live rows."""
        entering: list[Row] = []
        while len(entering) < n:
            item = self._next_item(waiting, source)
            if item is None:
                break
            if isinstance(item, BadJob):
                yield failed_result(item, item.kind, item.message, item.metadata)
                continue
            try:
                row = item if isinstance(item, Row) else self._row(item)
            except Exception as e:
                yield error_result(item, e)
                continue
            if not self._fits(row, entering):
                waiting.insert(0, row)  # waits for rows to free
                break
            entering.append(row)
        return entering

    def run(self, items: Iterable[Job | BadJob]) -> Iterator[Result]:
        source = iter(items)
        waiting: list = []
        with mx.stream(generation_stream):
            yield from self._admit(waiting, source)
            prev = None
            while self.live or prev is not None:
                # queue the next step before reading the current one back
                cur = self._queue_step(prev) if self.live else None
                if prev is not None:
                    yield from self._read(prev)
                    yield from self._admit(waiting, source)
                if cur is not None and cur.logits is not None:
                    self._pick(cur)  # its grammar rows' masks: their matchers have the tokens just read
                prev = cur
                if self.step % _COMPACT_EVERY == 0:
                    self._compact()
                self._shrink()
        stepped = "compiled" if self.compiled and self.stepper.compiled else "unrecorded" if self.compiled else "model"
        self.engine.batch_report.update(self.report, step=stepped, kv_cache=self.kv.kind,
                                        draft="none")  # what batched rows did
