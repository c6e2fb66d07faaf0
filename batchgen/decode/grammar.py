"""JSON-schema constrained decoding: a token mask per step from llguidance.

Why llguidance (bench/grammar_masks.py, bench/RESULTS.md "Structured output"):
of the three engines made for this, it was the only one whose masks let no
invalid instance of the tested schema features through (what it cannot
enforce, such as `uniqueItems`, it refuses at compile time: that job's error
line, before any generation); xgrammar let `allOf` and `uniqueItems` pass
unenforced and outlines-core also number bounds and `multipleOf`. It compiles a
schema in ~1 ms (outlines-core: 0.2-1.3 s a schema, which a file of per-job
schemas would pay per job), and it is one abi3 wheel with no dependencies,
which carries to a machine without a package index (xgrammar needs torch,
triton and transformers). Its masks cost more per row-token than xgrammar's
(87 against 35 us at a 100k vocabulary, 35 against 2 us at the demo's 4k, on
a 2-core CPU, 2026-12-03): the scheduler makes them while the GPU runs the
step they are for. `LLExecutor` would spread a batch's rows over the host's
cores, but copies of one kept matcher share its parser behind one lock, so
their masks are made one row at a time; a schema therefore keeps one matcher
per host core (up to `TEMPLATES`), built apart, and its jobs copy them in
turn (bench/RESULTS.md "One kept grammar matcher a host core"). What would
reopen the engine's choice: JSON steps measured well above free ones with the
masks as the cause (an H100's 7B shape: 0.94-0.97 of a free step's length).

Optional: `pip install 'batchgen[grammar]'`; without it a job that asks for a
schema gets one error line saying so, and everything else runs.
"""

from __future__ import annotations

import copy
import os

import mlx.core as mx
import numpy as np

from .text import JobRunError

INSTALL_HINT = "pip install 'batchgen[grammar]' (llguidance)"
# One line, Python's `json.dumps` spacing: with free whitespace a model can spend
# its max_tokens on blanks between tokens (the demo model does, greedily); a
# schema's own "x-guidance" options still override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Most matchers kept per schema: copies of one share its lock, so a batch's rows
# mask in parallel over at most this many (bench/grammar_threads.py: 256 rows on
# 16 cores, 4.97 ms a step from copies of one, 1.58 from copies of 16 built apart).
TEMPLATES = 16


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise JobRunError("grammar_unavailable", f"response_format needs a grammar engine: {INSTALL_HINT}") from None
    return llguidance


def invalid_schema(why) -> JobRunError:
    """The job's error for a schema the engine refuses, on one line (llguidance's
    messages may span several: a regex's caret under its pattern)."""
    return JobRunError("invalid_schema", "the JSON schema cannot be used: " + " ".join(str(why).split()))


def _grammar(lib, schema: str):
    try:
        return lib.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as e:
        raise invalid_schema(e) from None


def check_schema(schema: str) -> None:
    """Raise the `JobRunError` a run would write for a job with `schema` (JSON
    text) if the grammar engine is missing or refuses the schema, checked
    without a tokenizer or model (`batchgen validate`). What only a vocabulary
    could show is left to the run (`Grammars.matcher`)."""
    lib = _llguidance()
    error = lib.LLMatcher.validate_grammar(_grammar(lib, schema))
    if error:
        raise invalid_schema(error)


class Grammars:
    """Compiles jobs' JSON schemas for one tokenizer and model vocabulary (the
    logits' width, which may exceed the tokenizer's: ids past it are never
    allowed). Built on first use, once an engine (the tokenizer costs ~1 s at
    a 150k vocabulary)."""

    def __init__(self, tokenizer, vocab: int):
        self.lib = llguidance = _llguidance()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise JobRunError("grammar_unavailable", "response_format needs a fast (tokenizers) tokenizer")
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        eos = sorted(tokenizer.eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.vocab = vocab
        self.words = (vocab + 31) // 32
        self.eos = eos
        self.templates = max(1, min(TEMPLATES, os.cpu_count() or 1))
        self._kept: dict[str, list] = {}  # schema text -> fresh matchers, copied per job
        self._asked: dict[str, int] = {}  # schema text -> matchers handed out

    def matcher(self, schema: str):
        """A fresh matcher for `schema` (JSON text); `JobRunError` if it does not compile.
        The first `templates` jobs with a schema each build a matcher to keep
        (a build is a host item of the JSON run's profile, bench/RESULTS.md
        "Dataset-generation features on the batch path"); later jobs copy
        them in turn, untouched (`deep_copy`), so that one batch's rows hold
        copies of different kept matchers, which mask in parallel."""
        kept = self._kept.setdefault(schema, [])
        n = self._asked.get(schema, 0)
        if len(kept) < self.templates:
            m = self.lib.LLMatcher(self.tokenizer, _grammar(self.lib, schema), log_level=0)
            if m.is_error():
                raise invalid_schema(m.get_error())
            kept.append(m)
        self._asked[schema] = n + 1
        return kept[n % len(kept)].deep_copy()

    def fill(self, matchers: list, out: np.ndarray) -> None:
        """Each (matcher, row) pair's mask into row `row` of `out` (rows, words)
        int32, through the executor (copies of one kept matcher one after
        another: they share its lock; copies of different ones in parallel). A matcher in an error state
        (never, with its own masks applied) allows only EOS, so the job ends."""
        good = [(m, i) for m, i in matchers if not m.is_error()]
        if good:
            self.executor.unsafe_compute_mask_ptr(good, out.ctypes.data, self.words * 4, out.shape[0])
        for m, i in matchers:
            if m.is_error():
                out[i] = 0
                for t in self.eos:
                    out[i, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))

    def consume(self, pairs: list) -> None:
        """Each (matcher, token) pair's matcher takes its token, through the
        executor (as `fill`, copies of one kept matcher one after another); a
        finished matcher (the JSON closed) takes nothing more."""
        pairs = [(m, t) for m, t in pairs if not m.is_stopped()]
        if pairs:
            self.executor.consume_token_par(pairs)

    def masks(self, rows: int) -> np.ndarray:
        """A host buffer for `rows` masks, every token allowed."""
        return np.full((rows, self.words), -1, np.int32)


def apply_masks(logits: mx.array, masks: np.ndarray) -> mx.array:
    """Logits (rows, vocab) with each row's disallowed tokens at -inf; `masks`
    (rows, words) int32 bitmasks, bit t % 32 of word t // 32 for token t.

    >>> apply_masks(mx.zeros((2, 3)), np.array([[0b101], [-1]], np.int32)).tolist()
    [[0.0, -inf, 0.0], [0.0, 0.0, 0.0]]
    """
    vocab = logits.shape[-1]
    if masks.shape[1] * 32 < vocab:  # logits wider than the tokenizer's words: the rest never allowed
        masks = np.pad(masks, [(0, 0), (0, -(-vocab // 32) - masks.shape[1])])
    ids = mx.arange(vocab, dtype=mx.uint32)
    words = mx.take(mx.array(masks.view(np.uint32)), ids // 32, axis=1)  # (rows, vocab)
    allowed = ((words >> (ids % 32)) & 1).astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))
