"""A pool of prompt caches matched by longest common token prefix (LCP).

Each slot is `(token ids, per-layer cache after exactly those tokens)`. A job
takes the slot sharing the longest token prefix with its prompt, gets a clone
trimmed to that prefix, and prefills only the rest. Slots are never changed by
a job: a clone holds new array objects, and mlx copies a shared buffer on the
first write instead of writing through it.

Caches with recurrent layers (qwen3_5's linear attention) cannot be trimmed:
their slots serve only prompts that extend the slot's whole token list.

Prewarm: before the first job, the shared system prompt's token prefix is
prefilled into a pinned slot. Which tokens? The longest common token prefix of
the chat template rendered with several different user messages: the role
header and system text, never the closing tag or any request text, whatever
the template. The pool still only ever reuses the LCP of the real token ids.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

log = logging.getLogger("batchgen")

# Different user messages whose renderings share exactly the prefix we want.
_PROBE_MESSAGES = ("A", "zebra?", "1\n2", "Hello there")
DEFAULT_MAX_SLOTS = 64


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists.

    >>> common_prefix_len([1, 2, 3, 4], [1, 2, 9])
    2
    """
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.asarray(a[:n]) != np.asarray(b[:n])
    first = int(np.argmax(diff))
    return first if diff[first] else n


def prewarm_prefix(render: Callable[[str], list[int]]) -> list[int]:
    """Tokens every request with this system prompt starts with.

    `render(user_text)` gives the prompt tokens of [system, user]; the common
    prefix over several different user texts is template-agnostic.
    """
    prefix = render(_PROBE_MESSAGES[0])
    for text in _PROBE_MESSAGES[1:]:
        prefix = prefix[: common_prefix_len(prefix, render(text))]
    return prefix


def _fresh(value):
    """A copy of cache state whose arrays are new objects (no data copied)."""
    if isinstance(value, mx.array):
        return value[...]
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    if hasattr(value, "update_and_fetch") or hasattr(value, "state"):
        return clone_layer(value)
    return value


def clone_layer(c):
    new = copy.copy(c)
    for name, value in vars(c).items():
        setattr(new, name, _fresh(value))
    return new


def clone_cache(cache: list) -> list:
    """An independent copy of a per-layer cache list, sharing buffers until written."""
    return [clone_layer(c) for c in cache]


def cache_nbytes(cache: list) -> int:
    return sum(c.nbytes for c in cache)


def is_trimmable(cache: list) -> bool:
    return all(c.is_trimmable() for c in cache)


def trim_cache(cache: list, n: int) -> None:
    for c in cache:
        c.trim(n)


@dataclass
class Slot:
    tokens: list[int]
    cache: list
    kind: str  # the KV cache kind the slot was built with ("fp16", "turboquant-4", ...)
    nbytes: int
    pinned: bool = False
    last_used: int = 0


@dataclass
class Hit:
    cache: list | None  # a clone, trimmed to `cached_tokens`; None on a miss
    cached_tokens: int


class PromptPool:
    """LRU pool of prompt caches under a byte budget.

    `fetch` never returns all of a prompt: at least one token is left to run,
    since the model's logits for the last prompt token start decoding.
    """

    def __init__(self, max_bytes: int, max_slots: int = DEFAULT_MAX_SLOTS):
        self.max_bytes = max_bytes
        self.max_slots = max_slots
        self.slots: list[Slot] = []
        self._clock = 0
        self.untrimmable_logged = False

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def _usable_len(self, slot: Slot, tokens: Sequence[int]) -> int:
        lcp = min(common_prefix_len(slot.tokens, tokens), len(tokens) - 1)
        if is_trimmable(slot.cache):
            return lcp
        # A recurrent state holds all of the slot's tokens or nothing.
        return lcp if lcp == len(slot.tokens) else 0

    def fetch(self, tokens: Sequence[int], kind: str) -> Hit:
        best, best_len = None, 0
        for slot in self.slots:
            if slot.kind == kind:
                n = self._usable_len(slot, tokens)
                if n > best_len:
                    best, best_len = slot, n
        if best is None:
            return Hit(None, 0)
        self._clock += 1
        best.last_used = self._clock
        cache = clone_cache(best.cache)
        if best_len < len(best.tokens):
            trim_cache(cache, len(best.tokens) - best_len)
        return Hit(cache, best_len)

    def insert(self, tokens: Sequence[int], cache: list, kind: str, pinned: bool = False) -> None:
        """Keep `cache` (covering exactly `tokens`) as a slot; the pool owns it now."""
        if len(tokens) == 0:
            return
        if not is_trimmable(cache) and not self.untrimmable_logged:
            log.info(
                "prompt cache: this model's cache has recurrent layers and cannot be "
                "trimmed; only exact-prefix snapshots are reused"
            )
            self.untrimmable_logged = True
        tokens = list(tokens)
        self.slots = [s for s in self.slots if not (s.kind == kind and s.tokens == tokens and not s.pinned)]
        self._clock += 1
        nbytes = cache_nbytes(cache)
        if nbytes > self.max_bytes and not pinned:
            return
        self.slots.append(Slot(tokens, cache, kind, nbytes, pinned, self._clock))
        self._evict()

    def forget(self) -> None:
        """Drop every slot but the pinned ones (the prewarmed prefix)."""
        self.slots = [s for s in self.slots if s.pinned]

    def _evict(self) -> None:
        while self.slots and (self.nbytes > self.max_bytes or len(self.slots) > self.max_slots):
            unpinned = [s for s in self.slots if not s.pinned]
            if not unpinned:
                return
            victim = min(unpinned, key=lambda s: s.last_used)
            self.slots.remove(victim)


