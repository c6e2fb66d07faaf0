"""No input, signal or concurrent run may lose, duplicate or invent a result
line: whole `batchgen run` processes on a tiny real model, stopped, raced and
starved the ways cron, supervisors and full disks do it."""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchgen.cli import main

SYSTEM = "You are a helpful assistant. Answer briefly and exactly."


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import tiny

    return str(tiny.build_model("qwen2", tmp_path_factory.mktemp("rel-qwen2")))


def write_jobs(path: Path, n: int, max_tokens: int = 6, header: bool = True, extra=()) -> Path:
    lines = [{"batchgen": {"system": SYSTEM, "defaults": {"max_tokens": max_tokens}}}] if header else []
    lines += [{"id": f"j{i}", "messages": [{"role": "user", "content": f"task {i}"}]} for i in range(n)]
    lines += list(extra)
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


def ids_of(path: Path) -> list[str]:
    return [orjson.loads(l)["id"] for l in path.read_bytes().splitlines()]


def result_lines(path: Path) -> list[dict]:
    raw = path.read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), "the output ends in a torn line"
    return [orjson.loads(l) for l in raw.splitlines()]


def invoke(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def start(model, *args, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "batchgen", "run", *args, "--model", model, "--no-fuse"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=kw.pop("cwd", None), **kw)


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before writing {n} lines: {proc.stderr.read().decode()}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"no {n} lines in {timeout} s")


# 1. SIGTERM / SIGHUP stop a run as SIGINT does -----------------------------


@pytest.mark.parametrize(
    "sig, code, rows",
    [(signal.SIGTERM, 143, "1"), (signal.SIGTERM, 143, "4"), (signal.SIGHUP, 129, "1"), (signal.SIGINT, 130, "4")],
)
def test_stop_signal_keeps_real_lines_only_and_resumes(tmp_path, model, sig, code, rows):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 24, max_tokens=120)
    out = tmp_path / "out.jsonl"
    proc = start(model, str(jobs), "-o", str(out), "--batch-size", rows)
    wait_for_lines(out, 2, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == code, err
    lines = result_lines(out)
    assert 2 <= len(lines) < 24
    assert all(l["error"] is None for l in lines), "a stop became an error line"
    assert len({l["id"] for l in lines}) == len(lines)
    assert f"interrupted after {len(lines)} jobs ({signal.Signals(sig).name})" in err
    again = start(model, str(jobs), "-o", str(out), "--batch-size", rows)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err.decode()
    assert sorted(ids_of(out)) == sorted(f"j{i}" for i in range(24))
    assert all(l["error"] is None for l in result_lines(out))


# 2. One run per output at a time -------------------------------------------


def test_second_run_on_the_same_output_is_refused(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 16, max_tokens=100)
    out = tmp_path / "out.jsonl"
    first = start(model, str(jobs), "-o", str(out))
    wait_for_lines(out, 1, first)
    second = start(model, str(jobs), "-o", str(out))
    _, err = second.communicate(timeout=120)
    err = err.decode().strip()
    assert second.returncode == 2 and "is in use by another batchgen run" in err and len(err.splitlines()) == 1
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err.decode()
    assert sorted(ids_of(out)) == sorted(f"j{i}" for i in range(16))
    # The lock went with the first run: a third run resumes (all done).
    third = start(model, str(jobs), "-o", str(out))
    _, err = third.communicate(timeout=120)
    assert third.returncode == 0 and "16 skipped" in err.decode()


def test_a_killed_run_leaves_no_lock_behind(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 16, max_tokens=100)
    out = tmp_path / "out.jsonl"
    proc = start(model, str(jobs), "-o", str(out))
    wait_for_lines(out, 1, proc)
    proc.kill()
    proc.wait()
    again = start(model, str(jobs), "-o", str(out))
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err.decode()
    assert sorted(ids_of(out)) == sorted(f"j{i}" for i in range(16))


# 3. The job file as its own output ------------------------------------------


@pytest.mark.parametrize("how", ["same", "hardlink", "symlink"])
def test_output_equal_to_input_is_refused(tmp_path, model, how):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2, extra=[{"prompt": "no id here"}])
    before = jobs.read_bytes()
    out = jobs
    if how == "hardlink":
        out = tmp_path / "link.jsonl"
        os.link(jobs, out)
    elif how == "symlink":
        out = tmp_path / "sym.jsonl"
        out.symlink_to(jobs)
    r = invoke("run", str(jobs), "--model", model, "-o", str(out))
    assert r.exit_code == 2 and "is the job file itself" in r.stderr
    assert jobs.read_bytes() == before


