"""A sample's logprob entries as a result holds them: OpenAI's
`choices[].logprobs.content[]` (contracts: no MLX; `decode.logprobs` fills them).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import orjson


class TokenPieces:
    """A token id's text and bytes (`__call__`, subclasses), and the pieces of JSON
    around a logprob that an entry of that token is made of (cached):
    `{"token":"…","logprob":` and `,"bytes":[…]`.

    >>> class Letters(TokenPieces):
    ...     def __call__(self, t):
    ...         return chr(97 + t), [97 + t]
    >>> Letters().pieces(1)
    (b'{"token":"b","logprob":', b',"bytes":[98]')
    """

    def __init__(self):
        self.piece_cache: dict[int, tuple[bytes, bytes]] = {}

    def pieces(self, token: int) -> tuple[bytes, bytes]:
        hit = self.piece_cache.get(token)
        if hit is None:
            text, raw = self(token)
            hit = (b'{"token":' + orjson.dumps(text) + b',"logprob":', b',"bytes":' + orjson.dumps(raw))
            self.piece_cache[token] = hit
        return hit


class Content(Sequence):
    """`logprobs.content`: one entry a token, `{"token", "logprob", "bytes",
    "top_logprobs": [{"token", "logprob", "bytes"}, ...]}` (k alternatives, most
    likely first). A result line writes it with `json` (`output.result_line`), from
    each token's cached pieces and the numbers formatted in one call, without making
    the entries' dicts; indexing or iterating makes them (the completions endpoint's
    shape reads them). Why: at 5 alternatives an entry is six dicts, and making them
    for 256 rows was most of a logprobs step's host work in a batch (bench/RESULTS.md,
    "Dataset-generation features on the batch path"); what would change it: an output
    that needs the dicts anyway for every line.

    >>> class Letters(TokenPieces):
    ...     def __call__(self, t):
    ...         return chr(97 + t), [97 + t]
    >>> c = Content(Letters(), 1, [0], [-0.5], [[0, 1]], [[-0.5, -1.0]])
    >>> c.json()
    b'[{"token":"a","logprob":-0.5,"bytes":[97],"top_logprobs":[{"token":"a","logprob":-0.5,"bytes":[97]}]}]'
    >>> orjson.loads(c.json()) == list(c)
    True
    """

    def __init__(self, text: TokenPieces, k: int, ids: list, lps: list, top_ids: list, top_lps: list):
        self.text, self.k = text, k
        self.ids, self.lps, self.top_ids, self.top_lps = ids, lps, top_ids, top_lps
        self._entries: list | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        if self._entries is None:
            self._entries = orjson.loads(self.json())
        return self._entries[i]

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))

    def json(self) -> bytes:
        k, pieces = self.k, self.text.pieces
        if not self.ids:
            return b"[]"
        lps = orjson.dumps(self.lps)[1:-1].split(b",")
        nums = iter(orjson.dumps(list(chain.from_iterable(v[:k] for v in self.top_lps)))[1:-1].split(b",") if k else ())
        entries = []
        for t, lp, alternatives in zip(self.ids, lps, self.top_ids):
            head, tail = pieces(t)
            top = []
            for a in alternatives[:k]:
                h, b = pieces(a)
                top.append(h + next(nums) + b + b"}")
            entries.append(head + lp + tail + b',"top_logprobs":[' + b",".join(top) + b"]}")
        return b"[" + b",".join(entries) + b"]"
