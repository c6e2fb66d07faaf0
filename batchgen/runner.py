"""A whole `batchgen run`: check the file, resume, load, prewarm, stream jobs
through the engine into the output, summarise.

Everything that can make the run unusable (the job file, the output file, the
model) is checked before the first job runs and before an output file is
created; it raises `RunError` with a one-line reason (exit code 2).
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .config import RunConfig
from .jobs import JobFileError, ScanReport, iter_jobs, scan_jobs
from .output import OutputFileError, ResumeIndex, open_output, read_resume_index
from .stats import RunSummary, Timer

log = logging.getLogger("batchgen")

EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE, EXIT_INTERRUPTED = 0, 1, 2, 130


class RunError(Exception):
    """The run cannot start (exit code 2); the message is one line."""


@dataclass
class Outcome:
    summary: RunSummary
    exit_code: int


def spool_stdin() -> Path:
    """Copy stdin to a temporary file, so it can be checked, then streamed."""
    tmp = tempfile.NamedTemporaryFile(prefix="batchgen-stdin-", suffix=".jsonl", delete=False)
    with tmp:
        shutil.copyfileobj(sys.stdin.buffer, tmp)
    return Path(tmp.name)


def default_output(jobs_path: str) -> str:
    stem = "stdin" if jobs_path == "-" else Path(jobs_path).stem
    return str(Path("outputs") / f"{stem}.jsonl")


class _Terminated(Exception):
    pass


def _raise_on_sigterm(*_):
    raise _Terminated()


def run_jobs(cfg: RunConfig, jobs_path: Path, progress: bool) -> Outcome:
    wall = Timer()
    try:
        scan, defaults = scan_jobs(jobs_path, cfg.default_max_tokens, cfg.default_seed)
        index = read_resume_index(Path(cfg.output_path)) if cfg.output_path != "-" else ResumeIndex()
    except (JobFileError, OutputFileError) as e:
        raise RunError(str(e)) from None
    retry = index.failed if cfg.retry_failed else set()
    done = index.done - retry
    engine = _load_engine(cfg)
    summary = _start_summary(cfg, engine)
    try:
        writer = open_output(cfg.output_path, index, cfg.fsync, cfg.retry_failed)
    except OutputFileError as e:
        raise RunError(str(e)) from None
    if index.torn_bytes:
        log.info(f"repaired a torn last line ({index.torn_bytes} bytes) in {cfg.output_path}")
    _prewarm(cfg, engine, scan, summary)
    todo = (item for item in iter_jobs(jobs_path, defaults, scan.format, scan.header_line) if item.id not in done)
    summary.total = scan.jobs
    summary.skipped = len(scan.ids & done)
    if summary.skipped:
        log.info(f"resuming: {summary.skipped} jobs already have results in {cfg.output_path}")
    bar = _progress_bar(scan.jobs - summary.skipped, progress)
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        for result in engine.run_all(todo, total=scan.jobs - summary.skipped):
            writer.write(result)
            summary.add(result)
            if not result.ok:
                log.warning(f"job {result.id!r} (line {result.line}) failed: {result.error.type}: {result.error.message}")
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{summary.decode_tps:.1f} tok/s")
    except (KeyboardInterrupt, _Terminated):
        summary.interrupted = True
        log.warning(
            f"interrupted after {writer.written} jobs; their results are in {cfg.output_path}; "
            "run the same command again to resume"
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
        writer.close()
        if bar is not None:
            bar.close()
    summary.wall_s = wall.elapsed_s
    summary.batch = {k: round(v, 4) if isinstance(v, float) else v for k, v in engine.batch_report.items()}
    if summary.interrupted:
        code = EXIT_INTERRUPTED
    else:
        code = EXIT_FAILED if summary.failed else EXIT_OK
    return Outcome(summary, code)


def _load_engine(cfg: RunConfig):
    timer = Timer()  # mlx-lm's first import (transformers) is part of loading
    from .engine import Engine, ModelLoadError

    try:
        engine = Engine.load(cfg.engine)
    except ModelLoadError as e:
        raise RunError(str(e)) from None
    engine.load_s = timer.elapsed_s
    return engine


def _start_summary(cfg: RunConfig, engine) -> RunSummary:
    from .engine import device_name

    d = engine.config.decode  # as resolved for this device
    s = RunSummary(
        load_s=engine.load_s,
        model_memory_gb=engine.model_memory_gb,
        device=device_name(),
        model=cfg.engine.model,
        draft=d.draft,
        kv_cache=cfg.engine.kv.kind,
        pld_ngram_size=d.pld_ngram_size if d.draft == "pld" else 0,
        pld_max_lookup=d.pld_max_lookup if d.draft == "pld" else 0,
    )
    report = engine.fusion_report
    s.fusion = report.as_dict() if report is not None else {"qkv": 0, "gate_up": 0, "experts": 0, "skipped": ["fusion off (--no-fuse)"], "bytes_freed": 0}
    log.info(f"loaded {cfg.engine.model} in {engine.load_s:.2f}s ({engine.model_memory_gb:.3f} GB) on {s.device}")
    if report is not None:
        log.info(f"fusion: qkv={report.qkv} gate_up={report.gate_up} experts={report.experts} bytes_freed={report.bytes_freed}")
    if d.draft == "pld":
        log.info(f"prompt-lookup decoding ENABLED pld_max_lookup={d.pld_max_lookup} pld_ngram_size={d.pld_ngram_size}")
    if cfg.engine.kv.kind == "turboquant":
        log.info(f"kv cache: turboquant kv_bits={cfg.engine.kv.bits}")
    return s


def _prewarm(cfg: RunConfig, engine, scan: ScanReport, summary: RunSummary) -> None:
    pc = cfg.engine.prompt_cache
    if not (pc.enabled and pc.prewarm):
        return
    if scan.header.system:
        system, source = scan.header.system, "header's"
    elif scan.common_system:
        system, source = scan.common_system, f"most common ({scan.common_system_jobs} jobs)"
    elif pc.prewarm_file is not None:
        system, source = pc.prewarm_file.read_text(encoding="utf-8"), f"--prewarm-file {pc.prewarm_file}"
    else:
        return
    info = engine.prewarm(system, source)
    summary.prewarm = {"tokens": info["tokens"], "seconds": info["seconds"]}


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="job", file=sys.stderr, dynamic_ncols=True)
