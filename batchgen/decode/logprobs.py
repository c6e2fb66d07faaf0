"""Per-token log-probabilities in OpenAI's shape.

A token's logprob is log_softmax of the model's raw logits at its position
(float32), before any penalty, bias, grammar mask, temperature or top-p/k/min-p
filter: what the model gives the token, whatever picked it. Under PLD a
verified draft token's logprob comes from the verify pass's row at that
position, the same distribution a plain step there computes.

`token_logprobs` stays on the device (lazy) and is read back with the tokens;
`Entries` keeps the numbers a sample's tokens read back, and its `Content` is
`choices[].logprobs.content[]`: `token`, `logprob`, `bytes`, `top_logprobs` (the k
most likely tokens there).
"""

from __future__ import annotations

import mlx.core as mx

from ..logprob_entries import Content, TokenPieces


def token_logprobs(logits: mx.array, tokens: mx.array, k: int) -> tuple:
    """(logprob of each row's token (rows,), top-k ids (rows, k), their logprobs
    (rows, k), most likely first), lazy; k = 0 gives no top-k arrays.

    >>> lp, ids, top = token_logprobs(mx.log(mx.array([[0.5, 0.25, 0.25]])), mx.array([1]), 1)
    >>> round(lp.item(), 4), ids.tolist(), round(top.item(), 4)
    (-1.3863, [[0]], -0.6931)
    """
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens.astype(mx.int32).reshape(-1, 1), axis=-1)[:, 0]
    if k <= 0:
        return chosen, None, None
    ids, vals = top_k(lp, k)
    return chosen, ids, vals


def top_k(x: mx.array, k: int, chunk: int = 512) -> tuple:
    """(ids, values) of each row's k largest entries of x (rows, n), largest
    first. Two stages: each `chunk`-wide slice's maximum, the k slices with the
    largest maxima, then the k best of their k * chunk entries. Exact in the
    values: a slice holding one of the k largest has a maximum at least that
    large, so at most k - 1 slices beat it. Among equal values the ids may
    differ from a full sort's. Why: one `argpartition` over each whole row of a
    150k vocabulary was most of a logprobs step's extra on the H200; the two
    stages shortened that step in whole runs (bench/RESULTS.md
    "Dataset-generation features on the batch path").

    >>> ids, vals = top_k(mx.array([[1.0, 9, 3, 7, 5, 8, 2]]), 3, chunk=2)
    >>> ids.tolist(), vals.tolist()
    ([[1, 5, 3]], [[9.0, 8.0, 7.0]])
    """
    rows, n = x.shape
    slices = -(-n // chunk)
    if slices <= k:  # too few slices to choose k of: one pass over the row
        ids = mx.argpartition(-x, kth=k - 1, axis=-1)[:, :k]
        vals = mx.take_along_axis(x, ids, axis=-1)
    else:
        if slices * chunk > n:  # the last slice padded with -inf, never picked while n >= k
            x = mx.pad(x, [(0, 0), (0, slices * chunk - n)], constant_values=-mx.inf)
        tiles = x.reshape(rows, slices, chunk)
        best = mx.argpartition(-tiles.max(axis=-1), kth=k - 1, axis=-1)[:, :k]  # (rows, k) slice numbers
        cand = mx.take_along_axis(tiles, best[:, :, None], axis=1).reshape(rows, k * chunk)
        at = mx.argpartition(-cand, kth=k - 1, axis=-1)[:, :k]
        ids = mx.take_along_axis(best, at // chunk, axis=-1) * chunk + at % chunk
        vals = mx.take_along_axis(cand, at, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


class TokenText(TokenPieces):
    """Each token id's bytes and text: byte-level BPE pieces mapped back through
    GPT-2's byte alphabet, SentencePiece's `<0xAB>` and `▁`, else the tokenizer's own
    decoding of the single token (`pieces` keeps them, as JSON)."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.undo = {c: b for b, c in bytes_to_unicode().items()}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        raw = self._bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _bytes(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token) if token not in self.special else None
        if piece is None:
            return self.tokenizer.decode([token]).encode("utf-8")
        if self.byte_level and all(c in self.undo for c in piece):
            return bytes(self.undo[c] for c in piece)
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token]).encode("utf-8")


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return "ByteLevel" in repr(decoder)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, as byte-level BPE vocabularies spell bytes.

    >>> m = bytes_to_unicode(); m[ord("a")], m[ord(" ")], len(set(m.values()))
    ('a', 'Ġ', 256)
    """
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Entries:
    """A sample's logprob numbers, kept token by token as they are read back: a
    token, its logprob and its alternatives' ids and logprobs, no more (a batch
    step hands every logprobs row one token; the entries' dicts wait for `Content`)."""

    def __init__(self, text: TokenPieces, k: int):
        self.text, self.k = text, k
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.top_ids: list = []
        self.top_lps: list = []

    def add(self, token: int, logprob: float, top_ids=None, top_lps=None) -> None:
        self.ids.append(token)
        self.lps.append(logprob)
        self.top_ids.append(top_ids or ())
        self.top_lps.append(top_lps or ())

    def add_rows(self, tokens: list[int], arrays: tuple, rows: int | None = None) -> None:
        """Entries for `tokens` from `token_logprobs` arrays (read back here), row i for token i."""
        chosen, ids, vals = arrays
        n = len(tokens) if rows is None else rows
        chosen = chosen.tolist()[:n]
        ids = ids.tolist()[:n] if ids is not None else [None] * n
        vals = vals.tolist()[:n] if vals is not None else [None] * n
        for t, c, i, v in zip(tokens, chosen, ids, vals):
            self.add(t, c, i, v)

    def result(self, eos: set) -> Content:
        """The entries, less a closing EOS (OpenAI's content ends with the text)."""
        n = len(self.ids) - (bool(self.ids) and self.ids[-1] in eos)
        return Content(self.text, self.k, self.ids[:n], self.lps[:n], self.top_ids[:n], self.top_lps[:n])
