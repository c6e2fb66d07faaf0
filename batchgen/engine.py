"""The engine: load a model once, make it fast, and turn jobs into results.

Per job: chat template -> prompt tokens -> prompt-pool lookup (LCP) -> prefill
of the uncached rest -> a token stream from the chosen decoder (plain or
prompt-lookup) over the chosen KV cache -> detokenize, stop strings, finish
reason, stats. `Engine.run_all` is the scheduler over the job stream;
sequential decoding is its batch size 1.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from . import pld
from .attention import mark_cache
from .config import DEFAULT_MAX_TOKENS, DecodeConfig, EngineConfig, KVConfig
from .jobs import BadJob, Job
from .prompt_cache import (
    PromptPool,
    cache_nbytes,
    clone_cache,
    default_pool_bytes,
    load_prewarm,
    prewarm_key,
    prewarm_prefix,
    save_prewarm,
    trim_cache,
)
from .sampling import job_seed, make_keys, pick
from .stats import JobFailure, JobStats, Result, Timer, Usage

log = logging.getLogger("batchgen")

# A stream of our own for generation, as mlx-lm does, so async evaluation of
# the next step overlaps the host's work on the current token.
generation_stream = mx.new_thread_local_stream(mx.default_device())


class ModelLoadError(Exception):
    """The model could not be loaded (exit code 2)."""


class JobRunError(Exception):
    """A job cannot run on this model; `kind` goes to its error line."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


# ---------------------------------------------------------------------------
# Loading


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def load_model(spec: str):
    """`mlx_lm.load` with one clear error for a missing or broken model."""
    from mlx_lm import load

    path = Path(spec).expanduser()
    if not path.exists() and not _HUB_ID.match(spec):
        raise ModelLoadError(f"model not found: {spec} (no such directory, and not a hub id)")
    try:
        model, tokenizer, config = load(str(path) if path.exists() else spec, return_config=True)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load model {spec}: {reason}") from None
    return model, tokenizer, config


def model_digest(spec: str, config: dict, fused: bool) -> str:
    """Identity of the model + tokenizer + template, for persisted prompt caches.

    Weight files are fingerprinted by size and their first and last MiB, which
    tells apart any two real checkpoints without reading gigabytes.
    """
    h = hashlib.sha256(repr(sorted(config.items())).encode())
    h.update(b"fused" if fused else b"unfused")
    path = Path(spec).expanduser()
    if not path.exists():
        h.update(spec.encode())
        return h.hexdigest()
    for f in sorted(path.iterdir()):
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                size = f.stat().st_size
                h.update(str(size).encode() + fh.read(1 << 20))
                fh.seek(max(size - (1 << 20), 0))
                h.update(fh.read(1 << 20))
        elif f.suffix in (".json", ".jinja", ".model", ".tiktoken") and f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def context_length(config: dict) -> int | None:
    cfg = config.get("text_config", config)
    return cfg.get("max_position_embeddings") or config.get("max_position_embeddings")