def test_a_copy_of_the_job_file_is_not_a_resumable_output(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2, header=False)
    out = tmp_path / "copy.jsonl"
    out.write_bytes(jobs.read_bytes())
    r = invoke("run", str(jobs), "--model", model, "-o", str(out))
    assert r.exit_code == 2 and "line 1 is not a batchgen result line" in r.stderr
    assert out.read_bytes() == jobs.read_bytes()


# 4. A last line that is not a result is refused, not cut ----------------------


@pytest.mark.parametrize("tail", [b"my notes\n", b"my notes"])
def test_foreign_last_line_is_refused_not_deleted(tmp_path, model, tail):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2)
    out = tmp_path / "out.jsonl"
    assert invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse").exit_code == 0
    content = out.read_bytes() + tail
    out.write_bytes(content)
    r = invoke("run", str(jobs), "--model", model, "-o", str(out))
    assert r.exit_code == 2 and "line 3 is not a batchgen result line" in r.stderr
    assert out.read_bytes() == content


def test_resume_refuses_an_output_with_a_repeated_id(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2)
    out = tmp_path / "out.jsonl"
    assert invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse").exit_code == 0
    first = out.read_bytes().splitlines(keepends=True)[0]
    out.write_bytes(out.read_bytes() + first)
    r = invoke("run", str(jobs), "--model", model, "-o", str(out))
    assert r.exit_code == 2 and "line 3 repeats id 'j0' (first on line 1)" in r.stderr


# 5. Separate stdin runs never share an output --------------------------------


def test_two_stdin_runs_get_their_own_outputs(tmp_path, model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = json.dumps({"prompt": "first run", "max_tokens": 3}) + "\n"
    b = json.dumps({"prompt": "second run", "max_tokens": 3}) + "\n"
    assert invoke("run", "-", "--model", model, "--no-fuse", input=a).exit_code == 0
    r = invoke("run", "-", "--model", model, "--no-fuse", input=b)
    assert r.exit_code == 0 and "skipped" in r.stderr and "1 ok" in r.stderr
    outs = sorted((tmp_path / "outputs").glob("stdin-*.jsonl"))
    assert len(outs) == 2 and all(ids_of(o) == ["1"] for o in outs)
    # The same input again resumes its own output.
    r = invoke("run", "-", "--model", model, "--no-fuse", input=a)
    assert r.exit_code == 0 and "1 skipped" in r.stderr
    assert len(list((tmp_path / "outputs").glob("stdin-*.jsonl"))) == 2


# 6. Ids are unique over good and bad lines ----------------------------------


def test_a_bad_line_sharing_an_id_with_a_good_job_is_a_duplicate(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2, extra=[{"id": "j1", "prompt": "x", "max_tokens": 0}])
    r = invoke("validate", str(jobs))
    assert r.exit_code == 2 and "duplicate job id 'j1' on lines 3 and 4" in r.stderr
    r = invoke("run", str(jobs), "--model", model, "-o", str(tmp_path / "o.jsonl"))
    assert r.exit_code == 2 and "duplicate job id 'j1'" in r.stderr and not (tmp_path / "o.jsonl").exists()


# 7. Unbounded max_tokens ------------------------------------------------------


def test_absurd_max_tokens_fails_validation(tmp_path):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 0, extra=[{"id": "huge", "prompt": "x", "max_tokens": 10**12}])
    r = invoke("validate", str(jobs))
    assert r.exit_code == 1 and "'max_tokens' must be an integer in 1..16777216" in r.stdout


def test_max_tokens_is_capped_at_the_context(tmp_path, model):
    # The tiny model's context is 2048 tokens.
    prompt = " ".join(["fox"] * 630)  # about 1,890 tokens: 400 more do not fit
    jobs = write_jobs(tmp_path / "jobs.jsonl", 0, header=False,
                      extra=[{"id": "long", "prompt": prompt, "max_tokens": 400}])  # fmt: skip
    out = tmp_path / "out.jsonl"
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse", "--draft", "none")
    assert r.exit_code == 0, r.stderr
    (line,) = result_lines(out)
    used = line["usage"]["prompt_tokens"] + line["usage"]["completion_tokens"]
    assert line["stats"]["max_tokens_capped_from"] == 400
    assert line["finish_reason"] in ("length", "stop") and used <= 2048
    if line["finish_reason"] == "length":
        assert used == 2048


