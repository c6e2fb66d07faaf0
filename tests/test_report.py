"""`batchgen report`: the HTML page made from real outputs (the demo model on
jobs/example.jsonl, a half-finished copy, error lines, OpenAI batch lines),
parsed back and checked against the lines; one self-contained file (inline
SVG, nothing fetched); one-line exit-2 errors; and, with a Chromium on the
machine, the page rendered headless (`-m browser`)."""

import collections
import json
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batchgen.cli import main

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def without_max_tokens(src: Path, dst: Path) -> Path:
    """`src` with every max_tokens taken out (header defaults, jobs, OpenAI
    bodies), so `--max-tokens 8` applies to every job and the run stays short."""
    out = []
    for raw in src.read_text().splitlines():
        obj = json.loads(raw)
        for d in (obj, obj.get("body") or {}, (obj.get("batchgen") or {}).get("defaults") or {}):
            d.pop("max_tokens", None)
        out.append(json.dumps(obj))
    dst.write_text("\n".join(out) + "\n")
    return dst


def read_lines(path: Path):
    return [orjson.loads(l) for l in path.read_text().splitlines() if l.strip()]


class Page(HTMLParser):
    """What the tests read back: cells by id, tables by id (rows of cell
    texts, header row included), every tag with its attributes."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.text = text
        self.cells, self.tables, self.tags = {}, {}, []
        self._cell_id = None
        self._table = None
        self._cell = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "table" and "id" in a:
            self._table = self.tables.setdefault(a["id"], [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._table[-1].append("")
            self._cell = True
        if tag == "td" and "id" in a:
            self._cell_id = a["id"]
            self.cells[self._cell_id] = ""

    def handle_endtag(self, tag):
        if tag == "table":
            self._table = None
        elif tag in ("td", "th"):
            self._cell = None
            self._cell_id = None

    def handle_data(self, data):
        if self._cell and self._table is not None:
            self._table[-1][-1] += data
        if self._cell_id is not None:
            self.cells[self._cell_id] += data

    def number(self, ident: str):
        text = self.cells[ident].replace(",", "")
        return float(text) if "." in text else int(text)

    def rows(self, ident: str) -> list:
        return self.tables[ident][1:]  # without the header row


def external_references(page: Page) -> list:
    """Anything the page would fetch: scripts, stylesheets, frames, images
    that are not inline data, any http(s) or protocol-relative link."""
    found = []
    for tag, attrs in page.tags:
        if tag in ("script", "link", "iframe", "object", "embed"):
            found.append(tag)
        for k, v in attrs.items():
            if k in ("src", "href", "xlink:href", "srcset", "data", "action", "poster") and v:
                if not v.startswith("data:") and not v.startswith("#"):
                    found.append(f"{tag} {k}={v}")
    low = page.text.lower()
    for marker in ("@import", "url(http", "url(//"):
        if marker in low:
            found.append(marker)
    return found


def make_report(tmp_path, output, *args) -> Page:
    dest = tmp_path / (output.stem + ".html")
    r = invoke("report", output, "-o", dest, *args)
    assert r.exit_code == 0, r.stderr
    assert r.stderr.startswith(f"batchgen: wrote {dest} (") and r.stderr.count("\n") == 1, r.stderr
    page = Page(dest.read_text(encoding="utf-8"))
    assert page.text.count("<svg") >= 3
    assert external_references(page) == []
    return page


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The bundled demo model (the default model) on jobs/example.jsonl."""
    d = tmp_path_factory.mktemp("report-demo")
    jobs = without_max_tokens(ROOT / "jobs" / "example.jsonl", d / "example.jsonl")
    out, summary = d / "out.jsonl", d / "summary.json"
    before = time.time()
    r = invoke("run", jobs, "-o", out, "--summary", summary, "--max-tokens", "8")
    assert r.exit_code == 0, r.stderr
    return out, summary, before, time.time()


