"""Progress lines for logs (batchgen/progress.py): the line with literal
numbers, the interval with a fake clock, and `batchgen run` without a terminal
end to end (CliRunner's stderr is not a tty)."""

import json
import re

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.progress import ProgressLog, format_duration, format_line, parse_interval

LINE = re.compile(r"^batchgen: progress: \d+/\d+ jobs \(\d+%\), \d+ failed, [\d.]+ tok/s, elapsed \S+(, ETA \S+)?$")


def test_format_line_with_literal_numbers():
    assert format_line(120, 1000, 3, 845.2, 130.0) == (
        "progress: 120/1000 jobs (12%), 3 failed, 845.2 tok/s, elapsed 2m10s, ETA 15m53s"
    )
    assert format_line(0, 50, 0, 0.0, 4.2) == "progress: 0/50 jobs (0%), 0 failed, 0.0 tok/s, elapsed 4s"
    assert format_line(50, 50, 1, 12.345, 3725) == "progress: 50/50 jobs (100%), 1 failed, 12.3 tok/s, elapsed 1h02m05s, ETA 0s"
    assert format_line(1, 3, 0, 1.0, 59.6) == "progress: 1/3 jobs (33%), 0 failed, 1.0 tok/s, elapsed 1m00s, ETA 1m59s"


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (0.4, "0s"), (45, "45s"), (130, "2m10s"), (3600, "1h00m00s"),
                                           (90061, "25h01m01s")])  # fmt: skip
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("text, seconds", [("30s", 30.0), ("2m", 120.0), ("10", 10.0), ("0.5s", 0.5), (".25", 0.25),
                                           ("1h", 3600.0), (" 5 S ", 5.0), ("0", None), ("0s", None), ("off", None),
                                           ("OFF", None)])  # fmt: skip
def test_parse_interval(text, seconds):
    assert parse_interval(text) == seconds


@pytest.mark.parametrize("text", ["", "-1", "5x", "1e3", "nan", "inf", "2 minutes", "s"])
def test_parse_interval_refuses(text):
    with pytest.raises(ValueError, match="not an interval"):
        parse_interval(text)


class FakeClock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_interval_with_a_fake_clock():
    clock, lines = FakeClock(), []
    p = ProgressLog(total=10, every_s=30.0, emit=lines.append, clock=clock)
    clock.t += 29.9
    assert not p.update(1, 0, 100) and lines == []
    clock.t += 0.1  # 30s in: the first line
    assert p.update(2, 0, 600)
    assert lines == ["progress: 2/10 jobs (20%), 0 failed, 20.0 tok/s, elapsed 30s, ETA 2m00s"]
    clock.t += 10
    assert not p.update(3, 1, 700)  # 10s after the line: nothing
    clock.t += 100  # a long job: one line, not one per missed interval
    assert p.update(4, 1, 1400)
    assert lines[-1] == "progress: 4/10 jobs (40%), 1 failed, 10.0 tok/s, elapsed 2m20s, ETA 3m30s"
    assert not p.update(5, 1, 1500) and len(lines) == 2
    clock.t += 30
    assert p.update(6, 1, 1700) and len(lines) == 3 and p.lines == 3


def test_run_option_refuses_a_bad_interval(tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": "a", "prompt": "x"}\n')
    r = CliRunner().invoke(main, ["run", str(jobs), "--log-every", "soon"])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and "not an interval: 'soon'" in r.stderr and "--log-every" in r.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import tiny

    return str(tiny.build_model("qwen2", tmp_path_factory.mktemp("progress-qwen2")))


@pytest.fixture
def jobs(tmp_path):
    path = tmp_path / "jobs.jsonl"
    header = {"batchgen": {"system": "You are a helpful assistant.", "defaults": {"max_tokens": 24}}}
    lines = [header] + [{"id": f"j{i}", "messages": [{"role": "user", "content": f"task {i} " * 8}]} for i in range(8)]
    path.write_text("".join(json.dumps(l) + "\n" for l in lines))
    return path


def test_progress_lines_on_stderr_never_on_stdout(jobs, model):
    r = CliRunner().invoke(main, ["run", str(jobs), "--model", model, "-o", "-", "--log-every", "0.01s", "--no-fuse"],
                           catch_exceptions=False)  # fmt: skip
    assert r.exit_code == 0, r.stderr
    progress = [l for l in r.stderr.splitlines() if "progress:" in l]
    assert progress, r.stderr
    for line in progress:
        assert LINE.match(line), line
    assert int(progress[-1].split()[2].split("/")[1]) == 8
    out = r.stdout.splitlines()
    assert len(out) == 8 and all(json.loads(l)["error"] is None for l in out)
    assert "progress" not in r.stdout
    # every result line carries its finish time, in order
    times = [json.loads(l)["stats"]["finished_at"] for l in out]
    assert times == sorted(times) and all(round(t, 3) == t for t in times)


def test_no_progress_lines_when_quiet_or_off(jobs, model, tmp_path):
    r = CliRunner().invoke(main, ["run", str(jobs), "--model", model, "-o", str(tmp_path / "q.jsonl"), "--log-every",
                                  "0.01s", "-q", "--no-fuse"], catch_exceptions=False)  # fmt: skip
    assert r.exit_code == 0 and r.stderr == ""
    r = CliRunner().invoke(main, ["run", str(jobs), "--model", model, "-o", str(tmp_path / "off.jsonl"), "--log-every",
                                  "off", "--no-fuse"], catch_exceptions=False)  # fmt: skip
    assert r.exit_code == 0 and "progress:" not in r.stderr and "jobs: 8 total, 8 ok" in r.stderr
