"""The plots of `batchgen report` and `batchgen bench`, in one place.

matplotlib, through `matplotlib.figure.Figure` and never pyplot: no global
figure state, no GUI backend, nothing to close. PNGs render with Agg (the
default raster canvas of a bare Figure, whatever backend a user configured);
the report's plots are SVG text, inlined into its HTML. SVG because the report
must be one self-contained file that opens anywhere, offline, with no
JavaScript: an inline `<svg>` is text in the page (sharp at any zoom, the page
stays greppable), needs no base64 blob or external file, and no plotting
library runs in the browser. Scatter plots of many thousand points rasterize
their dots (an embedded PNG inside the SVG) so the file stays small.

matplotlib is an optional extra (`batchgen[report]`, `batchgen[bench]`),
imported inside the functions that draw: this module imports without it
(`available()` says whether plotting can work), and the command line imports
this module only inside the commands that plot.
"""

from __future__ import annotations

import importlib.util
import io
import math
from pathlib import Path

import numpy as np

BLUE, GRAY, RED, ORANGE = "tab:blue", "tab:gray", "tab:red", "tab:orange"
RASTERIZE_OVER = 5000  # points
MAX_GROUPS = 20

WIDTH, HEIGHT = 5.2, 3.2  # inches; the report's figures


def available() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def figure(width: float = WIDTH, height: float = HEIGHT, layout: str = "constrained"):
    """A bare `matplotlib.figure.Figure` (no pyplot, no backend state)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout=layout)


def to_svg(fig) -> str:
    """The figure as an `<svg>` element for inlining into HTML (no XML
    prolog, no DOCTYPE, no metadata block); text stays text."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    text = buf.getvalue()
    return text[text.index("<svg") :].strip()


def histogram(values, xlabel: str, title: str, bins: int | None = None, color: str = BLUE):
    """A distribution: one bar per bin, with the median marked."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    fig = figure()
    ax = fig.add_subplot()
    if bins is None:
        bins = int(min(40, max(5, math.ceil(math.sqrt(len(v))))))
    ax.hist(v, bins=bins, color=color, alpha=0.85, edgecolor="white", linewidth=0.5)
    if len(v):
        med = float(np.median(v))
        ax.axvline(med, color=RED, lw=1, ls="--", label=f"median {med:.3g}")
        ax.legend(fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("jobs")
    ax.set_title(title, fontsize=10)
    return fig


def scatter(x, y, xlabel: str, ylabel: str, title: str, groups=None):
    """y against x, one dot per job; coloured by group when `groups` (one label per dot) is given."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    fig = figure()
    ax = fig.add_subplot()
    raster = len(x) > RASTERIZE_OVER
    if groups is None:
        ax.scatter(x, y, s=22, color=BLUE, alpha=0.7, rasterized=raster, linewidths=0)
    else:
        labels = np.asarray(groups, dtype=object)
        for name in _top_groups(labels):
            m = labels == name
            ax.scatter(x[m], y[m], s=22, alpha=0.7, rasterized=raster, linewidths=0, label=plain(name))
        ax.legend(fontsize=7, markerscale=1.5, loc="best")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    return fig


def plain(text) -> str:
    """Job text as a label: shown as it is, never parsed as mathtext ($...$)."""
    return str(text).replace("$", r"\$")


def _top_groups(labels) -> list:
    names, counts = np.unique(labels.astype(str), return_counts=True)
    return [n for _, n in sorted(zip(-counts, names))][:MAX_GROUPS]


def by_group(values: dict, ylabel: str, title: str):
    """Per-job values as dots, one column per group (a box over each), in the
    order given; at most MAX_GROUPS columns."""
    names = list(values)[:MAX_GROUPS]
    fig = figure(WIDTH, HEIGHT + (0.6 if len(names) > 4 else 0.0))
    ax = fig.add_subplot()
    rng = np.random.default_rng(0)  # the jitter is the same every time
    data = [np.asarray(values[n], dtype=float) for n in names]
    nonempty = [i for i, d in enumerate(data) if len(d)]
    if nonempty:
        ax.boxplot([data[i] for i in nonempty], positions=[i + 1 for i in nonempty], widths=0.5,
                   showfliers=False, medianprops={"color": RED})  # fmt: skip
    total = sum(len(d) for d in data)
    for i, d in enumerate(data):
        jitter = rng.uniform(-0.15, 0.15, len(d))
        ax.scatter(np.full(len(d), i + 1) + jitter, d, s=16, color=BLUE, alpha=0.7, linewidths=0,
                   rasterized=total > RASTERIZE_OVER, zorder=3)  # fmt: skip
    ax.set_xticks(range(1, len(names) + 1))
    ax.set_xticklabels([f"{plain(n)}\n({len(d)})" for n, d in zip(names, data)], fontsize=7,
                       rotation=30 if len(names) > 4 else 0)  # fmt: skip
    ax.set_xlim(0.4, len(names) + 0.6)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    return fig


