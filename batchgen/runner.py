"""A whole `batchgen run`: check the file, resume, load, prewarm, stream jobs
through the engine into the output, summarise.

Everything that can make the run unusable (the job file, the output file, the
model) is checked before the first job runs and before an output file is
created; it raises `RunError` with a one-line reason (exit code 2).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson

from .config import RunConfig
from .jobs import JobFileError, ScanReport, iter_jobs, scan_jobs
from .output import (
    OutputClosed,
    OutputFileError,
    OutputLock,
    OutputWriteError,
    ResumeIndex,
    open_output,
    read_resume_index,
)
from .progress import ProgressLog
from .stats import RunSummary, Timer

log = logging.getLogger("batchgen")

EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE = 0, 1, 2
# 128 + the signal's number, as a shell reports a process the signal ended.
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
EXIT_INTERRUPTED = EXIT_SIGNAL[signal.SIGINT]
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: the reader of `-o -` went away


class RunError(Exception):
    """The run cannot start, or cannot go on writing (exit code 2); the
    message is one line. Lines written before it stay whole."""


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


def default_output(jobs_path: str, spooled: Path | None = None) -> str:
    """`outputs/<stem>.jsonl`; for stdin, `outputs/stdin-<digest>.jsonl`, named
    by the content, so two different stdin runs never share an output (their
    line-number ids would collide), and the same input run again resumes."""
    if jobs_path == "-":
        h = hashlib.sha256()
        with open(spooled, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return str(Path("outputs") / f"stdin-{h.hexdigest()[:12]}.jsonl")
    return str(Path("outputs") / f"{Path(jobs_path).stem}.jsonl")


class Stopped(BaseException):
    """A stop signal arrived. A BaseException, as KeyboardInterrupt is: the
    engine's per-job `except Exception` must never turn a stop into an error
    line for the job in flight."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _StopSignals:
    """SIGINT, SIGTERM and SIGHUP raise `Stopped` in the main thread, except
    while a result line is being written: then the stop waits for the line to
    be whole (and counted), so a signal can neither tear nor lose it."""

    def __init__(self):
        self._writing = False
        self._pending: int | None = None
        self._previous: dict = {}

    def __enter__(self):
        for sig in EXIT_SIGNAL:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, _frame):
        if self._writing:
            self._pending = signum
        else:
            raise Stopped(signum)

    @contextmanager
    def writing(self):
        self._writing = True
        try:
            yield
        finally:
            self._writing = False
            if self._pending is not None:
                raise Stopped(self._pending)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # through links too: same device and inode
    except OSError:
        return False


def check_writable(path: Path, what: str) -> None:
    """Raise `RunError` now if `path` could not be written at the end."""
    if path.is_dir():
        raise RunError(f"{what} {path} is a directory")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as e:
        raise RunError(f"cannot write {what} {path}: {e.strerror}") from None
    if not existed:
        path.unlink(missing_ok=True)


