"""Prompts that enter a batch together: one pass for many.

The batch scheduler admits jobs at one step in rounds; `start_prompts` gives each
entering prompt its cache and first-token logits, as `Engine.start_prompt` would
one by one, with fewer and larger passes:

- prompts with the same cached prefix (the pool's hit) are rows of one pass over
  their tails (`prefill_rows`), right-padded to a common length;
- what prompts share beyond that prefix (a few-shot block) is prefilled once and
  pooled before their tails run;
- duplicate prompts are prefilled once; a prompt whose pool hit leaves only its
  last token gets no pass at all (the batch's next step feeds it).

Passes are bounded (GROUP_TOKENS tokens, GROUP_SCORE_BYTES of attention scores),
split by tail length where a pass costs less than the padding it saves
(`_row_groups`), and, where prompt passes are padded (a GPU), come in few shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from ..cache.fp16 import empty_like
from ..config import JobPlan
from ..decode.passes import generation_stream, logits_at, padded_length, pads_exactly
from ..cache.pool import clone_cache, common_prefix_len, trim_cache
from ..cache.turboquant import TurboQuantKVCache

if TYPE_CHECKING:  # the engine hands itself in; imports run down, from it to here
    from .core import Engine

# Rows x padded length of one shared prompt pass (activations grow with it).
GROUP_TOKENS = 16384
GROUP_SCORE_BYTES = 1 << 30
# A pass's own cost beyond its tokens (`pass_cost_tokens`): its layers queued and
# evaluated one by one, its rows' caches cut out and copied; a token costs ~2 x
# parameters FLOPs at PROMPT_FLOPS. Both fit on an H200
# (bench/RESULTS.md#entering-prompt-passes); a device whose passes cost otherwise
# would split the entering rows differently.
PASS_OVERHEAD_S = 0.035
PROMPT_FLOPS = 4.7e14
# Tokens that prompts entering together share beyond their cached prefix, from
# which that part gets a pass of its own first (below it, the rows repeat it).
SHARED_MIN = 32
# Where passes are padded (a GPU: a small pass costs about the same whatever its
# size), a pool hit up to this many tokens longer than another entering
# prompt's hit on the same tokens is cut back to it, so that the two share one
# pass instead of one each (a pass costs tens of milliseconds:
# bench/RESULTS.md#entering-prompt-passes).
MERGE_SLACK = 64


def pass_shape(rows: int, length: int, pad_step: int | None) -> tuple[int, int]:
    """(rows, length) of a shared pass over `rows` tails of at most `length`
    tokens: padded (`padded_rows`, `padded_length` up to `pad_step`) where
    prompt passes are padded, as they are (pad_step None: not padded)."""
    if pad_step is None:
        return rows, length
    return padded_rows(rows), padded_length(length, pad_step)


def pass_cost_tokens(model: nn.Module) -> int:
    """A prompt pass's own cost in tokens of its compute: ~1,100 for the 7B
    shape (rows of very different tails then take passes of their own),
    ~17,000 for the 0.5B (passes as large as their bound allows). Parameters
    counted as mlx-lm counts them: a quantized weight's as it was before
    quantizing (its compute is a dense one's: dequantized from 64 rows on)."""
    from mlx_lm.utils import get_total_parameters

    params = get_total_parameters(model)
    return int(PASS_OVERHEAD_S * PROMPT_FLOPS / max(2 * params, 1))


def _row_groups(members: list[int], tails: dict, pad_step: int | None, cached: int = 0, heads: int = 0,
                pass_cost: int = 256) -> list[list[int]]:  # fmt: skip
    """Split prompts (sorted by tail length) into shared passes, runs of
    neighbours, at the least cost: a pass costs its rows x longest tail (both
    padded where passes are) in tokens of compute, pads included, plus
    `pass_cost` (`pass_cost_tokens`). A pass holds at most GROUP_TOKENS, and
    its attention scores (rows x heads x tail x keys, float32: the short-pass
    attention holds them) stay within GROUP_SCORE_BYTES. (256 jobs of
    `jobs/edits.jsonl` entering 32 at a time, tails of 59 to 500 tokens after
    the system prompt: passes up to the bound alone computed 131k tokens for
    50k real ones in 8 passes, by cost at the 7B shape's pass cost 87k in 19.)

    >>> _row_groups([0, 1, 2], {0: 3000, 1: 5000, 2: 9000}, pad_step=None)
    [[0], [1], [2]]
    >>> _row_groups([0, 1, 2, 3], {0: 100, 1: 100, 2: 120, 3: 200}, pad_step=2048)
    [[0, 1, 2, 3]]
    >>> _row_groups([0, 1, 2, 3, 4, 5, 6, 7], {i: 40 * 2**(i // 2) for i in range(8)}, pad_step=2048)
    [[0, 1, 2, 3], [4, 5], [6, 7]]
    >>> _row_groups([0, 1, 2, 3], {0: 100, 1: 100, 2: 120, 3: 200}, pad_step=2048, cached=30000, heads=32)
    [[0], [1, 2], [3]]
    >>> _row_groups([0, 1, 2, 3, 4, 5, 6, 7], {i: 40 * 2**(i // 2) for i in range(8)}, pad_step=2048, pass_cost=4000)
    [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    def cost(first: int, stop: int) -> float:  # members[first:stop] as one pass
        rows, length = pass_shape(stop - first, tails[members[stop - 1]], pad_step)
        score_bytes = rows * heads * length * (cached + length) * 4
        if stop - first > 1 and (rows * length > GROUP_TOKENS or score_bytes > GROUP_SCORE_BYTES):
            return float("inf")
        return pass_cost + rows * length

    # best[k]: the least cost of members[:k]; cut[k]: where its last pass starts
    best, cut = [0.0] + [float("inf")] * len(members), [0] * (len(members) + 1)
    for stop in range(1, len(members) + 1):
        for first in range(stop - 1, -1, -1):
            c = cost(first, stop)
            if c == float("inf"):
                break  # a longer run only grows
            if best[first] + c <= best[stop]:  # (a tie: the longer last pass)
                best[stop], cut[stop] = best[first] + c, first
    parts, stop = [], len(members)
    while stop:
        parts.insert(0, members[cut[stop] : stop])
        stop = cut[stop]
    return parts


def attention_heads(model: nn.Module) -> int:
    """Query heads per layer (for sizing attention temporaries); 32 if unknown."""
    args = getattr(getattr(model, "language_model", model), "args", None)
    return getattr(args, "num_attention_heads", None) or 32


def padded_rows(n: int) -> int:
    """Rows of a shared prompt pass: powers of two up to 8, then multiples of 8.

    >>> [padded_rows(n) for n in (1, 3, 8, 9, 17, 32)]
    [1, 4, 8, 16, 24, 32]
    """
    if n > 8:
        return -(-n // 8) * 8
    return 1 << (n - 1).bit_length() if n > 1 else 1


# Shared passes of at least this many tokens (rows x length) are evaluated layer by
# layer on a GPU: there a pass's temporaries are released only when the GPU has
# finished with them, and a whole pass queued at once held many layers' worth
# (bench/RESULTS.md#entering-prompt-passes).
LAYERWISE_TOKENS = 1024


class _Evaluated:
    """A layer whose output is evaluated before the next layer is queued; its
    attributes are the layer's (models read them: llama's `use_sliding`)."""

    def __init__(self, layer):
        self.layer = layer

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        mx.eval(out)
        return out


@contextmanager
def layer_by_layer(model: nn.Module, on: bool):
    """Within this block, `model`'s decoder layers (`.model.layers`, where it
    has them: the list itself, which a model's `layers` property may copy)
    evaluate their output one at a time (`on`)."""
    layers = getattr(getattr(getattr(model, "language_model", model), "model", None), "layers", None)
    if not on or not isinstance(layers, list):
        yield
        return
    saved = list(layers)
    layers[:] = [_Evaluated(layer) for layer in saved]
    try:
        yield
    finally:
        layers[:] = saved


def prefill_rows(model: nn.Module, cache: list, tails: list[list[int]], length: int, rows: int) -> mx.array:
    """One pass over several prompts' tails into `cache` (`group_cache`: `rows`
    rows holding the same prefix, one row per tail, spare rows after).
    Each tail is right-padded to `length` with its last token: causal attention
    keeps the real tokens' entries and logits exactly as in a pass of their own,
    and the pads are cut when a row is taken out (`cache_row`). Returns each
    row's next-token logits (rows, vocab)."""
    inputs = [t + [t[-1]] * (length - len(t)) for t in tails]
    inputs += [inputs[0]] * (rows - len(tails))
    big = rows * length >= LAYERWISE_TOKENS and mx.default_device().type == mx.gpu
    with mx.stream(generation_stream), layer_by_layer(model, big):
        logits = logits_at(model, mx.array(inputs), cache, [len(t) - 1 for t in tails] + [0] * (rows - len(tails)))
        mx.eval(logits, [c.state for c in cache])
    return logits


