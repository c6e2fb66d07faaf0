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
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator

import mlx.core as mx
import mlx.nn as nn

from ..cache.factory import CACHE_CLASSES, make_kv_cache
from ..cache.fp16 import DEFAULT_MAX_QUERIES, as_fp16
from ..decode import pld
from ..decode.drafts import DraftPolicy
from ..kernels.registry import keep_builds
from ..transforms.attention import route_attention
from ..transforms.quantized import on_cuda
from ..config import (
    CPU_PLD_MAX_LOOKUP,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PLD_MAX_LOOKUP,
    EngineConfig,
    JobPlan,
    KVConfig,
    pld_lookup,
)
from ..jobs import BadJob, Job
from ..cache.pool import (
    PromptPool,
    cache_nbytes,
    clone_cache,
    default_pool_bytes,
    load_prewarm,
    prewarm_key,
    prewarm_prefix,
    save_prewarm,

)
from ..decode.passes import generation_stream, padded_length, pads_exactly, plain_tokens, prefill
from ..decode.picking import SamplePicker, picked_tokens, sample_jobs, wants_picker
from ..decode.processors import check_bias
from ..decode.sampling import job_seed, make_keys
from ..decode.text import (
    JobRunError,
    TextAssembler,
    error_result,
    failed_result,
    finished_result,
    first_token,
    merged_result,
)
from ..stats import JobStats, Result, Timer
from .collector import fewer_collections

log = logging.getLogger("batchgen")

class ModelLoadError(Exception):
    """The model could not be loaded (exit code 2)."""


# ---------------------------------------------------------------------------
# Loading


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def load_model(spec: str, tensor_group=None):
    """`mlx_lm.load` with one clear error for a missing or broken model. With
    a `tensor_group` (tensor parallelism) each rank keeps its shard of every
    layer: loaded lazily, split by mlx-lm's `model.shard`, then evaluated, so
    no rank ever holds the whole model."""
    from mlx_lm import load

    path = Path(spec).expanduser()
    if not path.exists() and not _HUB_ID.match(spec):
        raise ModelLoadError(f"model not found: {spec} (no such directory, and not a hub id)")
    try:
        model, tokenizer, config = load(str(path) if path.exists() else spec, return_config=True,
                                        lazy=tensor_group is not None)  # fmt: skip
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot load model {spec}: {reason}") from None
    if tensor_group is not None:
        shard_model(model, config, tensor_group, spec)
    return model, tokenizer, config


def shard_model(model, config: dict, group, spec: str) -> None:
    """mlx-lm's tensor-parallel split of `model` over `group`, in place."""
    n = group.size()
    if not hasattr(model, "shard"):
        raise ModelLoadError(
            f"tensor parallel: mlx-lm cannot shard {config.get('model_type')!r} models ({spec}); "
            "it shards llama, qwen2, qwen3, qwen3_moe, deepseek and some other families"
        )
    try:
        model.shard(group)
    except ValueError as e:  # a size that does not divide by the ranks (heads, experts' widths)
        raise ModelLoadError(f"tensor parallel: cannot shard {spec} over {n} ranks: {e}") from None
    mx.eval(model.parameters())


