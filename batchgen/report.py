"""`batchgen report`: one self-contained HTML page about a run, read from its
output file (finished or not, native or OpenAI batch lines) and, when given,
its `--summary` JSON.

The page needs nothing but itself: inline CSS, the plots as inline SVG
(batchgen/plots.py says why SVG), no JavaScript, no fonts, images or styles
fetched from anywhere. Every piece of job text (ids, error messages, metadata
values, file names) goes through `html.escape`.

Reading is forgiving where a run leaves marks: blank lines are skipped, and a
last line without its newline (a run cut off mid-write, or one still running)
is left out, as a resume would cut it. Lines that are not result lines are
counted and named by line number, not fatal; a file with no result line at
all is a `ReportError` (exit code 2), as is one that cannot be read.
"""

from __future__ import annotations

import datetime
import html
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

MAX_FAILED_ROWS = 500
SLOWEST = 10


class ReportError(Exception):
    """The report cannot be made (exit code 2); the message is one line."""


def require_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportError("the report needs matplotlib: install batchgen[report] "
                          "(pip install 'batchgen[report]')") from None  # fmt: skip


# ---------------------------------------------------------------------------
# Reading


@dataclass
class Row:
    """One result line, whichever shape it came in."""

    id: str
    n: int  # its line number in the output
    ok: bool
    error_type: str | None = None
    error_message: str | None = None
    error_line: int | None = None  # the job's line in the job file
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stats: dict = field(default_factory=dict)
    metadata: Any = None

    def stat(self, key: str, default=None):
        v = self.stats.get(key, default)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    @property
    def seconds(self) -> float:
        return (self.stat("prefill_s", 0.0) or 0.0) + (self.stat("decode_s", 0.0) or 0.0)


@dataclass
class OutputLines:
    path: Path
    rows: list = field(default_factory=list)
    formats: set = field(default_factory=set)  # "native", "openai"
    blank: int = 0
    torn_bytes: int = 0
    not_results: list = field(default_factory=list)  # line numbers

    @property
    def ok(self) -> list:
        return [r for r in self.rows if r.ok]

    @property
    def failed(self) -> list:
        return [r for r in self.rows if not r.ok]


def _num(v, default=0):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _native_row(obj: dict, n: int) -> Row | None:
    key = obj.get("id")
    err = obj.get("error")
    if not isinstance(key, str) or not ("text" in obj or "samples" in obj or err is not None):
        return None
    if err is not None:
        err = err if isinstance(err, dict) else {"message": str(err)}
        return Row(key, n, False, str(err.get("type", "error")), str(err.get("message", "")),
                   err.get("line") if isinstance(err.get("line"), int) else None, metadata=obj.get("metadata"))  # fmt: skip
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    stats = obj.get("stats") if isinstance(obj.get("stats"), dict) else {}
    samples = obj.get("samples") if isinstance(obj.get("samples"), list) else [{}]
    finish = obj.get("finish_reason", samples[0].get("finish_reason") if samples and isinstance(samples[0], dict) else None)
    return Row(key, n, True, finish_reason=finish, prompt_tokens=_num(usage.get("prompt_tokens")),
               completion_tokens=_num(usage.get("completion_tokens")), cached_tokens=_num(usage.get("cached_tokens")),
               stats=stats, metadata=obj.get("metadata"))  # fmt: skip


def _openai_row(obj: dict, n: int) -> Row | None:
    key = obj.get("custom_id")
    if not isinstance(key, str) or "response" not in obj or "error" not in obj:
        return None
    err = obj.get("error")
    if err is not None:
        err = err if isinstance(err, dict) else {"message": str(err)}
        return Row(key, n, False, str(err.get("code") or err.get("type") or "error"), str(err.get("message", "")),
                   err.get("line") if isinstance(err.get("line"), int) else None)  # fmt: skip
    response = obj.get("response") if isinstance(obj.get("response"), dict) else {}
    body = response.get("body") if isinstance(response.get("body"), dict) else {}
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    extra = body.get("batchgen") if isinstance(body.get("batchgen"), dict) else {}
    stats = extra.get("stats") if isinstance(extra.get("stats"), dict) else {}
    if body.get("object") == "response":  # /v1/responses: its own names for the same figures
        details = usage.get("input_tokens_details") if isinstance(usage.get("input_tokens_details"), dict) else {}
        finish = {"completed": "stop", "incomplete": "length"}.get(body.get("status"))
        prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    else:
        details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
        choices = body.get("choices") if isinstance(body.get("choices"), list) else []
        finish = choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return Row(key, n, True, finish_reason=finish, prompt_tokens=_num(prompt), completion_tokens=_num(completion),
               cached_tokens=_num(details.get("cached_tokens")), stats=stats, metadata=body.get("metadata"))  # fmt: skip


