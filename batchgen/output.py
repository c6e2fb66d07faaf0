"""Writing result lines, and the resume index of an existing output file.

Each result is one `write` of a whole line, flushed and (by default) fsync'd
before the next job starts, so a crash loses at most the line being written.
Such a torn last line has no newline; `open_output` cuts it off before
appending, so nothing is ever duplicated or half-parsed.

A run over several ranks (`mlx.launch`) has one writer of the output, rank 0;
every other rank appends its lines, the same way, to a part file of its own
beside the output (`.<name>.part-<run>-<rank>`). Rank 0 folds them in: each
whole line whose id the output does not hold yet is appended, and a part is
deleted only once everything in it is in the output and fsync'd. A part left
behind (a rank killed) is folded in by the next run on the output, whatever
its number of ranks, so a reader of the output only ever sees whole lines,
each id once, and a part's lines are never lost.
"""

from __future__ import annotations

import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import orjson

from .jobs import CHAT, NATIVE, RESPONSES
from .logprob_entries import Content
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
    return {**out, "usage": r.usage.as_dict(), "stats": r.stats.as_dict(), "metadata": r.metadata, "error": None}


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


def _responses_body(r: Result, created: int) -> dict:
    """A /v1/responses body: one assistant message of one output_text part; a text
    cut by its token limit is an "incomplete" response, as OpenAI marks it."""
    u, s = r.usage, _samples(r)[0]
    cut = s.finish_reason == "length"
    part = {"type": "output_text", "text": s.text, "annotations": [], "logprobs": s.logprobs or []}
    message = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "incomplete" if cut else "completed",
               "role": "assistant", "content": [part]}  # fmt: skip
    usage = {
        "input_tokens": u.prompt_tokens,
        # cache_write_tokens is what OpenAI bills for writing its prompt cache; batchgen's
        # prompt pool lives in the run's own memory, billed to no one: 0
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": created,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None, "model": r.model_name or "batchgen", "output": [message],
        "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "metadata": r.metadata,
        "usage": usage, "batchgen": {"stats": r.stats.as_dict()},
    }  # fmt: skip


def _openai_body(r: Result, created: int) -> dict:
    if r.format == RESPONSES:
        return _responses_body(r, created)
    u = r.usage
    usage = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    if r.format == CHAT:  # OpenAI's shape; the predicted-output counts add nothing to completion_tokens here
        usage["completion_tokens_details"] = {
            "reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": u.accepted_prediction_tokens or 0,
            "rejected_prediction_tokens": u.rejected_prediction_tokens or 0,
        }  # fmt: skip
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


def _json_default(obj):
    """orjson's hook for what it cannot write itself: logprob entries (`Content`) as
    the JSON they make, without their dicts."""
    if isinstance(obj, Content):
        return orjson.Fragment(obj.json())
    raise TypeError(f"cannot write {type(obj).__name__} to a result line")


def result_line(r: Result) -> bytes:
    obj = native_line(r) if r.format == NATIVE else openai_line(r)
    return orjson.dumps(obj, default=_json_default) + b"\n"


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


def line_figures(obj: dict) -> tuple[bool, int]:
    """(ok, completion tokens) of a parsed result line, native or OpenAI.

    >>> line_figures({"id": "a", "text": "hi", "usage": {"completion_tokens": 3}, "error": None})
    (True, 3)
    >>> line_figures({"custom_id": "a", "response": None, "error": {"code": "x"}})
    (False, 0)
    >>> line_figures({"custom_id": "a", "response": {"body": {"usage": {"output_tokens": 4}}}, "error": None})
    (True, 4)
    """
    if _is_error_line(obj):
        return False, 0
    usage = (obj["response"]["body"].get("usage") if "custom_id" in obj else obj.get("usage")) or {}
    return True, int(usage.get("completion_tokens", usage.get("output_tokens", 0)))  # output_tokens: /v1/responses


# Every line batchgen writes starts so (orjson keeps the dicts' key order, and
# both shapes put "id" first): a torn tail is cut only when it is the start of
# one of ours, never when it is some other file's last line.
_LINE_START = b'{"id":'


def _parsed(raw: bytes) -> tuple:
    """(the parsed line or None, its job key or None when it is not a result line)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, None
    return obj, _line_key(obj)


@dataclass
class ResumeIndex:
    done: set = field(default_factory=set)  # keys with a complete line (in the output or a part)
    failed: set = field(default_factory=set)  # keys whose line is an error
    torn_bytes: int = 0  # bytes of a torn last line, cut off on open
    parts: list = field(default_factory=list)  # part files left beside the output, folded in on open
    in_parts: set = field(default_factory=set)  # keys whose line is in a part only
    folded: int = 0  # lines moved from parts into the output on open


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
    The part files beside it (an earlier run's ranks') count too.
    """
    index = ResumeIndex()
    if path.exists():
        _read_output(path, index)
    _read_parts(path, index)
    return index


def _read_output(path: Path, index: ResumeIndex) -> None:
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
            obj, key = _parsed(raw)
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


