"""`batchgen warm-up`: run a model's paths once so that MLX builds their kernels,
and keep the builds on disk for every later process.

On MLX's CUDA backend a process builds each kernel the first time a shape and
type needs it; `kernels.registry.keep_builds` keeps those builds per MLX
version and GPU kind (MLX writes its own kernels' builds, kernels/builds.py
batchgen's), so a machine's first process pays them and later ones load
them. A cron schedule's first run pays them at its own time; this
command pays them ahead of it: a few short jobs through each path a run
takes (one job at a time with prompt lookup, and batched rows; fp16 and
TurboQuant caches; prompts of a few lengths, so prompt passes of several
sizes build). On CUDA the fp16 batched path also runs once as wide as a
large batch (`attention.wide_rows`: from there the batch attention kernels
take a block per kv head or fewer warps a block, other builds). Off CUDA there is nothing to keep and
the command only runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from .config import EngineConfig, KVConfig, SamplingConfig
from .jobs import CHAT, Job

# Prompt lengths in tokens: a short prompt, a typical one and a long one (each
# at most half the model's context), so prompt passes of three sizes run; the
# repeated lines give prompt lookup drafts to verify.
_LENGTHS = (48, 320, 1280)
_LINE = "    total = total + values[index] * weights[index]\n"


def warm_up_jobs(line_tokens: int, context: int | None, max_tokens: int = 24, batched: int = 8) -> list[Job]:
    """Jobs of the three prompt lengths (`line_tokens`: the tokens of one
    repeated line), `batched` of them in all (at least three), each asking to
    repeat code so that prompt lookup has drafts.

    >>> [len(j.messages[0]["content"].splitlines()) for j in warm_up_jobs(12, 1024, batched=4)]
    [8, 30, 46, 8]
    """
    jobs = []
    for i in range(max(batched, len(_LENGTHS))):
        length = min(_LENGTHS[i % len(_LENGTHS)], (context or 1 << 30) // 2)
        code = "def f(values, weights):\n    total = 0\n" + _LINE * max(length // max(line_tokens, 1), 1)
        messages = ({"role": "user", "content": f"Repeat this function exactly:\n\n{code}"},)
        jobs.append(Job(f"warm-up-{i}", i + 1, CHAT, messages, None, max_tokens, SamplingConfig()))
    return jobs


class WarmupError(Exception):
    """The model did not load, or a warm-up job failed (the message says which)."""


@dataclass
class WarmupReport:
    model: str
    device: str
    builds_dir: str | None  # where MLX keeps kernel builds; None: nothing kept (not CUDA)
    load_s: float = 0.0
    paths: list = field(default_factory=list)  # (kv cache, rows, jobs, seconds)

    def line(self) -> str:
        """One line for the log: what ran, how long, where the builds are."""
        ran = ", ".join(f"{kv} {'one at a time' if rows == 1 else f'{rows} rows'} {jobs} jobs {s:.1f} s"
                        for kv, rows, jobs, s in self.paths)  # fmt: skip
        kept = f"kernel builds kept in {self.builds_dir}" if self.builds_dir else "no kernel builds to keep on this device"
        return f"warm-up: {self.model} on {self.device}: loaded in {self.load_s:.1f} s; {ran}; {kept}"


def warm_up(config: EngineConfig, kv_kinds: tuple[str, ...] = ("fp16",), batched: bool = True,
            max_tokens: int = 24) -> WarmupReport:  # fmt: skip
    """Load `config`'s model as a run does and run the warm-up jobs through
    each of `kv_kinds`, one at a time and (`batched`) as rows of a batch.
    Raises WarmupError where the model does not load or a job fails."""
    from .engine.imports import import_mlx_lm

    import_mlx_lm()  # before the engine imports it: without torch (engine/imports.py)
    from .engine.core import Engine, ModelLoadError, device_name
    from .kernels.registry import keep_builds

    builds = keep_builds()
    try:
        engine = Engine.load(config)
    except ModelLoadError as e:
        raise WarmupError(str(e)) from None
    report = WarmupReport(config.model, device_name(), str(builds) if builds else None, engine.load_s)
    line_tokens = len(engine.tokenizer.encode(_LINE, add_special_tokens=False))
    jobs = warm_up_jobs(line_tokens, engine.context_length, max_tokens)
    resolved = engine.config  # the draft and its ceiling as this device resolved them
    wide = 0
    if builds and batched:  # a large fp16 batch's kernels (grouped heads, fewer warps a block) build apart
        from .engine.entering import attention_heads
        from .kernels.attention import wide_rows

        wide = wide_rows(attention_heads(engine.model))
    for kind in kv_kinds:
        kv = KVConfig(kind=kind, bits=config.kv.bits)
        widths = (1, len(jobs)) + ((wide,) if kind == "fp16" and wide > len(jobs) else ())
        for rows in widths if batched else (1,):
            engine.config = replace(resolved, kv=kv, batch_size=rows)
            # the wide batch's extra rows are copies of the shortest job: the step's width is what builds
            subset = jobs[:3] if rows == 1 else jobs + [replace(jobs[0], id=f"warm-up-{i}") for i in range(len(jobs), rows)]
            start = time.perf_counter()
            for result in engine.run_all(subset, total=len(subset)):
                if not result.ok:
                    raise WarmupError(f"warm-up job {result.id} ({kind}, {rows} rows) failed: {result.error.message}")
            report.paths.append((kind, engine.batch_report.get("rows", rows), len(subset), time.perf_counter() - start))
    return report