def test_a_job_too_large_for_memory_fails_alone(tmp_path, model, monkeypatch):
    import batchgen.engine.core as engine
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2, extra=[{"id": "big", "prompt": "x", "max_tokens": 2000}])
    monkeypatch.setattr(engine, "memory_limit", lambda: engine.mx.get_active_memory() + 600_000)  # ~1 MB for "big"
    out = tmp_path / "out.jsonl"
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse")
    assert r.exit_code == 1
    by_id = {l["id"]: l for l in result_lines(out)}
    assert by_id["j0"]["error"] is None and by_id["j1"]["error"] is None
    assert by_id["big"]["error"]["type"] == "too_large" and "GB of KV cache" in by_id["big"]["error"]["message"]


def test_huge_sampled_job_in_a_small_address_space_finishes_the_rest(tmp_path, model):
    extra = [{"id": "huge", "prompt": "x", "max_tokens": 1 << 24, "temperature": 1.0, "seed": 3}]
    jobs = write_jobs(tmp_path / "jobs.jsonl", 3, extra=extra)
    out = tmp_path / "out.jsonl"

    def limit():  # 6 GB of address space, as a small container has
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    proc = start(model, str(jobs), "-o", str(out), preexec_fn=limit)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode in (0, 1), err.decode()
    by_id = {l["id"]: l for l in result_lines(out)}
    assert sorted(by_id) == ["huge", "j0", "j1", "j2"]
    assert all(by_id[f"j{i}"]["error"] is None for i in range(3))
    huge = by_id["huge"]
    assert huge["error"] is not None or huge["stats"]["max_tokens_capped_from"] == 1 << 24


# 8. --retry-failed over an output with a blank line --------------------------


def test_retry_failed_over_a_blank_line(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2, extra=[{"id": "bad", "prompt": "x", "max_tokens": 0}])
    out = tmp_path / "out.jsonl"
    assert invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse").exit_code == 1
    out.write_bytes(out.read_bytes().replace(b"\n", b"\n\n", 1))
    write_jobs(jobs, 2, extra=[{"id": "bad", "prompt": "x", "max_tokens": 2}])
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse", "--retry-failed")
    assert r.exit_code == 0, r.stderr
    assert ids_of(out) == ["j0", "j1", "bad"] and not list(tmp_path.glob("*.tmp"))


# 9. I/O failures: one line, the documented code, every finished line whole ----


def test_output_naming_a_directory(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 1)
    r = invoke("run", str(jobs), "--model", model, "-o", str(tmp_path))
    assert r.exit_code == 2 and r.stderr.strip() == f"batchgen: error: output {tmp_path} is a directory"


def test_unwritable_summary_is_refused_before_any_job(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 1)
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "out.jsonl"
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--summary", str(tmp_path / "afile" / "s.json"))
    assert r.exit_code == 2 and "cannot write summary" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "0.5", "-3GB", "0"])
@pytest.mark.parametrize("option", ["--prompt-cache-bytes", "--kv-budget"])
def test_size_options_accept_only_finite_positive_sizes(tmp_path, option, value):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 1)
    r = invoke("run", str(jobs), "-o", str(tmp_path / "o.jsonl"), option, value)
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("batchgen: error: ") and "Traceback" not in r.stderr