def group_cache(cache: list, cached: int, rows: int, length: int) -> list:
    """A one-row cache holding `cached` tokens, repeated in `rows` rows for one
    pass over tails of up to `length` tokens after them (`prefill_rows`)."""
    out = []
    for c in cache:
        if isinstance(c, TurboQuantKVCache):
            out.append(c.repeated(rows, reserve=length))
            continue
        g = empty_like(c)
        if cached:
            g.keys = mx.repeat(c.keys[..., :cached, :], rows, axis=0)
            g.values = mx.repeat(c.values[..., :cached, :], rows, axis=0)
            g.offset = cached
        out.append(g)
    return out


def cache_row(cache: list, row: int, length: int, padded: int) -> list:
    """Row `row` of a `group_cache` after its pass over tails of up to `padded`
    tokens, its first `length` positions, as a cache of its own (copied: it must
    not keep the whole batch's buffer alive once evaluated)."""
    out = []
    for c in cache:
        if isinstance(c, TurboQuantKVCache):
            out.append(c.row(row, length, reserve=padded))
            continue
        one = empty_like(c)
        one.keys = mx.contiguous(c.keys[row : row + 1, :, :length, :])
        one.values = mx.contiguous(c.values[row : row + 1, :, :length, :])
        one.offset = length
        out.append(one)
    return out