def cast_floats(model: nn.Module, dtype) -> None:
    """Cast floating-point weights (not quantized codes, scales stay float too)."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))
    mx.eval(model.parameters())


def short_attention_wanted(setting: bool | None) -> bool:
    """On by default on MLX's CUDA backend, whose fused attention builds a kernel
    per new shape of a multi-query pass (see attention.py)."""
    if setting is not None:
        return setting
    return mx.default_device().type == mx.gpu and not mx.metal.is_available()


def default_draft() -> str:
    """Prompt lookup on every device: its policy times this device's plain steps and
    verify passes and verifies only the drafts that pay. Measured with the demo
    model: H200 1.60x on edits; 2-core CPU 1.25x on edits, 1.41x on free-form (an
    earlier, weaker build of the model lost there, 0.87x, before the policy measured
    realized throughput)."""
    return "pld"


def default_batch_size() -> int | str:
    """Batching pays where a step is bound by per-pass overhead, as on a GPU, and
    the more rows the better there (H200, 256 jobs, 0.5B shape: "auto" ran 256 rows
    at 4.6x the throughput of 32 rows); on a CPU a step costs in proportion to its rows."""
    return "auto" if mx.default_device().type == mx.gpu else 1


def default_kv_budget() -> int:
    """Bytes the batch's KV cache may take: half of the memory left after the model."""
    from .prompt_cache import default_pool_bytes

    total = default_pool_bytes() * 10
    return max((total - mx.get_active_memory()) // 2, 1 << 28)


def memory_limit() -> int:
    """The device's memory, or less where the process is held to less
    (`ulimit -v`, a container's address-space limit)."""
    import resource

    from .prompt_cache import default_pool_bytes

    total = default_pool_bytes() * 10
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return min(total, soft) if soft != resource.RLIM_INFINITY else total


def device_name() -> str:
    info = mx.device_info()
    name = info.get("device_name") or info.get("architecture") or ""
    return f"{mx.default_device().type.name}: {name}".strip()


# ---------------------------------------------------------------------------
# Text: detokenize, stop strings, EOS, max_tokens


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


# ---------------------------------------------------------------------------
# Decoding pieces shared by the decoders


def prefill(model: nn.Module, cache: list, tokens: list[int], step_size: int, pad: bool = False,
            logits: bool = False) -> mx.array | None:  # fmt: skip
    """Run `tokens` through the model into `cache`, in chunks, as mlx-lm does.

    `logits`: return the next-token logits (1, vocab) after the last token, so
    the first generated token needs no pass of its own (mlx-lm's loop feeds the
    prompt's last token as a separate one-token step: a whole forward pass,
    11 ms of a 48 ms time-to-first-token on the H200 at the 7B shape).

    `pad`: the last chunk is padded to `padded_length` and the pads trimmed from
    the cache afterwards. Causal attention keeps the real tokens' entries exactly
    as without pads; the pass shapes repeat across jobs instead of being new for
    each prompt length (each new shape costs ~50 ms of kernel and plan builds on
    MLX's CUDA backend, measured 2026-11-29). Only for caches that trim exactly."""
    extra = padded_length(len(tokens) % step_size, step_size) - len(tokens) % step_size if pad and tokens else 0
    last = len(tokens) - 1
    tokens = list(tokens) + [tokens[-1]] * extra if extra else tokens
    out = None
    with mx.stream(generation_stream):
        for start in range(0, len(tokens), step_size):
            chunk = mx.array(tokens[start : start + step_size])[None]
            if logits and start + step_size >= len(tokens):
                out = logits_at(model, chunk, cache, last - start)
                mx.eval(out, [c.state for c in cache])
            else:
                model(chunk, cache=cache)
                mx.eval([c.state for c in cache])
            mx.clear_cache()
    if extra:
        trim_cache(cache, extra)
    return out


# mlx-lm causal LMs whose __call__ is exactly `head(backbone(inputs, cache))`:
# a prompt pass projects only the position it samples from onto the vocabulary
# (a 2k-token pass would otherwise compute 2k rows of logits to keep one).
_SPLIT_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"})


def split_head(model: nn.Module):
    """(backbone, head) for a model of `_SPLIT_HEAD_TYPES`, else None."""
    if getattr(getattr(model, "args", None), "model_type", None) not in _SPLIT_HEAD_TYPES:
        return None
    inner = getattr(model, "language_model", model)
    if getattr(inner, "sharding_group", None) is not None:
        return None
    backbone = inner.model
    head = backbone.embed_tokens.as_linear if inner.args.tie_word_embeddings else inner.lm_head
    return backbone, head


def logits_at(model: nn.Module, inputs: mx.array, cache: list, index: int | list[int]) -> mx.array:
    """The model's logits (rows, vocab) at position `index` of a pass over
    `inputs` (rows, length); a list gives each row's own position."""
    if isinstance(index, int):
        pick_rows = lambda x: x[:, index, :]  # noqa: E731
    else:
        pick_rows = lambda x: x[mx.arange(len(index)), mx.array(index)]  # noqa: E731
    parts = split_head(model)
    if parts is None:
        return pick_rows(model(inputs, cache=cache))
    backbone, head = parts
    return head(pick_rows(backbone(inputs, cache)))


PAD_MIN = 16
PAD_POW2_MAX = 256  # the short-pass attention's range (attention.DEFAULT_MAX_QUERIES)
PAD_STEP = 256


def padded_length(n: int, step_size: int) -> int:
    """The pass length a chunk of n tokens is padded to: the next power of two
    (at least PAD_MIN) up to PAD_POW2_MAX, then the next multiple of PAD_STEP;
    at most step_size (0 stays 0).

    Short passes are bound by per-pass overhead, so a few repeating shapes pay.
    Longer ones are compute-bound and their attention builds per (queries, keys)
    pair anyway (mx.fast attention: the keys length is the cached prefix's), so
    they are padded only to a coarse step: a 1.1k-token prompt costs 1,280
    tokens of compute, not 2,048.

    >>> [padded_length(n, 2048) for n in (0, 1, 16, 17, 256, 257, 300, 1100, 2047)]
    [0, 16, 16, 32, 256, 512, 512, 1280, 2048]
    """
    if n <= 0:
        return 0
    if n > PAD_POW2_MAX:
        return min(step_size, -(-n // PAD_STEP) * PAD_STEP)
    return min(step_size, max(PAD_MIN, 1 << (n - 1).bit_length()))


def pads_exactly(cache: list) -> bool:
    """Plain KV caches only: their trim drops the pads and nothing else."""
    return all(type(c) is KVCache for c in cache)


def plain_tokens(model, cache, last: int, sampling, keys, stats: JobStats, t: int = 1) -> Iterator[int]:
    """Plain decoding after token `last` (the cache holds everything before it;
    `t` tokens were generated so far): one forward pass per token, the next pass
    queued (`async_eval`) before the current token is read back."""

    def step(y: mx.array) -> mx.array:
        nonlocal t
        logits = model(y[None], cache=cache)[:, -1, :]
        token = pick(logits, sampling, None if sampling.greedy else keys[t])
        t += 1
        stats.forward_passes += 1
        return token

    with mx.stream(generation_stream):
        y = step(mx.array([last]))
        mx.async_eval(y)
        while True:
            next_y = step(y)
            mx.async_eval(next_y)
            yield y.item()
            y = next_y


# ---------------------------------------------------------------------------
# The engine


@dataclass(frozen=True)
class JobPlan:
    """What the run's settings and the job's overrides resolve to."""

    decode: DecodeConfig
    kv: KVConfig

    @property
    def kv_kind(self) -> str:
        return "fp16" if self.kv.kind == "fp16" else f"turboquant-{self.kv.bits}"


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig, model_config: dict):
        if config.decode.draft == "auto":
            config = replace(config, decode=replace(config.decode, draft=default_draft()))
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_config = model_config
        self.context_length = context_length(model_config)
        self.fusion_report = None
        self.load_s = 0.0
        self.model_memory_gb = 0.0
        self._digest = None
        self._per_token_bytes: dict = {}  # (kind, bits) -> `_kv_bytes_per_token`
        pc = config.prompt_cache
        self.pool = PromptPool(pc.max_bytes or default_pool_bytes()) if pc.enabled else None
        self.prewarm_info = {"tokens": 0, "seconds": 0.0, "source": None}
        self.batch_report: dict = {}  # the last run's rows (and, batched, its steps and prompt time)
        self.batch_steps: dict = {}  # compiled batch steps (kept across runs: recording costs)
        self.draft_policy = pld.DraftPolicy(adaptive=config.decode.pld_adaptive)
        self.short_attention = short_attention_wanted(config.short_attention)
        self.kv_budget_bytes = config.kv_budget_bytes or default_kv_budget()
        static = config.decode.pld_static_shapes
        self.static_verify_shapes = mx.default_device().type == mx.gpu if static is None else static
        pad = config.pad_prompts
        self.pad_prompts = mx.default_device().type == mx.gpu if pad is None else pad

    @classmethod
    def load(cls, config: EngineConfig) -> "Engine":
        timer = Timer()
        model, tokenizer, model_config = load_model(config.model)
        engine = cls(model, tokenizer, config, model_config)
        engine.make_fast()
        engine.load_s = timer.elapsed_s
        return engine

    def make_fast(self) -> None:
        """Load-time transforms: dtype, weight fusion, the short-pass attention hook."""
        if self.config.dtype:
            cast_floats(self.model, getattr(mx, self.config.dtype))
        if self.config.fuse:
            from .fusion import fuse_model

            self.fusion_report = fuse_model(self.model)
        if self.short_attention:
            from .attention import install_short_attention

            install_short_attention(self.model)
        mx.clear_cache()
        self.model_memory_gb = mx.get_active_memory() / 1e9

    @property
    def digest(self) -> str:
        if self._digest is None:
            self._digest = model_digest(self.config.model, self.model_config, self.config.fuse)
        return self._digest

    # -- prompts ----------------------------------------------------------

    def prompt_tokens(self, job: Job) -> list[int]:
        if job.prompt is not None:
            bos = self.tokenizer.bos_token
            add_special = bos is None or not job.prompt.startswith(bos)
            return self.tokenizer.encode(job.prompt, add_special_tokens=add_special)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise JobRunError("no_chat_template", "the model's tokenizer has no chat template; use 'prompt' instead of 'messages'")
        return self._render(list(job.messages))

    def _render(self, messages: list) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    def plan(self, job: Job) -> JobPlan:
        d, k = self.config.decode, self.config.kv
        decode = replace(
            d,
            draft=job.draft or d.draft,
            pld_ngram_size=job.pld_ngram_size or d.pld_ngram_size,
            pld_max_lookup=d.pld_max_lookup if job.pld_max_lookup is None else job.pld_max_lookup,
        )
        kv = KVConfig(kind=job.kv_cache or k.kind, bits=job.kv_bits or k.bits)
        return JobPlan(decode, kv)

    def make_cache(self, kv: KVConfig) -> list:
        if kv.kind == "turboquant":
            from .turboquant import make_turboquant_cache

            # Exact trims up to what a pipelined verify can roll back: its own
            # pass and the speculative one behind it.
            reserve = 2 * (self.config.decode.pld_max_lookup + 1)
            return make_turboquant_cache(self.model, bits=kv.bits, trim_reserve=reserve)
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        if self.short_attention:
            mark_cache(cache)
        return cache

    # -- prewarm ----------------------------------------------------------

    def prewarm(self, system: str, source: str) -> dict:
        """Prefill the shared system prompt's token prefix into a pinned slot."""
        if self.pool is None or not system:
            return self.prewarm_info
        timer = Timer()
        kv = self.config.kv
        kind = JobPlan(self.config.decode, kv).kv_kind
        if getattr(self.tokenizer, "chat_template", None) is None:
            log.info("prewarm skipped: the tokenizer has no chat template")
            return self.prewarm_info
        tokens = prewarm_prefix(
            lambda user: self._render([{"role": "system", "content": system}, {"role": "user", "content": user}])
        )
        cache, loaded = self._prewarm_cache(tokens, kind, kv)
        self.pool.insert(tokens, cache, kind, pinned=True)
        warmed = self.warm_up_tails(cache)
        self.prewarm_info = {
            "tokens": len(tokens),
            "seconds": round(timer.elapsed_s, 4),
            "source": source,
            "loaded": loaded,
            "tail_shapes_warmed": warmed,
        }
        how = "loaded from disk" if loaded else "prefilled"
        log.info(f"prewarm: {len(tokens)} tokens of the {source} system prompt {how} in {timer.elapsed_s:.3f}s")
        return self.prewarm_info

    def _prewarm_cache(self, tokens: list[int], kind: str, kv: KVConfig) -> tuple[list, bool]:
        cache_dir = self.config.prompt_cache.cache_dir
        path = key = None
        if cache_dir is not None:
            key = prewarm_key(self.digest, kind, tokens)
            path = Path(cache_dir) / f"prewarm-{key}.safetensors"
            cache = load_prewarm(path, key, tokens, self._cache_classes())
            if cache is not None:
                return cache, True
        cache = self.make_cache(kv)
        self._prefill(cache, tokens)
        if path is not None:
            save_prewarm(path, cache, tokens, key)
        return cache, False

    def _prefill(self, cache: list, tokens: list[int], logits: bool = False) -> mx.array | None:
        # Padded passes keep the short-pass attention: mx.fast attention builds per
        # (queries, keys) pair and the keys length is the cached prefix's, which
        # varies. H200, 7B shape: a padded 256-token tail took 13 ms through it once
        # built, 20-26 ms as plain ops, but the bench's first jobs 73-86 ms against
        # 48 ms (bench/results/2026-11-29-h200-c/padattn).
        pad = self.pad_prompts and pads_exactly(cache)
        return prefill(self.model, cache, tokens, self.config.prefill_step_size, pad=pad, logits=logits)

    def warm_up_tails(self, cache: list, largest: int = 512) -> int:
        """Run each padded tail length up to `largest` once over a scratch copy of
        a prewarmed cache, so that the first jobs' tails find their pass shapes
        built. Returns the number of lengths run (0 where nothing is padded)."""
        if not (self.pad_prompts and pads_exactly(cache)):
            return 0
        lengths = sorted({padded_length(n, self.config.prefill_step_size) for n in range(1, largest + 1)})
        for n in lengths:
            self._prefill(clone_cache(cache), [0] * n)
        return len(lengths)

    def _cache_classes(self) -> dict:
        try:
            from . import turboquant
        except ImportError:
            return {}
        return {name: getattr(turboquant, name) for name in getattr(turboquant, "CACHE_CLASSES", ())}

    # -- jobs -------------------------------------------------------------

    def run_all(self, items: Iterable[Job | BadJob], total: int | None = None) -> Iterator[Result]:
        """Results in completion order (sequential: job order). `total`, the
        number of jobs coming, caps the batch size."""
        rows = self.resolve_batch_size(total)
        self.batch_report = {"rows": 1}
        if rows > 1:
            from .batch import BatchScheduler, supports_batching

            ok, why = supports_batching(self.make_cache(self.config.kv))
            if ok:
                log.info(f"batched decoding: up to {rows} jobs per step")
                self.batch_report = {"rows": rows}
                yield from BatchScheduler(self, rows, self.kv_budget_bytes).run(items)
                return
            log.info(f"batched decoding off: {why}; jobs run one at a time")
        for item in items:
            if isinstance(item, BadJob):
                yield failed_result(item, item.kind, item.message, item.metadata)
            else:
                yield self.run(item)

    def run(self, job: Job) -> Result:
        try:
            return self._run(job)
        except Exception as e:
            return error_result(job, e)

    def resolve_batch_size(self, total: int | None = None) -> int:
        """The batch size: as configured, the device's default, or ("auto")
        as many rows as the KV budget holds at the default job length."""
        b = self.config.batch_size
        if b is None:
            b = default_batch_size()
        if b == "auto":
            from .batch import BatchScheduler
            from .compiled_step import held_positions

            per_token, per_row = self._kv_bytes_per_token(self.config.kv)
            b = BatchScheduler.auto_size(self.kv_budget_bytes, per_token, held_positions(1024 + DEFAULT_MAX_TOKENS),
                                         per_row=per_row)  # fmt: skip
        return max(1, min(b, total)) if total else b

    def _kv_bytes_per_token(self, kv: KVConfig | None = None) -> tuple[int, int]:
        """(KV bytes per token over all layers, bytes each batch row holds
        besides: TurboQuant's exact sinks and windows) for a cache kind (fp16 by
        default): read off a one-token pass, once per kind."""
        kv = kv or KVConfig()
        key = (kv.kind, kv.bits if kv.kind == "turboquant" else None)
        if key not in self._per_token_bytes:
            from .batch import kv_bytes_per_token

            cache = self.make_cache(kv)
            self.model(mx.array([[0]]), cache=cache)
            self._per_token_bytes[key] = kv_bytes_per_token(cache)
        return self._per_token_bytes[key]

    def checked_job(self, job: Job) -> tuple[Job, list[int], int | None]:
        """(the job as it will run, its prompt tokens, the max_tokens it asked for
        where that was capped, else None), or `JobRunError` if it cannot run.

        max_tokens is capped to the model's context less the prompt: past the
        context the model has no positions, and a job asking more would only
        hold the file up (the result says `stats.max_tokens_capped_from`). What
        is left must fit in memory, checked before any generation, so one job
        can never take the run down."""
        tokens = self.prompt_tokens(job)
        if not tokens:
            raise JobRunError("empty_prompt", "the prompt has no tokens")
        if self.context_length and len(tokens) >= self.context_length:
            raise JobRunError("prompt_too_long", f"prompt has {len(tokens)} tokens; the model's context is {self.context_length}")
        asked = job.max_tokens
        if self.context_length and len(tokens) + asked > self.context_length:
            job = replace(job, max_tokens=self.context_length - len(tokens))
        per_token, per_row = self._kv_bytes_per_token(self.plan(job).kv)
        need = per_token * (len(tokens) + job.max_tokens) + per_row + 8 * job.max_tokens  # KV + sampling keys
        free = memory_limit() - mx.get_active_memory()
        if need > free:
            raise JobRunError(
                "too_large",
                f"prompt ({len(tokens)} tokens) and max_tokens {job.max_tokens} need {need / 1e9:.2f} GB of KV cache; "
                f"{max(free, 0) / 1e9:.2f} GB is free",
            )
        return job, tokens, (asked if job.max_tokens != asked else None)

    def start_prompt(self, tokens: list[int], plan: JobPlan) -> tuple[list, int, mx.array]:
        """A cache holding the prompt, from the pool where it can, and the logits
        of the first token; (cache, cached tokens, logits (1, vocab))."""
        cache, cached = self._cache_for(tokens, plan)
        logits = self._prefill(cache, tokens[cached:], logits=True)
        self._remember(tokens, cache, cached, plan)
        return cache, cached, logits

    def _remember(self, tokens: list[int], cache: list, cached: int, plan: JobPlan) -> None:
        if self.pool is not None and cached < len(tokens):
            self.pool.insert(tokens, clone_cache(cache), plan.kv_kind)

    def _run(self, job: Job) -> Result:
        timer = Timer()
        mx.reset_peak_memory()
        job, tokens, capped_from = self.checked_job(job)
        plan = self.plan(job)
        stats = JobStats(draft=plan.decode.draft, kv_cache=plan.kv.kind, max_tokens_capped_from=capped_from)
        n_keys = job.max_tokens + plan.decode.pld_max_lookup + 2
        keys = None if job.sampling.greedy else make_keys(job_seed(job.sampling), n_keys)
        cache, cached, logits = self.start_prompt(tokens, plan)
        first = first_token(logits, job.sampling, keys, stats)
        first_token_s = timer.elapsed_s
        text = TextAssembler(self.tokenizer, job.stop, job.max_tokens)
        if not text.add(first):
            stream = self._decoder(plan, cache, tokens + [first], job, keys, stats, text)
            for token in stream:
                if text.add(token):
                    break
            stream.close()
        stats.kv_bytes = cache_nbytes(cache)
        return finished_result(job, text, stats, len(tokens), cached, first_token_s, timer.elapsed_s)

    def _cache_for(self, tokens: list[int], plan: JobPlan) -> tuple[list, int]:
        if self.pool is not None:
            hit = self.pool.fetch(tokens, plan.kv_kind)
            if hit.cache is not None:
                return hit.cache, hit.cached_tokens
        return self.make_cache(plan.kv), 0

    def _decoder(self, plan: JobPlan, cache, context, job: Job, keys, stats, text) -> Iterator[int]:
        """Tokens after the first: `context` is the prompt plus the first token,
        which the cache does not hold yet."""
        d = plan.decode
        if d.draft == "pld" and d.pld_max_lookup > 0:
            # Static verify shapes where a pass costs the same for 2..K+1 tokens
            # (a GPU); on a CPU a pass costs in proportion to its tokens.
            pad_to = d.pld_max_lookup + 1 if self.static_verify_shapes else None
            return pld.pld_tokens(
                self.model, cache, context, len(context) - 1, job.sampling, keys, d, stats,
                remaining=lambda: text.remaining, policy=self.draft_policy,
                pad_to=pad_to, stream=generation_stream,
            )  # fmt: skip
        return plain_tokens(self.model, cache, context[-1], job.sampling, keys, stats)


def pick_first(logits: mx.array, sampling, keys: mx.array | None, stats: JobStats) -> mx.array:
    """The first generated token (lazy), from the prompt pass's last logits (keys[0])."""
    stats.forward_passes += 1  # the prompt's last pass produced it
    with mx.stream(generation_stream):
        return pick(logits, sampling, None if sampling.greedy else keys[0])


def first_token(logits: mx.array, sampling, keys: mx.array | None, stats: JobStats) -> int:
    return pick_first(logits, sampling, keys, stats).item()


def finished_result(job: Job, text: TextAssembler, stats: JobStats, prompt_tokens: int, cached: int,
                    first_token_s: float, total_s: float) -> Result:  # fmt: skip
    """The result line of a finished job, its timing stats filled in."""
    stats.prefill_s = first_token_s
    stats.decode_s = total_s - first_token_s
    stats.prompt_tps = (prompt_tokens - cached) / first_token_s if first_token_s > 0 else 0.0
    after_first = text.completion_tokens - 1
    stats.decode_tps = after_first / stats.decode_s if stats.decode_s > 0 and after_first > 0 else 0.0
    stats.cache_hit_ratio = cached / prompt_tokens
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    return Result(
        id=job.id, line=job.line, format=job.format, text=text.text(), finish_reason=text.finish_reason,
        usage=Usage(prompt_tokens, text.completion_tokens, cached), stats=stats,
        metadata=job.metadata, model_name=job.model_name, token_ids=text.token_ids,
    )  # fmt: skip


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
