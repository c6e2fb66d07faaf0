"""Reading and validating job files (native and OpenAI Batch JSONL).

A job file is read twice, both times lazily: `scan_jobs` checks the whole file
(ids, header, shared system prompt) before any model loads, then `iter_jobs`
streams the jobs to the engine. Only ids and small counters are held, so a
file of any length streams in constant memory.

A bad line is not fatal: it becomes a `BadJob` carrying its line number and
reason, and the run writes an error line for it. Only problems with the file
as a whole (unreadable, bad header, duplicate ids) raise `JobFileError`.
"""

from __future__ import annotations

import codecs
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import orjson

from .config import LogitsConfig, SamplingConfig
from .job_fields import (
    CHAT_BODY_KEYS,
    COMPLETION_BODY_KEYS,
    DEFAULT_KEYS,
    FIELD_CHECKS,
    NATIVE_KEYS,
    OPENAI_UNSUPPORTED,
    RESPONSES_BODY_KEYS,
    RESPONSES_UNSUPPORTED,
    InvalidJob,
    is_int,
    reject_unknown,
    responses_settings,
    service_keys,
    text_parts,
    top_logprobs,
)

NATIVE, CHAT, COMPLETION, RESPONSES = "native", "chat", "completion", "responses"
OPENAI_URLS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/responses": RESPONSES}
ROLES = ("system", "developer", "user", "assistant", "tool")
INPUT_ROLES = ("system", "developer", "user", "assistant")  # a /v1/responses input message's


class JobFileError(Exception):
    """The job file as a whole cannot be used (exit code 2)."""


@dataclass(frozen=True)
class Header:
    system: str | None = None
    defaults: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Job:
    id: str
    line: int
    format: str  # NATIVE, CHAT or COMPLETION
    messages: tuple | None  # ({"role", "content"}, ...) for chat jobs
    prompt: str | None  # raw text, no template
    max_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...] = ()
    metadata: Any = None
    # Per-job technique overrides; None means "the run's setting".
    draft: str | None = None
    pld_ngram_size: int | None = None
    pld_max_lookup: int | None = None
    kv_cache: str | None = None
    kv_bits: int | None = None
    model_name: str | None = None  # OpenAI body's "model", echoed back
    n: int = 1  # samples of this prompt (seed + i each, where a seed is given)
    logprobs: bool = False
    top_logprobs: int = 0  # most likely alternatives per token, 0..20
    json_schema: str | None = None  # the JSON schema (text) the output is constrained to
    logits: LogitsConfig = field(default_factory=LogitsConfig)
    sample: int = 0  # which of the job's n samples this is, once a job is split into them
    prediction: str | None = None  # the expected output's text: prompt lookup drafts from it too

    @property
    def needs_logits(self) -> bool:
        """Whether picking a token needs more than the argmax of the raw logits."""
        return not self.sampling.greedy or self.logprobs or self.json_schema is not None or self.logits.active


@dataclass(frozen=True)
class BadJob:
    """A line that could not become a job; the run writes an error line for it."""

    id: str
    line: int
    format: str
    kind: str
    message: str
    metadata: Any = None


def _messages(v) -> tuple:
    if not isinstance(v, list) or not v:
        raise InvalidJob("invalid_job", "'messages' must be a non-empty list")
    return tuple(_message(m, f"messages[{i}]", {"role", "content", "name"}, ROLES) for i, m in enumerate(v))


def _message(m, key: str, keys: set, roles: tuple, kinds: tuple = ("text",)) -> dict:
    """One chat message object -> {"role", "content" (text)}; `keys` it may hold,
    `roles` it may take, `kinds` of text parts its content may hold."""
    if not isinstance(m, dict):
        raise InvalidJob("invalid_job", f"{key} must be an object")
    reject_unknown(m, keys, f"{key}.")
    role = m.get("role")
    if role not in roles:
        raise InvalidJob("invalid_job", f"{key}.role must be one of {', '.join(roles)}, got {role!r}")
    if "content" not in m:
        raise InvalidJob("invalid_job", f"{key} has no 'content'")
    return {"role": role, "content": text_parts(m["content"], f"{key}.content", kinds)}


def _prompt(v) -> str:
    if not isinstance(v, str) or not v:
        raise InvalidJob("invalid_value", "'prompt' must be a non-empty string")
    return v


def _with_system(messages: tuple, system: str | None) -> tuple:
    if system is None or any(m["role"] == "system" for m in messages):
        return messages
    return ({"role": "system", "content": system},) + messages