def counts_bar(counts: dict, xlabel: str, title: str):
    """Horizontal bars, one per key, largest first."""
    items = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))[:MAX_GROUPS]
    fig = figure(WIDTH, max(1.6, 0.9 + 0.35 * len(items)))
    ax = fig.add_subplot()
    names = [str(k) for k, _ in items][::-1]
    vals = [v for _, v in items][::-1]
    colors = [RED if n == "error" else BLUE for n in names]
    bars = ax.barh(range(len(names)), vals, color=colors)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([plain(n) for n in names])
    ax.bar_label(bars, padding=3, fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.12)
    return fig


def throughput_over_time(starts, ends, tokens, bins: int | None = None):
    """Completion tokens per second of the run's wall-clock time, and the jobs
    finished so far. Each job's tokens are spread over its decode interval
    [start, end] (unix seconds), so jobs decoding together all count; a job
    with no decode time counts at its end. Time runs from the first start."""
    s, e, t = (np.asarray(a, dtype=float) for a in (starts, ends, tokens))
    t0 = float(s.min())
    s, e = s - t0, e - t0
    span = max(float(e.max()), 1e-3)
    if bins is None:
        bins = int(min(60, max(5, math.ceil(math.sqrt(len(e)) * 2))))
    edges = np.linspace(0.0, span, bins + 1)
    lo, hi = edges[:-1][:, None], edges[1:][:, None]  # (bins, 1) against (jobs,)
    length = e - s
    overlap = np.clip(np.minimum(hi, e) - np.maximum(lo, s), 0.0, None)
    spread = np.where(length > 0, overlap / np.where(length > 0, length, 1.0), 0.0)
    at_end = (length <= 0) & (e >= lo) & ((e < hi) | ((hi == span) & (e <= hi)))
    per_bin = ((spread + at_end) * t).sum(axis=1)
    width = span / bins
    fig = figure()
    ax = fig.add_subplot()
    ax.bar(edges[:-1], per_bin / width, width=width, align="edge", color=BLUE, alpha=0.8, label="tok/s")
    ax.set_xlabel("seconds since the first job started")
    ax.set_ylabel("completion tokens/s")
    ax.set_title(f"throughput over the run ({span:.1f}s, {len(e)} jobs)", fontsize=10)
    ax2 = ax.twinx()
    order = np.sort(e)
    ax2.step(np.concatenate([[0.0], order]), np.arange(len(order) + 1), where="post", color=ORANGE, lw=1.2,
             label="jobs finished")  # fmt: skip
    ax2.set_ylabel("jobs finished")
    ax2.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    return fig


def bench_decode(result: dict, path: Path) -> None:
    """`batchgen bench`'s PNG: per-job decode tok/s of both sides, with each side's aggregate."""
    fig = figure(9, 4.5, layout="tight")
    ax = fig.add_subplot()
    for name, color in (("mlx-lm", GRAY), ("batchgen", BLUE)):
        tps = [r["decode_tps"] for r in result["per_job"][name]]
        ax.plot(range(len(tps)), tps, "o", ms=3, color=color, label=f"{name}: {result['sides'][name]['decode_tps']:.1f} tok/s")
        ax.axhline(result["sides"][name]["decode_tps"], color=color, lw=1, ls="--")
    ratio = result["ratio_batchgen_over_plain"]["decode_tps"] or 0.0
    ax.set_title(f"{result['model']} on {result['device']}: decode {ratio:.2f}x, "
                 f"{result['identical_outputs']}/{result['jobs']} identical", fontsize=10)  # fmt: skip
    ax.set_xlabel("job")
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    fig.savefig(path, dpi=110)