def start_prompts(engine: Engine, prompts: list[list[int]], plan: JobPlan, feed_last: bool = False) -> list[tuple]:
    """`Engine.start_prompt` for prompts that enter together (plain KV caches or
    TurboQuant's):

    - those with the same cached prefix share one pass over their tails, as
      rows of a batch (`prefill_rows`), instead of a pass each;
    - where they share more than that prefix (a few-shot block after the
      prewarmed system prompt), the shared part is prefilled once, pooled,
      and their tails start after it;
    - a prompt entering twice is prefilled once: the copy takes its cache and
      logits, all of its tokens counted as cached;
    - `feed_last`: a prompt whose pool hit leaves only its last token comes
      back without a pass, logits None, its cache one token short: the
      caller's next decode step feeds that token (a pass of its own here
      would cost a whole forward pass for one token).

    Same caches and logits as one by one (float32: exactly)."""
    first: dict = {}
    for i, tokens in enumerate(prompts):
        first.setdefault(tuple(tokens), i)
    unique = sorted(first.values())
    fetched = {i: engine.cache_for(prompts[i], plan) for i in unique}
    out: list = [None] * len(prompts)
    for i in unique:
        cache, cached = fetched[i]
        if feed_last and 0 < cached == len(prompts[i]) - 1:
            out[i] = (cache, cached, None)
    unique = [i for i in unique if out[i] is None]
    pad_step = _pad_step(engine)
    if pad_step is not None:
        _merge_hits(unique, prompts, fetched, pad_step)
    for members in _prefix_groups(engine, unique, prompts, fetched).values():
        if len(members) > 1:
            _share_prefix(engine, members, prompts, fetched, plan)
    for key, members in _prefix_groups(engine, unique, prompts, fetched).items():
        tails = {i: len(prompts[i]) - fetched[i][1] for i in members}
        cached = fetched[members[0]][1]
        order = sorted(members, key=tails.get)
        for part in _row_groups(order, tails, pad_step, cached, attention_heads(engine.model), _pass_cost(engine)):
            if len(part) == 1 and (key[0] == "single" or not _padded_row(fetched[part[0]][0], pad_step)):
                i = part[0]
                cache, cached = fetched[i]
                out[i] = (cache, cached, engine.prefill_tokens(cache, prompts[i][cached:], logits=True))
            else:
                _start_rows(engine, [prompts[i] for i in part], fetched[part[0]], part, out)
    for i in unique:
        engine.remember(prompts[i], out[i][0], out[i][1], plan)
    _copy_duplicates(prompts, first, out)
    return out


def _padded_row(cache: list, pad_step: int | None) -> bool:
    """Whether a prompt's pass of its own goes the rows' way, as one padded
    row: a TurboQuant prompt where passes are padded. `Engine.prefill_tokens` pads
    only caches whose trim drops the pads alone; `TurboQuantKVCache.repeated`
    keeps what makes a padded row exact, so its passes come in the few shapes
    the shared passes do instead of one per prompt length, each built once
    (bench/RESULTS.md#turboquant-rows)."""
    return pad_step is not None and all(isinstance(c, TurboQuantKVCache) for c in cache)


