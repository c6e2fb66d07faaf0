"""Side-by-side benchmark: plain mlx-lm against batchgen's engine, in one process.

Both sides get the same prompt tokens, the same sampler settings and the same
model weights (two copies, so fusion on one side leaves the other as mlx-lm
loads it). Jobs alternate between the sides (plain first on even jobs,
batchgen first on odd ones) after a warm-up on each, which cancels slow drift
(clocks, allocator state) instead of charging it to one side.

Both sides are timed the same way: time to first token (prefill + first
step), then decode time from the first token to the last; decode tok/s =
(tokens - 1) / decode time.
"""

from __future__ import annotations

import copy
import datetime
import json
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from .config import SHAPE_COMMON, SHAPES, EngineConfig, SamplingConfig
from .engine.core import Engine, cast_floats, load_model
from .jobs import NATIVE, Job, iter_jobs, scan_jobs

# Real model shapes, random weights: for speed figures where quality does not matter.
@dataclass(frozen=True)
class BenchConfig:
    engine: EngineConfig  # batchgen's side; `engine.model` is the path or a shape name
    jobs_path: Path | None = None
    shape: str | None = None
    dtype: str | None = None  # a shape's dtype (default bfloat16); for a model, cast both copies
    quantize_bits: int | None = None
    quantize_group: int = 64  # affine's group size; the fp modes have their own
    quantize_mode: str = "affine"  # or mxfp4, nvfp4 (4 bits), mxfp8 (8 bits)
    max_jobs: int | None = None
    warmup_jobs: int = 1
    synthetic_prompt_tokens: int | None = None
    synthetic_jobs: int = 4
    max_tokens: int | None = None  # override every job's max_tokens
    plain_kv_bits: int | None = None  # mlx-lm's own quantized KV cache on the plain side
    seed: int = 0
    tokenizer_path: Path | None = None  # for --shape models (default: the demo model's)
    pld_policy: tuple[tuple[str, float], ...] = ()  # DraftPolicy settings to try


@dataclass
class Run:
    """One job on one side."""

    id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_s: float
    wall_s: float
    forward_passes: int
    peak_memory_gb: float
    text: str
    pld_drafted: int = 0
    pld_accepted: int = 0
    kv_bytes: int = 0
    token_ids: list = field(default_factory=list)

    @property
    def decode_tps(self) -> float:
        n = self.completion_tokens - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0


@dataclass
class Side:
    name: str
    runs: list = field(default_factory=list)

    def summary(self) -> dict:
        r = self.runs
        decode_tokens = sum(max(x.completion_tokens - 1, 0) for x in r)
        decode_s = sum(x.decode_s for x in r)
        prefilled = sum(x.prompt_tokens - x.cached_tokens for x in r)
        ttft = sum(x.ttft_s for x in r)
        tokens = sum(x.completion_tokens for x in r)
        out = {
            "jobs": len(r),
            "decode_tps": decode_tokens / decode_s if decode_s else 0.0,
            "prefill_tps": prefilled / ttft if ttft else 0.0,
            "ttft_s_mean": ttft / len(r) if r else 0.0,
            "prefill_s_total": ttft,  # every job's time to its first token
            "first_job_ttft_s": r[0].ttft_s if r else 0.0,
            "first_job_cache_hit_ratio": r[0].cached_tokens / r[0].prompt_tokens if r and r[0].prompt_tokens else 0.0,
            "wall_s": sum(x.wall_s for x in r),
            "peak_memory_gb": max((x.peak_memory_gb for x in r), default=0.0),
            "forward_passes_per_token": sum(x.forward_passes for x in r) / tokens if tokens else 0.0,
            "completion_tokens": tokens,
            "prompt_tokens": sum(x.prompt_tokens for x in r),
            "cached_tokens": sum(x.cached_tokens for x in r),
        }
        drafted = sum(x.pld_drafted for x in r)
        if drafted:
            out["pld_acceptance"] = sum(x.pld_accepted for x in r) / drafted
        kv = [x.kv_bytes for x in r if x.kv_bytes]
        if kv:
            out["kv_bytes_mean"] = sum(kv) / len(kv)
        return out


# ---------------------------------------------------------------------------
# Models


