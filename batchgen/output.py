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
from .stats import Result


class OutputFileError(Exception):
    """The output file cannot be resumed or written (exit code 2)."""


def native_line(r: Result) -> dict:
    if r.error is not None:
        return {
            "id": r.id,
            "error": {"type": r.error.type, "message": r.error.message, "line": r.error.line},
            "metadata": r.metadata,
        }
    return {
        "id": r.id,
        "text": r.text,
        "finish_reason": r.finish_reason,
        "usage": vars(r.usage).copy(),
        "stats": r.stats.as_dict(),
        "metadata": r.metadata,
        "error": None,
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
    if r.format == CHAT:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": r.text},
            "finish_reason": r.finish_reason,
            "logprobs": None,
        }
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"}
    else:
        choice = {"index": 0, "text": r.text, "finish_reason": r.finish_reason, "logprobs": None}
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
    return {**head, **common, "choices": [choice], "batchgen": {"stats": r.stats.as_dict()}}


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
    """The job key of a result line: `custom_id` for OpenAI lines, else `id`."""
    if not isinstance(obj, dict):
        return None
    key = obj.get("custom_id") if "custom_id" in obj else obj.get("id")
    return key if isinstance(key, str) else None


def _is_error_line(obj: dict) -> bool:
    return obj.get("error") is not None


@dataclass
class ResumeIndex:
    done: set = field(default_factory=set)  # keys with a complete line
    failed: set = field(default_factory=set)  # keys whose line is an error
    torn_bytes: int = 0  # bytes of a torn last line, cut off on open


def read_resume_index(path: Path) -> ResumeIndex:
    """Keys already answered in `path`; raises if the file is not ours."""
    index = ResumeIndex()
    if not path.exists():
        return index
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            complete = raw.endswith(b"\n")
            try:
                obj = orjson.loads(raw) if raw.strip() else None
            except orjson.JSONDecodeError:
                obj = None
            key = _line_key(obj)
            if key is None and raw.strip():
                if not complete or f.peek(1) == b"":
                    index.torn_bytes = len(raw)  # the last line: a crash mid-write
                    break
                raise OutputFileError(
                    f"output file {path} line {n} is not a batchgen result line; "
                    "refusing to append to it"
                )
            if not complete:
                index.torn_bytes = len(raw)
                break
            if key is not None:
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
    """Rewrite `path` without the lines of `keys`, atomically (temp + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for raw in src:
            if _line_key(orjson.loads(raw)) not in keys:
                dst.write(raw)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)


class ResultWriter:
    """Appends result lines to a file (or stdout), one flushed write each."""

    def __init__(self, stream, fsync: bool):
        self._stream = stream
        self._fsync = fsync and stream is not sys.stdout.buffer
        self.written = 0

    def write(self, r: Result) -> None:
        self._stream.write(result_line(r))
        self._stream.flush()
        if self._fsync:
            os.fsync(self._stream.fileno())
        self.written += 1

    def close(self) -> None:
        if self._stream is not sys.stdout.buffer:
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
        stream = open(p, "ab")
    except OSError as e:
        raise OutputFileError(f"cannot write output file {p}: {e.strerror}") from None
    return ResultWriter(stream, fsync)
