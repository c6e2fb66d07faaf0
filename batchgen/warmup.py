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
sizes build; and jobs that sample, ask for logprobs, carry penalties or a JSON
schema, whose token picks run kernels of their own: a run's first logprobs job
otherwise paid 10 s of builds, bench/RESULTS.md#fresh-processes-as-a-cron-user-runs-them).
On CUDA the fp16 batched path also runs once as wide as a
large batch (`attention.wide_rows`: from there the batch attention kernels
take a block per kv head or fewer warps a block, other builds). Off CUDA there is nothing to keep and
the command only runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from .config import EngineConfig, KVConfig, LogitsConfig, SamplingConfig
from .jobs import CHAT, Job

# Prompt lengths in tokens: a short prompt, a typical one and a long one (each
# at most half the model's context), so prompt passes of three sizes run; the
# repeated lines give prompt lookup drafts to verify.
_LENGTHS = (48, 320, 1280)
_LINE = "    total = total + values[index] * weights[index]\n"
# What the jobs after the first three ask for, in turn: each picks its tokens through
# kernels plain greedy rows never run (sampling's sort and draw, log-softmax and top-k,
# the penalties' counts, a grammar's masks). A schema only where the grammar engine is
# installed (`warm_up_jobs(schema=...)`).
SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
_FEATURES = (
    {"sampling": SamplingConfig(temperature=0.8, top_p=0.95, top_k=40, min_p=0.02, seed=0)},
    {"logprobs": True, "top_logprobs": 5},
    {"logits": LogitsConfig(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)},
    {"sampling": SamplingConfig(temperature=1.0, seed=1), "logprobs": True, "top_logprobs": 20},
    {"json_schema": SCHEMA},
)


def warm_up_jobs(line_tokens: int, context: int | None, max_tokens: int = 24, batched: int = 8,
                 schema: bool = False) -> list[Job]:  # fmt: skip
    """Greedy jobs of the three prompt lengths (`line_tokens`: the tokens of one
    repeated line), each asking to repeat code so that prompt lookup has
    drafts; then a short job for each of `_FEATURES` (the JSON schema's only
    with `schema`); then greedy jobs again, `batched` jobs in all at least.

    >>> jobs = warm_up_jobs(12, 1024, batched=10)
    >>> [len(j.messages[0]["content"].splitlines()) for j in jobs]
    [8, 30, 46, 8, 8, 8, 8, 8, 30, 46]
    >>> [(j.sampling.greedy, j.top_logprobs, j.logits.active) for j in jobs[2:8]]
    [(True, 0, False), (False, 0, False), (True, 5, False), (True, 0, True), (False, 20, False), (True, 0, False)]
    >>> [j.json_schema is not None for j in warm_up_jobs(12, 1024, batched=8, schema=True)]
    [False, False, False, False, False, False, False, True]
    """
    features = [f for f in _FEATURES if schema or "json_schema" not in f]
    lengths = list(_LENGTHS) + [min(_LENGTHS)] * len(features)
    lengths += [_LENGTHS[i % len(_LENGTHS)] for i in range(max(batched - len(lengths), 0))]
    jobs = []
    for i, length in enumerate(lengths):
        length = min(length, (context or 1 << 30) // 2)
        code = "def f(values, weights):\n    total = 0\n" + _LINE * max(length // max(line_tokens, 1), 1)
        messages = ({"role": "user", "content": f"Repeat this function exactly:\n\n{code}"},)
        extra = features[i - len(_LENGTHS)] if len(_LENGTHS) <= i < len(_LENGTHS) + len(features) else {}
        jobs.append(replace(Job(f"warm-up-{i}", i + 1, CHAT, messages, None, max_tokens, SamplingConfig()), **extra))
    return jobs


def one_at_a_time(jobs: list[Job]) -> list[Job]:
    """The jobs a cache's one-job path runs: the three prompt lengths, then the
    short job of each feature (what they build does not follow the prompt's length).

    >>> [j.id for j in one_at_a_time(warm_up_jobs(12, 1024, batched=10))]
    ['warm-up-0', 'warm-up-1', 'warm-up-2', 'warm-up-3', 'warm-up-4', 'warm-up-5', 'warm-up-6']
    """
    n = len(_LENGTHS)
    return jobs[:n] + [j for j in jobs[n:] if j.needs_logits]


def _grammar_engine() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


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
    jobs = warm_up_jobs(line_tokens, engine.context_length, max_tokens, schema=_grammar_engine())
    resolved = engine.config  # the draft and its ceiling as this device resolved them
    wide = 0
    if builds and batched:  # a large fp16 batch's kernels (grouped heads, fewer warps a block) build apart
        from .engine.entering import attention_heads
        from .kernels.attention import wide_rows

        wide = wide_rows(attention_heads(engine.model))
    alone = one_at_a_time(jobs)
    # the wide batch's extra rows are copies of the short jobs, each feature among them: the
    # step's width is what builds
    short = [jobs[0]] + [j for j in alone if j.needs_logits]
    for kind in kv_kinds:
        kv = KVConfig(kind=kind, bits=config.kv.bits)
        widths = (1, len(jobs)) + ((wide,) if kind == "fp16" and wide > len(jobs) else ())
        for rows in widths if batched else (1,):
            engine.config = replace(resolved, kv=kv, batch_size=rows)
            subset = alone if rows == 1 else jobs + [
                replace(short[i % len(short)], id=f"warm-up-{i}") for i in range(len(jobs), rows)]
            start = time.perf_counter()
            for result in engine.run_all(subset, total=len(subset)):
                if not result.ok:
                    raise WarmupError(f"warm-up job {result.id} ({kind}, {rows} rows) failed: {result.error.message}")
            report.paths.append((kind, engine.batch_report.get("rows", rows), len(subset), time.perf_counter() - start))
    return report
