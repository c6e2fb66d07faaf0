"""Writing result lines, and the resume index of an existing output file.

Each result is one `write` of a whole line, flushed and (by default) fsync'd
before the next job starts, so a crash loses at most the line being written.
Such a torn last line has no newline; `open_output` cuts it off before
appending, so nothing is ever duplicated or half-parsed.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from .jobs import CHAT, NATIVE
from .stats import Result, Sample


class OutputFileError(Exception):
    """The output file cannot be resumed or written (exit code 2)."""


def native_line(r: Result) -> dict:
    if r.error is not None:
        return {
            "id": r.id,
            "error": {"type": r.error.type, "message": r.error.message, "line": r.error.line},
            "metadata": r.metadata,
        }
    if r.samples is None:
        out = {"id": r.id, "text": r.text, "finish_reason": r.finish_reason}
        if r.logprobs is not None:
            out["logprobs"] = {"content": r.logprobs}
    else:  # n > 1: one entry per sample, in sample order
        out = {"id": r.id, "samples": [_native_sample(i, s) for i, s in enumerate(r.samples)]}
    return {**out, "usage": vars(r.usage).copy(), "stats": r.stats.as_dict(), "metadata": r.metadata, "error": None}


def _native_sample(index: int, s: Sample) -> dict:
    out = {"index": index, "text": s.text, "finish_reason": s.finish_reason, "completion_tokens": s.completion_tokens}
    if s.logprobs is not None:
        out["logprobs"] = {"content": s.logprobs}
    return out


def _samples(r: Result) -> list[Sample]:
    if r.samples is not None:
        return r.samples
    return [Sample(r.text, r.finish_reason, r.usage.completion_tokens, r.logprobs)]


def completion_logprobs(content: list) -> dict:
    """The legacy completions endpoint's logprobs from chat-shaped entries:
    parallel lists, each alternative a {token: logprob} map, and each token's
    character offset in the text.

    >>> completion_logprobs([{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]},
    ...                      {"token": "bc", "logprob": -1.0, "bytes": [98, 99], "top_logprobs": []}])
    {'tokens': ['a', 'bc'], 'token_logprobs': [-0.5, -1.0], 'top_logprobs': [{'a': -0.5}, {}], 'text_offset': [0, 1]}
    """
    offsets, at = [], 0
    for e in content:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in content],
        "token_logprobs": [e["logprob"] for e in content],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in content],
        "text_offset": offsets,
    }


def _openai_body(r: Result, created: int) -> dict:
    u = r.usage
    usage = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    common = {"created": created, "model": r.model_name or "batchgen", "usage": usage}
    choices = []
    for i, s in enumerate(_samples(r)):
        if r.format == CHAT:
            logprobs = None if s.logprobs is None else {"content": s.logprobs, "refusal": None}
            choices.append({"index": i, "message": {"role": "assistant", "content": s.text},
                            "finish_reason": s.finish_reason, "logprobs": logprobs})  # fmt: skip
        else:
            logprobs = None if s.logprobs is None else completion_logprobs(s.logprobs)
            choices.append({"index": i, "text": s.text, "finish_reason": s.finish_reason, "logprobs": logprobs})
    if r.format == CHAT:
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"}
    else:
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
    return {**head, **common, "choices": choices, "batchgen": {"stats": r.stats.as_dict()}}


def openai_line(r: Result) -> dict:
    """The OpenAI Batch output shape: one response (or error) per custom_id."""
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": r.id}
    if r.error is not None:
        error = {"code": r.error.type, "message": r.error.message, "line": r.error.line}
        return {**line, "response": None, "error": error}
    response = {
        "status_code": 200,
        "request_id": f"req_{uuid.uuid4().hex}",
        "body": _openai_body(r, int(time.time())),
    }
    return {**line, "response": response, "error": None}


def result_line(r: Result) -> bytes:
    obj = native_line(r) if r.format == NATIVE else openai_line(r)
    return orjson.dumps(obj) + b"\n"


def _line_key(obj) -> str | None:
    """The job key of a result line (`custom_id` for OpenAI lines, else `id`),
    or None when `obj` is not a result line. A job line is not a result: it
    has an id but neither `text` nor `error` (native), or no `response`
    (OpenAI), so a job file given as the output is refused, never resumed."""
    if not isinstance(obj, dict):
        return None
    if "custom_id" in obj:
        ok = "response" in obj and "error" in obj
        key = obj.get("custom_id")
    else:
        ok = "error" in obj and ("text" in obj or "samples" in obj or obj.get("error") is not None)
        key = obj.get("id")
    return key if ok and isinstance(key, str) else None


def _is_error_line(obj: dict) -> bool:
    return obj.get("error") is not None


# Every line batchgen writes starts so (orjson keeps the dicts' key order, and
# both shapes put "id" first): a torn tail is cut only when it is the start of
# one of ours, never when it is some other file's last line.
_LINE_START = b'{"id":'


@dataclass
class ResumeIndex:
    done: set = field(default_factory=set)  # keys with a complete line
    failed: set = field(default_factory=set)  # keys whose line is an error
    torn_bytes: int = 0  # bytes of a torn last line, cut off on open


def _not_ours(path: Path, n: int, why: str = "") -> OutputFileError:
    return OutputFileError(
        f"output file {path} line {n} is not a batchgen result line{why}; refusing to append to it"
    )


def read_resume_index(path: Path) -> ResumeIndex:
    """Keys already answered in `path`; raises if the file is not ours.

    A torn last line (no newline: a crash mid-write) that starts like one of
    our lines is noted for `open_output` to cut. Any other line that is not a
    result, and any id answered twice, is refused by line number: the file is
    then not a clean batchgen output, and appending to it would hide that.
    """
    index = ResumeIndex()
    if not path.exists():
        return index
    first_line: dict[str, int] = {}
    try:
        f = open(path, "rb")
    except OSError as e:
        raise OutputFileError(f"cannot read output file {path}: {e.strerror}") from None
    with f:
        for n, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                if raw.startswith(_LINE_START) or not raw.strip():
                    index.torn_bytes = len(raw)
                    break
                raise _not_ours(path, n, " (nor the start of one)")
            if not raw.strip():
                continue
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                obj = None
            key = _line_key(obj)
            if key is None:
                raise _not_ours(path, n)
            if key in first_line:
                raise OutputFileError(
                    f"output file {path} line {n} repeats id {key!r} (first on line {first_line[key]}); "
                    "refusing to append to it"
                )
            first_line[key] = n
            index.done.add(key)
            if _is_error_line(obj):
                index.failed.add(key)
    return index


def _cut_torn_tail(path: Path, torn_bytes: int) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - torn_bytes)
        f.flush()
        os.fsync(f.fileno())


def _drop_keys(path: Path, keys: set) -> None:
    """Rewrite `path` without the lines of `keys` (and without blank lines),
    atomically: a temp file renamed over it, removed if anything fails."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            for raw in src:
                if raw.strip() and _line_key(orjson.loads(raw)) not in keys:
                    dst.write(raw)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class OutputClosed(Exception):
    """The reader of stdout went away (a broken pipe)."""