def test_full_disk_keeps_whole_lines_and_resumes(tmp_path, model, monkeypatch):
    """A write that fails part-way (ENOSPC after some bytes) leaves only whole
    lines; the run stops with one line and exit 2, and a rerun completes."""
    import batchgen.output as output

    jobs = write_jobs(tmp_path / "jobs.jsonl", 6)
    out = tmp_path / "out.jsonl"
    real_write, calls = os.write, []

    def write_until_full(fd, data):
        calls.append(len(data))
        if len(calls) == 4:  # the fourth line: half of it fits, then the disk is full
            return real_write(fd, bytes(data[: len(data) // 2]))
        if len(calls) > 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(output.os, "write", write_until_full)
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse")
    assert r.exit_code == 2
    err = [l for l in r.stderr.splitlines() if "error" in l]
    assert err == [f"batchgen: error: cannot write output file {out}: No space left on device; "
                   "stopped after 3 jobs, every finished line kept; run the same command again to resume"]  # fmt: skip
    assert ids_of(out) == ["j0", "j1", "j2"] and out.read_bytes().endswith(b"\n")
    monkeypatch.setattr(output.os, "write", real_write)
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse")
    assert r.exit_code == 0 and ids_of(out) == [f"j{i}" for i in range(6)]


def _can_mount_tmpfs(where: Path) -> bool:
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    where.mkdir(exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)], capture_output=True).returncode == 0
    return ok


def test_real_full_tmpfs_keeps_whole_lines_and_resumes(tmp_path, model):
    disk = tmp_path / "disk"
    if not _can_mount_tmpfs(disk):
        pytest.skip("cannot mount a tmpfs here")
    try:
        jobs = write_jobs(tmp_path / "jobs.jsonl", 200, max_tokens=2)
        out = disk / "out.jsonl"
        (disk / "filler").write_bytes(b"\0" * (480 << 10))  # leave room for some lines only
        proc = start(model, str(jobs), "-o", str(out), "--no-fsync")
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2 and "No space left on device" in err.decode()
        written = result_lines(out)
        assert 0 < len(written) < 200 and len({l["id"] for l in written}) == len(written)
        (disk / "filler").unlink()
        proc = start(model, str(jobs), "-o", str(out), "--no-fsync")
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
        assert sorted(ids_of(out)) == sorted(f"j{i}" for i in range(200))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# 10. The smaller points ----------------------------------------------------------


def test_a_closed_stdout_pipe_stops_with_its_own_code(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 30, max_tokens=20)
    proc = start(model, str(jobs), "-o", "-")
    first = proc.stdout.readline()
    assert orjson.loads(first)["id"] == "j0"
    proc.stdout.close()
    proc.wait(timeout=120)
    err = proc.stderr.read().decode()
    assert proc.returncode == 141 and "closed it after" in err and "Traceback" not in err


def test_resume_over_error_lines_exits_1(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2, extra=[{"id": "bad", "prompt": "x", "max_tokens": 0}])
    out = tmp_path / "out.jsonl"
    assert invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse").exit_code == 1
    r = invoke("run", str(jobs), "--model", model, "-o", str(out), "--no-fuse")
    assert r.exit_code == 1 and "3 skipped (1 of them error lines)" in r.stderr


def test_a_bom_before_the_header_is_ignored(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2)
    jobs.write_bytes(b"\xef\xbb\xbf" + jobs.read_bytes())
    assert invoke("validate", str(jobs)).exit_code == 0
    summary = tmp_path / "s.json"
    r = invoke("run", str(jobs), "--model", model, "-o", str(tmp_path / "o.jsonl"), "--summary", str(summary))
    assert r.exit_code == 0, r.stderr
    s = json.loads(summary.read_text())
    assert s["jobs"]["total"] == 2 and s["prewarm"]["tokens"] > 0


@pytest.mark.parametrize("seed", [-1, 1 << 32])
def test_seeds_outside_32_bits_are_refused(tmp_path, seed):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 0, extra=[{"id": "s", "prompt": "x", "seed": seed}])
    r = invoke("validate", str(jobs))
    assert r.exit_code == 1 and "'seed' must be an integer in 0..4294967295" in r.stdout
    r = invoke("run", str(jobs), "--seed", str(seed))
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1


def test_an_altered_saved_prompt_cache_is_rebuilt(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 2)
    cache_dir = tmp_path / "pc"
    out1, out2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    base = ["--model", model, "--no-fuse", "--prompt-cache-dir", str(cache_dir)]
    assert invoke("run", str(jobs), "-o", str(out1), *base).exit_code == 0
    (saved,) = cache_dir.glob("prewarm-*.safetensors")
    raw = bytearray(saved.read_bytes())
    raw[-7] ^= 0x55  # a flipped byte inside the last tensor
    saved.write_bytes(bytes(raw))
    r = invoke("run", str(jobs), "-o", str(out2), *base)
    assert r.exit_code == 0 and "fails its checksum" in r.stderr
    assert [l["text"] for l in result_lines(out2)] == [l["text"] for l in result_lines(out1)]
    r = invoke("run", str(jobs), "-o", str(tmp_path / "c.jsonl"), *base)  # the rebuilt file is whole again
    assert r.exit_code == 0 and "checksum" not in r.stderr


def test_option_errors_take_one_line(tmp_path):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 1)
    for args in (["run", str(jobs), "--kv-bits", "9"], ["run", str(jobs), "--bogus"], ["run"]):
        r = invoke(*args)
        assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("batchgen: error: ")


def test_quiet_prints_nothing_for_failed_jobs(tmp_path, model):
    jobs = write_jobs(tmp_path / "jobs.jsonl", 1, extra=[{"id": "bad", "prompt": "x", "max_tokens": 0}])
    r = invoke("run", str(jobs), "--model", model, "-o", str(tmp_path / "o.jsonl"), "-q")
    assert r.exit_code == 1 and r.stderr == ""
