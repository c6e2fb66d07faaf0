"""The `batchgen` command line: the only module that knows click.

Core modules raise plain exceptions; this one turns them into one-line
messages on stderr and exit codes: 0 ok, 1 some jobs failed (this run or an
earlier one whose error lines the output keeps), 2 unusable input or options,
or an output that cannot be written (finished lines kept), 130/143/129 stopped
by SIGINT/SIGTERM/SIGHUP, 141 the reader of `-o -` closed the pipe, 75 (a run
over several ranks) another rank stopped answering.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import json
import math

import click

# Quiet the tokenizer library's advice about missing deep-learning frameworks.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from . import __version__  # noqa: E402
from .config import (  # noqa: E402
    CPU_PLD_MAX_LOOKUP,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PLD_MAX_LOOKUP,
    DEFAULT_PLD_NGRAM_SIZE,
    DEMO_MODEL_DIR,
    DRAFT_KINDS,
    KV_BITS,
    KV_CACHE_KINDS,
    DecodeConfig,
    EngineConfig,
    KVConfig,
    PromptCacheConfig,
    SHAPES,
    RunConfig,
)
from .jobs import BadJob, JobFileError, scan_jobs  # noqa: E402


def _setup_logging(quiet: bool) -> None:
    log = logging.getLogger("batchgen")
    log.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("batchgen: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.ERROR if quiet else logging.INFO)
    log.propagate = False


def _fail(message: str, code: int = 2):
    click.echo(f"batchgen: error: {message}", err=True)
    sys.exit(code)


def _parse_bytes(text: str | None) -> int | None:
    """'2GB', '512MiB', '1e9' -> bytes."""
    if text is None:
        return None
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    unit = t[len(num) :]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise click.BadParameter(f"not a size: {text!r} (try 2GB or 512MiB)") from None
    if not math.isfinite(value) or value < 1:
        raise click.BadParameter(f"{text!r}: a size must be finite and at least 1 byte (try 2GB or 512MiB)")
    return int(value)


def _parse_interval(text: str) -> float | None:
    from .progress import parse_interval

    try:
        return parse_interval(text)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _parse_tensor_parallel(text: str):
    if text in ("auto", "all"):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise click.BadParameter(f"--tensor-parallel must be a positive integer, 'all' or 'auto', got {text!r}")


def _parse_batch_size(text: str | None):
    if text is None or text == "auto":
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise click.BadParameter(f"--batch-size must be a positive integer or 'auto', got {text!r}")


def _parse_dequantize_rows(text: str):
    if text in ("auto", "off"):
        return None if text == "off" else text
    if text.isdigit():
        return int(text) or None
    raise click.BadParameter(f"--dequantize-rows must be a row count, 'auto' or 'off', got {text!r}")


_DEQUANTIZE_ROWS = click.option(
    "--dequantize-rows", default="auto", show_default=True, callback=lambda _c, _p, v: _parse_dequantize_rows(v),
    help="Quantized layers: a dense matmul over the dequantized weight from N rows of input on, quantized_matmul "
         "below; auto: on MLX's CUDA backend only; off (or 0): quantized_matmul always.")  # fmt: skip


_DENSE_WEIGHTS = click.option(
    "--dense-weights", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
    callback=lambda _c, _p, v: v if v == "auto" else v == "on",
    help="Dequantize a quantized model's weights once at load; auto: on MLX's CUDA backend when they fit a "
         "quarter of its memory (faster there at every batch size; memory as the unquantized model's).")  # fmt: skip


class _OneLineErrors(click.Group):
    """click's usage errors as one line (`batchgen: error: ...`, exit 2)
    instead of its usage block, so logs and cron mail stay readable."""

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except click.UsageError as e:
            where = f" (batchgen {e.ctx.info_name})" if e.ctx is not None and e.ctx.parent is not None else ""
            _fail(f"{e.format_message()}{where}; see --help")
        except click.ClickException as e:
            _fail(e.format_message(), e.exit_code)
        except click.exceptions.Abort:
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_OneLineErrors)
@click.version_option(__version__, prog_name="batchgen")
def main():
    """Offline batch generation for MLX language models."""


@main.command()
@click.argument("jobs", type=str)
@click.option("-o", "--output", default=None, help="Output JSONL (default outputs/<stem>.jsonl; - for stdout).")
@click.option("--model", envvar="BATCHGEN_MODEL", default=None, help="Model path or hub id (env BATCHGEN_MODEL; default: the bundled demo model).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS, show_default=True, help="For jobs without max_tokens.")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=None, help="For jobs without a seed.")
@click.option("--draft", type=click.Choice(DRAFT_KINDS + ("auto",)), default="auto", show_default=True, help="Prompt-lookup drafting or plain decoding; auto: pld, whose policy verifies only the part of a draft that pays on this device.")
@click.option("--pld-ngram-size", type=click.IntRange(min=1), default=DEFAULT_PLD_NGRAM_SIZE, show_default=True)
@click.option("--pld-max-lookup", type=click.IntRange(min=0), default=None,
              help=f"Most draft tokens per verify pass.  [default: {DEFAULT_PLD_MAX_LOOKUP} on a GPU, {CPU_PLD_MAX_LOOKUP} on a CPU]")
@click.option("--pld-static-shapes/--pld-dynamic-shapes", default=None, help="Pad verify passes to a fixed length (default: on a GPU).")
@click.option("--kv-cache", type=click.Choice(KV_CACHE_KINDS), default="fp16", show_default=True, help="fp16 = uncompressed, in the model's dtype.")
@click.option("--kv-bits", type=click.Choice([str(b) for b in KV_BITS]), default="4", show_default=True, help="TurboQuant bits per coordinate.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None, help="Cast the model's floating weights (default: as stored).")
@click.option("--no-fuse", is_flag=True, help="Keep separate q/k/v and gate/up projections.")
@_DEQUANTIZE_ROWS
@_DENSE_WEIGHTS
@click.option("--no-prewarm", is_flag=True, help="Do not prefill the shared system prompt before the first job.")
@click.option("--no-prompt-cache", is_flag=True, help="No prompt-cache pool (every prompt prefilled in full).")
@click.option("--prompt-cache-bytes", default=None, help="Pool byte budget, e.g. 4GB (default: a tenth of memory).")
@click.option("--prompt-cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Save/load the prewarmed cache here.")
@click.option("--prewarm-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None, help="System prompt to prewarm when the file has none.")
@click.option("--batch-size", default=None, help="Jobs decoding together: N, or auto (fit the KV budget); default 1 on a CPU, auto on a GPU.")
@click.option("--kv-budget", default=None, help="Memory for the batch's KV cache, e.g. 20GB (default: half the free memory).")
@click.option("--summary", "summary_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the run summary JSON here.")
@click.option("--tensor-parallel", default="auto", show_default=True, callback=lambda _c, _p, v: _parse_tensor_parallel(v),
              help="Under mlx.launch: ranks that hold one model copy (N, all); auto: 1 unless the weights do not fit a device.")
@click.option("--retry-failed", is_flag=True, help="On resume, run again the jobs whose earlier line is an error.")
@click.option("--no-fsync", is_flag=True, help="Flush each line but skip fsync.")
@click.option("--log-every", default="30s", show_default=True, callback=lambda _c, _p, v: _parse_interval(v),
              help="Without a terminal: a progress line on stderr this often (30s, 2m, 10; 0 or off: none).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar, logs or summary on stderr.")
def run(jobs, output, model, max_tokens, seed, draft, pld_ngram_size, pld_max_lookup, pld_static_shapes,
        kv_cache, kv_bits, dtype, no_fuse, dequantize_rows, dense_weights, no_prewarm, no_prompt_cache, prompt_cache_bytes, prompt_cache_dir,
        prewarm_file, batch_size, kv_budget, summary_path, tensor_parallel, retry_failed, no_fsync, log_every,
        quiet):  # fmt: skip
    """Generate a result line for every job in JOBS (a JSONL file, or - for stdin).

    Under `mlx.launch -n N` (or `batchgen launch`), N ranks share the jobs and
    write one output; `--tensor-parallel` ranks hold one model copy together."""
    _setup_logging(quiet)
    from .runner import RunError, default_output, launched, run_jobs, save_summary, spool_stdin

    engine = EngineConfig(
        model=model or str(DEMO_MODEL_DIR),
        fuse=not no_fuse,
        dtype=dtype,
        dequantize_rows=dequantize_rows,
        dense_weights=dense_weights,
        decode=DecodeConfig(draft, pld_ngram_size, pld_max_lookup, pld_static_shapes),
        kv=KVConfig(kind=kv_cache, bits=int(kv_bits)),
        prompt_cache=PromptCacheConfig(
            enabled=not no_prompt_cache,
            prewarm=not no_prewarm,
            max_bytes=_parse_bytes(prompt_cache_bytes),
            cache_dir=prompt_cache_dir,
            prewarm_file=prewarm_file,
        ),
        batch_size=_parse_batch_size(batch_size),
        kv_budget_bytes=_parse_bytes(kv_budget),
    )
    ranked = launched()
    if ranked and jobs == "-":
        if os.environ.get("MLX_RANK", "0") != "0":
            sys.exit(2)  # rank 0 says why
        _fail("jobs from stdin (-) cannot be read by launched ranks (a launcher never ends their input); give a file")
    if jobs != "-" and not Path(jobs).is_file() and not ranked:  # ranked: rank 0 names the rank that lacks it
        _fail(f"cannot read job file {jobs}: no such file")
    jobs_path = spool_stdin() if jobs == "-" else Path(jobs)
    cfg = RunConfig(
        jobs_path=jobs,
        output_path=output or default_output(jobs, jobs_path),
        engine=engine,
        default_max_tokens=max_tokens,
        default_seed=seed,
        summary_path=summary_path,
        quiet=quiet,
        fsync=not no_fsync,
        retry_failed=retry_failed,
        tensor_parallel=tensor_parallel,
    )
    # A launched rank writes to the launcher's pipe; mlx.launch sets COLUMNS and
    # LINES when it has a terminal itself, where it passes a bar's redraws on.
    terminal = sys.stderr.isatty() or (ranked and "COLUMNS" in os.environ and "LINES" in os.environ)
    progress = not quiet and terminal
    log_every_s = None if quiet or progress else log_every  # no terminal: plain lines for logs
    try:
        if ranked:
            from .ranks import run_ranks

            outcome = run_ranks(cfg, jobs_path, progress, log_every_s)
        else:
            outcome = run_jobs(cfg, jobs_path, progress, log_every_s)
    except RunError as e:
        _fail(str(e), e.code)
    finally:
        if jobs == "-":
            jobs_path.unlink(missing_ok=True)
    summary = outcome.summary
    if summary is None:  # a rank other than 0: rank 0 reports the run
        sys.exit(outcome.exit_code)
    if not quiet:
        for line in summary.lines():
            click.echo(f"batchgen: {line}", err=True)
    if summary_path is not None:
        try:
            save_summary(summary_path, summary)
        except RunError as e:
            _fail(str(e))
    sys.exit(outcome.exit_code)


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                "help_option_names": []})  # fmt: skip
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def launch(args):
    """mlx.launch with the same arguments (`batchgen launch -n 2 -- batchgen run JOBS`), exiting
    with the run's code: rank 0's, or that of the first rank to fail (mlx.launch itself exits 0)."""
    from .launch import launch as launch_ranks

    sys.exit(launch_ranks(list(args)))


@main.command()
@click.argument("jobs", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--max-tokens", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS, show_default=True)
def validate(jobs, max_tokens):
    """Check JOBS without loading a model: exit 0 valid, 1 some jobs invalid, 2 unusable."""
    from .runner import spool_stdin

    path = spool_stdin() if jobs == "-" else Path(jobs)
    bad = []  # (line, id, kind, message)
    schemas: dict = {}  # schema text -> the run's error for it, or None

    def check(item):
        """A job's line error, or its schema's as a run would write it (the grammar
        engine checks a schema without a model; once per distinct schema)."""
        if isinstance(item, BadJob):
            bad.append((item.line, item.id, item.kind, item.message))
        elif item.json_schema is not None:
            if item.json_schema not in schemas:
                from .decode.grammar import check_schema
                from .decode.text import JobRunError

                try:
                    check_schema(item.json_schema)
                    schemas[item.json_schema] = None
                except JobRunError as e:
                    schemas[item.json_schema] = e
            if (e := schemas[item.json_schema]) is not None:
                bad.append((item.line, item.id, e.kind, str(e)))

    try:
        scan, _ = scan_jobs(path, max_tokens, None, on_item=check)
    except JobFileError as e:
        _fail(str(e))
    finally:
        if jobs == "-":
            path.unlink(missing_ok=True)
    for line, job_id, kind, message in bad:
        click.echo(f"line {line}: job {job_id!r}: {kind}: {message}")
    fmt = "openai batch" if scan.format != "native" else "native"
    click.echo(f"{scan.jobs} jobs ({fmt}), {scan.jobs - len(bad)} valid, {len(bad)} invalid", err=True)
    sys.exit(1 if bad else 0)


@main.command("warm-up")
@click.option("--model", envvar="BATCHGEN_MODEL", default=None, help="Model path or hub id, as `run` takes it.")
@click.option("--kv-cache", type=click.Choice(KV_CACHE_KINDS + ("both",)), default="both", show_default=True,
              help="The cache kinds whose paths to build.")
@click.option("--kv-bits", type=click.Choice([str(b) for b in KV_BITS]), default="4", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None)
@click.option("--no-fuse", is_flag=True)
@_DEQUANTIZE_ROWS
@_DENSE_WEIGHTS
@click.option("--one-at-a-time", is_flag=True, help="Only the one-job path (no batched rows).")
def warm_up(model, kv_cache, kv_bits, dtype, no_fuse, dequantize_rows, dense_weights, one_at_a_time):
    """Build the kernels runs of MODEL need, once, and keep them on disk: later
    processes (a cron schedule's) load them instead of building them. Give the
    options the runs use (--dtype, --no-fuse, --dequantize-rows, --dense-weights): they change
    which kernels run."""
    _setup_logging(quiet=True)
    from .warmup import WarmupError, warm_up as run_warm_up

    engine = EngineConfig(model=model or str(DEMO_MODEL_DIR), fuse=not no_fuse, dtype=dtype,
                          dequantize_rows=dequantize_rows, dense_weights=dense_weights,
                          kv=KVConfig(bits=int(kv_bits)))  # fmt: skip
    kinds = KV_CACHE_KINDS if kv_cache == "both" else (kv_cache,)
    try:
        report = run_warm_up(engine, kinds, batched=not one_at_a_time)
    except WarmupError as e:
        _fail(str(e))
    click.echo(f"batchgen: {report.line()}", err=True)


@main.command()
@click.argument("output", type=str)
@click.option("--summary", "summary_path", type=click.Path(path_type=Path), default=None, help="The run's --summary JSON.")
@click.option("-o", "--out", "report_path", default=None, help="Report HTML (default OUTPUT's name with .report.html; - for stdout).")
@click.option("--by", default=None, help="Group the per-job plots and tables by this metadata key.")
def report(output, summary_path, report_path, by):
    """One self-contained HTML page (inline SVG plots, no network) about OUTPUT, a result JSONL, finished or not."""
    from .report import ReportError, write_report

    try:
        where, n = write_report(Path(output), summary_path, report_path, by)
    except ReportError as e:
        _fail(str(e))
    click.echo(f"batchgen: wrote {where} ({n} result lines)", err=True)


@main.command()
@click.argument("jobs", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", envvar="BATCHGEN_MODEL", default=None, help="Model path or hub id (default: the demo model).")
@click.option("--shape", type=click.Choice(sorted(SHAPES)), default=None,
              help="Random weights of a real model shape instead of --model.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="Both sides' dtype (default: bfloat16 for --shape, as stored for a model).")
@click.option("--quantize", "quantize_bits", type=click.Choice(["4", "8"]), default=None, help="Quantize a --shape model.")
@click.option("--quantize-group", type=click.Choice(["32", "64", "128"]), default="64", show_default=True,
              help="With --quantize: the affine group size (mxfp4/mxfp8: 32, nvfp4: 16, whatever this says).")
@click.option("--quantize-mode", type=click.Choice(["affine", "mxfp4", "nvfp4", "mxfp8"]), default="affine", show_default=True,
              help="With --quantize: MLX's quantization mode (mxfp4/nvfp4 are 4-bit, mxfp8 8-bit, whatever --quantize says).")
@click.option("--max-jobs", type=click.IntRange(min=1), default=None)
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Warm-up jobs per side, not measured.")
@click.option("--synthetic", "synthetic_tokens", type=click.IntRange(min=1), default=None, help="Random prompts of N tokens instead of JOBS.")
@click.option("--synthetic-jobs", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="Override every job's max_tokens.")
@click.option("--draft", type=click.Choice(DRAFT_KINDS), default="pld", show_default=True)
@click.option("--pld-ngram-size", type=click.IntRange(min=1), default=DEFAULT_PLD_NGRAM_SIZE, show_default=True)
@click.option("--pld-max-lookup", type=click.IntRange(min=0), default=None,
              help=f"[default: {DEFAULT_PLD_MAX_LOOKUP} on a GPU, {CPU_PLD_MAX_LOOKUP} on a CPU]")
@click.option("--pld-static-shapes/--pld-dynamic-shapes", default=None)
@click.option("--pld-always", is_flag=True, help="Verify every draft (no adaptive policy).")
@click.option("--pld-policy", default=None, help="Draft-policy settings to try, e.g. min_plain_tokens=4,margin=1.0.")
@click.option("--kv-cache", type=click.Choice(KV_CACHE_KINDS), default="fp16", show_default=True)
@click.option("--kv-bits", type=click.Choice([str(b) for b in KV_BITS]), default="4", show_default=True)
@click.option("--plain-kv-bits", type=click.Choice(["4", "8"]), default=None, help="mlx-lm's own quantized KV cache on the plain side.")
@click.option("--no-fuse", is_flag=True)
@click.option("--fuse-quantized", is_flag=True, help="Fuse quantized q/k/v and gate/up too (not fused by default).")
@_DEQUANTIZE_ROWS
@_DENSE_WEIGHTS
@click.option("--no-step-forward", is_flag=True,
              help="Batch steps through the model's own layers, not step/forward.py's pass (which takes quantized models too).")
@click.option("--no-prompt-cache", is_flag=True)
@click.option("--no-prewarm", is_flag=True)
@click.option("--out", "out_json", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench/results/bench.json"), show_default=True)
@click.option("--png", "out_png", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Plot (default: next to --out).")
@click.option("--no-png", is_flag=True)
@click.option("--throughput", "batch_sizes", default=None,
              help="Comma-separated batch sizes: whole-file throughput against mlx-lm's batch_generate.")
@click.option("--jobs-total", type=click.IntRange(min=1), default=256, show_default=True, help="With --throughput: jobs, cycling JOBS.")
@click.option("--throughput-drafts", default=None, help="With --throughput: batchgen runs at each size, one per draft kind (e.g. pld,none).")
@click.option("--throughput-repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --throughput (or --features): each side's run this many times, in turn; rows report the median run.")
@click.option("--features", is_flag=True,
              help="Batched JSON-schema rows against free ones, logprobs on against off (at the --throughput sizes, "
                   "default 32,auto, over --jobs-total jobs), and n samples against separate jobs.")
@click.option("--samples", "samples_spec", default="64x8x1536", show_default=True,
              help="With --features: PROMPTSxNxTOKENS, random prompts of TOKENS tokens at n=N against PROMPTS*N jobs.")
def bench(jobs, model, shape, dtype, quantize_bits, quantize_group, quantize_mode, max_jobs, warmup, synthetic_tokens,
          synthetic_jobs, max_tokens, draft, pld_ngram_size, pld_max_lookup, pld_static_shapes, pld_always, pld_policy,
          kv_cache, kv_bits, plain_kv_bits, no_fuse, fuse_quantized, dequantize_rows, dense_weights, no_step_forward, no_prompt_cache, no_prewarm,
          out_json, out_png, no_png, batch_sizes, jobs_total, throughput_drafts, throughput_repeats, features,
          samples_spec):  # fmt: skip
    """Run JOBS through plain mlx-lm and through batchgen, side by side."""
    _setup_logging(quiet=True)
    from .bench import BenchConfig, parse_policy, run_bench, save_results

    try:
        policy = parse_policy(pld_policy or "")
    except ValueError as e:
        _fail(f"--pld-policy: {e}")
    if jobs is None and not synthetic_tokens:
        _fail("give a JOBS file or --synthetic N")
    engine = EngineConfig(
        model=model or shape or str(DEMO_MODEL_DIR),
        fuse=not no_fuse,
        fuse_quantized=fuse_quantized,
        dequantize_rows=dequantize_rows,
        dense_weights=dense_weights,
        batch_step_forward=not no_step_forward,
        decode=DecodeConfig(draft, pld_ngram_size, pld_max_lookup, pld_static_shapes, pld_adaptive=not pld_always),
        kv=KVConfig(kind=kv_cache, bits=int(kv_bits)),
        prompt_cache=PromptCacheConfig(enabled=not no_prompt_cache, prewarm=not no_prewarm),
    )
    cfg = BenchConfig(
        engine=engine, jobs_path=jobs, shape=shape, dtype=dtype,
        quantize_bits=int(quantize_bits) if quantize_bits else None, quantize_group=int(quantize_group),
        quantize_mode=quantize_mode, max_jobs=max_jobs, warmup_jobs=warmup,
        synthetic_prompt_tokens=synthetic_tokens, synthetic_jobs=synthetic_jobs, max_tokens=max_tokens,
        plain_kv_bits=int(plain_kv_bits) if plain_kv_bits else None,
        tokenizer_path=Path(model) if (shape and model) else None, pld_policy=policy,
    )  # fmt: skip
    if features:
        from .bench_features import run_features

        try:
            n_prompts, n_samples, prompt_tokens = (int(x) for x in samples_spec.lower().split("x"))
        except ValueError:
            _fail(f"--samples: expected PROMPTSxNxTOKENS (e.g. 64x8x1536), got {samples_spec!r}")
        sizes = [b if b == "auto" else int(b) for b in (batch_sizes or "32,auto").split(",")]
        out_json.parent.mkdir(parents=True, exist_ok=True)
        run_features(cfg, sizes, jobs_total, n_prompts, n_samples, prompt_tokens, repeats=throughput_repeats,
                     log=lambda line: click.echo(line, err=True),
                     on_result=lambda r: out_json.write_text(json.dumps(r, indent=2) + "\n"))  # fmt: skip
        click.echo(f"wrote {out_json}")
        return
    if batch_sizes:
        from .bench import run_throughput

        sizes = [b if b == "auto" else int(b) for b in batch_sizes.split(",")]
        drafts = throughput_drafts.split(",") if throughput_drafts else None
        if drafts and not set(drafts) <= set(DRAFT_KINDS):
            _fail(f"--throughput-drafts: draft kinds are {', '.join(DRAFT_KINDS)}")
        out_json.parent.mkdir(parents=True, exist_ok=True)

        def write(result: dict) -> None:  # after each batch size: a run cut short keeps the sizes it finished
            out_json.write_text(json.dumps(result, indent=2) + "\n")

        run_throughput(cfg, sizes, jobs_total, log=lambda line: click.echo(line, err=True), drafts=drafts,
                       repeats=throughput_repeats, on_rows=write)  # fmt: skip
        click.echo(f"wrote {out_json}")
        return
    result = run_bench(cfg, log=lambda line: click.echo(line, err=True))
    png = None if no_png else (out_png or out_json.with_suffix(".png"))
    save_results(result, out_json, png)
    p, o, ratio = result["sides"]["mlx-lm"], result["sides"]["batchgen"], result["ratio_batchgen_over_plain"]
    click.echo(f"decode tok/s: mlx-lm {p['decode_tps']:.1f}, batchgen {o['decode_tps']:.1f} ({ratio['decode_tps']:.2f}x); "
               f"prefill tok/s {p['prefill_tps']:.0f} / {o['prefill_tps']:.0f}; ttft {p['ttft_s_mean']*1e3:.1f} / "
               f"{o['ttft_s_mean']*1e3:.1f} ms; identical {result['identical_outputs']}/{result['jobs']}; "
               f"passes/token {p['forward_passes_per_token']:.2f} / {o['forward_passes_per_token']:.2f}")  # fmt: skip
    click.echo(f"wrote {out_json}" + (f" and {png}" if png else ""))