def test_report_of_a_demo_run_matches_its_lines_and_summary(tmp_path, demo_run):
    out, summary, before, after = demo_run
    lines = read_lines(out)
    s = json.loads(summary.read_text())
    page = make_report(tmp_path, out, "--summary", summary, "--by", "kind")
    assert len(lines) == 10 and all(l["error"] is None for l in lines)
    assert page.number("lines-ok") == 10 == page.number("summary-ok") == s["jobs"]["ok"]
    assert page.number("lines-failed") == 0 == page.number("summary-failed")
    assert page.number("summary-total") == s["jobs"]["total"] and page.number("summary-skipped") == 0
    assert page.number("lines-completion") == sum(l["usage"]["completion_tokens"] for l in lines) == s["tokens"]["completion"]
    assert page.number("lines-prompt") == sum(l["usage"]["prompt_tokens"] for l in lines) == page.number("summary-prompt")
    assert page.number("lines-cached") == sum(l["usage"]["cached_tokens"] for l in lines)
    assert page.number("summary-wall_s") == pytest.approx(s["wall_s"], rel=1e-3)
    assert page.cells["summary-device"] == s["device"] and page.cells["summary-draft"] == s["draft"]
    # finish times: unix seconds to the millisecond, within the run, in order
    times = [l["stats"]["finished_at"] for l in lines]
    assert all(before <= t <= after and round(t, 3) == t for t in times) and times == sorted(times)
    starts = min(t - l["stats"]["prefill_s"] - l["stats"]["decode_s"] for t, l in zip(times, lines))
    assert page.number("lines-wall_s") == pytest.approx(max(times) - starts, abs=2e-3)
    # grouped by metadata "kind"
    kinds = collections.Counter(l["metadata"]["kind"] for l in lines)
    assert {r[0]: int(r[1]) for r in page.rows("groups")} == dict(kinds)
    assert page.tables["groups"][0][0] == "kind"
    reasons = collections.Counter(l["finish_reason"] for l in lines)
    assert {r[0]: int(r[1]) for r in page.rows("finish-reasons")} == dict(reasons)
    slowest = max(lines, key=lambda l: l["stats"]["prefill_s"] + l["stats"]["decode_s"])
    assert page.rows("slowest")[0][0] == slowest["id"] and len(page.rows("slowest")) == 10
    assert "failed" not in page.tables and "Failed jobs (0)" in page.text
    assert "Throughput over the run" in page.text and "No line has stats.finished_at" not in page.text


