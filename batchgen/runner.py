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
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import orjson

from .config import RunConfig, pld_lookup
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
# A rank of a run over several ranks lost another (finished lines kept): the
# other rank's own code says why (sysexits' EX_TEMPFAIL: run again to resume).
EXIT_PEER_LOST = 75


# Set by the launchers: mlx.launch (every backend), mpirun.
LAUNCH_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched() -> bool:
    """Whether a launcher started this process as a rank (`batchgen.ranks`
    then runs it); read from the environment, so that one process imports
    nothing distributed."""
    return any(k in os.environ for k in LAUNCH_ENV)


class RunError(Exception):
    """The run cannot start, or cannot go on writing (exit code 2, or
    `code`); the message is one line. Lines written before it stay whole."""

    def __init__(self, message: str, code: int = EXIT_UNUSABLE):
        super().__init__(message)
        self.code = code


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


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP raise `Stopped` in the main thread, except
    while a result line is being written: then the stop waits for the line to
    be whole (and counted), so a signal can neither tear nor lose it.
    `received` is set once the main thread has seen a stop."""

    def __init__(self):
        self._writing = False
        self._pending: int | None = None
        self._previous: dict = {}
        self.received = threading.Event()

    def __enter__(self):
        for sig in EXIT_SIGNAL:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, _frame):
        self.received.set()
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


def check_paths(cfg: RunConfig, jobs_path: Path) -> None:
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
    tp = cfg.tensor_parallel
    if isinstance(tp, int) and tp > 1:
        raise RunError(f"--tensor-parallel {tp} needs {tp} ranks: mlx.launch -n {tp} -- batchgen run ...")
    check_paths(cfg, jobs_path)
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
    engine = load_engine(cfg)
    summary = start_summary(cfg, engine)
    try:
        writer = open_output(cfg.output_path, index, cfg.fsync, cfg.retry_failed)
    except OutputFileError as e:
        raise RunError(str(e)) from None
    if index.torn_bytes:
        log.info(f"repaired a torn last line ({index.torn_bytes} bytes) in {cfg.output_path}")
    if index.folded:
        log.info(f"took in {index.folded} result lines an earlier run's ranks left in part files")
    todo = (item for item in iter_jobs(jobs_path, defaults, scan.format, scan.header_line) if item.id not in done)
    summary.total = scan.jobs
    summary.skipped = len(scan.ids & done)
    summary.failed_earlier = len(scan.ids & (index.failed - retry))
    if summary.skipped:
        log.info(f"resuming: {summary.skipped} jobs already have results in {cfg.output_path}")
    if summary.failed_earlier:
        log.warning(f"{summary.failed_earlier} of them are error lines; --retry-failed runs them again")
    code = None
    stops = StopSignals()
    shown = None
    try:
        with stops:
            prewarm(cfg, engine, scan, summary)
            shown = Progress(scan.jobs - summary.skipped, progress, log_every_s)

            def show(_result) -> None:
                shown.update(summary.ok + summary.failed, summary.failed, summary.completion_tokens, summary.decode_tps)

            # rows wanted: a job of n samples takes n (its skipped jobs' counted too: a cap, not a count)
            write_results(engine.run_all(todo, total=scan.jobs - summary.skipped + scan.extra_samples), writer, summary,
                          stops, show)
    except (Stopped, KeyboardInterrupt) as e:
        summary.interrupted = True
        code = stop_code(e)
        log.warning(interrupted(code, writer.written, cfg.output_path))
    except OutputClosed:
        code = reader_gone(summary, writer.written)
    except OutputWriteError as e:
        raise RunError(write_failed(e, writer.written)) from None
    finally:
        writer.close()
        if shown is not None:
            shown.close()
    summary.wall_s = wall.elapsed_s
    summary.batch = {k: round(v, 4) if isinstance(v, float) else v for k, v in engine.batch_report.items()}
    if code is None:
        code = EXIT_FAILED if summary.failed or summary.failed_earlier else EXIT_OK
    return Outcome(summary, code)


def write_results(results, writer, summary: RunSummary, stops: StopSignals, after=None) -> None:
    """Write each result as one whole line and count it (a stop waits for
    both), warn about a failed job, then `after(result)`."""
    for result in results:
        result.stats.finished_at = round(time.time(), 3)
        with stops.writing():
            writer.write(result)
            summary.add(result)
        if not result.ok:
            log.warning(f"job {result.id!r} (line {result.line}) failed: {result.error.type}: {result.error.message}")
        if after is not None:
            after(result)


def stop_code(e: BaseException) -> int:
    """The exit code of a stop signal (`Stopped`, or Python's own SIGINT)."""
    return EXIT_SIGNAL[e.signum if isinstance(e, Stopped) else signal.SIGINT]


def interrupted(code: int, written: int, where: str) -> str:
    name = next(sig.name for sig, c in EXIT_SIGNAL.items() if c == code)
    return (f"interrupted after {written} jobs ({name}); their results are in {where}; "
            "run the same command again to resume")  # fmt: skip


def reader_gone(summary: RunSummary, written: int) -> int:
    """The reader of `-o -` closed it: stopped, stdout silenced; the exit code."""
    summary.interrupted = True
    silence_stdout()
    log.warning(f"the output's reader closed it after {written} jobs; stopped")
    return EXIT_BROKEN_PIPE


def write_failed(e: OutputWriteError, written: int) -> str:
    return f"{e}; stopped after {written} jobs, every finished line kept; run the same command again to resume"


class Progress:
    """A tqdm bar on a terminal (`bar`), else a plain line on stderr every
    `log_every_s` seconds (None: neither)."""

    def __init__(self, total: int, bar: bool, log_every_s: float | None, emit=None):
        self.bar = progress_bar(total, bar)
        emit = emit or log.info
        self.every = ProgressLog(total, log_every_s, emit) if log_every_s and self.bar is None else None

    def update(self, done: int, failed: int, tokens: int, decode_tps: float, ranks: str = "") -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(f"{decode_tps:.1f} tok/s" + (f"; {ranks}" if ranks else ""))
        elif self.every is not None:
            self.every.update(done, failed, tokens, ranks)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of a closed
    pipe cannot fail again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def load_engine(cfg: RunConfig, tensor_group=None):
    timer = Timer()  # mlx-lm's first import (transformers with it) is part of loading
    from .engine.imports import import_mlx_lm

    import_mlx_lm()
    from .engine.core import Engine, ModelLoadError

    imported = timer.elapsed_s
    try:
        engine = Engine.load(cfg.engine, tensor_group)
    except ModelLoadError as e:
        raise RunError(str(e)) from None
    engine.load_s = timer.elapsed_s
    engine.load_parts = {"import": imported, **engine.load_parts}
    return engine


def start_summary(cfg: RunConfig, engine) -> RunSummary:
    from .engine.core import device_name

    d = engine.config.decode  # as resolved for this device
    d = replace(d, pld_max_lookup=pld_lookup(cfg.engine.kv.kind, d.pld_max_lookup))  # as a job's plan caps it
    s = RunSummary(
        load_s=engine.load_s,
        load_parts=dict(engine.load_parts),
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
    q = engine.quantized_report
    s.quantized = q.as_dict() if q is not None else {}
    parts = ", ".join(f"{k} {v:.2f}s" for k, v in engine.load_parts.items())
    log.info(f"loaded {cfg.engine.model} in {engine.load_s:.2f}s ({parts}; {engine.model_memory_gb:.3f} GB) on {s.device}")
    if report is not None:
        log.info(f"fusion: qkv={report.qkv} gate_up={report.gate_up} experts={report.experts} bytes_freed={report.bytes_freed}")
    if q is not None and q.modes:
        route = "dense weights" if q.dense else f"dequantize_rows={q.dequantize_rows}"
        log.info(f"quantized ({', '.join(q.modes)}): {route} linear={q.linear} embedding={q.embedding} experts={q.experts}")
    if d.draft == "pld":
        log.info(f"prompt-lookup decoding ENABLED pld_max_lookup={d.pld_max_lookup} pld_ngram_size={d.pld_ngram_size}")
    if cfg.engine.kv.kind == "turboquant":
        log.info(f"kv cache: turboquant kv_bits={cfg.engine.kv.bits}")
    return s


def prewarm(cfg: RunConfig, engine, scan: ScanReport, summary: RunSummary) -> None:
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


def progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="job", file=sys.stderr, dynamic_ncols=True)