def default_pool_bytes() -> int:
    """A tenth of the device's memory: unified memory on a Mac, GPU memory with CUDA
    (`total_memory`), RAM on a Linux CPU."""
    info = mx.device_info()
    total = info.get("memory_size") or info.get("total_memory")
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            total = 16 << 30
    return int(total) // 10


# ---------------------------------------------------------------------------
# Persisting the prewarmed slot, so a nightly run skips even the prewarm.


def prewarm_key(model_digest: str, kind: str, tokens: Sequence[int]) -> str:
    """Hash of what the cached KV depends on: model, tokenizer, template, cache
    kind and the exact prefix tokens."""
    h = hashlib.sha256()
    h.update(model_digest.encode())
    h.update(kind.encode())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.hexdigest()[:32]


def tensors_digest(arrays: dict) -> str:
    """SHA-256 over a file's tensors: names, dtypes, shapes and raw bytes, in
    name order. The key says what a cache was made for; this says the tensors
    are still the ones that were saved (a bit flip or an edit changes it)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}:{a.dtype}:{tuple(a.shape)};".encode())
        h.update(np.asarray(a.reshape(-1).view(mx.uint8)).tobytes() if a.size else b"")
    return h.hexdigest()


def save_prewarm(path: Path, cache: list, tokens: Sequence[int], key: str) -> None:
    """mlx-lm's prompt-cache file format, with our key, tokens and the
    tensors' checksum as metadata (the checksum is taken over the tensors as
    written, read back, so it covers exactly what `load_prewarm` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temp file of this process's own: the ranks of a run on one machine may
    # save the same cache at once, and each rename then puts a whole file there.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.safetensors")
    metadata = {"batchgen_key": key, "tokens": json.dumps(list(tokens))}
    mlx_cache.save_prompt_cache(str(tmp), cache, metadata)
    arrays, meta = mx.load(str(tmp), return_metadata=True)
    mx.eval(list(arrays.values()))  # read in full before the file is written over
    meta["0.batchgen_sha256"] = tensors_digest(arrays)
    mx.save_safetensors(str(tmp), arrays, meta)
    os.replace(tmp, path)


def load_prewarm(path: Path, key: str, tokens: Sequence[int], classes: dict) -> list | None:
    """The saved cache if it is for exactly this key and these tokens, else None
    (with a warning); a stale or corrupt file is never trusted."""
    if not path.exists():
        return None
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
        if meta.get("0.batchgen_sha256") != tensors_digest(arrays):
            log.warning(f"prompt cache file {path} fails its checksum (altered or damaged); rebuilding it")
            return None
        cache = _rebuild(arrays, meta, classes)
        ok = meta.get("0.batchgen_key") == key and json.loads(meta.get("0.tokens", "[]")) == list(tokens)
    except Exception as e:  # any damage to the file means: prefill again
        log.warning(f"prompt cache file {path} is unreadable ({type(e).__name__}: {e}); ignoring it")
        return None
    if not ok:
        log.warning(f"prompt cache file {path} was made for another model or prompt; ignoring it")
        return None
    return cache


def _rebuild(arrays: dict, meta: dict, classes: dict) -> list:
    """`mlx_lm.models.cache.load_prompt_cache`, with our cache classes known too."""
    from mlx.utils import tree_unflatten

    tree = tree_unflatten(list(meta.items()))
    _, names, scalars = tree
    for pos, kind in scalars[1:]:
        a = arrays[pos]
        arrays[pos] = {"scalar": lambda: a.item(), "none": lambda: None,
                       "string": lambda: "".join(chr(i) for i in a.tolist())}[kind]()  # fmt: skip
    states = tree_unflatten(list(arrays.items()))
    known = {**vars(mlx_cache), **classes}
    return [known[name].from_state(state) for name, state in zip(names, states)]