def test_a_half_finished_output(tmp_path, demo_run):
    out = demo_run[0]
    raw = out.read_bytes().splitlines(keepends=True)
    half = tmp_path / "half.jsonl"
    half.write_bytes(b"".join(raw[:4]) + b"\n\n" + raw[4][: len(raw[4]) // 2])  # blank lines, then a torn tail
    lines = [orjson.loads(l) for l in raw[:4]]
    page = make_report(tmp_path, half)
    assert page.number("lines-results") == 4 and page.number("lines-ok") == 4 and page.number("lines-failed") == 0
    assert page.number("lines-completion") == sum(l["usage"]["completion_tokens"] for l in lines)
    assert "summary-ok" not in page.cells
    assert f"The last line is cut off ({len(raw[4]) // 2} bytes, no newline)" in page.text
    assert "2 blank lines skipped" in page.text
    assert [r[0] for r in page.rows("slowest")] == [
        l["id"] for l in sorted(lines, key=lambda l: -(l["stats"]["prefill_s"] + l["stats"]["decode_s"]))
    ]


def test_older_lines_without_finish_times(tmp_path, demo_run):
    """Lines written before stats.finished_at existed still make a report, without the timeline."""
    old = tmp_path / "old.jsonl"
    lines = read_lines(demo_run[0])
    for l in lines:
        del l["stats"]["finished_at"]
    old.write_bytes(b"".join(orjson.dumps(l) + b"\n" for l in lines))
    page = make_report(tmp_path, old)
    assert page.number("lines-ok") == 10 and "lines-wall_s" not in page.cells
    assert "No line has stats.finished_at" in page.text


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import tiny

    return str(tiny.build_model("qwen2", tmp_path_factory.mktemp("report-qwen2")))


def test_error_lines_and_escaped_job_text(tmp_path, model):
    bad_id = '<b>bold</b> & "co"'
    jobs = tmp_path / "jobs.jsonl"
    rows = [
        {"batchgen": {"system": "You are a helpful assistant.", "defaults": {"max_tokens": 6}}},
        {"id": "ok-1", "prompt": "hello", "metadata": {"task": "<i>greet</i> $\\nocommand{$"}},
        "{broken json",
        {"id": bad_id, "prompt": "x", "temprature": 0.2},
        {"id": "ok-2", "prompt": "bye", "metadata": {"task": "plain"}},
        {"id": "neg", "prompt": "x", "max_tokens": -3, "metadata": {"task": "plain"}},
    ]
    jobs.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    r = invoke("run", jobs, "--model", model, "-o", out, "--no-fuse")
    assert r.exit_code == 1, r.stderr
    lines = read_lines(out)
    failed = [l for l in lines if l["error"] is not None]
    assert len(failed) == 3
    page = make_report(tmp_path, out, "--by", "task")
    assert page.number("lines-ok") == 2 and page.number("lines-failed") == 3
    table = page.rows("failed")
    assert [row[0] for row in table] == [l["id"] for l in failed]
    assert [int(row[1]) for row in table] == [l["error"]["line"] for l in failed]
    assert [row[2] for row in table] == [l["error"]["type"] for l in failed]
    assert [row[3] for row in table] == [l["error"]["message"] for l in failed]
    assert bad_id in [row[0] for row in table] and "temprature" in table[[row[0] for row in table].index(bad_id)][3]
    assert "<b>bold</b>" not in page.text and "<i>greet</i>" not in page.text  # escaped, never markup
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; &quot;co&quot;" in page.text
    assert {row[0] for row in page.rows("groups")} == {"<i>greet</i> $\\nocommand{$", "plain"}  # shown as it is
    assert {r[0]: int(r[1]) for r in page.rows("finish-reasons")}["error"] == 3
    assert "Failed jobs (3)" in page.text


def test_openai_batch_output(tmp_path):
    jobs = without_max_tokens(ROOT / "jobs" / "openai-batch.jsonl", tmp_path / "openai-batch.jsonl")
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    r = invoke("run", jobs, "-o", out, "--summary", summary, "--max-tokens", "8")
    assert r.exit_code == 0, r.stderr
    lines = read_lines(out)
    assert len(lines) == 20 and all(l["response"]["body"]["batchgen"]["stats"]["finished_at"] for l in lines)
    page = make_report(tmp_path, out, "--summary", summary)
    assert "20 result lines (OpenAI batch)" in page.text
    assert page.number("lines-ok") == 20 == page.number("summary-ok") and page.number("lines-failed") == 0
    bodies = [l["response"]["body"] for l in lines]
    assert page.number("lines-completion") == sum(b["usage"]["completion_tokens"] for b in bodies)
    assert page.number("lines-cached") == sum(b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    slowest = max(lines, key=lambda l: sum(l["response"]["body"]["batchgen"]["stats"][k] for k in ("prefill_s", "decode_s")))
    assert page.rows("slowest")[0][0] == slowest["custom_id"]
    reasons = collections.Counter(b["choices"][0]["finish_reason"] for b in bodies)
    assert {r[0]: int(r[1]) for r in page.rows("finish-reasons")} == dict(reasons)


def test_responses_output(tmp_path):
    """/v1/responses lines: the report reads their input/output token names and status."""
    jobs = tmp_path / "responses.jsonl"
    jobs.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                                        "body": {"input": f"def f{i}(x):", "max_output_tokens": 2 + 4 * i}}) + "\n"
                            for i in range(3)))  # fmt: skip
    out = tmp_path / "out.jsonl"
    r = invoke("run", jobs, "-o", out, "--dtype", "float32")
    assert r.exit_code == 0, r.stderr
    bodies = [l["response"]["body"] for l in read_lines(out)]
    page = make_report(tmp_path, out)
    assert page.number("lines-ok") == 3
    assert page.number("lines-completion") == sum(b["usage"]["output_tokens"] for b in bodies) > 0
    assert page.number("lines-cached") == sum(b["usage"]["input_tokens_details"]["cached_tokens"] for b in bodies)
    reasons = collections.Counter({"completed": "stop", "incomplete": "length"}[b["status"]] for b in bodies)
    assert {r[0]: int(r[1]) for r in page.rows("finish-reasons")} == dict(reasons)


def one_line_error(r, *needles):
    assert r.exit_code == 2, r.output
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("batchgen: error: "), r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