def _unreadable(what: str, path: Path, e: OSError) -> ReportError:
    """The one-line error for a file the report cannot read."""
    if isinstance(e, FileNotFoundError):
        return ReportError(f"cannot read {what} {path}: no such file")
    if isinstance(e, IsADirectoryError):
        return ReportError(f"{what} {path} is a directory")
    return ReportError(f"cannot read {what} {path}: {e.strerror}")


def read_output(path: Path) -> OutputLines:
    """Every result line of `path`; raises `ReportError` when it cannot be
    read or holds none."""
    out = OutputLines(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise _unreadable("output file", path, e) from None
    try:
        with f:
            for n, raw in enumerate(f, start=1):
                if not raw.endswith(b"\n"):
                    if raw.strip():
                        out.torn_bytes = len(raw)  # the last line, cut off mid-write
                    break
                if not raw.strip():
                    out.blank += 1
                    continue
                try:
                    obj = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    obj = None
                row = None
                if isinstance(obj, dict):
                    row = _openai_row(obj, n) if "custom_id" in obj else _native_row(obj, n)
                if row is None:
                    out.not_results.append(n)
                    continue
                out.formats.add("openai" if "custom_id" in obj else "native")
                out.rows.append(row)
    except OSError as e:
        raise _unreadable("output file", path, e) from None
    if not out.rows:
        raise ReportError(f"output file {path} has no result lines")
    return out


def read_summary(path: Path) -> dict:
    try:
        data = orjson.loads(path.read_bytes())
    except OSError as e:
        raise _unreadable("summary", path, e) from None
    except orjson.JSONDecodeError:
        raise ReportError(f"summary {path} is not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), dict):
        raise ReportError(f"summary {path} is not a batchgen run summary (no \"jobs\")")
    return data


# ---------------------------------------------------------------------------
# Figures


def line_figures(lines: OutputLines) -> dict:
    """The run in numbers, as the output's lines tell it."""
    ok = lines.ok
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    decode_s = sum(r.stat("decode_s", 0.0) for r in ok)
    decode_tokens = sum(max(r.completion_tokens - 1, 0) for r in ok)
    drafted = sum(r.stat("pld_drafted", 0) for r in ok)
    accepted = sum(r.stat("pld_accepted", 0) for r in ok)
    timed = [r for r in ok if r.stat("finished_at") is not None]
    wall = None
    if timed:
        start = min(r.stat("finished_at") - r.seconds for r in timed)
        wall = max(r.stat("finished_at") for r in timed) - start
    ttft = [r.stat("prefill_s") for r in ok if r.stat("prefill_s") is not None]
    peaks = [r.stat("peak_memory_gb") for r in ok if r.stat("peak_memory_gb") is not None]
    return {
        "results": len(lines.rows),
        "ok": len(ok),
        "failed": len(lines.failed),
        "prompt": prompt,
        "completion": completion,
        "cached": cached,
        "cache_hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "wall_s": round(wall, 3) if wall is not None else None,
        "decode_tps": round(decode_tokens / decode_s, 2) if decode_s > 0 else 0.0,
        "throughput_tps": round(completion / wall, 2) if wall else None,
        "jobs_per_s": round(len(timed) / wall, 3) if wall else None,
        "ttft_median_s": round(statistics.median(ttft), 4) if ttft else None,
        "peak_memory_gb": round(max(peaks), 4) if peaks else None,
        "pld_acceptance": round(accepted / drafted, 4) if drafted else None,
        "pld_drafted": drafted,
        "pld_accepted": accepted,
        "draft": _tally(r.stats.get("draft") for r in ok),
        "kv_cache": _tally(r.stats.get("kv_cache") for r in ok),
        "finished_at": len(timed),
    }


def _tally(values) -> str:
    counts: dict = {}
    for v in values:
        if v is not None:
            counts[str(v)] = counts.get(str(v), 0) + 1
    return ", ".join(f"{k} ({n} jobs)" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])) or None


