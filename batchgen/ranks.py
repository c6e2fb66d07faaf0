"""`batchgen run` over several ranks: `mlx.launch -n N -- batchgen run JOBS`
(or `--hosts a,b`), one engine per rank, one output as one process would
have written it.

The design:

* Every rank reads the whole job file and computes the same shares from it
  (`shares.plan_shares`: runs of jobs in prefix order, balanced by expected
  work), so no plan travels. A group of `--tensor-parallel` ranks holds one
  model copy (mlx-lm's `model.shard`) and runs one share, in step.
* Rank 0 holds the output's lock and is its only writer. Every other rank
  that writes (one per model copy) appends its lines, whole, flushed and
  fsync'd as rank 0 does, to a part file of its own beside the output. Rank
  0 folds those lines into the output as they come where it can see the
  parts (ranks on its machine, or a shared filesystem), and MLX's
  collectives carry the rest to it at the end (ranks on other machines). A
  part is deleted only once its lines are in the output on disk, and the
  fold skips every id the output holds: a reader of the output sees whole
  lines, each id once, however a run ends, and the next run (with any number
  of ranks, or one process) folds in whatever parts are left first.
* The ranks exchange messages (`engine.distributed.exchange`, MLX's
  all_gather) at the start (the file is the same everywhere, the resume
  index, the go) and at the end (each rank's figures, the far ranks' lines),
  never per job: no rank waits for another while there is work.
* Rank 0 speaks for the run: the progress line, the summary and its exit
  code are the run's. The other ranks log only what concerns them alone,
  prefixed with their rank, and exit 0 when rank 0 reports for them.
* A rank that dies: `mlx.launch` stops the others (SIGTERM: exit 143, their
  finished lines kept), the ring backend raises in ranks waiting on it
  (exit 2, lines kept), and a stop signal ends a rank even while it waits in
  a collective (`StopWatchdog`).
"""

from __future__ import annotations

import base64
import logging
import os
import signal
import socket
import sys
import tempfile
import uuid
from array import array
from dataclasses import dataclass, replace
from pathlib import Path

from .config import RunConfig
from .jobs import BadJob, JobFileError, iter_jobs, scan_jobs
from .output import (
    OutputClosed,
    OutputFileError,
    OutputLock,
    OutputWriteError,
    ResultWriter,
    open_output,
    part_files,
    part_path,
    read_resume_index,
)
from .rank_parts import (
    Discard,
    Folding,
    RankPrefix,
    StopWatchdog,
    file_digest,
    file_size,
    memory,
    open_part,
    per_rank_memory,
    refuse_transport_errors,
    shared_device,
    weight_bytes,
    whole_lines,
    write_atomically,
)
from .runner import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_PEER_LOST,
    Outcome,
    Progress,
    RunError,
    StopSignals,
    Stopped,
    check_paths,
    interrupted,
    load_engine,
    prewarm,
    reader_gone,
    run_jobs,
    start_summary,
    stop_code,
    write_failed,
    write_results,
)
from .shares import expected_work, plan_shares, prefix_digest, rank_layout, tensor_parallel_size
from .stats import RunSummary, Timer, rank_figures

log = logging.getLogger("batchgen")



def run_ranks(cfg: RunConfig, jobs_path: Path, progress: bool, log_every_s: float | None = None) -> Outcome:
    """The run as this rank's part of a launch; one rank alone runs as one process."""
    from .engine import distributed

    try:
        group = distributed.init()
    except RuntimeError as e:
        raise RunError(f"cannot join the launch's other ranks: {e}") from None
    if group is None:
        return run_jobs(cfg, jobs_path, progress, log_every_s)
    return RankRun(cfg, jobs_path, group, progress, log_every_s).run()


class Quiet(Exception):
    """Rank 0 reports why the run cannot go on; this rank ends with `code`, silently."""

    def __init__(self, code: int = EXIT_OK):
        super().__init__(code)
        self.code = code


@dataclass
class Share:
    """The jobs this rank runs (ordinals in file order) and how the ranks lie."""

    mine: set
    sizes: list  # jobs of each model copy's share
    copies: int
    tensor: int
    copy: int
    leader: bool  # writes its copy's lines (rank 0 of the copy)