def save_summary(path: Path, summary: RunSummary) -> None:
    """Write the summary JSON atomically (temp file, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(orjson.dumps(summary.as_dict(), option=orjson.OPT_INDENT_2) + b"\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunError(f"cannot write summary {path}: {e.strerror} (every result line is in the output)") from None


def _check_paths(cfg: RunConfig, jobs_path: Path) -> None:
    if cfg.output_path != "-":
        out = Path(cfg.output_path)
        if out.is_dir():
            raise RunError(f"output {out} is a directory")
        if _same_file(out, jobs_path):
            raise RunError(f"output {out} is the job file itself; give another -o")
    if cfg.summary_path is not None:
        if _same_file(cfg.summary_path, jobs_path) or (
            cfg.output_path != "-" and _same_file(cfg.summary_path, Path(cfg.output_path))
        ):
            raise RunError(f"summary {cfg.summary_path} is the job file or the output")
        check_writable(cfg.summary_path, "summary")


def run_jobs(cfg: RunConfig, jobs_path: Path, progress: bool, log_every_s: float | None = None) -> Outcome:
    """`progress`: a tqdm bar on stderr (a terminal); `log_every_s`: else a
    plain progress line on stderr every so many seconds (None: none)."""
    wall = Timer()
    _check_paths(cfg, jobs_path)
    lock = OutputLock(Path(cfg.output_path)) if cfg.output_path != "-" else None
    try:
        scan, defaults = scan_jobs(jobs_path, cfg.default_max_tokens, cfg.default_seed)
        if lock is not None:
            lock.acquire()
        index = read_resume_index(Path(cfg.output_path)) if cfg.output_path != "-" else ResumeIndex()
    except (JobFileError, OutputFileError) as e:
        if lock is not None:
            lock.release()
        raise RunError(str(e)) from None
    try:
        return _run_locked(cfg, jobs_path, progress, scan, defaults, index, wall, log_every_s)
    finally:
        if lock is not None:
            lock.release()


def _run_locked(cfg, jobs_path, progress, scan, defaults, index, wall, log_every_s=None) -> Outcome:
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
    todo = (item for item in iter_jobs(jobs_path, defaults, scan.format, scan.header_line) if item.id not in done)
    summary.total = scan.jobs
    summary.skipped = len(scan.ids & done)
    summary.failed_earlier = len(scan.ids & (index.failed - retry))
    if summary.skipped:
        log.info(f"resuming: {summary.skipped} jobs already have results in {cfg.output_path}")
    if summary.failed_earlier:
        log.warning(f"{summary.failed_earlier} of them are error lines; --retry-failed runs them again")
    bar = None
    code = None
    stops = _StopSignals()
    try:
        with stops:
            _prewarm(cfg, engine, scan, summary)
            bar = _progress_bar(scan.jobs - summary.skipped, progress)
            every = ProgressLog(scan.jobs - summary.skipped, log_every_s, log.info) if log_every_s and bar is None else None
            # rows wanted: a job of n samples takes n (its skipped jobs' counted too: a cap, not a count)
            for result in engine.run_all(todo, total=scan.jobs - summary.skipped + scan.extra_samples):
                result.stats.finished_at = round(time.time(), 3)
                with stops.writing():
                    writer.write(result)
                    summary.add(result)
                if not result.ok:
                    log.warning(f"job {result.id!r} (line {result.line}) failed: {result.error.type}: {result.error.message}")
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"{summary.decode_tps:.1f} tok/s")
                elif every is not None:
                    every.update(summary.ok + summary.failed, summary.failed, summary.completion_tokens)
    except (Stopped, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        summary.interrupted = True
        code = EXIT_SIGNAL[signum]
        log.warning(
            f"interrupted after {writer.written} jobs ({signal.Signals(signum).name}); their results are in "
            f"{cfg.output_path}; run the same command again to resume"
        )
    except OutputClosed:
        summary.interrupted = True
        code = EXIT_BROKEN_PIPE
        _silence_stdout()
        log.warning(f"the output's reader closed it after {writer.written} jobs; stopped")
    except OutputWriteError as e:
        raise RunError(f"{e}; stopped after {writer.written} jobs, every finished line kept; "
                       "run the same command again to resume") from None  # fmt: skip
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    summary.wall_s = wall.elapsed_s
    summary.batch = {k: round(v, 4) if isinstance(v, float) else v for k, v in engine.batch_report.items()}
    if code is None:
        code = EXIT_FAILED if summary.failed or summary.failed_earlier else EXIT_OK
    return Outcome(summary, code)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of a closed
    pipe cannot fail again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _load_engine(cfg: RunConfig):
    timer = Timer()  # mlx-lm's first import (transformers) is part of loading
    from .engine.core import Engine, ModelLoadError

    try:
        engine = Engine.load(cfg.engine)
    except ModelLoadError as e:
        raise RunError(str(e)) from None
    engine.load_s = timer.elapsed_s
    return engine


def _start_summary(cfg: RunConfig, engine) -> RunSummary:
    from .engine.core import device_name

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
