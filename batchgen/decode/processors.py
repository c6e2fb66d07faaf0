"""Logits processors: penalties and a bias per token, before a token is picked.

Definitions (a job's `LogitsConfig`), in mlx-lm's order (`make_logits_processors`:
bias, then repetition, then the additive penalties):

- `logit_bias`: logits[t] += bias[t] (OpenAI's and mlx-lm's).
- `repetition_penalty` p (mlx-lm's `make_repetition_penalty`): each distinct
  token among the last `repetition_context_size` tokens of prompt and output
  has its logit l made l / p where l >= 0, l * p where l < 0.
- `presence_penalty` a and `frequency_penalty` f (OpenAI's definition): with
  c[t] the times token t was generated so far (this sample's output only, as
  OpenAI counts it; mlx-lm counts a 20-token window instead),
  logits[t] -= c[t] * f + (c[t] > 0) * a.

`processed` applies them to one job's logits from host token lists (one job at
a time); `LogitsState` holds the same state on the device for the rows of a
batch, updated with each step's tokens without reading them back.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..config import LogitsConfig


def repetition_window(context: Sequence[int], size: int) -> list[int]:
    """The last `size` tokens of `context` (prompt + output), padded on the left
    with its first token: a repeated index is penalized once, as a set.

    >>> repetition_window([5, 6, 7], 5), repetition_window([1, 2, 3, 4], 2)
    ([5, 5, 5, 6, 7], [3, 4])
    """
    tail = list(context[-size:])
    return [tail[0]] * (size - len(tail)) + tail


def apply_repetition(logits: mx.array, window: mx.array, penalty: mx.array) -> mx.array:
    """mlx-lm's repetition penalty over each row's `window` of token ids
    (rows, size); `penalty` (rows, 1), 1.0 for rows without one.

    >>> apply_repetition(mx.array([[2.0, -2.0, 1.0]]), mx.array([[0, 1, 1]]), mx.array([[2.0]])).tolist()
    [[1.0, -4.0, 1.0]]
    """
    chosen = mx.take_along_axis(logits, window, axis=-1)
    chosen = mx.where(chosen < 0, chosen * penalty, chosen / penalty)
    return mx.put_along_axis(logits, window, chosen, axis=-1)


def apply_counts(logits: mx.array, counts: mx.array, presence: mx.array, frequency: mx.array) -> mx.array:
    """OpenAI's penalties: counts (rows, vocab) of each token generated so far,
    presence and frequency (rows, 1).

    >>> apply_counts(mx.array([[1.0, 1.0, 1.0]]), mx.array([[0.0, 1.0, 3.0]]), mx.array([[0.5]]), mx.array([[0.25]])).tolist()
    [[1.0, 0.25, -0.25]]
    """
    return logits - counts * frequency - (counts > 0) * presence


def bias_row(bias: tuple, vocab: int) -> mx.array:
    """A dense (vocab,) additive bias from ((token id, bias), ...)."""
    row = mx.zeros((vocab,), mx.float32)
    if bias:
        ids, values = zip(*bias)
        row = row.at[mx.array(ids)].add(mx.array(values, mx.float32))
    return row


def check_bias(cfg: LogitsConfig, vocab: int) -> None:
    """ValueError naming the first logit_bias token id the model does not have."""
    bad = [t for t, _ in cfg.logit_bias if t >= vocab]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} is outside the model's vocabulary (0..{vocab - 1})")


def processed(logits: mx.array, cfg: LogitsConfig, context: Sequence[int], generated: Sequence[int],
              draft: Sequence[int] = ()) -> mx.array:  # fmt: skip
    """One job's logits after its processors; `context`: prompt and output so
    far (the repetition window), `generated`: the output alone. Row i of
    `logits` (len(draft) + 1 rows: a verify pass's positions) is processed as
    if draft[:i] had been generated too."""
    if not cfg.active:
        return logits
    rows, vocab = logits.shape[0], logits.shape[-1]
    draft = list(draft)[: rows - 1]
    out = logits.astype(mx.float32)
    if cfg.logit_bias:
        out = out + bias_row(cfg.logit_bias, vocab)
    if cfg.repetition_penalty != 1.0:
        size = cfg.repetition_context_size
        window = mx.array([repetition_window(list(context) + draft[:i], size) for i in range(rows)])
        out = apply_repetition(out, window, mx.full((rows, 1), cfg.repetition_penalty))
    if cfg.presence_penalty or cfg.frequency_penalty:
        seen = [list(generated) + draft[:i] for i in range(rows)]
        if any(seen):
            where = [(i, t) for i, ids in enumerate(seen) for t in ids]
            rows_ids, token_ids = zip(*where)
            counts = mx.zeros((rows, vocab), mx.float32).at[mx.array(rows_ids), mx.array(token_ids)].add(1.0)
            presence, frequency = mx.array([[cfg.presence_penalty]]), mx.array([[cfg.frequency_penalty]])
            out = apply_counts(out, counts, presence, frequency)
    return out


class LogitsState:
    """The processors of a batch's rows, on the device: token counts (rows,
    vocab) for the additive penalties, a window of recent tokens per row for the
    repetition penalty, a dense bias per row. Arrays exist only once some row
    needs them; a row without a setting gets neutral values (0, 1.0, 0).

    `push(tokens)` adds a step's tokens (lazy arrays: nothing is read back);
    `apply(logits)` is `processed` for every row at once."""

    def __init__(self, rows: int, vocab: int):
        self.rows, self.vocab = rows, vocab
        self.configs: list[LogitsConfig | None] = [None] * rows
        self.counts: mx.array | None = None
        self.window: mx.array | None = None  # (rows, size)
        self.bias: mx.array | None = None
        self._params: tuple | None = None  # (presence, frequency, repetition), (rows, 1) each

    @property
    def active(self) -> bool:
        return any(c is not None for c in self.configs)

    def set_row(self, i: int, cfg: LogitsConfig, prompt: Sequence[int], generated: Sequence[int] = ()) -> None:
        """Row i's job: its settings, and the tokens so far (prompt, output)."""
        self.clear_row(i)
        if not cfg.active:
            return
        self.configs[i] = cfg
        self._params = None
        if cfg.presence_penalty or cfg.frequency_penalty:
            if self.counts is None:
                self.counts = mx.zeros((self.rows, self.vocab), mx.float32)
            if generated:
                self.counts[i] = mx.zeros((self.vocab,), mx.float32).at[mx.array(list(generated))].add(1.0)
        if cfg.repetition_penalty != 1.0:
            size = cfg.repetition_context_size
            if self.window is None or self.window.shape[1] < size:
                self._widen(size)
            self.window[i] = mx.array(repetition_window(list(prompt) + list(generated), self.window.shape[1]))
        if cfg.logit_bias:
            if self.bias is None:
                self.bias = mx.zeros((self.rows, self.vocab), mx.float32)
            self.bias[i] = bias_row(cfg.logit_bias, self.vocab)

    def clear_row(self, i: int) -> None:
        if self.configs[i] is None:
            return
        self.configs[i] = None
        self._params = None
        if self.counts is not None:
            self.counts[i] = 0
        if self.bias is not None:
            self.bias[i] = 0

    def select(self, keep: list[int]) -> None:
        """Keep these rows only (the batch shrank)."""
        index = mx.array(keep)
        self.configs = [self.configs[i] for i in keep]
        self.rows = len(keep)
        self._params = None
        for name in ("counts", "window", "bias"):
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, a[index])

    def _widen(self, size: int) -> None:
        old = self.window
        if old is None:
            self.window = mx.zeros((self.rows, size), mx.int32)
        else:  # left-pad each row with its own first entry (a repeat: penalized once)
            self.window = mx.concatenate([mx.repeat(old[:, :1], size - old.shape[1], axis=1), old], axis=1)

    def params(self) -> tuple:
        if self._params is None:
            cfgs = self.configs
            col = lambda f, neutral: mx.array([[f(c) if c else neutral] for c in cfgs], mx.float32)  # noqa: E731
            self._params = (col(lambda c: c.presence_penalty, 0.0), col(lambda c: c.frequency_penalty, 0.0),
                            col(lambda c: c.repetition_penalty, 1.0))  # fmt: skip
        return self._params

    def apply(self, logits: mx.array) -> mx.array:
        if not self.active:
            return logits
        presence, frequency, repetition = self.params()
        out = logits.astype(mx.float32)
        if self.bias is not None:
            out = out + self.bias
        if self.window is not None:
            # a row whose own window is shorter than the batch's reads only its last entries
            out = apply_repetition(out, self._row_windows(), repetition)
        if self.counts is not None:
            out = apply_counts(out, self.counts, presence, frequency)
        return out

    def _row_windows(self) -> mx.array:
        size = self.window.shape[1]
        own = [c.repetition_context_size if c and c.repetition_penalty != 1.0 else size for c in self.configs]
        if all(s >= size for s in own):
            return self.window
        start = mx.array([[size - min(s, size)] for s in own])
        cols = mx.maximum(mx.arange(size)[None], start)  # entries before a row's window repeat its first
        return mx.take_along_axis(self.window, cols, axis=1)

    def push(self, tokens: mx.array, valid: list[bool]) -> None:
        """Add one step's tokens (rows,) for the rows marked `valid`."""
        if not self.active:
            return
        on = mx.array([v and c is not None for v, c in zip(valid, self.configs)])
        tokens = tokens.astype(mx.int32)
        if self.counts is not None:
            self.counts = self.counts.at[mx.arange(self.rows), tokens].add(on.astype(mx.float32))
        if self.window is not None:
            shifted = mx.concatenate([self.window[:, 1:], tokens[:, None]], axis=1)
            self.window = mx.where(on[:, None], shifted, self.window)