class RankRun:
    def __init__(self, cfg: RunConfig, jobs_path: Path, group, progress: bool, log_every_s: float | None):
        self.cfg, self.jobs_path, self.group = cfg, jobs_path, group
        self.rank, self.size = group.rank(), group.size()
        self.who = f"rank {self.rank}: " if self.rank else ""
        self.progress, self.log_every_s = progress, log_every_s
        self.stdout = cfg.output_path == "-"
        # Parts lie beside the output; with `-o -` (no resume) in the temp directory.
        self.base = Path(tempfile.gettempdir()) / "batchgen-stdout.jsonl" if self.stdout else Path(cfg.output_path)
        self.lock: OutputLock | None = None
        self.index = None
        self.writer: ResultWriter | None = None
        self.part: Path | None = None
        self.shipped: list = []  # this rank's leftover parts rank 0 now holds
        self.received = False  # rank 0: it holds parts shipped from other machines
        self.visible: list = []
        self.wall = Timer()

    # -- the run -----------------------------------------------------------

    def run(self) -> Outcome:
        if self.rank:
            for h in log.handlers:
                h.addFilter(RankPrefix(self.rank))
        self.stops = stops = StopSignals()
        try:
            with stops, StopWatchdog(stops, self.who):
                return self._run()
        except Quiet as q:
            return Outcome(None, q.code)
        except (Stopped, KeyboardInterrupt) as e:  # before the first job: nothing written
            log.warning(f"stopped ({signal.Signals(stop_code(e) - 128).name}) before the first job")
            return Outcome(None, stop_code(e))
        finally:
            if self.writer is not None:
                self.writer.close()
            if self.lock is not None:
                self.lock.release()
            if self.stdout and self.rank and self.part is not None:
                self.part.unlink(missing_ok=True)  # -o - has no resume to keep it for

    def _run(self) -> Outcome:
        from .engine.distributed import PeerLost

        try:
            start = self._start()
            share = self._share(start)
            engine = self._ready(start, share)
        except PeerLost as e:
            raise RunError(f"{self.who}another rank stopped answering before the first job ({e})",
                           EXIT_PEER_LOST) from None  # fmt: skip
        summary = start_summary(self.cfg, engine)
        summary.total, summary.skipped = start["jobs"], start["skipped"]
        summary.failed_earlier = start["failed_earlier"]
        folding = Folding(self, share, start["run_id"]) if self.rank == 0 else None
        code = None
        try:
            self._jobs(engine, share, start, summary, folding)
        except (Stopped, KeyboardInterrupt) as e:
            code = stop_code(e)
            summary.interrupted = True
            self._wind_down(folding, summary)
            log.warning(interrupted(code, self._written(), self._where()))
        except OutputClosed:
            code = reader_gone(summary, self._written())
        except OutputWriteError as e:
            self._wind_down(folding, summary)
            raise RunError(self.who + write_failed(e, self._written())) from None
        except PeerLost as e:
            self._wind_down(folding, summary)
            raise RunError(f"{self.who}another rank stopped answering ({e}); every finished line is kept in "
                           f"{self._where()}; run the same command again to resume", EXIT_PEER_LOST) from None  # fmt: skip
        if self.rank:
            return Outcome(None, code if code is not None else EXIT_OK)
        summary.wall_s = self.wall.elapsed_s
        summary.batch = {k: round(v, 4) if isinstance(v, float) else v for k, v in engine.batch_report.items()}
        if code is None:
            code = EXIT_FAILED if summary.failed or summary.failed_earlier else EXIT_OK
        return Outcome(summary, code)

    def _where(self) -> str:
        if self.rank == 0 or self.stdout:
            return self.cfg.output_path
        return f"{self.part} (the next run on {self.cfg.output_path} takes them in)"

    def _written(self) -> int:
        """Lines this rank wrote this run (rank 0: its own and those it folded in)."""
        return self.writer.written if self.writer is not None else 0

    def _wind_down(self, folding, summary: RunSummary) -> None:
        """Stopping: rank 0 takes in the whole lines it can see (the parts stay,
        for the next run; with `-o -`, which has none, they go)."""
        if folding is None:
            return
        try:
            folding.take()
            self.writer.sync()
        except (OutputWriteError, OutputFileError, OutputClosed) as e:
            log.warning(f"could not take the other ranks' lines in ({e}); the next run will")
        summary.ok += folding.lines - folding.failed  # what rank 0 saw of the others' work
        summary.failed += folding.failed
        summary.completion_tokens += folding.tokens
        if self.stdout:
            for tail in folding.tails.values():
                tail.path.unlink(missing_ok=True)

    # -- start: every rank checks, then the ranks agree ---------------------

    def _start(self) -> dict:
        """Check and scan locally, then agree: every rank's checks and job
        file, the parts earlier runs left on other machines, rank 0's resume
        index. Returns what every rank needs (the same on every rank)."""
        from .engine.distributed import exchange_json

        cfg, rank = self.cfg, self.rank
        mine = {"error": None, "host": socket.gethostname(), "pid": os.getpid(), "leftover": [],
                "memory": memory(), "weights": weight_bytes(cfg.engine.model) if rank == 0 else 0,
                "run_id": uuid.uuid4().hex[:12] if rank == 0 else None, "digest": None, "jobs": 0}  # fmt: skip
        self.keys: list = []
        self.work = array("d")
        self.ids: list = []
        try:
            if rank == 0:
                check_paths(cfg, self.jobs_path)
            elif not self.stdout and Path(cfg.output_path).is_dir():
                raise RunError(f"output {cfg.output_path} is a directory")
            self.scan, self.defaults = scan_jobs(self.jobs_path, cfg.default_max_tokens, cfg.default_seed,
                                                 on_item=self._note)  # fmt: skip
            mine["digest"], mine["jobs"] = file_digest(self.jobs_path), self.scan.jobs
            if rank == 0 and not self.stdout:
                self.lock = OutputLock(self.base).acquire()
                self.index = read_resume_index(self.base)
            elif not self.stdout:
                mine["leftover"] = [[p.name, file_size(p)] for p in part_files(self.base)]
        except (RunError, JobFileError, OutputFileError) as e:
            mine["error"] = str(e)
        except OSError as e:
            mine["error"] = f"cannot read job file {self.jobs_path}: {e.strerror}"
        self.records = records = exchange_json(self.group, mine)
        self._agree_or_stop(records)
        for k, r in enumerate(records[1:], start=1):
            if r["digest"] != records[0]["digest"]:
                self._stop_all(f"rank {k} ({r['host']}) reads a different {self.jobs_path} than rank 0 ({r['jobs']} "
                               f"jobs against {records[0]['jobs']}); every rank needs the same file")  # fmt: skip
        self._ship_leftovers(records)
        return self._resume(records)

    def _note(self, item) -> None:
        """Each job's prefix fingerprint and expected work, for the shares."""
        from .engine.scheduler import prefix_key

        if isinstance(item, BadJob):
            self.keys.append(b"")  # an error line to write, nothing to run
            self.work.append(0.0)
        else:
            text = prefix_key(item)
            self.keys.append(prefix_digest(text))
            self.work.append(expected_work(len(text), item.max_tokens))
        if self.rank == 0:
            self.ids.append(item.id)

    def _agree_or_stop(self, records: list) -> None:
        errors = [(k, r["error"]) for k, r in enumerate(records) if r.get("error")]
        if errors:
            k, error = errors[0]
            self._stop_all(error if k == 0 else f"rank {k} ({records[k]['host']}): {error}")

    def _stop_all(self, message: str) -> None:
        """Every rank learnt the same reason at once: rank 0 reports it."""
        if self.rank == 0:
            raise RunError(message)
        raise Quiet()

    def _ship_leftovers(self, records: list) -> None:
        """Parts of an earlier run that rank 0 cannot see (another machine's
        disk) travel to it; they are deleted here once rank 0 holds them."""
        from .engine.distributed import exchange_json

        if not any(r["leftover"] for r in records[1:]):
            return
        need = None
        if self.rank == 0:
            need = {str(k): [n for n, size in r["leftover"] if file_size(self.base.with_name(n)) != size]
                    for k, r in enumerate(records) if k}  # fmt: skip
        need = {int(k): names for k, names in exchange_json(self.group, need)[0].items() if names}
        self.shipped = [self.base.with_name(n) for n in need.get(self.rank, [])]
        self._ship(need)

    def _ship(self, names: dict) -> None:
        """Rank k's part files `names[k]` (their whole lines) into one file,
        named as the first, beside rank 0's output."""
        from .engine.distributed import exchange

        if not names:
            return
        payload = b"".join(whole_lines(self.base.with_name(n)) for n in names.get(self.rank, []))
        got = exchange(self.group, payload)
        if self.rank == 0:
            for k, data in enumerate(got):
                if names.get(k):
                    write_atomically(self.base.with_name(names[k][0]), data)
                    self.received = True

    def _resume(self, records: list) -> dict:
        """Rank 0's resume index (output and every part it holds now) as a
        mask over the jobs, to every rank."""
        from .engine.distributed import exchange_json

        info = None
        if self.rank == 0:
            error, index = None, self.index
            if self.received:
                try:
                    index = self.index = read_resume_index(self.base)  # the shipped parts too
                except OutputFileError as e:
                    error = str(e)
            retry = index.failed if index is not None and self.cfg.retry_failed else set()
            done = (index.done - retry) if index is not None else set()
            failed = (index.failed - retry) if index is not None else set()
            mask = bytearray((len(self.ids) + 7) // 8)
            for i, key in enumerate(self.ids):
                if key in done:
                    mask[i // 8] |= 1 << (i % 8)
            info = {"error": error, "mask": base64.b64encode(bytes(mask)).decode(), "run_id": records[0]["run_id"],
                    "jobs": self.scan.jobs, "skipped": len(self.scan.ids & done),
                    "failed_earlier": len(self.scan.ids & failed)}  # fmt: skip
            self.ids = []
        info = exchange_json(self.group, info)[0]
        if info["error"]:
            self._stop_all(info["error"])
        for p in self.shipped:  # rank 0 holds their lines now
            p.unlink(missing_ok=True)
        info["mask"] = base64.b64decode(info["mask"])
        return info

    def _share(self, start: dict) -> Share:
        mask = start["mask"]
        todo = [i for i in range(start["jobs"]) if not mask[i // 8] >> (i % 8) & 1]
        tensor = self._tensor_size()
        copies = self.size // tensor
        copy, tp_rank = rank_layout(self.size, tensor)[self.rank]
        shares = plan_shares([self.keys[i] for i in todo], [self.work[i] for i in todo], copies)
        self.keys, self.work = [], array("d")  # the plan is made
        return Share({todo[j] for j in shares[copy]}, [len(s) for s in shares], copies, tensor, copy, tp_rank == 0)

    def _tensor_size(self) -> int:
        """Ranks per model copy, from the same records on every rank."""
        tp, world = self.cfg.tensor_parallel, self.size
        if tp == "all":
            return world
        if tp == "auto":
            device = min(per_rank_memory(self.records, k) for k in range(world))
            size = tensor_parallel_size(self.records[0]["weights"], device, world)
            if size > 1 and self.rank == 0:
                log.info(f"the weights ({self.records[0]['weights'] / 1e9:.1f} GB) do not fit one device's memory "
                         f"({device / 1e9:.1f} GB): tensor parallel over {size} ranks")  # fmt: skip
            return size
        if world % tp:
            self._stop_all(f"--tensor-parallel {tp} does not divide the {world} ranks launched")
        return tp

    # -- ready: parts, the model, and the go ---------------------------------

    def _ready(self, start: dict, share: Share):
        from .engine.distributed import exchange_json, least, split

        error, engine, tensor_group = None, None, None
        self.part = part_path(self.base, start["run_id"], self.rank)
        try:
            if share.tensor > 1:
                try:
                    tensor_group = split(self.group, share.copies, share.copy, self.rank)
                except RuntimeError as e:
                    raise RunError(f"data and tensor parallel together need a backend that splits groups "
                                   f"(nccl, mpi): {str(e).rstrip('.')}; use --tensor-parallel all or 1") from None  # fmt: skip
            engine = load_engine(self._rank_config(share), tensor_group)  # no collective: a rank may fail alone
        except RunError as e:
            error = str(e)
        self._agree_or_stop(exchange_json(self.group, {"error": error, "host": socket.gethostname()}))
        self._fit(engine, tensor_group, least)
        # The output and the parts once every rank can go: a run that cannot
        # start creates no file, as one process does.
        try:
            if self.rank == 0:
                self.writer = self._open_output()
            elif share.leader:
                self.writer = open_part(self.part, self.cfg.fsync)
        except OutputFileError as e:
            error = str(e)
        self._agree_or_stop(exchange_json(self.group, {"error": error, "host": socket.gethostname()}))
        leaders = [k for k in range(1, self.size) if rank_layout(self.size, share.tensor)[k][1] == 0]
        seen = None
        if self.rank == 0:
            seen = [k for k in leaders if part_path(self.base, start["run_id"], k).exists()]
        self.visible = exchange_json(self.group, seen)[0]
        far = sorted(set(leaders) - set(self.visible))
        if self.rank == 0 and far:
            log.info(f"ranks {far} write where this machine cannot read: their lines come in at the end")
        return engine

    def _open_output(self) -> ResultWriter:
        index = self.index
        if index is None:  # -o -: no resume
            return ResultWriter(sys.stdout.buffer, fsync=False)
        writer = open_output(self.cfg.output_path, index, self.cfg.fsync, self.cfg.retry_failed)
        if index.torn_bytes:
            log.info(f"repaired a torn last line ({index.torn_bytes} bytes) in {self.cfg.output_path}")
        if index.folded:
            log.info(f"took in {index.folded} result lines an earlier run's ranks left in part files")
        return writer

    def _rank_config(self, share: Share) -> RunConfig:
        """This rank's engine settings. In a tensor-parallel group every rank
        must run the same passes: drafts are verified by a rule, not by timing
        (timings differ per rank), and a saved prompt cache is a shard's own."""
        engine = self.cfg.engine
        if share.tensor > 1:
            engine = replace(engine, decode=replace(engine.decode, pld_adaptive=False))
            pc = engine.prompt_cache
            if pc.cache_dir is not None:
                shard = Path(pc.cache_dir) / f"tensor-{share.tensor}-{self.rank % share.tensor}"
                engine = replace(engine, prompt_cache=replace(pc, cache_dir=shard))
        return replace(self.cfg, engine=engine)

    def _fit(self, engine, tensor_group, least) -> None:
        """Memory figures for this rank: a device several ranks share (a CPU,
        a Mac's GPU) is divided among them; a tensor-parallel group takes its
        least, so that its ranks decide alike."""
        local = sum(r["host"] == self.records[self.rank]["host"] for r in self.records)
        if local > 1 and shared_device():
            engine.memory_bytes //= local
            if self.cfg.engine.kv_budget_bytes is None:
                engine.kv_budget_bytes //= local
            if engine.pool is not None and self.cfg.engine.prompt_cache.max_bytes is None:
                engine.pool.max_bytes //= local
        if tensor_group is not None:
            engine.memory_bytes = least(tensor_group, engine.memory_bytes)
            engine.kv_budget_bytes = least(tensor_group, engine.kv_budget_bytes)
            if engine.pool is not None:
                engine.pool.max_bytes = least(tensor_group, engine.pool.max_bytes)
            engine.agree = lambda value: least(tensor_group, value)

    # -- the jobs ------------------------------------------------------------

    def _jobs(self, engine, share: Share, start: dict, summary: RunSummary, folding) -> None:
        from .engine.distributed import PeerLost

        prewarm(self.cfg, engine, self.scan, summary)
        items = (item for i, item in enumerate(iter_jobs(self.jobs_path, self.defaults, self.scan.format,
                                                         self.scan.header_line)) if i in share.mine)  # fmt: skip
        # rows wanted: a job of n samples takes n (the file's extra samples: a cap, not a count)
        results = engine.run_all(items, total=len(share.mine) + self.scan.extra_samples)
        if share.tensor > 1:
            results = refuse_transport_errors(results, PeerLost)
        shown = None
        if self.rank == 0:
            shown = Progress(start["jobs"] - start["skipped"], self.progress, self.log_every_s)
        elif share.leader and self.rank not in self.visible:  # rank 0 cannot count its lines: it says itself
            shown = Progress(len(share.mine), False, self.log_every_s, emit=log.warning)

        def after(_result) -> None:
            if folding is not None:
                folding.maybe_take()
            if shown is None:
                return
            done, failed, tokens = summary.ok + summary.failed, summary.failed, summary.completion_tokens
            ranks = ""
            if folding is not None:
                done, failed, tokens = done + folding.lines, failed + folding.failed, tokens + folding.tokens
                ranks = folding.ranks_line(summary)
            shown.update(done, failed, tokens, summary.decode_tps, ranks)

        try:
            write_results(results, self.writer if share.leader else Discard(), summary, self.stops, after)
            if share.leader and self.rank:
                self.writer.close()
            if folding is not None:
                folding.wait_for_visible(after)
            self._finish(share, summary, folding, start["run_id"])
        finally:
            if shown is not None:
                shown.close()

    def _finish(self, share: Share, summary: RunSummary, folding, run_id: str) -> None:
        """Every rank's figures to rank 0, then the far ranks' lines."""
        from .engine.distributed import exchange_json

        summary.wall_s = self.wall.elapsed_s
        records = exchange_json(self.group, {"counts": summary.counts(), "share": len(share.mine),
                                             "leader": share.leader})  # fmt: skip
        far = [k for k in range(1, self.size) if records[k]["leader"] and k not in self.visible]
        self._ship({k: [part_path(self.base, run_id, k).name] for k in far})
        if self.rank == 0:
            folding.finish(far, run_id)
            for r in records[1:]:
                if r["leader"]:
                    summary.absorb(RunSummary(**r["counts"]))
            summary.parallel = {"ranks": self.size, "data": share.copies, "tensor": share.tensor}
            summary.ranks = [rank_figures(k, r["counts"], r["share"]) for k, r in enumerate(records)]
        if far:  # rank 0 holds the far ranks' lines on disk: their parts may go
            ok = exchange_json(self.group, True if self.rank == 0 else None)[0]
            if ok and self.rank in far:
                self.part.unlink(missing_ok=True)