def _settings(obj: dict, defaults: dict) -> dict:
    """Validated per-job settings: the job's own value, else the defaults'."""
    out = {}
    for key, check in FIELD_CHECKS.items():
        if key in obj:
            out[key] = check(key, obj[key])
        elif key in defaults:
            out[key] = defaults[key]
    return out


def _job(job_id, line, fmt, messages, prompt, s: dict, defaults: "Defaults", model=None):
    if "response_format" in s and "json_schema" in s:
        raise InvalidJob("invalid_job", "give one of 'response_format' or 'json_schema'")
    if s.get("top_logprobs") and not s.get("logprobs"):
        raise InvalidJob("invalid_value", "'top_logprobs' needs 'logprobs': true")
    logits = LogitsConfig(
        presence_penalty=s.get("presence_penalty", 0.0),
        frequency_penalty=s.get("frequency_penalty", 0.0),
        repetition_penalty=s.get("repetition_penalty", 1.0),
        repetition_context_size=s.get("repetition_context_size", 20),
        logit_bias=s.get("logit_bias", ()),
    )
    sampling = SamplingConfig(
        temperature=s.get("temperature", 0.0),
        top_p=s.get("top_p", 1.0),
        top_k=s.get("top_k", 0),
        min_p=s.get("min_p", 0.0),
        seed=s.get("seed", defaults.seed),
    )
    return Job(
        id=job_id,
        line=line,
        format=fmt,
        messages=messages,
        prompt=prompt,
        max_tokens=s.get("max_tokens", defaults.max_tokens),
        sampling=sampling,
        stop=s.get("stop", ()),
        metadata=s.get("metadata"),
        draft=s.get("draft"),
        pld_ngram_size=s.get("pld_ngram_size"),
        pld_max_lookup=s.get("pld_max_lookup"),
        kv_cache=s.get("kv_cache"),
        kv_bits=s.get("kv_bits"),
        model_name=model,
        n=s.get("n", 1),
        logprobs=s.get("logprobs", False),
        top_logprobs=s.get("top_logprobs", 0),
        json_schema=s.get("response_format", s.get("json_schema")),
        logits=logits,
        prediction=s.get("prediction"),
    )


@dataclass(frozen=True)
class Defaults:
    """What a job gets for keys it leaves out: header defaults over CLI ones."""

    header: Header
    max_tokens: int
    seed: int | None


def _native_job(obj: dict, line: int, d: Defaults) -> Job:
    job_id = _job_id(obj, line)
    reject_unknown(obj, NATIVE_KEYS)
    has_messages, has_prompt = "messages" in obj, "prompt" in obj
    if has_messages == has_prompt:
        raise InvalidJob(
            "invalid_job", "a job needs exactly one of 'messages' or 'prompt'"
        )
    settings = _settings(obj, d.header.defaults)
    if has_messages:
        messages = _with_system(_messages(obj["messages"]), d.header.system)
        return _job(job_id, line, NATIVE, messages, None, settings, d)
    return _job(job_id, line, NATIVE, None, _prompt(obj["prompt"]), settings, d)


def _job_id(obj: dict, line: int) -> str:
    if "id" not in obj:
        return str(line)
    v = obj["id"]
    if isinstance(v, str) and v:
        return v
    if is_int(v):
        return str(v)
    raise InvalidJob("invalid_value", f"'id' must be a non-empty string, got {v!r}")