# MLX's quantization modes: (bits, group size); affine's group size is a choice.
QUANTIZE_MODES = {"affine": (None, None), "mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


def random_model(shape: str, dtype: str, quantize_bits: int | None, seed: int, *, group_size: int = 64,
                 mode: str = "affine"):  # fmt: skip
    """A model of a real shape with random weights (the same for a given seed),
    quantized where `quantize_bits` is given: affine at `group_size`, or an fp
    `mode` with its own bits and group size (its bits must be `quantize_bits`)."""
    import importlib

    import mlx.nn as nn

    config = {**SHAPE_COMMON, **SHAPES[shape]}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    if quantize_bits:
        if mode not in QUANTIZE_MODES:
            raise ValueError(f"quantize mode: one of {', '.join(QUANTIZE_MODES)}, got {mode!r}")
        bits, group = QUANTIZE_MODES[mode]
        if bits is not None and bits != quantize_bits:
            raise ValueError(f"quantize mode {mode} is {bits}-bit, not {quantize_bits}-bit")
        group = group or group_size
        nn.quantize(model, group_size=group, bits=quantize_bits, mode=mode)
        config["quantization"] = {"group_size": group, "bits": quantize_bits, "mode": mode}
    mx.eval(model.parameters())
    return model, config


def weights_dtype(model) -> str:
    """The dtype of the model's floating weights as they are (quantized: their scales)."""
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return str(value.dtype).removeprefix("mlx.core.")
    return "none"


def parse_policy(text: str) -> tuple[tuple[str, float], ...]:
    """"min_plain_tokens=4,margin=1.0" -> (("min_plain_tokens", 4), ("margin", 1.0)),
    checked against DraftPolicy's numeric settings."""
    from .decode.pld import DraftPolicy

    counters = ("accepted", "drafted")
    known = {k: type(v) for k, v in vars(DraftPolicy()).items() if type(v) in (int, float) and k not in counters}
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise ValueError(f"expected NAME=VALUE with NAME one of {sorted(known)}, got {item!r}")
        out.append((key, known[key](value)))
    return tuple(out)


def load_pair(cfg: BenchConfig, plain: bool = True):
    """(plain model, batchgen engine): two copies of the same weights (`plain`
    False: batchgen's alone, the plain model None)."""
    from .config import DEMO_MODEL_DIR
    from .kernels.registry import keep_builds

    keep_builds()  # before the weights are made: that builds kernels too
    if cfg.shape:
        from mlx_lm.utils import load_tokenizer

        dtype = cfg.dtype or "bfloat16"
        quantized = {"group_size": cfg.quantize_group, "mode": cfg.quantize_mode}
        ours, config = random_model(cfg.shape, dtype, cfg.quantize_bits, cfg.seed, **quantized)
        plain = random_model(cfg.shape, dtype, cfg.quantize_bits, cfg.seed, **quantized)[0] if plain else None
        tokenizer = load_tokenizer(Path(cfg.tokenizer_path or DEMO_MODEL_DIR))
    else:
        ours, tokenizer, config = load_model(cfg.engine.model)
        plain = load_model(cfg.engine.model)[0] if plain else None
        if cfg.dtype:  # e.g. float32 on a CPU, where bf16 matmuls are slow
            for model in (plain, ours):
                if model is not None:
                    cast_floats(model, getattr(mx, cfg.dtype))
    engine = Engine(ours, copy.copy(tokenizer), cfg.engine, config)
    engine.make_fast()
    for key, value in cfg.pld_policy:
        setattr(engine.draft_policy, key, value)
    return plain, tokenizer, engine, config


# ---------------------------------------------------------------------------
# Jobs


def bench_jobs(cfg: BenchConfig, tokenizer) -> tuple[list[Job], str | None]:
    """The jobs to run, and the shared system prompt to prewarm (if any)."""
    if cfg.synthetic_prompt_tokens:
        rng = np.random.default_rng(cfg.seed)
        vocab = min(len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 4000, 4000)
        jobs = []
        for i in range(cfg.synthetic_jobs + cfg.warmup_jobs):
            ids = rng.integers(10, vocab, cfg.synthetic_prompt_tokens).tolist()
            text = tokenizer.decode(ids)
            jobs.append(Job(f"s{i}", i + 1, NATIVE, None, text, cfg.max_tokens or 200, SamplingConfig()))
        return jobs, None
    scan, defaults = scan_jobs(cfg.jobs_path, cfg.max_tokens or 256, None)
    jobs = [j for j in iter_jobs(cfg.jobs_path, defaults, scan.format, scan.header_line) if isinstance(j, Job)]
    if cfg.max_tokens:
        jobs = [Job(**{**j.__dict__, "max_tokens": cfg.max_tokens}) for j in jobs]
    if cfg.max_jobs:
        jobs = jobs[: cfg.max_jobs + cfg.warmup_jobs]
    return jobs, scan.header.system or scan.common_system


# ---------------------------------------------------------------------------
# The two sides


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def run_plain(model, tokenizer, tokens: list[int], job: Job, kv_bits: int | None) -> Run:
    """mlx-lm's own `stream_generate` (its generate_step and sampler)."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    s = job.sampling
    sampler = make_sampler(s.temperature, s.top_p, s.min_p, top_k=s.top_k)
    if s.seed is not None:
        mx.random.seed(s.seed)
    kw = {} if kv_bits is None else {"kv_bits": kv_bits, "quantized_kv_start": 0}
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = None
    text, n, ids = "", 0, []
    for r in stream_generate(model, tokenizer, mx.array(tokens), max_tokens=job.max_tokens, sampler=sampler, **kw):
        if first is None:
            first = time.perf_counter()
        text += r.text
        n = r.generation_tokens
        ids.append(r.token)
        if job.stop:
            text, hit = _cut_at_stop(text, job.stop)
            if hit:
                break
    end = time.perf_counter()
    return Run(job.id, len(tokens), 0, n, first - start, end - first, end - start, n,
               mx.get_peak_memory() / 1e9, text, token_ids=ids)  # fmt: skip


def run_batchgen(engine: Engine, job: Job) -> Run:
    start = time.perf_counter()
    r = engine.run(job)
    wall = time.perf_counter() - start
    if not r.ok:
        raise RuntimeError(f"job {job.id} failed: {r.error.message}")
    s = r.stats
    return Run(r.id, r.usage.prompt_tokens, r.usage.cached_tokens, r.usage.completion_tokens,
               s.prefill_s, s.decode_s, wall, s.forward_passes, s.peak_memory_gb, r.text,
               s.pld_drafted, s.pld_accepted, s.kv_bytes, r.token_ids or [])  # fmt: skip


# ---------------------------------------------------------------------------


def versions() -> dict:
    import mlx_lm

    from . import __version__

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "batchgen": __version__,
            "python": platform.python_version()}  # fmt: skip


def run_bench(cfg: BenchConfig, log=print) -> dict:
    from .engine.core import device_name

    plain_model, tokenizer, engine, config = load_pair(cfg)
    jobs, system = bench_jobs(cfg, tokenizer)
    if system and engine.pool is not None and cfg.engine.prompt_cache.prewarm:
        engine.prewarm(system, "bench")
    plain, ours = Side("mlx-lm"), Side("batchgen")
    warm, measured = jobs[: cfg.warmup_jobs], jobs[cfg.warmup_jobs :]
    for job in warm:
        run_plain(plain_model, tokenizer, engine.prompt_tokens(job), job, cfg.plain_kv_bits)
        run_batchgen(engine, job)
    for i, job in enumerate(measured):
        tokens = engine.prompt_tokens(job)
        order = ("plain", "ours") if i % 2 == 0 else ("ours", "plain")
        for side in order:
            if side == "plain":
                plain.runs.append(run_plain(plain_model, tokenizer, tokens, job, cfg.plain_kv_bits))
            else:
                ours.runs.append(run_batchgen(engine, job))
        p, o = plain.runs[-1], ours.runs[-1]
        log(f"{job.id}: mlx-lm {p.decode_tps:7.1f} tok/s  batchgen {o.decode_tps:7.1f} tok/s  "
            f"ttft {p.ttft_s * 1e3:6.1f}/{o.ttft_s * 1e3:6.1f} ms  same={p.text == o.text}")  # fmt: skip
    ps, os_ = plain.summary(), ours.summary()
    ratio = {k: (os_[k] / ps[k] if ps.get(k) else None) for k in ("decode_tps", "prefill_tps", "wall_s", "ttft_s_mean", "peak_memory_gb")}
    identical = sum(a.text == b.text for a, b in zip(plain.runs, ours.runs))
    prompts = [engine.prompt_tokens(j) for j in measured]
    diverged = divergences(plain_model, prompts, plain.runs, ours.runs) if identical < len(measured) else []
    e = cfg.engine
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "versions": versions(),
        "model": cfg.shape or e.model,
        "dtype": weights_dtype(engine.model),
        "plain_dtype": weights_dtype(plain_model),
        "quantize_bits": cfg.quantize_bits if cfg.shape else (config.get("quantization") or {}).get("bits"),
        "quantization": config.get("quantization"),
        "jobs_file": str(cfg.jobs_path) if cfg.jobs_path else f"synthetic {cfg.synthetic_prompt_tokens}-token prompts",
        "batchgen": {"fuse": e.fuse, "draft": e.decode.draft, "kv_cache": e.kv.kind, "kv_bits": e.kv.bits,
                     "prompt_cache": e.prompt_cache.enabled, "prewarm": e.prompt_cache.prewarm,
                     "pld_ngram_size": e.decode.pld_ngram_size, "pld_max_lookup": engine.config.decode.pld_max_lookup,
                     "static_verify_shapes": engine.static_verify_shapes, "pld_policy": dict(cfg.pld_policy),
                     "fusion": engine.fusion_report.as_dict() if engine.fusion_report else None,
                     "quantized": engine.quantized_report.as_dict() if engine.quantized_report else None},  # fmt: skip
        "plain_kv_bits": cfg.plain_kv_bits,
        "sides": {"mlx-lm": ps, "batchgen": os_},
        "ratio_batchgen_over_plain": ratio,
        "identical_outputs": identical,
        "divergences": diverged,
        "jobs": len(measured),
        "per_job": {"mlx-lm": [_run_dict(r) for r in plain.runs], "batchgen": [_run_dict(r) for r in ours.runs]},
    }


def answer_nll(model, prompt: list[int], answer: list[int], cache: list) -> float:
    """Teacher-forced negative log-likelihood (nats) of `answer` after `prompt`: the
    prompt prefilled at once, then the answer fed one token at a time, as decoding
    feeds it (so a compressed cache is read as it would be while generating)."""
    logits, total = model(mx.array([prompt]), cache=cache)[0, -1], 0.0
    for i, token in enumerate(answer):
        total -= (logits - mx.logsumexp(logits))[token].item()
        if i + 1 < len(answer):
            logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return total


def greedy_ids(model, prompt: list[int], cache: list, max_tokens: int, eos: set[int]) -> list[int]:
    """Greedy token ids after `prompt` through mlx-lm's own decode loop over
    `cache` (a cache under test), up to `max_tokens` or the first of `eos` (kept)."""
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache):
        out.append(int(token))
        if out[-1] in eos:
            break
    return out


def prefix_agreement(got: list[int], ref: list[int]) -> float:
    """The fraction of `ref` before `got` first differs from it (1.0 when equal, or
    when `got` holds all of `ref` and runs on).

    >>> prefix_agreement([1, 2, 9], [1, 2, 3, 4]), prefix_agreement([1, 2], [1, 2, 3, 4])
    (0.5, 0.5)
    >>> prefix_agreement([1, 2], [1, 2])
    1.0
    """
    if got == ref:
        return 1.0
    parted = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    return parted / max(len(ref), 1)


def divergences(model, prompts: list[list[int]], plain: list[Run], ours: list[Run]) -> list[dict]:
    """Where outputs first differ, and how close plain decoding's top two
    logits were there (a near tie is where rounding decides)."""
    out = []
    for tokens, a, b in zip(prompts, plain, ours):
        x, y = a.token_ids, b.token_ids
        i = next((k for k in range(min(len(x), len(y))) if x[k] != y[k]), None)
        if i is None:
            continue
        logits = model(mx.array(tokens + x[:i])[None])[0, -1].astype(mx.float32)
        top2 = mx.sort(logits)[-2:].tolist()
        out.append({"id": a.id, "first_diff_token": i, "of_tokens": len(x), "top2_logit_margin": top2[1] - top2[0]})
    return out


def _run_dict(r: Run) -> dict:
    d = asdict(r)
    d.pop("text")
    d.pop("token_ids")
    d["decode_tps"] = r.decode_tps
    return d


def save_results(result: dict, out_json: Path, out_png: Path | None) -> None:
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    if out_png is not None:
        from . import plots

        if plots.available():
            plots.bench_decode(result, out_png)
        else:
            print("no plot: matplotlib is not installed (pip install -e '.[bench]')")


# ---------------------------------------------------------------------------
# Throughput with many jobs in flight: batchgen's batches against mlx-lm's
# `batch_generate` on the same prompts.


def repeat_jobs(jobs: list[Job], n: int) -> list[Job]:
    """`n` jobs cycling through `jobs`, with distinct ids."""
    return [Job(**{**jobs[i % len(jobs)].__dict__, "id": f"{jobs[i % len(jobs)].id}#{i}"}) for i in range(n)]


def run_throughput(cfg: BenchConfig, batch_sizes: list, n_jobs: int, sequential_jobs: int = 32, log=print,
                   drafts: list[str] | None = None, repeats: int = 1, on_rows=None) -> dict:  # fmt: skip
    """`batch_sizes`: ints, or "auto" (the engine's KV-budget sizing; mlx-lm
    gets the same number of rows). `drafts`: batchgen's runs at each size, one
    per draft kind (default: the configured one), beside one `batch_generate` run.
    `repeats`: each side's timed run that many times, the sides' order reversed
    every other round (one side's run can vary by a third from one to the next
    on a GPU); a row reports each side's median run and lists every run's tok/s.
    `on_rows(result)`: called with the result so far after each batch size's
    rows (a run cut short keeps the sizes it finished)."""
    from mlx_lm.generate import batch_generate

    start = time.perf_counter()
    plain_model, tokenizer, engine, config = load_pair(cfg)
    log(f"loaded both sides in {time.perf_counter() - start:.1f} s")  # a run cut short still says where it was
    base, _ = bench_jobs(cfg, tokenizer)
    jobs = repeat_jobs(base, n_jobs)
    prompts = [engine.prompt_tokens(j) for j in jobs]
    max_tokens = [j.max_tokens for j in jobs]

    def ours(b: int, subset: list[Job], draft: str):
        engine.config = replace(engine.config, batch_size=b, decode=replace(engine.config.decode, draft=draft))
        if engine.pool is not None:  # every run from the same pool: nothing cached by an earlier one
            engine.pool.forget()
        mx.reset_peak_memory()
        start = time.perf_counter()
        results = list(engine.run_all(subset, total=len(subset)))
        wall = time.perf_counter() - start
        return wall, results, mx.get_peak_memory() / 1e9, dict(engine.batch_report) if b > 1 else {}

    def plain(b: int, n: int):
        mx.reset_peak_memory()
        start = time.perf_counter()
        r = batch_generate(plain_model, tokenizer, prompts[:n], max_tokens=max_tokens[:n],
                           completion_batch_size=b, prefill_batch_size=min(b, 8),
                           return_token_ids=True)  # fmt: skip
        tokens = sum(len(ids) for ids in r.token_ids)
        return time.perf_counter() - start, r.texts, tokens, mx.get_peak_memory() / 1e9

    rows: list = []
    result = {**result_head(cfg, engine), "rows": rows}
    for size in batch_sizes:
        b = resolved_rows(engine, size, len(jobs))
        n = len(jobs) if b > 1 else min(sequential_jobs, len(jobs))
        kinds = drafts or [cfg.engine.decode.draft]
        start = time.perf_counter()
        plain(b, min(b, n))  # warm-up at this batch size, both sides
        log(f"batch {b:3d}: batch_generate warm-up ({min(b, n)} jobs) {time.perf_counter() - start:.1f} s")
        for draft in kinds:
            start = time.perf_counter()
            ours(b, jobs[: min(b, n)], draft)
            log(f"batch {b:3d}: batchgen warm-up ({min(b, n)} jobs, {draft}) {time.perf_counter() - start:.1f} s")
        sides = {"batch_generate": lambda: plain(b, n), **{d: (lambda d=d: ours(b, jobs[:n], d)) for d in kinds}}
        runs = runs_in_turn(repeats, sides)
        plain_tps = [tokens / wall for wall, _, tokens, _ in runs["batch_generate"]]
        p_wall, p_texts, p_tokens, p_mem = runs["batch_generate"][median_index(plain_tps)]
        for draft in kinds:
            tps = [_completion_tokens(results) / wall for wall, results, _, _ in runs[draft]]
            wall, results, mem, report = runs[draft][median_index(tps)]
            row = _throughput_row(b, n, (wall, results, mem), (p_wall, p_tokens, p_mem), list(zip(jobs[:n], p_texts)), log)
            rows.append({**row, "requested": size, "draft": draft, "batchgen": {**row["batchgen"], **report}})
            if repeats > 1:
                rows[-1]["runs_tokens_per_s"] = {"mlx_lm_batch_generate": plain_tps, "batchgen": tps}
        _over_sequential(rows)
        if on_rows is not None:
            on_rows(result)
    return result


def result_head(cfg: BenchConfig, engine: Engine) -> dict:
    """What a throughput result starts with: when, where, which model and jobs."""
    from .engine.core import device_name

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(), "versions": versions(), "model": cfg.shape or cfg.engine.model,
        "dtype": weights_dtype(engine.model), "jobs_file": str(cfg.jobs_path) if cfg.jobs_path else "synthetic",
        "quantization": (engine.model_config or {}).get("quantization"), "fuse": cfg.engine.fuse,
        "step_forward": cfg.engine.batch_step_forward,
        "quantized": engine.quantized_report.as_dict() if engine.quantized_report else None,
    }  # fmt: skip


def resolved_rows(engine: Engine, size, jobs: int) -> int:
    """A batch size as given, or "auto" as the engine sizes it for `jobs` jobs."""
    if size != "auto":
        return size
    engine.config = replace(engine.config, batch_size="auto")
    return engine.resolve_batch_size(jobs)


def _over_sequential(rows: list) -> None:
    """Each row's batchgen tok/s over its draft kind's one-row run, where there is one."""
    for r in rows:
        seq = next((s for s in rows if s["batch_size"] == 1 and s["draft"] == r["draft"]), None)
        if seq:
            r["batchgen_over_batchgen_sequential"] = r["batchgen"]["tokens_per_s"] / seq["batchgen"]["tokens_per_s"]


def runs_in_turn(repeats: int, sides: dict) -> dict:
    """{name: [its runs]}: each of `sides` ({name: one run}) run `repeats` times,
    their order reversed every other round, so that drift favours neither."""
    runs = {name: [] for name in sides}
    for r in range(repeats):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            runs[name].append(sides[name]())
    return runs


def median_index(rates: list) -> int:
    """Index of the median of `rates` (the lower middle one of an even count).

    >>> median_index([1.0, 3.0, 2.0, 4.0])
    2
    """
    return sorted(range(len(rates)), key=rates.__getitem__)[(len(rates) - 1) // 2]


def _completion_tokens(results: list) -> int:
    """Tokens batchgen generated, counted as `batch_generate` counts its own
    (its token ids leave out the EOS that ended a sequence)."""
    return sum(r.usage.completion_tokens - (r.finish_reason == "stop") for r in results)


def _throughput_row(b: int, n: int, ours: tuple, plain: tuple, pairs: list, log) -> dict:
    """One batchgen run (wall, results, peak) at batch size b against the
    `batch_generate` run (wall, tokens, peak) on the same n prompts (`pairs`:
    each job and its plain text)."""
    (o_wall, o_results, o_mem), (p_wall, p_tokens, p_mem) = ours, plain
    o_tokens = _completion_tokens(o_results)
    by_id = {r.id: r.text or "" for r in o_results}
    same = sum(by_id.get(j.id, "").strip() == t.strip() for j, t in pairs)
    row = {
        "batch_size": b, "jobs": n,
        "mlx_lm_batch_generate": {"wall_s": p_wall, "tokens_per_s": p_tokens / p_wall, "peak_memory_gb": p_mem},
        "batchgen": {"wall_s": o_wall, "tokens_per_s": o_tokens / o_wall, "completion_tokens": o_tokens,
                     "cached_tokens": sum(r.usage.cached_tokens for r in o_results),
                     "pld_drafted": sum(r.stats.pld_drafted for r in o_results),
                     "pld_accepted": sum(r.stats.pld_accepted for r in o_results), "peak_memory_gb": o_mem},
        "ratio_tokens_per_s": (o_tokens / o_wall) / (p_tokens / p_wall) if p_tokens else None,
        "identical_outputs": same,
    }  # fmt: skip
    log(f"batch {b:3d} ({n} jobs): batch_generate {p_tokens / p_wall:8.1f} tok/s, batchgen {o_tokens / o_wall:8.1f} "
        f"tok/s ({row['ratio_tokens_per_s']:.2f}x), identical {same}/{n}, peak {p_mem:.2f}/{o_mem:.2f} GB")  # fmt: skip
    return row