def model_digest(spec: str, config: dict, fused: bool, dequantize_rows: int | str | None = None) -> str:
    """Identity of the model + tokenizer + template, for persisted prompt caches.
    Fusion and the quantized layers' dense route ("dense": weights dequantized
    at load) round differently, so they are part of it (a route that is off
    leaves the digest as it was before routes).

    Weight files are fingerprinted by size and their first and last MiB, which
    tells apart any two real checkpoints without reading gigabytes.
    """
    h = hashlib.sha256(repr(sorted(config.items())).encode())
    h.update(b"fused" if fused else b"unfused")
    if dequantize_rows is not None:
        h.update(f"dequantize_rows={dequantize_rows}".encode())
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
    per new shape of a multi-query pass (cache/fp16.py)."""
    if setting is not None:
        return setting
    return on_cuda()


def default_draft() -> str:
    """Prompt lookup on every device: its policy times this device's plain steps and
    verify passes and verifies only the part of a draft that pays, so it is a gain where drafts
    are accepted and close to plain decoding where they are not
    (bench/RESULTS.md#prompt-lookup). A device or model where PLD measured a loss
    would make "none" the default there."""
    return "pld"


def default_pld_max_lookup() -> int:
    """The draft ceiling for this device (config.py says why the two differ)."""
    return DEFAULT_PLD_MAX_LOOKUP if mx.default_device().type == mx.gpu else CPU_PLD_MAX_LOOKUP


def default_batch_size() -> int | str:
    """Batching pays where a step is bound by per-pass overhead, as on a GPU, and
    the more rows the better there (bench/RESULTS.md#whole-file-throughput); on a
    CPU a step costs in proportion to its rows."""
    return "auto" if mx.default_device().type == mx.gpu else 1


def default_kv_budget() -> int:
    """Bytes the batch's KV cache may take: half of the memory left after the model."""
    from ..cache.pool import default_pool_bytes

    total = default_pool_bytes() * 10
    return max((total - mx.get_active_memory()) // 2, 1 << 28)


def memory_limit() -> int:
    """The device's memory, or less where the process is held to less
    (`ulimit -v`, a container's address-space limit)."""
    import resource

    from ..cache.pool import default_pool_bytes

    total = default_pool_bytes() * 10
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return min(total, soft) if soft != resource.RLIM_INFINITY else total


def device_name() -> str:
    info = mx.device_info()
    name = info.get("device_name") or info.get("architecture") or ""
    return f"{mx.default_device().type.name}: {name}".strip()


# ---------------------------------------------------------------------------
# The engine


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig, model_config: dict):
        if config.decode.draft == "auto":
            config = replace(config, decode=replace(config.decode, draft=default_draft()))
        if config.decode.pld_max_lookup is None:
            config = replace(config, decode=replace(config.decode, pld_max_lookup=default_pld_max_lookup()))
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_config = model_config
        self.context_length = context_length(model_config)
        self.fusion_report = None
        self.quantized_report = None  # `QuantizedReport`, once `make_fast` ran
        self.load_s = 0.0
        self.load_parts: dict = {}  # seconds by step of `load` (and the runner's imports)
        self.model_memory_gb = 0.0
        self._digest = None
        self._per_token_bytes: dict = {}  # (kind, bits) -> `kv_bytes_per_token`
        pc = config.prompt_cache
        self.pool = PromptPool(pc.max_bytes or default_pool_bytes()) if pc.enabled else None
        self.prewarm_info = {"tokens": 0, "seconds": 0.0, "source": None}
        self.batch_report: dict = {}  # the last run's rows (and, batched, its steps and prompt time)
        self.batch_steps: dict = {}  # compiled batch steps (kept across runs: recording costs)
        self.draft_policy = DraftPolicy(adaptive=config.decode.pld_adaptive)
        self.short_attention = short_attention_wanted(config.short_attention)
        self.kv_budget_bytes = config.kv_budget_bytes or default_kv_budget()
        # Read once a run: on CUDA `mx.device_info()` asks the driver (free
        # memory among its fields), which the per-job check need not repeat.
        self.memory_bytes = memory_limit()
        # Turns this rank's figure for a decision into the one every rank of a
        # tensor-parallel group takes (their least): the group's ranks must run
        # the same passes. One rank alone: the figure itself.
        self.agree = lambda value: value
        static = config.decode.pld_static_shapes
        self.static_verify_shapes = mx.default_device().type == mx.gpu if static is None else static
        # A queued speculative verify pass that misses costs its whole compute where
        # the device is the CPU itself; on a GPU it hides the read-back. The CPU's
        # figures: bench/RESULTS.md#prompt-lookup-on-models-it-was-not-tuned-on.
        pipe = config.decode.pld_pipeline
        self.verify_pipeline = mx.default_device().type == mx.gpu if pipe is None else pipe
        pad = config.pad_prompts
        self.pad_prompts = mx.default_device().type == mx.gpu if pad is None else pad
        self._grammars = None  # `grammar.Grammars`, made at the first job with a schema
        self._token_text = None  # `logprobs.TokenText`, at the first job with logprobs

    @classmethod
    def load(cls, config: EngineConfig, tensor_group=None) -> "Engine":
        """Load and transform the model; `load_parts` times the steps: "device"
        (the first contact with the GPU, which on CUDA starts its context, and
        the kernel-build folder), "read" (mlx-lm's load: weights, tokenizer),
        "transforms" (`make_fast`, evaluated)."""
        timer = Timer()
        parts = {}
        keep_builds()  # before anything builds a kernel
        parts["device"] = timer.lap()
        model, tokenizer, model_config = load_model(config.model, tensor_group)
        parts["read"] = timer.lap()
        engine = cls(model, tokenizer, config, model_config)
        engine.make_fast()
        parts["transforms"] = timer.lap()
        engine.load_s = timer.elapsed_s
        engine.load_parts = parts
        return engine

    def make_fast(self) -> None:
        """Load-time transforms: dtype, quantized weights made dense where that
        pays, weight fusion, the remaining quantized layers routed by their rows
        (after fusion, which wants the layers' own types), attention routed to
        the caches."""
        from ..transforms.quantized import dense_weights, resolve_rows, route_quantized, wants_dense

        if self.config.dtype:
            cast_floats(self.model, getattr(mx, self.config.dtype))
        dense = dense_weights(self.model) if wants_dense(self.config.dense_weights, self.model) else None
        if self.config.fuse:
            from ..transforms.fusion import fuse_model

            self.fusion_report = fuse_model(self.model, quantized=self.config.fuse_quantized)
        routed = route_quantized(self.model, resolve_rows(self.config.dequantize_rows))
        self.quantized_report = dense if dense is not None and dense.dense else routed
        route_attention(self.model)
        mx.clear_cache()
        self.model_memory_gb = mx.get_active_memory() / 1e9
        if not self.config.kv_budget_bytes:  # what is left after the model as transformed (dense weights grow it)
            self.kv_budget_bytes = default_kv_budget()

    @property
    def digest(self) -> str:
        if self._digest is None:
            q = self.quantized_report
            rows = (q.dequantize_rows if not q.dense else "dense") if q else None
            self._digest = model_digest(self.config.model, self.model_config, self.config.fuse, rows)
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
            pld_pipeline=self.verify_pipeline,
        )
        kv = KVConfig(kind=job.kv_cache or k.kind, bits=job.kv_bits or k.bits)
        decode = replace(decode, pld_max_lookup=pld_lookup(kv.kind, decode.pld_max_lookup))
        return JobPlan(decode, kv)

    def make_cache(self, kv: KVConfig) -> list:
        # TurboQuant: exact trims up to what a verify can roll back: a whole pass
        # of L + 1 tokens (a model with recurrent layers trims it all and replays
        # the kept tokens), or, pipelined, its own pass and the speculative one
        # behind it. Every exact copy is a token of the model's dtype a layer and
        # head (sinks, window and trims: 17 at L = 5, 23 pipelined).
        lookup = pld_lookup("turboquant", self.config.decode.pld_max_lookup)
        reserve = (2 if self.verify_pipeline else 1) * (lookup + 1)
        return make_kv_cache(self.model, kv.kind, kv.bits, short_passes=self.short_attention, trim_reserve=reserve)

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
            cache = load_prewarm(path, key, tokens, CACHE_CLASSES)
            if cache is not None:
                max_queries = DEFAULT_MAX_QUERIES if self.short_attention else 0
                return [as_fp16(c, max_queries) for c in cache], True
        cache = self.make_cache(kv)
        self.prefill_tokens(cache, tokens)
        if path is not None:
            save_prewarm(path, cache, tokens, key)
        return cache, False

    def prefill_tokens(self, cache: list, tokens: list[int], logits: bool = False) -> mx.array | None:
        # Padded passes keep the short-pass attention: mx.fast attention builds per
        # (queries, keys) pair and the keys length is the cached prefix's, which
        # varies, so its builds cost the first jobs more than plain ops cost every
        # pass (bench/RESULTS.md#short-pass-attention).
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
            self.prefill_tokens(clone_cache(cache), [0] * n)
        return len(lengths)

    # -- jobs -------------------------------------------------------------

    def run_all(self, items: Iterable[Job | BadJob], total: int | None = None) -> Iterator[Result]:
        """Results in completion order (sequential: job order). `total`, the
        number of rows the jobs coming take (a job of n samples takes n),
        caps the batch size."""
        with fewer_collections():
            yield from self._run_all(items, total)

    def _run_all(self, items: Iterable[Job | BadJob], total: int | None) -> Iterator[Result]:
        rows = self.resolve_batch_size(total)
        self.batch_report = {"rows": 1}
        if rows > 1:
            from .scheduler import BatchScheduler, supports_batching

            ok, why = supports_batching(self.make_cache(self.config.kv))
            if ok:
                log.info(f"batched decoding: up to {rows} jobs per step")
                self.batch_report = {"rows": rows}
                parents: dict = {}
                results = BatchScheduler(self, rows, self.kv_budget_bytes).run(_split_samples(_noting_predictions(items), parents))
                yield from _merged_samples(results, parents)
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

    # -- what picks a job's tokens ----------------------------------------

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits."""
        cfg = self.model_config.get("text_config", self.model_config)
        return cfg.get("vocab_size") or self.model_config["vocab_size"]

    def matcher_for(self, job: Job):
        """A fresh grammar matcher for a job with a JSON schema (else None);
        `JobRunError` where the schema does not compile or no grammar engine
        is installed, before anything of the job runs. Also checks its
        logit_bias ids against the vocabulary."""
        if job.logits.logit_bias:
            try:
                check_bias(job.logits, self.vocab_size)
            except ValueError as e:
                raise JobRunError("invalid_value", str(e)) from None
        if job.json_schema is None:
            return None
        if self._grammars is None:
            from ..decode.grammar import Grammars

            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars.matcher(job.json_schema)

    @property
    def grammars(self):
        return self._grammars

    @property
    def token_text(self):
        if self._token_text is None:
            from ..decode.logprobs import TokenText

            self._token_text = TokenText(self.tokenizer)
        return self._token_text

    def resolve_batch_size(self, total: int | None = None) -> int:
        """The batch size: as configured, the device's default, or ("auto")
        as many rows as the KV budget holds at the default job length."""
        b = self.config.batch_size
        if b is None:
            b = default_batch_size()
        if b == "auto":
            from .scheduler import BatchScheduler
            from ..step.compiled import held_positions

            per_token, per_row = self.kv_bytes_per_token(self.config.kv)
            b = BatchScheduler.auto_size(self.kv_budget_bytes, per_token, held_positions(1024 + DEFAULT_MAX_TOKENS),
                                         per_row=per_row)  # fmt: skip
        return max(1, min(b, total)) if total else b

    def kv_bytes_per_token(self, kv: KVConfig | None = None) -> tuple[int, int]:
        """(KV bytes per token over all layers, bytes each batch row holds
        besides: TurboQuant's exact sinks and windows) for a cache kind (fp16 by
        default): read off a one-token pass, once per kind."""
        kv = kv or KVConfig()
        key = (kv.kind, kv.bits if kv.kind == "turboquant" else None)
        if key not in self._per_token_bytes:
            from .scheduler import kv_bytes_per_token

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
        per_token, per_row = self.kv_bytes_per_token(self.plan(job).kv)
        need = per_token * (len(tokens) + job.max_tokens) + per_row + 8 * job.max_tokens  # KV + sampling keys
        free = self.agree(self.memory_bytes - mx.get_active_memory())
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
        cache, cached = self.cache_for(tokens, plan)
        logits = self.prefill_tokens(cache, tokens[cached:], logits=True)
        self.remember(tokens, cache, cached, plan)
        return cache, cached, logits

    def remember(self, tokens: list[int], cache: list, cached: int, plan: JobPlan) -> None:
        if self.pool is not None and cached < len(tokens):
            self.pool.insert(tokens, clone_cache(cache), plan.kv_kind)

    def _run(self, job: Job) -> Result:
        """A job: its prompt prefilled once, then each of its n samples decoded
        from a copy of that cache (the last sample takes the cache itself)."""
        timer = Timer()
        mx.reset_peak_memory()
        job, tokens, capped_from = self.checked_job(job)
        samples = sample_jobs(job)
        matchers = [self.matcher_for(s) for s in samples]  # a schema that cannot compile fails here
        plan = self.plan(job)
        cache, cached, logits = self.start_prompt(tokens, plan)
        prediction = self.prediction_tokens(job)  # the samples share it
        results = []
        for i, (sample, matcher) in enumerate(zip(samples, matchers)):
            own = cache if i == len(samples) - 1 else clone_cache(cache)
            results.append(self._sample(sample, matcher, plan, tokens, own, cached if i == 0 else len(tokens),
                                        logits, capped_from, timer, prediction))  # fmt: skip
        return results[0] if job.n == 1 else merged_result(job, results)

    def _sample(self, job: Job, matcher, plan: JobPlan, tokens: list[int], cache: list, cached: int, logits: mx.array,
                capped_from: int | None, timer: Timer, prediction: list[int] | None) -> Result:  # fmt: skip
        """One sample from a cache holding its prompt and the prompt's last logits;
        `prediction`, the tokens of the job's predicted output (`prediction_tokens`)."""
        stats = JobStats(draft=plan.decode.draft, kv_cache=plan.kv.kind, max_tokens_capped_from=capped_from)
        n_keys = job.max_tokens + plan.decode.pld_max_lookup + 2
        keys = None if job.sampling.greedy else make_keys(job_seed(job.sampling), n_keys)
        picker = None
        if wants_picker(job):
            text_of = self.token_text if job.logprobs else None
            picker = SamplePicker(job, tokens, keys, matcher, self.grammars, text_of)
            first = picker.first(logits, stats)
        else:
            first = first_token(logits, job.sampling, keys, stats)
        first_token_s = timer.elapsed_s
        text = TextAssembler(self.tokenizer, job.stop, job.max_tokens)
        if not text.add(first):
            stream = self._decoder(plan, cache, tokens + [first], job, keys, stats, text, picker, prediction)
            for token in stream:
                if text.add(token):
                    break
            stream.close()
        stats.kv_bytes = cache_nbytes(cache)
        result = finished_result(job, text, stats, len(tokens), cached, first_token_s, timer.elapsed_s, prediction)
        result.sample = job.sample
        if picker is not None:
            result.logprobs = picker.logprobs(set(self.tokenizer.eos_token_ids))
        return result

    def cache_for(self, tokens: list[int], plan: JobPlan) -> tuple[list, int]:
        if self.pool is not None:
            hit = self.pool.fetch(tokens, plan.kv_kind)
            if hit.cache is not None:
                return hit.cache, hit.cached_tokens
        return self.make_cache(plan.kv), 0

    def prediction_tokens(self, job: Job) -> list[int] | None:
        """The tokens of the job's predicted output (None: it gave none)."""
        return self.tokenizer.encode(job.prediction, add_special_tokens=False) if job.prediction else None

    def _decoder(self, plan: JobPlan, cache, context, job: Job, keys, stats, text, picker=None,
                 prediction=None) -> Iterator[int]:  # fmt: skip
        """Tokens after the first: `context` is the prompt plus the first token,
        which the cache does not hold yet; `prediction`, the job's predicted output's."""
        d = plan.decode
        if d.draft == "pld" and d.pld_max_lookup > 0:
            # Static verify shapes where a pass costs the same for 2..K+1 tokens
            # (a GPU); on a CPU a pass costs in proportion to its tokens.
            pad_to = d.pld_max_lookup + 1 if self.static_verify_shapes else None
            return pld.pld_tokens(
                self.model, cache, context, len(context) - 1, job.sampling, keys, d, stats,
                remaining=lambda: text.remaining, policy=self.draft_policy,
                pad_to=pad_to, stream=generation_stream, entries=None if picker is None else picker.entries,
                picker=picker if picker is not None and picker.stateful else None,
                prediction=prediction,
            )  # fmt: skip
        if picker is not None:
            return picked_tokens(self.model, cache, context[-1], picker, stats)
        return plain_tokens(self.model, cache, context[-1], job.sampling, keys, stats)


def _noting_predictions(items: Iterable[Job | BadJob]) -> Iterator[Job | BadJob]:
    """The items, with one log line at the first job that gives a prediction: batched
    rows decode plainly, so it is not drafted from (prompt lookup is one at a time)."""
    noted = False
    for item in items:
        if not noted and isinstance(item, Job) and item.prediction:
            log.info("predictions are drafted from where jobs run one at a time (--batch-size 1); "
                     "batched rows decode plainly and leave them unused")  # fmt: skip
            noted = True
        yield item


def _split_samples(items: Iterable[Job | BadJob], parents: dict) -> Iterator[Job | BadJob]:
    """A job of n samples as n rows of one (`sample_jobs`): in the batch their
    identical prompts enter together and are prefilled once (`start_prompts`
    copies a repeated prompt's cache). `parents`: id -> [job, results so far]."""
    for item in items:
        if isinstance(item, Job) and item.n > 1:
            parents[item.id] = [item, []]
            yield from sample_jobs(item)
        else:
            yield item


def _merged_samples(results: Iterable[Result], parents: dict) -> Iterator[Result]:
    """Results as they come, a job of n samples once its last sample is in (`merged_result`)."""
    for r in results:
        group = parents.get(r.id)
        if group is None:
            yield r
            continue
        group[1].append(r)
        if len(group[1]) == group[0].n:
            del parents[r.id]
            yield merged_result(group[0], group[1])

