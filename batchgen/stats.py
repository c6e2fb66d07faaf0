"""Per-job results and statistics, and the run summary."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class JobStats:
    prefill_s: float = 0.0  # from job start to the first token: prefill + first step
    decode_s: float = 0.0  # from the first token to the last
    prompt_tps: float = 0.0  # prefilled (uncached) tokens per second
    decode_tps: float = 0.0  # tokens after the first, per second of decode
    cache_hit_ratio: float = 0.0  # cached prompt tokens / prompt tokens
    draft: str = "none"
    pld_drafted: int = 0
    pld_accepted: int = 0
    forward_passes: int = 0
    kv_cache: str = "fp16"
    kv_bytes: int = 0
    peak_memory_gb: float = 0.0
    max_tokens_capped_from: int | None = None  # the job's max_tokens, where the model's context capped it
    finished_at: float | None = None  # unix seconds (ms) when the result line was written

    def as_dict(self) -> dict:
        d = asdict(self)
        for k in ("prefill_s", "decode_s", "prompt_tps", "decode_tps", "peak_memory_gb"):
            d[k] = round(d[k], 6)
        d["cache_hit_ratio"] = round(d["cache_hit_ratio"], 4)
        d["pld_acceptance"] = (
            round(self.pld_accepted / self.pld_drafted, 4) if self.pld_drafted else 0.0
        )
        return d


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # A job that gave a predicted output: its tokens found in the output and the rest
    # (`drafts.prediction_usage`); None (not written) for a job without one.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class JobFailure:
    type: str
    message: str
    line: int


@dataclass
class Sample:
    """One of a job's n samples (`Result.samples`, n > 1)."""

    text: str
    finish_reason: str
    completion_tokens: int
    logprobs: Sequence | None = None  # OpenAI's `logprobs.content` entries (`Content`), where asked


@dataclass
class Result:
    """One finished job (or a failed one, with `error` set and no text)."""

    id: str
    line: int
    format: str
    text: str | None = None
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    stats: JobStats = field(default_factory=JobStats)
    metadata: Any = None
    error: JobFailure | None = None
    model_name: str | None = None
    token_ids: list | None = None  # generated ids, EOS included (not written out)
    logprobs: Sequence | None = None  # OpenAI's `logprobs.content` entries (`Content`), where the job asked
    samples: list | None = None  # a job of n > 1 samples: its `Sample`s (text, finish_reason unset)
    sample: int = 0  # the sample this result is, before a job's samples are merged

    @property
    def ok(self) -> bool:
        return self.error is None


class Timer:
    """Wall-clock seconds since construction (perf_counter)."""

    def __init__(self):
        self.start = self._lap = time.perf_counter()

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def lap(self) -> float:
        """Seconds since the last `lap` (the first: since construction)."""
        now = time.perf_counter()
        seconds, self._lap = now - self._lap, now
        return seconds


