"""Shared decode pieces below the engine: the text a job's tokens make (stop
strings, EOS, max_tokens) and the result lines built from it.

Every decoder (plain, PLD, the batch's rows) ends a job the same way, so these
live here, under the engine and the scheduler alike.
"""

from __future__ import annotations

import mlx.core as mx

from dataclasses import replace

from ..jobs import Job
from ..stats import JobFailure, JobStats, Result, Sample, Usage
from .drafts import prediction_usage
from .passes import generation_stream
from .sampling import pick


class JobRunError(Exception):
    """A job cannot run on this model; `kind` goes to its error line."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class TextAssembler:
    """Consumes generated tokens one at a time and decides when a job ends.

    `completion_tokens` counts every token the model produced, EOS included;
    the text excludes EOS and ends before the first stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], max_tokens: int):
        self._detok = tokenizer.detokenizer
        self._eos = set(tokenizer.eos_token_ids)
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._scan_from = 0
        self._cut = None
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []
        self.finish_reason = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, token: int) -> bool:
        """True once the job is finished (the token is counted either way)."""
        self.token_ids.append(token)
        if token in self._eos:
            self.finish_reason = "stop"
            return True
        self._detok.add_token(token)
        if self._stop and self._find_stop(self._detok.text):
            self.finish_reason = "stop"
            return True
        if self.completion_tokens >= self.max_tokens:
            self.finish_reason = "length"
            return True
        return False

    def _find_stop(self, text: str) -> bool:
        # Only the new text, plus enough before it to catch a straddling stop.
        start = max(0, self._scan_from - self._max_stop + 1)
        hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        self._scan_from = len(text)
        if hits:
            self._cut = min(hits)
        return bool(hits)

    def text(self) -> str:
        self._detok.finalize()
        text = self._detok.text
        if self._cut is None and self._stop and self._find_stop(text):
            self.finish_reason = "stop"  # completed by bytes flushed only at the end
        return text if self._cut is None else text[: self._cut]

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.completion_tokens


def pick_first(logits: mx.array, sampling, keys: mx.array | None, stats: JobStats) -> mx.array:
    """The first generated token (lazy), from the prompt pass's last logits (keys[0])."""
    stats.forward_passes += 1  # the prompt's last pass produced it
    with mx.stream(generation_stream):
        return pick(logits, sampling, None if sampling.greedy else keys[0])


def first_token(logits: mx.array, sampling, keys: mx.array | None, stats: JobStats) -> int:
    return pick_first(logits, sampling, keys, stats).item()


def finished_result(job: Job, text: TextAssembler, stats: JobStats, prompt_tokens: int, cached: int,
                    first_token_s: float, total_s: float, prediction: list[int] | None = None) -> Result:  # fmt: skip
    """The result line of a finished job, its timing stats filled in;
    `prediction`, the tokens of the job's predicted output, where it gave one."""
    stats.prefill_s = first_token_s
    stats.decode_s = total_s - first_token_s
    stats.prompt_tps = (prompt_tokens - cached) / first_token_s if first_token_s > 0 else 0.0
    after_first = text.completion_tokens - 1
    stats.decode_tps = after_first / stats.decode_s if stats.decode_s > 0 and after_first > 0 else 0.0
    stats.cache_hit_ratio = cached / prompt_tokens
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    usage = Usage(prompt_tokens, text.completion_tokens, cached)
    if prediction is not None:
        usage.accepted_prediction_tokens, usage.rejected_prediction_tokens = prediction_usage(prediction, text.token_ids)
    return Result(
        id=job.id, line=job.line, format=job.format, text=text.text(), finish_reason=text.finish_reason,
        usage=usage, stats=stats,
        metadata=job.metadata, model_name=job.model_name, token_ids=text.token_ids,
    )  # fmt: skip


def merged_result(job: Job, results: list[Result]) -> Result:
    """One result for a job's n samples (`picking.sample_jobs`): its `samples`
    in order; the prompt counted once (its tokens, and the fewest cached of
    any sample: the copy that prefilled it), completion tokens summed; time to
    the first sample's first token, then decode until the last sample ends.
    A sample that failed makes the job's error line."""
    results = sorted(results, key=lambda r: r.sample)
    failed = next((r for r in results if not r.ok), None)
    if failed is not None:
        return replace(failed, sample=0)
    first = results[0]
    prompt = first.usage.prompt_tokens
    cached = min(r.usage.cached_tokens for r in results)
    completion = sum(r.usage.completion_tokens for r in results)
    usage = Usage(prompt, completion, cached)
    for name in ("accepted_prediction_tokens", "rejected_prediction_tokens"):
        if getattr(first.usage, name) is not None:
            setattr(usage, name, sum(getattr(r.usage, name) for r in results))
    stats = replace(first.stats)
    stats.prefill_s = min(r.stats.prefill_s for r in results)
    stats.decode_s = max(r.stats.prefill_s + r.stats.decode_s for r in results) - stats.prefill_s
    after_first = sum(max(r.usage.completion_tokens - 1, 0) for r in results)
    stats.decode_tps = after_first / stats.decode_s if stats.decode_s > 0 else 0.0
    stats.prompt_tps = (prompt - cached) / stats.prefill_s if stats.prefill_s > 0 else 0.0
    stats.cache_hit_ratio = cached / prompt if prompt else 0.0
    for name in ("forward_passes", "pld_drafted", "pld_accepted", "kv_bytes"):
        setattr(stats, name, sum(getattr(r.stats, name) for r in results))
    stats.peak_memory_gb = max(r.stats.peak_memory_gb for r in results)
    samples = [Sample(r.text, r.finish_reason, r.usage.completion_tokens, r.logprobs) for r in results]
    return Result(id=job.id, line=job.line, format=job.format, usage=usage, stats=stats,
                  metadata=job.metadata, model_name=job.model_name, samples=samples)  # fmt: skip


def error_result(job: Job, e: Exception) -> Result:
    """The error line of a job that raised: a `JobRunError`'s kind, else generation_error."""
    if isinstance(e, JobRunError):
        return failed_result(job, e.kind, str(e), job.metadata)
    return failed_result(job, "generation_error", f"{type(e).__name__}: {e}", job.metadata)


def failed_result(item, kind: str, message: str, metadata=None) -> Result:
    return Result(
        id=item.id,
        line=item.line,
        format=item.format,
        metadata=metadata,
        error=JobFailure(type=kind, message=message, line=item.line),
        model_name=getattr(item, "model_name", None),
    )
