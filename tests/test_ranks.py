"""`batchgen run` over several ranks, the way mlx and mlx-lm test theirs:
`mlx.launch` (here through `batchgen launch`) with the ring backend on
localhost, whole processes on a tiny real model, against what one process
writes for the same file; and the pieces underneath (part files, shares,
sharding errors) with literal data."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.output import part_path, read_resume_index

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are a helpful assistant. Answer briefly and exactly."
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def write_jobs(path: Path, n: int, max_tokens: int = 8, extra=()) -> Path:
    lines = [{"batchgen": {"system": SYSTEM, "defaults": {"max_tokens": max_tokens}}}]
    lines += [{"id": f"j{i}", "messages": [{"role": "user", "content": f"task {i} " + "fox " * (i % 5)}]}
              for i in range(n)]  # fmt: skip
    lines += list(extra)
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def lines_of(path: Path) -> list[dict]:
    raw = path.read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), "the output ends in a torn line"
    return [orjson.loads(l) for l in raw.splitlines()]


def by_id(path: Path) -> dict:
    lines = lines_of(path)
    ids = [l["id"] for l in lines]
    assert len(ids) == len(set(ids)), f"an id twice in {path}"
    return {l["id"]: l for l in lines}


def one_process(jobs: Path, out: Path, model: str, *args) -> int:
    r = CliRunner().invoke(main, ["run", str(jobs), "-o", str(out), "--model", model, "--dtype", "float32", *args],
                           catch_exceptions=False)  # fmt: skip
    return r.exit_code


def free_ports(n: int) -> int:
    """The first of n consecutive free local ports (the ring backend listens on port, port + 1, ...)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n >= 65535:
            continue
        try:
            socks = []
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def launch(n: int, jobs: Path, out: Path, model: str, *args) -> subprocess.Popen:
    """`batchgen launch -n N --backend ring -- python -m batchgen run ...` from the worktree."""
    cmd = [sys.executable, "-m", "batchgen", "launch", "-n", str(n), "--backend", "ring",
           "--starting-port", str(free_ports(n)), "--", sys.executable, "-m", "batchgen", "run", str(jobs),
           "-o", str(out), "--model", model, "--dtype", "float32", *args]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode()


@pytest.fixture(scope="module")
def model(model_dir):
    return str(model_dir("qwen2"))


# Two ranks write what one process writes ------------------------------------


def test_two_ranks_write_what_one_process_writes(tmp_path, model):
    """Float32 greedy texts over 2 ranks equal one process's for the same file,
    every id once; the bad line's error line (with its line number) and the
    exit code are one process's; one summary, with each rank's figures; rank
    0's progress line counts both ranks."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", 10, extra=[{"id": "bad", "prompt": "x", "max_tokens": 0}, "not json"])
    ref, out, summary = tmp_path / "ref.jsonl", tmp_path / "out.jsonl", tmp_path / "summary.json"
    assert one_process(jobs, ref, model) == 1
    code, err = finish(launch(2, jobs, out, model, "--summary", str(summary), "--log-every", "0.01"))
    assert code == 1, err
    got, want = by_id(out), by_id(ref)
    assert sorted(got) == sorted(want) == sorted([f"j{i}" for i in range(10)] + ["bad", "13"])
    assert {k: l.get("text") for k, l in got.items()} == {k: l.get("text") for k, l in want.items()}
    assert got["bad"]["error"] == want["bad"]["error"] and got["bad"]["error"]["line"] == 12
    assert got["13"]["error"] == want["13"]["error"] and got["13"]["error"]["type"] == "invalid_json"
    assert not list(tmp_path.glob(".out.jsonl.part-*")), "a part file was left behind"
    s = json.loads(summary.read_text())
    assert s["jobs"] == {"total": 12, "ok": 10, "failed": 2, "skipped": 0, "skipped_failed": 0}
    assert s["tokens"]["completion"] == sum(l["usage"]["completion_tokens"] for l in got.values() if l["error"] is None)
    assert s["parallel"] == {"ranks": 2, "data": 2, "tensor": 1}
    assert [r["rank"] for r in s["ranks"]] == [0, 1] and sum(r["ok"] + r["failed"] for r in s["ranks"]) == 12
    assert all(r["share"] > 0 and r["throughput_tps"] > 0 for r in s["ranks"])
    assert "batchgen: ranks: 2 (2 x data parallel, 1 x tensor parallel): rank 0 " in err
    assert "; ranks: 0 " in err and ", 1 " in err  # rank 0's progress line, both ranks in it
    assert err.count("batchgen: jobs: 12 total") == 1  # one summary


def test_one_process_imports_nothing_distributed(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 1, max_tokens=2)
    code = ("import sys\nfrom batchgen.cli import main\n"
            f"try:\n    main(['run', {str(jobs)!r}, '-o', {str(tmp_path / 'o.jsonl')!r}, '--model', {model!r}, '-q'])\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print(sorted(m for m in sys.modules if m in ('batchgen.ranks', 'batchgen.shares', "
            "'batchgen.engine.distributed', 'batchgen.launch')))")  # fmt: skip
    env = {k: v for k, v in ENV.items() if k not in ("MLX_RANK", "MLX_HOSTFILE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# Part files, as the output's contract ----------------------------------------


def test_parts_left_by_an_earlier_run_fold_in_once(tmp_path, model):
    """A resume by one process takes in the lines a killed rank left in its
    part (the torn tail left out), skips those the output holds already,
    deletes the part, and runs only the jobs nobody finished."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", 6, max_tokens=4)
    full = tmp_path / "full.jsonl"
    assert one_process(jobs, full, model) == 0
    lines = full.read_bytes().splitlines(keepends=True)
    out = tmp_path / "out.jsonl"
    out.write_bytes(lines[0] + lines[1])
    part = part_path(out, "abc123", 1)
    part.write_bytes(lines[1] + lines[2] + lines[3] + lines[4][:20])  # j1 in both; j4 torn
    index = read_resume_index(out)
    assert index.done == {"j0", "j1", "j2", "j3"} and index.in_parts == {"j2", "j3"} and index.parts == [part]
    r = CliRunner().invoke(main, ["run", str(jobs), "-o", str(out), "--model", model, "--dtype", "float32"])
    assert r.exit_code == 0, r.stderr
    assert "took in 2 result lines" in r.stderr and "4 skipped" in r.stderr
    assert not part.exists()
    got, want = by_id(out), by_id(full)
    assert sorted(got) == sorted(want) and all(got[k]["text"] == want[k]["text"] for k in got)
    assert out.read_bytes().startswith(lines[0] + lines[1] + lines[2] + lines[3])


