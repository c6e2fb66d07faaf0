"""How long a process's kernel builds took, MLX's own against batchgen's, from the kept
builds' write times (`find DIR -name '*.ptx' -printf '%T@ %s %P\\n' | sort -n`):

    python bench/build_times.py LIST [PREVIOUS_LIST] [--json OUT]

Builds in LIST and not in PREVIOUS_LIST are this process's. A build is written when its
compile ends and builds run one after another, so the time since the write before it is
that build's compile, unless the process did other work between (a gap longer than
`--longest` seconds is counted as other work, not as a build). batchgen's builds are the
`custom_kernel_*` modules (kernels/builds.py); every other module is MLX's own.
"""

from __future__ import annotations

import argparse
import json


def read_list(path: str | None) -> list[tuple[float, str]]:
    """(write time, module) of each line "TIME BYTES NAME", oldest first."""
    if path is None:
        return []
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.split(maxsplit=2)
            if len(parts) == 3:
                rows.append((float(parts[0]), parts[2].strip()))
    return sorted(rows)


def build_times(rows: list[tuple[float, str]], before: set[str], longest: float = 8.0) -> dict:
    """Seconds of builds by kind, each build's time the gap since the write before it.

    >>> rows = [(0.0, "a.ptx"), (1.5, "custom_kernel_x.ptx"), (2.0, "b.ptx"), (30.0, "c.ptx")]
    >>> build_times(rows, {"a.ptx"})
    {'mlx': {'builds': 2, 'seconds': 0.5, 'after_other_work': 1}, 'batchgen': {'builds': 1, 'seconds': 1.5, 'after_other_work': 0}, 'span_s': 28.5}
    """
    out = {k: {"builds": 0, "seconds": 0.0, "after_other_work": 0} for k in ("mlx", "batchgen")}
    new = [(t, name) for t, name in rows if name not in before]
    last = None
    for t, name in rows:
        if name in before:
            last = t
            continue
        kind = out["batchgen" if name.rsplit("/", 1)[-1].startswith("custom_kernel_") else "mlx"]
        kind["builds"] += 1
        gap = None if last is None else t - last
        if gap is None or gap > longest:
            kind["after_other_work"] += 1
        else:
            kind["seconds"] = round(kind["seconds"] + gap, 3)
        last = t
    out["span_s"] = round(new[-1][0] - new[0][0], 3) if new else 0.0
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("list")
    ap.add_argument("previous", nargs="?")
    ap.add_argument("--longest", type=float, default=8.0, help="a longer gap is other work, not a build")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    before = {name for _, name in read_list(a.previous)}
    report = build_times(read_list(a.list), before, a.longest)
    line = ", ".join(f"{k} {v['builds']} builds {v['seconds']:.1f} s (+{v['after_other_work']} after other work)"
                     for k, v in report.items() if isinstance(v, dict))
    print(f"new builds over {report['span_s']:.1f} s: {line}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