def _pass_cost(engine: Engine) -> int:
    cost = getattr(engine, "pass_cost_tokens", None)
    if cost is None:  # once an engine (the weights do not change)
        cost = engine.pass_cost_tokens = pass_cost_tokens(engine.model)
    return cost


def _copy_duplicates(prompts: list[list[int]], first: dict, out: list) -> None:
    """A repeated prompt takes its first occurrence's cache (cloned) and logits;
    all its tokens count as cached, or (fed by the next step) as its original's."""
    for i, tokens in enumerate(prompts):
        j = first[tuple(tokens)]
        if j != i:
            fed = out[j][2] is None
            out[i] = (clone_cache(out[j][0]), out[j][1] if fed else len(tokens), out[j][2])


def _pad_step(engine: Engine) -> int | None:
    """Where prompt passes are padded (shapes that repeat, see `prefill`): up to the prefill step."""
    return engine.config.prefill_step_size if engine.pad_prompts else None


def _prefix_groups(engine: Engine, unique: list[int], prompts: list[list[int]], fetched: dict) -> dict:
    """Prompts by cached prefix (those that cannot share a pass: alone)."""
    groups: dict = {}
    for i in unique:
        cache, cached = fetched[i]
        single = not _can_share(prompts[i], cache, cached, engine.config.prefill_step_size)
        groups.setdefault(("single", i) if single else (cached, tuple(prompts[i][:cached])), []).append(i)
    return groups


def _can_share(prompt: list[int], cache: list, cached: int, step: int) -> bool:
    """Whether a prompt whose first `cached` tokens are in `cache` can be a row
    of a shared pass: plain caches (a trim drops the pads and nothing else) or
    TurboQuant's (`TurboQuantKVCache.repeated`), and a tail within the prefill
    `step`."""
    rows = pads_exactly(cache) or all(isinstance(c, TurboQuantKVCache) for c in cache)
    return rows and len(prompt) - cached <= step


def _merge_hits(unique: list[int], prompts: list[list[int]], fetched: dict, step: int) -> None:
    """Cut pool hits back to a shorter hit of another prompt on the same tokens,
    at most MERGE_SLACK tokens shorter (shortest hits first: they are the bases
    others join), so that those prompts fall into one prefix group. A hit is
    kept where the tail after the cut would exceed `step` (the prefill step):
    that prompt gets a pass of its own anyway (`_prefix_groups`)."""
    bases: list[int] = []
    for i in sorted(unique, key=lambda i: fetched[i][1]):
        cache, cached = fetched[i]
        for j in bases:
            base = fetched[j][1]
            joins = _can_share(prompts[i], cache, base, step) and pads_exactly(fetched[j][0])
            if joins and cached - base <= MERGE_SLACK and prompts[i][:base] == prompts[j][:base]:
                if cached > base:
                    trim_cache(cache, cached - base)
                    fetched[i] = (cache, base)
                break
        else:
            bases.append(i)


def _share_prefix(engine: Engine, members: list[int], prompts: list[list[int]], fetched: dict, plan: JobPlan) -> None:
    """Prompts of one cached prefix that agree on their next SHARED_MIN tokens
    or more: prefill what they share once (each keeps one token of its own)."""
    cached = fetched[members[0]][1]
    clusters: dict = {}
    for i in members:
        if len(prompts[i]) - 1 - cached >= SHARED_MIN:
            clusters.setdefault(tuple(prompts[i][cached : cached + SHARED_MIN]), []).append(i)
    for cluster in (c for c in clusters.values() if len(c) > 1):
        head = prompts[cluster[0]]
        shared = min(min(common_prefix_len(head, prompts[i]), len(prompts[i]) - 1) for i in cluster)
        cache = fetched[cluster[0]][0]
        engine.prefill_tokens(cache, head[cached:shared])
        engine.remember(head[:shared], cache, cached, plan)
        for i in cluster:
            fetched[i] = (clone_cache(cache), shared)


def _start_rows(engine: Engine, prompts: list[list[int]], prefix: tuple[list, int], index: list[int], out: list) -> None:
    cache, cached = prefix
    tails = [t[cached:] for t in prompts]
    rows, length = pass_shape(len(tails), max(len(t) for t in tails), _pad_step(engine))
    group = group_cache(cache, cached, rows, length)
    logits = prefill_rows(engine.model, group, tails, length, rows)
    taken = []
    for r, (i, tokens) in enumerate(zip(index, prompts)):
        taken.append(cache_row(group, r, len(tokens), length))
        out[i] = (taken[-1], cached, logits[r : r + 1])
    mx.eval([c.state for row in taken for c in row])  # one wait for every row's copy