def group_of(row: Row, key: str | None) -> str:
    if key is None:
        return "all jobs"
    md = row.metadata
    if isinstance(md, dict) and key in md and md[key] is not None:
        v = md[key]
        return v if isinstance(v, str) else orjson.dumps(v).decode()
    return f"(no {key})"


def groups(rows: list, key: str | None) -> dict:
    """{group: [rows]}, largest group first."""
    out: dict = {}
    for r in rows:
        out.setdefault(group_of(r, key), []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (-len(kv[1]), kv[0])))


# ---------------------------------------------------------------------------
# HTML

esc = html.escape

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2330; margin: 0 auto;
       max-width: 1060px; padding: 24px; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #dde;
     padding-bottom: 4px; }
.sub { color: #5a6275; margin: 0 0 16px; } .note { color: #7a5a00; background: #fff8e1; padding: 6px 10px;
     border-radius: 4px; margin: 6px 0; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 13px; }
th, td { border: 1px solid #dde; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f4f8; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.msg { max-width: 560px; word-break: break-word; white-space: pre-wrap; }
.grid { display: flex; flex-wrap: wrap; gap: 12px; align-items: flex-start; } .grid > .note { max-width: 480px; } figure { margin: 0; } figure svg { max-width: 100%; height: auto; }
figcaption { color: #5a6275; font-size: 12px; max-width: 620px; }
"""


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "–"
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.1f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _cell(v, ident: str | None = None) -> str:
    cls = ' class="num"' if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
    idattr = f' id="{esc(ident)}"' if ident else ""
    return f"<td{cls}{idattr}>{esc(_fmt(v))}</td>"


class _Raw(str):
    """A cell already made (`<td ...>`), escaped where it was made."""


def _table(head: list, rows: list, ident: str | None = None) -> str:
    idattr = f' id="{esc(ident)}"' if ident else ""
    out = [f"<table{idattr}><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for r in rows:
        out.append("<tr>" + "".join(c if isinstance(c, _Raw) else _cell(c) for c in r) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{esc(caption)}</figcaption></figure>"


def _numbers(lines: OutputLines, summary: dict | None) -> str:
    f = line_figures(lines)
    s = summary or {}
    sj, st = s.get("jobs", {}) or {}, s.get("tokens", {}) or {}
    fusion = s.get("fusion") or {}
    prewarm = s.get("prewarm") or {}
    batch = s.get("batch") or {}
    # (label, key, from the lines, from the summary)
    rows = [
        ("jobs in the run", "total", None, sj.get("total")),
        ("result lines", "results", f["results"], None),
        ("ok", "ok", f["ok"], sj.get("ok")),
        ("failed", "failed", f["failed"], sj.get("failed")),
        ("skipped (results already there)", "skipped", None, sj.get("skipped")),
        ("prompt tokens", "prompt", f["prompt"], st.get("prompt")),
        ("completion tokens", "completion", f["completion"], st.get("completion")),
        ("cached prompt tokens", "cached", f["cached"], st.get("cached")),
        ("cache_hit_ratio", "cache_hit_ratio", f["cache_hit_ratio"], s.get("cache_hit_ratio")),
        ("wall time, s", "wall_s", f["wall_s"], s.get("wall_s")),
        ("model load, s", "load_s", None, s.get("load_s")),
        ("decode tok/s per job", "decode_tps", f["decode_tps"], s.get("decode_tps")),
        ("throughput, completion tok/s", "throughput_tps", f["throughput_tps"], s.get("throughput_tps")),
        ("jobs/s", "jobs_per_s", f["jobs_per_s"], s.get("jobs_per_s")),
        ("median time to first token, s", "ttft", f["ttft_median_s"], None),
        ("peak memory, GB", "peak_memory_gb", f["peak_memory_gb"], s.get("peak_memory_gb")),
        ("model memory, GB", "model_memory_gb", None, s.get("model_memory_gb")),
        ("PLD acceptance (accepted/drafted)", "pld_acceptance", f["pld_acceptance"], None),
        ("draft", "draft", f["draft"], s.get("draft")),
        ("kv cache", "kv_cache", f["kv_cache"], s.get("kv_cache")),
    ]
    if summary is not None:
        rows += [
            ("pld_ngram_size / pld_max_lookup", "pld", None,
             f"{s.get('pld_ngram_size', '–')} / {s.get('pld_max_lookup', '–')}" if s.get("draft") == "pld" else None),
            ("fusion (qkv, gate_up, experts)", "fusion", None,
             f"{fusion.get('qkv', 0)}, {fusion.get('gate_up', 0)}, {fusion.get('experts', 0)}" if fusion else None),
            ("prewarm", "prewarm", None,
             f"{prewarm.get('tokens', 0)} tokens in {prewarm.get('seconds', 0)}s" if prewarm else None),
            ("batch rows", "batch_rows", None, batch.get("rows")),
            ("device", "device", None, s.get("device")),
            ("model", "model", None, s.get("model")),
            ("interrupted", "interrupted", None, "yes" if s.get("interrupted") else "no"),
        ]  # fmt: skip
    head = ["", "from the output's lines"] + (["from the run's summary"] if summary is not None else [])
    body = []
    for label, key, from_lines, from_summary in rows:
        if from_lines is None and (summary is None or from_summary is None):
            continue
        cells = [f"<th>{esc(label)}</th>", _cell(from_lines, f"lines-{key}")]
        if summary is not None:
            cells.append(_cell(from_summary, f"summary-{key}"))
        body.append("<tr>" + "".join(cells) + "</tr>")
    table = ("<table id=\"numbers\"><thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head)
             + "</tr></thead><tbody>" + "".join(body) + "</tbody></table>")  # fmt: skip
    notes = []
    if summary is not None and sj.get("skipped"):
        notes.append("The summary counts the last run only; the lines hold every run's results (a resume skips "
                     "jobs that already have one).")  # fmt: skip
    if f["wall_s"] is not None:
        notes.append("From the lines, wall time runs from the first job's start to the last result line "
                     "(model load and prewarm are not in it).")  # fmt: skip
    return table + "".join(f'<p class="note">{esc(n)}</p>' for n in notes)


def _plots_section(lines: OutputLines, by: str | None) -> str:
    from . import plots

    ok = lines.ok
    parts = []
    timed = [r for r in ok if r.stat("finished_at") is not None]
    parts.append("<h2>Throughput over the run</h2>")
    if timed:
        ends = [r.stat("finished_at") for r in timed]
        starts = [r.stat("finished_at") - (r.stat("decode_s", 0.0) or 0.0) for r in timed]
        fig = plots.throughput_over_time(starts, ends, [r.completion_tokens for r in timed])
        parts.append(_figure(plots.to_svg(fig), "Completion tokens per second of wall time (each job's tokens "
                             "spread over its decode), and the jobs finished so far. From stats.finished_at."))  # fmt: skip
        if len(timed) < len(ok):
            parts.append(f'<p class="note">{len(ok) - len(timed)} ok lines have no finished_at and are not in it.</p>')
    else:
        parts.append('<p class="note">No line has stats.finished_at (written by a batchgen before it recorded '
                     "finish times), so there is no timeline.</p>")  # fmt: skip
    if not ok:
        parts.append('<p class="note">No job finished ok: nothing to plot per job.</p>')
        return "".join(parts)
    parts.append("<h2>Per job</h2><div class=\"grid\">")
    ttft = [r.stat("prefill_s") for r in ok if r.stat("prefill_s") is not None]
    if ttft:
        fig = plots.histogram(ttft, "seconds", f"time to first token (stats.prefill_s), {len(ttft)} jobs")
        parts.append(_figure(plots.to_svg(fig), "Prefill plus the first step, per job."))
    tps = [r.stat("decode_tps") for r in ok if r.completion_tokens > 1 and r.stat("decode_tps") is not None]
    if tps:
        fig = plots.histogram(tps, "decode tokens/s", f"decode tok/s per job, {len(tps)} jobs", color=plots.ORANGE)
        parts.append(_figure(plots.to_svg(fig), "Tokens after the first, per second of decode (jobs of one token left out)."))
    group_labels = [group_of(r, by) for r in ok] if by else None
    fig = plots.scatter([r.prompt_tokens for r in ok], [r.completion_tokens for r in ok], "prompt tokens",
                        "completion tokens", "completion length against prompt length", groups=group_labels)  # fmt: skip
    parts.append(_figure(plots.to_svg(fig), "One dot per job" + (f", coloured by metadata {by!r}." if by else ".")))
    parts.append("</div>")
    parts.append(_groups_section(ok, by, plots))
    return "".join(parts)


def _groups_section(ok: list, by: str | None, plots) -> str:
    grouped = groups(ok, by)
    title = f"Prompt cache and PLD by {by!r}" if by else "Prompt cache and PLD"
    parts = [f"<h2>{esc(title)}</h2><div class=\"grid\">"]
    hits = {g: [r.stat("cache_hit_ratio", 0.0) for r in rows] for g, rows in grouped.items()}
    fig = plots.by_group(hits, "cache_hit_ratio", "prompt-cache hit ratio per job")
    parts.append(_figure(plots.to_svg(fig), "Cached prompt tokens over prompt tokens, per job."))
    acc = {g: [r.stat("pld_accepted", 0) / r.stat("pld_drafted") for r in rows if r.stat("pld_drafted", 0) > 0]
           for g, rows in grouped.items()}  # fmt: skip
    if any(acc.values()):
        fig = plots.by_group(acc, "accepted / drafted", "PLD acceptance per job")
        parts.append(_figure(plots.to_svg(fig), "Accepted over drafted tokens, per job that drafted any "
                                                "(jobs that drafted nothing are left out)."))  # fmt: skip
    else:
        parts.append('<p class="note">No job drafted a token (PLD off, or no draft paid): no acceptance to plot.</p>')
    parts.append("</div>")
    head = [by if by else "group", "jobs", "mean cache_hit_ratio", "PLD acceptance", "mean decode tok/s",
            "prompt tokens", "completion tokens"]  # fmt: skip
    rows = []
    for g, rs in grouped.items():
        drafted = sum(r.stat("pld_drafted", 0) for r in rs)
        accepted = sum(r.stat("pld_accepted", 0) for r in rs)
        tps = [r.stat("decode_tps") for r in rs if r.completion_tokens > 1 and r.stat("decode_tps") is not None]
        rows.append([g, len(rs), round(statistics.fmean(hits[g]), 4) if hits[g] else None,
                     round(accepted / drafted, 4) if drafted else None,
                     round(statistics.fmean(tps), 2) if tps else None,
                     sum(r.prompt_tokens for r in rs), sum(r.completion_tokens for r in rs)])  # fmt: skip
    parts.append(_table(head, rows, "groups"))
    return "".join(parts)


def _finish_section(lines: OutputLines) -> str:
    from . import plots

    counts: dict = {}
    for r in lines.rows:
        k = "error" if not r.ok else str(r.finish_reason)
        counts[k] = counts.get(k, 0) + 1
    fig = plots.counts_bar(counts, "jobs", "finish reasons")
    rows = [[k, v] for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return ("<h2>Finish reasons</h2><div class=\"grid\">" + _figure(plots.to_svg(fig), "error: an error line.")
            + _table(["finish_reason", "jobs"], rows, "finish-reasons") + "</div>")  # fmt: skip


def _failed_section(lines: OutputLines) -> str:
    failed = lines.failed
    parts = [f"<h2>Failed jobs ({len(failed)})</h2>"]
    if not failed:
        return parts[0] + "<p>None.</p>"
    rows = [[r.id, r.error_line, r.error_type, _Raw(f'<td class="msg">{esc(r.error_message or "")}</td>')]
            for r in failed[:MAX_FAILED_ROWS]]  # fmt: skip
    parts.append(_table(["id", "line", "error type", "message"], rows, "failed"))
    if len(failed) > MAX_FAILED_ROWS:
        parts.append(f'<p class="note">and {len(failed) - MAX_FAILED_ROWS} more (the first {MAX_FAILED_ROWS} '
                     "are shown).</p>")  # fmt: skip
    return "".join(parts)


def _slowest_section(lines: OutputLines) -> str:
    ok = sorted(lines.ok, key=lambda r: -r.seconds)[:SLOWEST]
    if not ok:
        return ""
    rows = [[r.id, round(r.seconds, 4), r.stat("prefill_s"), r.stat("decode_tps"), r.prompt_tokens,
             r.completion_tokens, r.finish_reason] for r in ok]  # fmt: skip
    return (f"<h2>The slowest jobs ({len(ok)})</h2>"
            + _table(["id", "seconds", "time to first token, s", "decode tok/s", "prompt tokens", "completion tokens",
                      "finish_reason"], rows, "slowest"))  # fmt: skip


def _reading_notes(lines: OutputLines) -> list:
    notes = []
    if lines.torn_bytes:
        notes.append(f"The last line is cut off ({lines.torn_bytes} bytes, no newline): a run stopped mid-write, "
                     "or one still running. It is left out.")  # fmt: skip
    if lines.not_results:
        shown = ", ".join(str(n) for n in lines.not_results[:20]) + (" ..." if len(lines.not_results) > 20 else "")
        notes.append(f"{len(lines.not_results)} lines are not result lines and are left out (line {shown}).")
    if lines.blank:
        notes.append(f"{lines.blank} blank lines skipped.")
    return notes


def render(lines: OutputLines, summary: dict | None = None, by: str | None = None,
           summary_path: Path | None = None) -> str:  # fmt: skip
    """The report page, as text."""
    fmt = " and ".join(sorted("OpenAI batch" if f == "openai" else "native" for f in lines.formats))
    when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    sub = f"{len(lines.rows)} result lines ({fmt}) in {lines.path}"
    if summary_path is not None:
        sub += f"; summary {summary_path}"
    if by:
        sub += f"; grouped by metadata {by!r}"
    notes = _reading_notes(lines)
    if by and "openai" in lines.formats and "native" not in lines.formats:
        notes.append(f"OpenAI batch lines carry no metadata, so --by {by} puts every job in one group.")
    body = [
        f"<h1>batchgen report: {esc(lines.path.name)}</h1>",
        f'<p class="sub">{esc(sub)}; made {esc(when)}.</p>',
        "".join(f'<p class="note">{esc(n)}</p>' for n in notes),
        "<h2>The run in numbers</h2>",
        _numbers(lines, summary),
        _plots_section(lines, by),
        _finish_section(lines),
        _failed_section(lines),
        _slowest_section(lines),
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>batchgen report: {esc(lines.path.name)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")  # fmt: skip


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def default_report_path(output: Path) -> Path:
    return output.with_name(output.stem + ".report.html")


def write_report(output: Path, summary_path: Path | None = None, report_path: str | None = None,
                 by: str | None = None) -> tuple[str, int]:  # fmt: skip
    """Read, render, write; `report_path` '-' is stdout. Returns (where, result lines)."""
    require_plotting()
    dest = Path(report_path) if report_path not in (None, "-") else None
    if report_path is None:
        dest = default_report_path(output)
    if dest is not None and (_same(dest, output) or (summary_path is not None and _same(dest, summary_path))):
        raise ReportError(f"report {dest} is the output or the summary; give another -o")
    lines = read_output(output)
    summary = read_summary(summary_path) if summary_path is not None else None
    page = render(lines, summary, by, summary_path)
    if dest is None:
        import sys

        sys.stdout.write(page)
        sys.stdout.flush()
        return "-", len(lines.rows)
    if dest.is_dir():
        raise ReportError(f"report {dest} is a directory")
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(page, encoding="utf-8")
        tmp.replace(dest)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ReportError(f"cannot write report {dest}: {e.strerror}") from None
    return str(dest), len(lines.rows)