@dataclass
class RunSummary:
    total: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    failed_earlier: int = 0  # skipped jobs whose earlier line is an error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    decode_s: float = 0.0
    decode_tokens: int = 0  # tokens generated after each job's first
    wall_s: float = 0.0
    load_s: float = 0.0
    load_parts: dict = field(default_factory=dict)  # load_s by step: import, device, read, transforms
    peak_memory_gb: float = 0.0
    model_memory_gb: float = 0.0
    device: str = ""
    model: str = ""
    fusion: dict = field(default_factory=dict)
    quantized: dict = field(default_factory=dict)  # `QuantizedReport.as_dict`: the dequantize route
    prewarm: dict = field(default_factory=lambda: {"tokens": 0, "seconds": 0.0})
    draft: str = "none"
    kv_cache: str = "fp16"
    pld_ngram_size: int = 0
    pld_max_lookup: int = 0
    interrupted: bool = False
    batch: dict = field(default_factory=lambda: {"rows": 1})  # rows; batched: steps, prompt_s
    # A run over several ranks: {"ranks", "data", "tensor"} and each rank's own
    # figures (`rank_figures`); empty for one process.
    parallel: dict = field(default_factory=dict)
    ranks: list = field(default_factory=list)

    def absorb(self, other: "RunSummary") -> None:
        """Add another rank's results (the jobs it wrote) to this summary."""
        self.ok += other.ok
        self.failed += other.failed
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens
        self.decode_s += other.decode_s
        self.decode_tokens += other.decode_tokens
        self.peak_memory_gb = max(self.peak_memory_gb, other.peak_memory_gb)
        self.load_s = max(self.load_s, other.load_s)
        self.model_memory_gb = max(self.model_memory_gb, other.model_memory_gb)

    def counts(self) -> dict:
        """What `absorb` adds, as data another rank can send."""
        keys = ("ok", "failed", "prompt_tokens", "completion_tokens", "cached_tokens", "decode_s", "decode_tokens",
                "peak_memory_gb", "load_s", "model_memory_gb", "wall_s", "device")  # fmt: skip
        return {k: getattr(self, k) for k in keys}

    def add(self, r: Result) -> None:
        if not r.ok:
            self.failed += 1
            return
        self.ok += 1
        self.prompt_tokens += r.usage.prompt_tokens
        self.completion_tokens += r.usage.completion_tokens
        self.cached_tokens += r.usage.cached_tokens
        self.decode_s += r.stats.decode_s
        self.decode_tokens += max(r.usage.completion_tokens - 1, 0)
        self.peak_memory_gb = max(self.peak_memory_gb, r.stats.peak_memory_gb)

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "jobs": {
                "total": self.total,
                "ok": self.ok,
                "failed": self.failed,
                "skipped": self.skipped,
                "skipped_failed": self.failed_earlier,
            },
            "tokens": {
                "prompt": self.prompt_tokens,
                "completion": self.completion_tokens,
                "cached": self.cached_tokens,
            },
            "wall_s": round(self.wall_s, 3),
            "load_s": round(self.load_s, 3),
            "load_parts": {k: round(v, 3) for k, v in self.load_parts.items()},
            "decode_tps": round(self.decode_tps, 2),
            "jobs_per_s": round(self.ok / self.wall_s, 3) if self.wall_s > 0 else 0.0,
            "throughput_tps": round(self.completion_tokens / self.wall_s, 2) if self.wall_s > 0 else 0.0,
            "cache_hit_ratio": (
                round(self.cached_tokens / self.prompt_tokens, 4)
                if self.prompt_tokens
                else 0.0
            ),
            "peak_memory_gb": round(self.peak_memory_gb, 4),
            "model_memory_gb": round(self.model_memory_gb, 4),
            "device": self.device,
            "model": self.model,
            "fusion": self.fusion,
            "quantized": self.quantized,
            "prewarm": self.prewarm,
            "draft": self.draft,
            "pld_ngram_size": self.pld_ngram_size,
            "pld_max_lookup": self.pld_max_lookup,
            "kv_cache": self.kv_cache,
            "batch": self.batch,
            "interrupted": self.interrupted,
            **({"parallel": self.parallel, "ranks": self.ranks} if self.ranks else {}),
        }

    def lines(self) -> list[str]:
        """The same figures as `as_dict`, for a human on stderr."""
        d = self.as_dict()
        j, t = d["jobs"], d["tokens"]
        f = d["fusion"] or {}
        return [
            f"jobs: {j['total']} total, {j['ok']} ok, {j['failed']} failed, {j['skipped']} skipped"
            + (f" ({j['skipped_failed']} of them error lines)" if j["skipped_failed"] else ""),
            f"tokens: {t['prompt']} prompt ({t['cached']} cached, cache_hit_ratio={d['cache_hit_ratio']}), "
            f"{t['completion']} completion",
            f"time: wall {d['wall_s']}s, load {d['load_s']}s{_parts(d['load_parts'])}, prewarm {d['prewarm']['tokens']} tokens "
            f"in {d['prewarm']['seconds']}s; decode {d['decode_tps']} tok/s per job, "
            f"{d['throughput_tps']} tok/s overall, {d['jobs_per_s']} jobs/s",
            f"memory: peak {d['peak_memory_gb']} GB, model {d['model_memory_gb']} GB; device {d['device']}",
            f"techniques: draft={d['draft']} pld_ngram_size={d['pld_ngram_size']} "
            f"pld_max_lookup={d['pld_max_lookup']} kv_cache={d['kv_cache']} "
            f"fusion qkv={f.get('qkv', 0)} gate_up={f.get('gate_up', 0)} experts={f.get('experts', 0)} "
            f"batch rows={d['batch'].get('rows', 1)}" + _batched_draft(d["batch"]),
        ] + ([_ranks_line(self.parallel, self.ranks)] if self.ranks else [])


def _parts(parts: dict) -> str:
    """' (import 1.2, read 0.3)' from {"import": 1.234, "read": 0.3}; '' if none.

    >>> _parts({"import": 1.234, "read": 0.3})
    ' (import 1.2, read 0.3)'
    """
    return f" ({', '.join(f'{k} {v:.1f}' for k, v in parts.items())})" if parts else ""


def rank_figures(rank: int, counts: dict, jobs: int) -> dict:
    """One rank's line in the summary's `ranks`, from its `RunSummary.counts`
    and the jobs of its share.

    >>> rank_figures(1, {"ok": 9, "failed": 1, "completion_tokens": 500, "wall_s": 10.0, "decode_s": 4.0,
    ...                  "decode_tokens": 480, "peak_memory_gb": 1.5, "model_memory_gb": 1.0, "device": "cpu"}, 10)
    ... # doctest: +NORMALIZE_WHITESPACE
    {'rank': 1, 'device': 'cpu', 'share': 10, 'ok': 9, 'failed': 1, 'completion_tokens': 500, 'wall_s': 10.0,
     'throughput_tps': 50.0, 'decode_tps': 120.0, 'peak_memory_gb': 1.5, 'model_memory_gb': 1.0}
    """
    wall, decode_s = counts["wall_s"], counts["decode_s"]
    return {
        "rank": rank,
        "device": counts["device"],
        "share": jobs,
        "ok": counts["ok"],
        "failed": counts["failed"],
        "completion_tokens": counts["completion_tokens"],
        "wall_s": round(wall, 3),
        "throughput_tps": round(counts["completion_tokens"] / wall, 2) if wall > 0 else 0.0,
        "decode_tps": round(counts["decode_tokens"] / decode_s, 2) if decode_s > 0 else 0.0,
        "peak_memory_gb": round(counts["peak_memory_gb"], 4),
        "model_memory_gb": round(counts["model_memory_gb"], 4),
    }


def _ranks_line(parallel: dict, ranks: list) -> str:
    each = ", ".join(f"rank {r['rank']} {r['ok'] + r['failed']}/{r['share']} jobs {r['throughput_tps']} tok/s"
                     for r in ranks)  # fmt: skip
    return (f"ranks: {parallel['ranks']} ({parallel['data']} x data parallel, {parallel['tensor']} x tensor "
            f"parallel): {each}")  # fmt: skip


def _batched_draft(batch: dict) -> str:
    """How batched rows decoded, where it differs from one job at a time's draft."""
    if batch.get("rows", 1) <= 1 or "draft" not in batch:
        return ""
    passes = f", {batch['verify_passes']} verify passes" if "verify_passes" in batch else ""
    return f" (batched rows: draft={batch['draft']}{passes})"