def test_open_output_leaves_the_index_as_the_file_is(tmp_path):
    """After a fold and a --retry-failed drop, the index holds exactly the
    ids the output holds (rank 0 folds other ranks' lines against it)."""
    from batchgen.output import open_output

    out = tmp_path / "out.jsonl"
    ok = b'{"id":"a","text":"x","finish_reason":"stop","usage":{},"stats":{},"metadata":null,"error":null}\n'
    bad = b'{"id":"b","error":{"type":"t","message":"m","line":3},"metadata":null}\n'
    out.write_bytes(ok)
    part_path(out, "9", 1).write_bytes(bad + ok.replace(b'"a"', b'"c"'))
    index = read_resume_index(out)
    assert index.done == {"a", "b", "c"} and index.failed == {"b"}
    open_output(str(out), index, fsync=False, retry_failed=True).close()
    assert index.done == {"a", "c"} and index.failed == set() and index.folded == 2
    assert [l["id"] for l in lines_of(out)] == ["a", "c"] and not part_path(out, "9", 1).exists()


def test_a_part_holding_a_foreign_line_is_refused_by_name(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2, max_tokens=2)
    out = tmp_path / "out.jsonl"
    part = part_path(out, "abc", 2)
    part.write_text('{"id": "j0", "messages": []}\n')
    r = CliRunner().invoke(main, ["run", str(jobs), "-o", str(out), "--model", model])
    assert r.exit_code == 2 and f"part file {part} line 1 is not a batchgen result line" in r.stderr
    assert part.read_text() == '{"id": "j0", "messages": []}\n' and not out.exists()


# Shares -------------------------------------------------------------------------


