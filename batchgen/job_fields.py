"""One job's settings, checked key by key: the same names and meanings in native jobs,
header defaults and OpenAI bodies (batchgen/jobs.py reads the lines). No MLX.
"""

from __future__ import annotations

import orjson

from .config import DRAFT_KINDS, KV_BITS, KV_CACHE_KINDS


class InvalidJob(ValueError):
    """One job line is invalid; `kind` is the error type written to its result."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind



# ---------------------------------------------------------------------------
# Field validation: one small checker per key, shared by both formats.


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float))) and not isinstance(v, bool)


def _check(ok: bool, key: str, want: str, value) -> None:
    if not ok:
        raise InvalidJob("invalid_value", f"'{key}' must be {want}, got {value!r}")


# No model reads this many tokens; past it a number is a typo, not a request.
# Below it, the engine caps a job at the model's context (see Engine.token_budget).
MAX_TOKENS_LIMIT = 1 << 24
SEED_LIMIT = 1 << 32  # sampling keys hold 32 bits of seed: a larger one would alias


def _max_tokens(key, v):
    _check(is_int(v) and 0 < v <= MAX_TOKENS_LIMIT, key, f"an integer in 1..{MAX_TOKENS_LIMIT}", v)
    return v


def _temperature(key, v):
    _check(_is_number(v) and v >= 0, key, "a number >= 0", v)
    return float(v)


def _top_p(key, v):
    _check(_is_number(v) and 0 < v <= 1, key, "a number in (0, 1]", v)
    return float(v)


def _min_p(key, v):
    _check(_is_number(v) and 0 <= v <= 1, key, "a number in [0, 1]", v)
    return float(v)


def _non_negative_int(key, v):
    _check(is_int(v) and v >= 0, key, "an integer >= 0", v)
    return v


def _positive_int(key, v):
    _check(is_int(v) and v > 0, key, "a positive integer", v)
    return v


def _seed(key, v):
    _check(is_int(v) and 0 <= v < SEED_LIMIT, key, f"an integer in 0..{SEED_LIMIT - 1}", v)
    return v


def _stop(key, v):
    if isinstance(v, str):
        v = [v]
    _check(
        isinstance(v, list) and all(isinstance(s, str) and s for s in v),
        key,
        "a non-empty string or a list of them",
        v,
    )
    return tuple(v)


def _choice(options):
    def check(key, v):
        _check(v in options, key, "one of " + ", ".join(map(repr, options)), v)
        return v

    return check


def _any(key, v):
    return v


def _bool(key, v):
    _check(isinstance(v, bool), key, "true or false", v)
    return v


MAX_N = 128  # OpenAI's own bound on samples per request
MAX_TOP_LOGPROBS = 20


def _n(key, v):
    _check(is_int(v) and 1 <= v <= MAX_N, key, f"an integer in 1..{MAX_N}", v)
    return v


def top_logprobs(key, v):
    _check(is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS, key, f"an integer in 0..{MAX_TOP_LOGPROBS}", v)
    return v


def _penalty(key, v):
    _check(_is_number(v) and -2 <= v <= 2, key, "a number in [-2, 2]", v)
    return float(v)


def _positive_number(key, v):
    _check(_is_number(v) and v > 0, key, "a number > 0", v)
    return float(v)


def _logit_bias(key, v):
    """{"token id": bias in [-100, 100]} -> ((id, bias), ...) by id."""
    _check(isinstance(v, dict), key, "an object of token ids to numbers", v)
    out = {}
    for k, b in v.items():
        _check(isinstance(k, str) and k.isdigit(), f"{key} key", "a token id (digits)", k)
        _check(_is_number(b) and -100 <= b <= 100, f"{key}[{k!r}]", "a number in [-100, 100]", b)
        out[int(k)] = float(b)
    return tuple(sorted(out.items()))


JSON_OBJECT_SCHEMA = '{"type":"object"}'


def _schema_text(key, schema) -> str:
    """The schema as JSON text, its keys in the order given: the grammar writes an
    object's properties in the order the schema lists them (as OpenAI's structured
    outputs do), and that order is the user's (a "reasoning" before an "answer")."""
    _check(isinstance(schema, dict) or schema is True, key, "a JSON schema (an object)", schema)
    return orjson.dumps({} if schema is True else schema).decode()  # `true` admits any JSON, as `{}` does