class OutputWriteError(Exception):
    """A result line could not be written (full disk, I/O error); the file
    holds every line written before it, whole."""


class ResultWriter:
    """Appends result lines to a file (or stdout), one whole line at a time.

    A file is written unbuffered through its descriptor: a line that fails
    part-way (a full disk) is cut back off at once, so the file only ever
    holds whole lines, and nothing buffered can land later."""

    def __init__(self, stream, fsync: bool):
        self._stream = stream
        self._is_stdout = stream is sys.stdout.buffer
        self._fsync = fsync and not self._is_stdout
        self.written = 0

    def write(self, r: Result) -> None:
        line = result_line(r)
        if self._is_stdout:
            try:
                self._stream.write(line)
                self._stream.flush()
            except BrokenPipeError:
                raise OutputClosed() from None
        else:
            self._append(line)
        self.written += 1

    def _append(self, line: bytes) -> None:
        fd = self._stream.fileno()
        start = os.fstat(fd).st_size  # the run holds the output's lock: nobody else appends
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
            if self._fsync:
                os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass  # a resume cuts the torn tail instead
            raise OutputWriteError(f"cannot write output file {self._stream.name}: {e.strerror}") from None

    def close(self) -> None:
        if not self._is_stdout:
            self._stream.close()


def open_output(path: str, index: ResumeIndex, fsync: bool, retry_failed: bool) -> ResultWriter:
    """Open the output for appending, first repairing a torn tail (and dropping
    failed lines when they are to be retried)."""
    if path == "-":
        return ResultWriter(sys.stdout.buffer, fsync=False)
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if index.torn_bytes:
            _cut_torn_tail(p, index.torn_bytes)
        if retry_failed and index.failed:
            _drop_keys(p, index.failed)
        stream = open(p, "ab", buffering=0)
    except OSError as e:
        raise OutputFileError(f"cannot write output file {p}: {e.strerror}") from None
    return ResultWriter(stream, fsync)


class OutputLock:
    """An advisory lock (`flock`) on a hidden file beside the output,
    `.<name>.lock`, held for the whole run: a second run on the same output is
    refused at once, and a crashed run's lock goes with its process.

    The lock file is left in place: removing it would let a run that opened
    the old file and one that creates a new one both hold "the" lock."""

    def __init__(self, path: Path):
        self.output = path
        self.path = path.with_name(f".{path.name}.lock")
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        import fcntl

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputFileError(f"cannot lock output file {self.output}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise OutputFileError(
                f"output file {self.output} is in use by another batchgen run "
                f"(lock {self.path}); wait for it to end"
            ) from None
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