def test_shares_balance_work_not_count_and_keep_a_prefix_together():
    """Four long jobs and twelve short ones over two ranks: the long ones
    split two and two (equal work, unequal counts); a family of jobs sharing
    a 2,000-character document stays on one rank."""
    from batchgen.shares import expected_work, plan_shares, prefix_digest

    doc = "x" * 2000
    texts = [f"long {i}" for i in range(4)] + [f"short {i}" for i in range(8)] + [doc + f" q{i}" for i in range(4)]
    work = [expected_work(len(t), 1000 if t.startswith("long") else 10) for t in texts]
    shares = plan_shares([prefix_digest(t) for t in texts], work, 2)
    assert sorted(i for s in shares for i in s) == list(range(16))
    assert [sum(i < 4 for i in s) for s in shares] == [2, 2]
    loads = [sum(work[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= max(work)
    family = {12, 13, 14, 15}
    assert any(family <= set(s) for s in shares)
    assert plan_shares([], [], 3) == [[], [], []]


# Tensor parallel: sharding errors ---------------------------------------------


class _Group:
    """Stands for an mx.distributed group of `n` ranks (sharding reads size and rank only)."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return 0


def test_sharding_errors_are_one_clear_line(model):
    from batchgen.engine.core import ModelLoadError, load_model, shard_model

    model_obj, _, config = load_model(model)
    with pytest.raises(ModelLoadError, match=r"cannot shard .* over 3 ranks: Cannot shard the output of size"):
        shard_model(model_obj, config, _Group(3), model)  # 4 heads, 2 kv heads: not by 3

    class NoShard:
        pass

    with pytest.raises(ModelLoadError, match=r"mlx-lm cannot shard 'gpt_neox' models \(m\)"):
        shard_model(NoShard(), {"model_type": "gpt_neox"}, _Group(2), "m")


def test_tensor_parallel_needs_a_launch(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 1)
    r = CliRunner().invoke(main, ["run", str(jobs), "-o", str(tmp_path / "o.jsonl"), "--model", model,
                                  "--tensor-parallel", "2"])  # fmt: skip
    assert r.exit_code == 2 and "--tensor-parallel 2 needs 2 ranks: mlx.launch -n 2" in r.stderr
    r = CliRunner().invoke(main, ["run", str(jobs), "--tensor-parallel", "two"])
    assert r.exit_code == 2 and "--tensor-parallel must be a positive integer" in r.stderr


# Slow: ranks killed, resumed with other counts; tensor parallel; ranks that cannot see each other


def rank_pid(out: Path, rank: int) -> int | None:
    """The process of rank `rank` of the run writing `out` (its environment says its rank)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(out).encode() in cmd and b"launch" not in cmd and f"MLX_RANK={rank}".encode() in env:
            return int(pid)
    return None


def written(out: Path) -> int:
    """Whole lines in the output and its parts."""
    files = [out, *out.parent.glob(f".{out.name}.part-*")]
    return sum(f.read_bytes().count(b"\n") for f in files if f.exists())


def wait_for(cond, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) too soon: {proc.stderr.read().decode()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("timed out")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("again", [1, 3])
def test_a_killed_rank_loses_nothing_and_any_number_of_ranks_resumes(tmp_path, model, again):
    """Rank 1 killed (SIGKILL) mid-run: the launch says so (137), rank 0 stops
    cleanly (finished lines kept); a rerun with one process or three ranks
    completes the file, every id once, texts as one process writes them."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", 30, max_tokens=60)
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert one_process(jobs, ref, model) == 0
    proc = launch(2, jobs, out, model)
    wait_for(lambda: written(out) >= 6 and rank_pid(out, 1) is not None, proc)
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    code, err = finish(proc)
    assert code == 137, err
    assert "Traceback" not in err
    before = written(out)
    assert 6 <= before < 30
    lines_of(out)  # whole lines only
    if again == 1:
        assert one_process(jobs, out, model) == 0
    else:
        code, err = finish(launch(3, jobs, out, model))
        assert code == 0, err
    got, want = by_id(out), by_id(ref)
    assert sorted(got) == sorted(want)
    assert all(got[k]["text"] == want[k]["text"] for k in got)
    assert not list(tmp_path.glob(".out.jsonl.part-*"))


@pytest.mark.slow
def test_retry_failed_over_ranks_replaces_the_error_lines(tmp_path, model):
    """The error lines --retry-failed drops come back as the retried jobs'
    lines, whichever rank runs them (rank 0 folds them in as new ids)."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", 4, extra=[{"id": "bad", "prompt": "x", "max_tokens": 0}])
    out = tmp_path / "out.jsonl"
    code, err = finish(launch(2, jobs, out, model))
    assert code == 1 and by_id(out)["bad"]["error"]["type"] == "invalid_value", err
    write_jobs(jobs, 4, extra=[{"id": "bad", "prompt": "x", "max_tokens": 3}])
    code, err = finish(launch(2, jobs, out, model, "--retry-failed"))
    assert code == 0, err
    got = by_id(out)
    assert sorted(got) == ["bad", "j0", "j1", "j2", "j3"] and all(l["error"] is None for l in got.values())
    assert "jobs: 5 total, 1 ok, 0 failed, 4 skipped" in err


@pytest.mark.slow
@pytest.mark.parametrize("to", ["rank 0", "the launcher"])
def test_a_stop_signal_stops_every_rank_and_resumes(tmp_path, model, to):
    """SIGTERM to rank 0 (the launcher then stops rank 1), or to the launcher
    (which passes it on; mlx.launch alone would leave the ranks running)."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", 30, max_tokens=60)
    out = tmp_path / "out.jsonl"
    proc = launch(2, jobs, out, model)
    wait_for(lambda: written(out) >= 4 and rank_pid(out, 0) is not None, proc)
    os.kill(rank_pid(out, 0) if to == "rank 0" else proc.pid, signal.SIGTERM)
    code, err = finish(proc)
    assert code == 143, err
    assert "interrupted after" in err and "(SIGTERM)" in err and "Traceback" not in err
    assert rank_pid(out, 1) is None
    code, err = finish(launch(2, jobs, out, model))
    assert code == 0, err
    assert sorted(by_id(out)) == sorted(f"j{i}" for i in range(30))


@pytest.mark.slow
@pytest.mark.parametrize("arch, rows", [("qwen2", "1"), ("qwen3_moe", "1"), ("qwen2", "4")])
def test_tensor_parallel_over_two_ranks_equals_one_unsharded_process(tmp_path, model_dir, arch, rows):
    """Float32 (MoE gather_mm on a CPU needs it); fusion per shard, the prompt
    pool, PLD (`rows` 1) and the batch (4) over the sharded model."""
    m = str(model_dir(arch))
    jobs = write_jobs(tmp_path / "jobs.jsonl", 8, max_tokens=10)
    ref, out, summary = tmp_path / "ref.jsonl", tmp_path / "out.jsonl", tmp_path / "s.json"
    assert one_process(jobs, ref, m, "--batch-size", rows) == 0
    code, err = finish(launch(2, jobs, out, m, "--tensor-parallel", "all", "--batch-size", rows,
                              "--summary", str(summary)))  # fmt: skip
    assert code == 0, err
    got, want = by_id(out), by_id(ref)
    assert sorted(got) == sorted(want) and all(got[k]["text"] == want[k]["text"] for k in got)
    s = json.loads(summary.read_text())
    assert s["parallel"] == {"ranks": 2, "data": 1, "tensor": 2} and s["jobs"]["ok"] == 8
    assert s["fusion"]["qkv"] == 2  # fused per shard
    assert s["fusion"]["experts" if arch == "qwen3_moe" else "gate_up"] == 2


@pytest.mark.slow
def test_tensor_parallel_that_does_not_divide_the_heads_is_refused(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2)
    code, err = finish(launch(3, jobs, tmp_path / "out.jsonl", model, "--tensor-parallel", "all"))
    assert code == 2, err
    assert "batchgen: error: tensor parallel: cannot shard" in err and "over 3 ranks" in err
    assert not (tmp_path / "out.jsonl").exists() or lines_of(tmp_path / "out.jsonl") == []


def far_ranks(tmp_path: Path, jobs: Path, model: str) -> list[subprocess.Popen]:
    """Two ranks started as mlx.launch starts them, each in a directory of its
    own, the output named relatively: rank 0 cannot see rank 1's part, as on
    two machines."""
    port = free_ports(2)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    procs = []
    for rank in (0, 1):
        where = tmp_path / f"machine{rank}"
        where.mkdir(exist_ok=True)
        env = {**ENV, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        cmd = [sys.executable, "-m", "batchgen", "run", str(jobs), "-o", "out.jsonl", "--model", model,
               "--dtype", "float32"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


@pytest.mark.slow
def test_ranks_on_machines_that_cannot_see_each_other(tmp_path, model):
    """Rank 1's lines reach rank 0 through the collectives at the end; killed
    mid-run, its part stays on its machine, and the next run ships it over
    before planning: nothing lost, nothing run twice, nothing left behind."""
    jobs = write_jobs(tmp_path / "jobs.jsonl", 24, max_tokens=60)
    ref = tmp_path / "ref.jsonl"
    assert one_process(jobs, ref, model) == 0
    out, far = tmp_path / "machine0" / "out.jsonl", tmp_path / "machine1"
    first = far_ranks(tmp_path, jobs, model)
    wait_for(lambda: sum(p.read_bytes().count(b"\n") for p in far.glob(".out.jsonl.part-*")) >= 3, first[1])
    first[1].kill()
    code, err = finish(first[0])
    assert code == 75 and "another rank stopped answering" in err, err  # rank 1's death, not rank 0's doing
    first[1].wait()
    (left,) = far.glob(".out.jsonl.part-*")
    shipped = {orjson.loads(l)["id"] for l in left.read_bytes().splitlines()}
    kept = set(by_id(out))
    again = far_ranks(tmp_path, jobs, model)
    results = [finish(p) for p in again]
    assert [c for c, _ in results] == [0, 0], results
    got, want = by_id(out), by_id(ref)
    assert sorted(got) == sorted(want) and all(got[k]["text"] == want[k]["text"] for k in got)
    assert f"{24 - len(shipped | kept)} ok" in results[0][1].split("batchgen: jobs: ")[1]
    assert not list(far.glob(".out.jsonl.part-*")) and not list(out.parent.glob(".out.jsonl.part-*"))