def _response_format(key, v):
    """OpenAI's response_format -> the schema text to constrain to, or None (text)."""
    _check(isinstance(v, dict) and isinstance(v.get("type"), str), key, "an object with a 'type'", v)
    kind = v["type"]
    if kind == "text":
        reject_unknown(v, {"type"}, f"{key}.")
        return None
    if kind == "json_object":
        reject_unknown(v, {"type"}, f"{key}.")
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        reject_unknown(v, {"type", "json_schema"}, f"{key}.")
        spec = v.get("json_schema")
        _check(isinstance(spec, dict) and "schema" in spec, f"{key}.json_schema", "an object with a 'schema'", spec)
        reject_unknown(spec, {"name", "schema", "strict", "description"}, f"{key}.json_schema.")
        return _schema_text(f"{key}.json_schema.schema", spec["schema"])
    raise InvalidJob("invalid_value", f"'{key}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def text_parts(v, key: str, kinds: tuple = ("text",)) -> str:
    """Text given as a string or as OpenAI's text parts ([{"type": "text", "text": ...}, ...],
    joined; the Responses API's are "input_text" and "output_text"); a part of another
    type is `unsupported`, naming it."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        for j, p in enumerate(v):
            kind = p.get("type") if isinstance(p, dict) else None
            if isinstance(kind, str) and kind not in kinds:
                raise InvalidJob("unsupported", f"{key}[{j}] has type {kind!r}; batchgen takes text parts only")
        if all(isinstance(p, dict) and p.get("type") in kinds and isinstance(p.get("text"), str) for p in v):
            return "".join(p["text"] for p in v)
    raise InvalidJob("invalid_value", f"{key} must be a string or a list of text parts")


def _prediction(key, v) -> str:
    """OpenAI's predicted output, `{"type": "content", "content": text or text parts}`
    (native jobs may give the text alone) -> its text: what prompt lookup also drafts
    from. The output is the one without it; only the verify passes it saves differ."""
    if isinstance(v, str):
        return v
    _check(isinstance(v, dict) and v.get("type") == "content", key, "an object with 'type': 'content'", v)
    reject_unknown(v, {"type", "content"}, f"{key}.")
    _check("content" in v, key, "an object with a 'content'", v)
    return text_parts(v["content"], f"{key}.content")


def _service_only(kinds: tuple, want: str):
    """A key that tells OpenAI's service how to handle the request (storage, tier, its
    own prompt cache), not what to generate: checked for its type, then ignored."""

    def check(key, v):
        _check(v is None or isinstance(v, kinds), key, want, v)
        return v

    return check


# Keys of OpenAI bodies that change nothing batchgen generates: accepted, ignored.
SERVICE_ONLY = {
    "store": _service_only((bool,), "true, false or null"),
    "service_tier": _service_only((str,), "a string or null"),
    "prompt_cache_key": _service_only((str,), "a string or null"),
    "prompt_cache_retention": _service_only((str,), "a string or null"),
    "safety_identifier": _service_only((str,), "a string or null"),
    # meaningful only with tools, which are refused by name
    "parallel_tool_calls": _service_only((bool,), "true, false or null"),
}


# key -> checker; the same names and meanings in native jobs, header defaults
# and OpenAI bodies (where they exist there).
FIELD_CHECKS = {
    "max_tokens": _max_tokens,
    "temperature": _temperature,
    "top_p": _top_p,
    "top_k": _non_negative_int,
    "min_p": _min_p,
    "seed": _seed,
    "stop": _stop,
    "metadata": _any,
    "draft": _choice(DRAFT_KINDS),
    "pld_ngram_size": _positive_int,
    "pld_max_lookup": _non_negative_int,
    "kv_cache": _choice(KV_CACHE_KINDS),
    "kv_bits": _choice(KV_BITS),
    "n": _n,
    "logprobs": _bool,
    "top_logprobs": top_logprobs,
    "presence_penalty": _penalty,
    "frequency_penalty": _penalty,
    "repetition_penalty": _positive_number,
    "repetition_context_size": _positive_int,
    "logit_bias": _logit_bias,
    "response_format": _response_format,
    "json_schema": _schema_text,  # native shorthand for a json_schema response_format
    "prediction": _prediction,
}
NATIVE_KEYS = {"id", "messages", "prompt", *FIELD_CHECKS}
DEFAULT_KEYS = set(FIELD_CHECKS) - {"metadata", "prediction"}
_OPENAI_SHARED = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n", "user",
    "metadata", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
}  # fmt: skip
CHAT_BODY_KEYS = _OPENAI_SHARED | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                                   "prediction", "stream", "stream_options", *SERVICE_ONLY}  # fmt: skip
COMPLETION_BODY_KEYS = _OPENAI_SHARED | {"prompt", "stream", "stream_options"}
# Keys OpenAI's bodies allow that batchgen does not do: named as such, not as typos.
OPENAI_UNSUPPORTED = {
    "tools", "tool_choice", "functions", "function_call", "audio", "modalities", "web_search_options",
    "reasoning_effort", "verbosity", "echo", "best_of", "suffix",
}  # fmt: skip


# The Responses API (/v1/responses): its request keys batchgen reads or ignores, and
# those it refuses by name (tools, reasoning, server-side state).
RESPONSES_BODY_KEYS = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "metadata", "user",
    "top_logprobs", "include", "truncation", "stream", "stream_options", *SERVICE_ONLY,
}  # fmt: skip
RESPONSES_UNSUPPORTED = {
    "tools", "tool_choice", "max_tool_calls", "reasoning", "previous_response_id", "conversation", "background",
    "background_options", "prompt", "context_management", "image", "moderation", "access_programs",
    "prompt_cache_options",
}  # fmt: skip
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def responses_settings(body: dict) -> tuple[dict, str | None]:
    """A Responses body's settings under the names `FIELD_CHECKS` checks (its
    `max_output_tokens` is `max_tokens`; logprobs are on where `include` names
    them or `top_logprobs` asks for alternatives), and the JSON schema text its
    `text.format` constrains the output to (None: plain text)."""
    out = {k: body[k] for k in ("temperature", "top_p", "metadata", "top_logprobs") if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = _max_tokens("max_output_tokens", body["max_output_tokens"])
    include = body.get("include")
    if include is not None:
        _check(isinstance(include, list) and all(isinstance(x, str) for x in include), "include", "a list of strings", include)
        other = [x for x in include if x != LOGPROBS_INCLUDE]
        if other:
            raise InvalidJob("unsupported", f"'body.include' entry {other[0]!r} is not supported by batchgen")
        if include:
            out["logprobs"] = True
    if out.get("top_logprobs"):
        out["logprobs"] = True
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidJob("unsupported", f"'body.truncation' {body['truncation']!r} is not supported by batchgen (only 'disabled')")
    schema = None
    text = body.get("text")
    if text is not None:
        _check(isinstance(text, dict), "text", "an object", text)
        reject_unknown(text, {"format", "verbosity"}, "text.")
        if text.get("verbosity") is not None:
            raise InvalidJob("unsupported", "'body.text.verbosity' is not supported by batchgen")
        if text.get("format") is not None:
            schema = _text_format("text.format", text["format"])
    return out, schema


def _text_format(key, v) -> str | None:
    """The Responses API's `text.format` (the chat endpoint's `response_format`, its
    json_schema's fields one level up) -> the schema text, or None (text)."""
    _check(isinstance(v, dict) and isinstance(v.get("type"), str), key, "an object with a 'type'", v)
    kind = v["type"]
    if kind in ("text", "json_object"):
        reject_unknown(v, {"type"}, f"{key}.")
        return None if kind == "text" else JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        reject_unknown(v, {"type", "name", "schema", "strict", "description"}, f"{key}.")
        _check("schema" in v, key, "a json_schema format with a 'schema'", v)
        return _schema_text(f"{key}.schema", v["schema"])
    raise InvalidJob("invalid_value", f"'{key}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def service_keys(body: dict, key_prefix: str = "body.") -> None:
    """Check the keys an offline run ignores: `SERVICE_ONLY`'s, and `stream` (a
    result line is written whole: false or null only, `stream_options` with it)."""
    for k, check in SERVICE_ONLY.items():
        if k in body:
            check(key_prefix + k, body[k])
    if body.get("stream") not in (None, False):
        raise InvalidJob("unsupported", f"'{key_prefix}stream' must be false or null: batchgen writes whole result lines")
    if body.get("stream_options") is not None:
        raise InvalidJob("unsupported", f"'{key_prefix}stream_options' needs streaming, which batchgen does not do")


def reject_unknown(obj: dict, allowed: set, where: str = "") -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        names = ", ".join(repr(where + k) for k in unknown)
        raise InvalidJob("unknown_key", f"unknown key {names}")