def _openai_job(obj: dict, line: int, d: Defaults) -> Job:
    reject_unknown(obj, {"custom_id", "method", "url", "body"})
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidJob("invalid_value", "'custom_id' must be a non-empty string")
    if obj.get("method") != "POST":
        raise InvalidJob("invalid_value", f"'method' must be 'POST', got {obj.get('method')!r}")
    fmt = OPENAI_URLS.get(obj.get("url"))
    if fmt is None:
        urls = ", ".join(OPENAI_URLS)
        raise InvalidJob("invalid_value", f"'url' must be {urls}, got {obj.get('url')!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise InvalidJob("invalid_job", "'body' must be an object")
    unsupported = sorted(set(body) & (RESPONSES_UNSUPPORTED if fmt == RESPONSES else OPENAI_UNSUPPORTED))
    if unsupported:
        raise InvalidJob("unsupported", f"'body.{unsupported[0]}' is not supported by batchgen")
    reject_unknown(body, {CHAT: CHAT_BODY_KEYS, COMPLETION: COMPLETION_BODY_KEYS, RESPONSES: RESPONSES_BODY_KEYS}[fmt], "body.")
    service_keys(body)
    if fmt == RESPONSES:
        return _responses_job(custom_id, line, body, d)
    body = dict(body)
    if "max_completion_tokens" in body:
        body["max_tokens"] = body.pop("max_completion_tokens")
    if fmt == COMPLETION and "logprobs" in body:  # the legacy endpoint's logprobs: how many alternatives
        top = body.pop("logprobs")
        if top is not None:
            body["logprobs"], body["top_logprobs"] = True, top_logprobs("body.logprobs", top)
    settings = _settings(body, d.header.defaults)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    if fmt == CHAT:
        if "messages" not in body:
            raise InvalidJob("invalid_job", "a chat request needs 'body.messages'")
        messages = _with_system(_messages(body["messages"]), d.header.system)
        return _job(custom_id, line, fmt, messages, None, settings, d, model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return _job(custom_id, line, fmt, None, _prompt(prompt), settings, d, model)


def _responses_job(custom_id: str, line: int, body: dict, d: Defaults) -> Job:
    """A /v1/responses request: `input` (text, or message items) with `instructions`
    as the system message before it."""
    mapped, schema = responses_settings(body)
    settings = _settings(mapped, d.header.defaults)
    if schema is not None:
        settings.pop("json_schema", None)
        settings["response_format"] = schema
    if settings.get("n", 1) > 1:  # only a header's defaults can set it here
        raise InvalidJob("invalid_job", "a responses request has one output: the header's 'n' does not apply to it")
    if "input" not in body:
        raise InvalidJob("invalid_job", "a responses request needs 'body.input'")
    messages = _input_items(body["input"])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidJob("invalid_value", f"'instructions' must be a string, got {instructions!r}")
        messages = ({"role": "system", "content": instructions},) + messages
    else:
        messages = _with_system(messages, d.header.system)
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return _job(custom_id, line, RESPONSES, messages, None, settings, d, model)


def _input_items(v) -> tuple:
    """The Responses API's `input`: text (one user message), or message items, each
    `content` text or input_text / output_text parts; other items (tool calls and
    their outputs, references to stored items) are `unsupported`."""
    if isinstance(v, str) and v:
        return ({"role": "user", "content": v},)
    if not isinstance(v, list) or not v:
        raise InvalidJob("invalid_job", "'input' must be a non-empty string or list")
    out = []
    for i, item in enumerate(v):
        kind = item.get("type", "message") if isinstance(item, dict) else "message"
        if kind != "message":
            raise InvalidJob("unsupported", f"input[{i}] has type {kind!r}; batchgen takes messages only")
        out.append(_message(item, f"input[{i}]", {"type", "role", "content", "id", "status"}, INPUT_ROLES,
                            ("input_text", "output_text")))  # fmt: skip
    return tuple(out)


def line_format(obj) -> str:
    """NATIVE, or the OpenAI endpoint format (CHAT) for a batch request line."""
    return CHAT if isinstance(obj, dict) and "custom_id" in obj else NATIVE


def parse_job(raw: bytes, line: int, file_format: str, d: Defaults) -> Job | BadJob:
    """One job line to a `Job`, or a `BadJob` naming the line and the reason."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return BadJob(str(line), line, file_format, "invalid_json", f"not valid JSON: {e}")
    if not isinstance(obj, dict):
        kind = type(obj).__name__
        return BadJob(str(line), line, file_format, "invalid_job", f"a job must be a JSON object, got {kind}")
    key = obj.get("custom_id") if file_format != NATIVE else obj.get("id")
    fallback_id = key if isinstance(key, str) and key else str(line)
    if is_int(key):
        fallback_id = str(key)
    if "batchgen" in obj:
        return BadJob(fallback_id, line, file_format, "invalid_job", "a header line is only allowed as the first line")
    is_openai = line_format(obj) != NATIVE
    if is_openai != (file_format != NATIVE):
        what = "an OpenAI batch request" if is_openai else "a native job"
        return BadJob(fallback_id, line, file_format, "invalid_job",
                      f"{what} in a file whose first job has the other format")  # fmt: skip
    try:
        job = _openai_job(obj, line, d) if is_openai else _native_job(obj, line, d)
    except InvalidJob as e:
        meta = obj.get("metadata") if not is_openai else None
        return BadJob(fallback_id, line, file_format, e.kind, str(e), meta)
    return job


# ---------------------------------------------------------------------------
# The header line and the file-level scan.


def parse_header(obj: dict, line: int) -> Header:
    h = obj["batchgen"]
    where = f"header (line {line})"
    if not isinstance(h, dict):
        raise JobFileError(f"{where}: 'batchgen' must be an object")
    unknown = sorted(set(h) - {"system", "defaults"})
    if unknown:
        raise JobFileError(f"{where}: unknown key {', '.join(map(repr, unknown))}")
    system = h.get("system")
    if system is not None and not isinstance(system, str):
        raise JobFileError(f"{where}: 'system' must be a string")
    defaults = h.get("defaults", {})
    if not isinstance(defaults, dict):
        raise JobFileError(f"{where}: 'defaults' must be an object")
    unknown = sorted(set(defaults) - DEFAULT_KEYS)
    if unknown:
        raise JobFileError(f"{where}: unknown default {', '.join(map(repr, unknown))}")
    try:
        checked = {k: FIELD_CHECKS[k](k, v) for k, v in defaults.items()}
    except InvalidJob as e:
        raise JobFileError(f"{where}: {e}") from None
    return Header(system=system, defaults=checked)


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, stripped bytes) for each non-blank line."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise JobFileError(f"cannot read job file {path}: {e.strerror}") from None
    with f:
        for n, raw in enumerate(f, start=1):
            if n == 1 and raw.startswith(codecs.BOM_UTF8):  # editors on Windows write one
                raw = raw[len(codecs.BOM_UTF8) :]
            raw = raw.strip()
            if raw:
                yield n, raw


def _first_line(path: Path) -> tuple[int, Any] | None:
    for n, raw in _lines(path):
        try:
            return n, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return n, None
    return None


def read_header(path: Path) -> tuple[Header, int | None]:
    """The header (empty if none) and its line number."""
    first = _first_line(path)
    if first and isinstance(first[1], dict) and "batchgen" in first[1]:
        return parse_header(first[1], first[0]), first[0]
    return Header(), None


@dataclass
class ScanReport:
    header: Header
    header_line: int | None
    format: str
    jobs: int = 0  # lines that are jobs (valid or not)
    bad: int = 0
    # The most common system prompt among jobs, for prewarming (None if none).
    common_system: str | None = None
    common_system_jobs: int = 0
    ids: set = field(default_factory=set)  # every job's id (bad lines: their fallback id)
    extra_samples: int = 0  # sum of n - 1 over the valid jobs: batch rows beyond one per job


def _file_format(path: Path, header_line: int | None) -> str:
    for n, raw in _lines(path):
        if n == header_line:
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return line_format(obj)
    return NATIVE


def iter_jobs(path: Path, defaults: Defaults, file_format: str, header_line) -> Iterator[Job | BadJob]:
    """Every job line of the file, in order, parsed lazily."""
    for n, raw in _lines(path):
        if n != header_line:
            yield parse_job(raw, n, file_format, defaults)


def _system_of(job: Job) -> str | None:
    if job.messages and job.messages[0]["role"] == "system":
        return job.messages[0]["content"]
    return None


def scan_jobs(path: Path, max_tokens: int, seed: int | None, on_item=None) -> tuple[ScanReport, Defaults]:
    """Check the whole file; raise `JobFileError` if it cannot be run.

    Holds only ids and a digest per distinct system prompt, so memory stays
    flat however many jobs the file has. `on_item` sees every job line's
    `Job` or `BadJob`, in file order.
    """
    header, header_line = read_header(path)
    defaults = Defaults(header, max_tokens, seed)
    report = ScanReport(header, header_line, _file_format(path, header_line))
    seen: dict[str, int] = {}
    systems: Counter = Counter()
    first_line_of: dict[bytes, int] = {}
    for item in iter_jobs(path, defaults, report.format, header_line):
        if on_item is not None:
            on_item(item)
        report.jobs += 1
        report.ids.add(item.id)
        # Ids are unique over bad lines too: each line, good or bad, gets one
        # result line under its id, and resume knows jobs by id alone.
        if item.id in seen:
            raise JobFileError(
                f"duplicate job id {item.id!r} on lines {seen[item.id]} and {item.line}"
            )
        seen[item.id] = item.line
        if isinstance(item, BadJob):
            report.bad += 1
            continue
        report.extra_samples += item.n - 1
        system = _system_of(item)
        if system:
            digest = hashlib.sha1(system.encode()).digest()
            systems[digest] += 1
            first_line_of.setdefault(digest, item.line)
    if header.system:
        report.common_system = header.system
        report.common_system_jobs = systems[hashlib.sha1(header.system.encode()).digest()]
    elif systems:
        digest, count = systems.most_common(1)[0]
        report.common_system = _system_on_line(path, first_line_of[digest], defaults, report)
        report.common_system_jobs = count
    return report, defaults


def _system_on_line(path: Path, line: int, defaults: Defaults, report: ScanReport) -> str | None:
    for n, raw in _lines(path):
        if n == line:
            job = parse_job(raw, n, report.format, defaults)
            return _system_of(job) if isinstance(job, Job) else None
    return None