def _read_parts(path: Path, index: ResumeIndex) -> None:
    """Ids in the part files beside `path` count as done; a part's id that the
    output (or an earlier part) holds is a fold cut short, not a repeat."""
    for part in part_files(path):
        for n, raw in PartTail(part).numbered():
            obj, key = _parsed(raw)
            if key is None:
                raise OutputFileError(f"part file {part} line {n} is not a batchgen result line; "
                                      "move the file away to go on without its lines")  # fmt: skip
            if key in index.done:
                continue  # in the output already: a fold cut short before the part was deleted
            index.done.add(key)
            index.in_parts.add(key)
            if _is_error_line(obj):
                index.failed.add(key)
        index.parts.append(part)


# A part file's name: `.<output name>.part-<run id>-<rank>`.
_PART = re.compile(r"\.part-([0-9a-f]+)-(\d+)$")


def part_path(output: Path, run_id: str, rank: int) -> Path:
    """Where rank `rank` of run `run_id` appends its result lines.

    >>> part_path(Path("out/a.jsonl"), "3f2a", 1).as_posix()
    'out/.a.jsonl.part-3f2a-1'
    """
    return output.with_name(f".{output.name}.part-{run_id}-{rank}")


def part_files(output: Path) -> list[Path]:
    """The part files beside `output`, of any run, in name order."""
    prefix = f".{output.name}.part-"
    try:
        names = os.listdir(output.parent if str(output.parent) else ".")
    except OSError:
        return []
    ours = (n for n in names if n.startswith(prefix) and _PART.search(n[len(output.name) + 1 :]))
    return sorted(output.with_name(n) for n in ours)


class PartTail:
    """Reads a part file's whole lines as they are appended: `read` yields
    the lines completed since the last read (a line still being written, or
    torn by a crash, waits for its newline). Consume what it yields: the
    position moves as lines are taken."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0  # bytes of the lines taken so far
        self.lines = 0  # lines taken so far

    def read(self) -> Iterator[bytes]:
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return
        with f:
            f.seek(self.offset)
            for raw in f:
                if not raw.endswith(b"\n"):
                    return
                self.offset += len(raw)
                if raw.strip():
                    self.lines += 1
                    yield raw

    def numbered(self) -> Iterator[tuple[int, bytes]]:
        """Every whole line from the start, with its 1-based line number."""
        self.offset = self.lines = 0
        n = 0
        for raw in self.read():
            n += 1
            yield n, raw



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
        self.write_line(result_line(r))

    def write_line(self, line: bytes) -> None:
        """One whole result line, as `write` gives it."""
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

    def sync(self) -> None:
        """Everything written is on disk (whatever `fsync` said per line)."""
        if not self._is_stdout:
            try:
                os.fsync(self._stream.fileno())
            except OSError as e:
                raise OutputWriteError(f"cannot write output file {self._stream.name}: {e.strerror}") from None

    def close(self) -> None:
        if not self._is_stdout:
            self._stream.close()


def fold(writer: ResultWriter, lines: Iterable[bytes], seen: set, source: Path) -> list[dict]:
    """Append each result line of `lines` whose key `seen` lacks (adding it);
    return the lines appended, parsed. A line that is not a result is refused
    by name (`source`), never copied."""
    folded = []
    for raw in lines:
        obj, key = _parsed(raw)
        if key is None:
            raise OutputFileError(f"part file {source} holds a line that is not a batchgen result line")
        if key in seen:
            continue
        writer.write_line(raw if raw.endswith(b"\n") else raw + b"\n")
        seen.add(key)
        folded.append(obj)
    return folded


def fold_parts(writer: ResultWriter, parts: list[Path], seen: set) -> int:
    """Fold whole part files in, make the output durable, then delete them
    (a part goes only once its lines are on disk in the output)."""
    n = sum(len(fold(writer, PartTail(part).read(), seen, part)) for part in parts)
    writer.sync()
    for part in parts:
        part.unlink(missing_ok=True)
    return n


def open_output(path: str, index: ResumeIndex, fsync: bool, retry_failed: bool) -> ResultWriter:
    """Open the output for appending, first repairing a torn tail, folding in
    part files left by an earlier run (and dropping failed lines when they
    are to be retried)."""
    if path == "-":
        return ResultWriter(sys.stdout.buffer, fsync=False)
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if index.torn_bytes:
            _cut_torn_tail(p, index.torn_bytes)
        if index.parts:  # an earlier run's ranks' lines: into the output first
            with open(p, "ab", buffering=0) as stream:
                index.folded = fold_parts(ResultWriter(stream, fsync=False), index.parts, index.done - index.in_parts)
            index.parts, index.in_parts = [], set()
        if retry_failed and index.failed:
            _drop_keys(p, index.failed)
            index.done, index.failed = index.done - index.failed, set()  # what the file holds now
        stream = open(p, "ab", buffering=0)
    except OSError as e:
        raise OutputFileError(f"cannot write output file {p}: {e.strerror}") from None
    except OutputWriteError as e:
        raise OutputFileError(str(e)) from None
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