def test_unusable_inputs_exit_2_with_one_line(tmp_path, demo_run):
    one_line_error(invoke("report", tmp_path / "nope.jsonl"), "no such file")
    one_line_error(invoke("report", tmp_path), "is a directory")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    one_line_error(invoke("report", empty), "has no result lines")
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(demo_run[0].read_bytes()[:50])
    one_line_error(invoke("report", torn), "has no result lines")
    one_line_error(invoke("report", ROOT / "jobs" / "example.jsonl", "-o", tmp_path / "r.html"), "has no result lines")
    not_json = tmp_path / "summary.json"
    not_json.write_text("{nope")
    one_line_error(invoke("report", demo_run[0], "--summary", not_json, "-o", tmp_path / "r.html"), "is not JSON")
    one_line_error(invoke("report", demo_run[0], "--summary", tmp_path / "none.json", "-o", tmp_path / "r.html"),
                   "no such file")  # fmt: skip
    before = demo_run[0].read_bytes()
    one_line_error(invoke("report", demo_run[0], "-o", demo_run[0]), "is the output")
    assert demo_run[0].read_bytes() == before


def test_default_path_and_stdout(tmp_path, demo_run):
    out = tmp_path / "run.jsonl"
    shutil.copy(demo_run[0], out)
    r = invoke("report", out)
    assert r.exit_code == 0 and (tmp_path / "run.report.html").is_file()
    r = invoke("report", out, "-o", "-")
    assert r.exit_code == 0 and r.stdout.startswith("<!DOCTYPE html>") and r.stdout.rstrip().endswith("</html>")


def test_without_matplotlib_exit_2_naming_the_extra(tmp_path, demo_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    r = invoke("report", demo_run[0], "-o", tmp_path / "r.html")
    one_line_error(r, "install batchgen[report]")
    assert not (tmp_path / "r.html").exists()


def test_the_command_line_imports_neither_matplotlib_nor_mlx():
    code = ("import sys, batchgen.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('matplotlib', 'mlx', 'mlx_lm') or m in ('batchgen.plots', 'batchgen.report')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_bench_plots_through_plots_module(tmp_path):
    from batchgen.bench import save_results

    result = {"per_job": {"mlx-lm": [{"decode_tps": 10.0}, {"decode_tps": 12.0}],
                          "batchgen": [{"decode_tps": 20.0}, {"decode_tps": 23.0}]},
              "sides": {"mlx-lm": {"decode_tps": 11.0}, "batchgen": {"decode_tps": 21.5}},
              "ratio_batchgen_over_plain": {"decode_tps": 1.95}, "model": "m", "device": "cpu",
              "identical_outputs": 2, "jobs": 2}  # fmt: skip
    save_results(result, tmp_path / "bench.json", tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "bench.json").read_text())["jobs"] == 2


# ---------------------------------------------------------------------------
# In a real browser


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(browser: str, page: Path, png: Path, profile: Path) -> str:
    """Render `page` headless into `png`; returns the browser's log (stderr)."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}", "--window-size=1100,2200",
           f"--screenshot={png}", "--enable-logging=stderr", "--v=0", page.resolve().as_uri()]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stderr


def console_messages(log: str) -> list:
    return [l for l in log.splitlines() if ":CONSOLE" in l]


def pixels(png: Path):
    import numpy as np
    from matplotlib import image

    img = image.imread(png)  # floats in [0, 1], H x W x (3 or 4)
    return np.asarray(img[..., :3] * 255, dtype=np.uint8).reshape(-1, 3)


@pytest.mark.browser
@pytest.mark.skipif(chromium() is None, reason="no chromium binary (Debian: apt-get install chromium)")
def test_report_renders_in_headless_chromium(tmp_path, demo_run):
    import numpy as np

    browser = chromium()
    out, summary = demo_run[0], demo_run[1]
    page = tmp_path / "report.html"
    assert invoke("report", out, "--summary", summary, "--by", "kind", "-o", page).exit_code == 0
    png = tmp_path / "report.png"
    log = screenshot(browser, page, png, tmp_path / "profile")
    assert console_messages(log) == []
    px = pixels(png)
    colours, counts = np.unique(px, axis=0, return_counts=True)
    assert len(colours) > 50, "the screenshot is (nearly) one colour"
    assert counts.max() / len(px) < 0.97, "the screenshot is almost all background"
    # the checks can fail: a page with a console error, and a blank page
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><script>console.error("boom")</script></body></html>')
    log = screenshot(browser, bad, tmp_path / "bad.png", tmp_path / "profile-bad")
    assert any("boom" in l for l in console_messages(log))
    assert len(np.unique(pixels(tmp_path / "bad.png"), axis=0)) == 1
