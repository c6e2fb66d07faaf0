"""Dataset-generation features on real models (float32 on CPU): JSON-schema
constrained output validates, n samples share one prefill, logprobs equal
log_softmax of plain decoding's logits (with and without PLD, alone and
batched), penalties and bias as defined; and the OpenAI client's own models
parse every body written."""

import json
import sys
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_tokenizer

from batchgen.config import DEMO_MODEL_DIR, DecodeConfig, EngineConfig, LogitsConfig, PromptCacheConfig, SamplingConfig
from batchgen.engine.core import Engine
from batchgen.job_fields import JSON_OBJECT_SCHEMA
from batchgen.jobs import NATIVE, Job

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L"]}},
              "required": ["colour", "size"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}},
        "required": ["tags", "scores"], "additionalProperties": False},
    "bounded": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                                 "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                                                 "ok": {"type": "boolean"}},
                "required": ["age", "ratio", "ok"], "additionalProperties": False},
}  # fmt: skip
EDIT = "Rename the variable `x` to `total` in:\ndef f(x):\n    y = x + 1\n    return x * y\n"
FREE = ["Write a function that adds two numbers.", EDIT, "def main():"]


def job(text, job_id="j", max_tokens=24, **kw):
    return Job(id=job_id, line=1, format=NATIVE, messages=({"role": "user", "content": text},), prompt=None,
               max_tokens=max_tokens, sampling=kw.pop("sampling", SamplingConfig()), **kw)  # fmt: skip


@pytest.fixture(scope="module")
def demo():
    """make(batch_size, draft) -> an engine over the demo model, float32, made once per setting."""
    made = {}

    def make(batch_size=1, draft="none", pool=True):
        key = (batch_size, draft, pool)
        if key not in made:
            cfg = EngineConfig(model=str(DEMO_MODEL_DIR), dtype="float32", batch_size=batch_size,
                               decode=DecodeConfig(draft=draft, pld_adaptive=False),
                               prompt_cache=PromptCacheConfig(enabled=pool, prewarm=False))  # fmt: skip
            made[key] = Engine.load(cfg)
        return made[key]

    return make


def constrained_jobs():
    out = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        text = f"Answer with JSON: {name} {i}"
        out.append(job(text, f"s-{name}", max_tokens=80, json_schema=json.dumps(schema)))
    return out


def check_constrained(results):
    for name, schema in SCHEMAS.items():
        r = results[f"s-{name}"]
        assert r.ok, r.error
        assert r.finish_reason == "stop", (name, r.text)
        jsonschema.validate(json.loads(r.text), schema)


@pytest.fixture(scope="module")
def mixed(demo):
    """The four schema jobs, three free ones and a free one with a penalty, and
    their results one at a time."""
    batch = constrained_jobs() + [job(t, f"f{i}", max_tokens=16) for i, t in enumerate(FREE)]
    batch.append(job(FREE[0], "penalized", max_tokens=16, logits=LogitsConfig(frequency_penalty=0.5)))  # picks from logits
    return batch, {r.id: r for r in demo(1).run_all(batch)}


def test_constrained_output_validates_alone(mixed):
    check_constrained(mixed[1])


@pytest.mark.parametrize("batch_size", [8, 2])
def test_constrained_rows_share_a_batch_with_free_rows(demo, mixed, batch_size):
    """Four schemas and four free rows in one batch of 8, or 2 (free rows take
    the slots schema rows leave, whose masks must not follow them): every JSON
    validates, and every text equals the same job's run alone (float32)."""
    batch, alone = mixed
    batch = batch[:2] + batch[-1:] + batch[2:-1]  # the penalized row enters beside a schema row
    got = {r.id: r for r in demo(batch_size).run_all(batch)}
    check_constrained(got)
    assert {i: r.text for i, r in got.items()} == {i: r.text for i, r in alone.items()}


def test_json_object_mode_admits_objects_only(demo):
    """`{"type": "json_object"}`: any JSON object, nothing else (checked on the
    matcher: the demo model, free in its keys, writes one key until max_tokens)."""
    e = demo(1)
    fresh = lambda: e.matcher_for(job("x", json_schema=JSON_OBJECT_SCHEMA))  # noqa: E731
    for text, whole in [('{"a": [1, {"b": null}]}', True), ("[1]", False), ('"a"', False)]:
        tokens = e.tokenizer.encode(text)
        m = fresh()
        assert (m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()) == whole, text
    r = e.run(job("Answer in JSON.", max_tokens=12, json_schema=JSON_OBJECT_SCHEMA))
    assert r.ok and r.text.startswith("{")


def test_output_keys_follow_the_schema_s_order_not_the_alphabet(demo):
    """A job line's schema keeps its keys' order from the file to the grammar,
    so an object's properties come out in the order the schema lists them
    (a "reasoning" before its "answer"), alone and batched."""
    from batchgen.jobs import Defaults, Header, parse_job

    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 16},
                                               "answer": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "basis": {"enum": ["lookup", "sum"]}},
              "required": ["reasoning", "answer", "basis"], "additionalProperties": False}  # fmt: skip
    line = json.dumps({"id": "ordered", "prompt": "Answer with JSON.", "max_tokens": 60, "json_schema": schema})
    parsed = parse_job(line.encode(), 1, NATIVE, Defaults(Header(), max_tokens=60, seed=None))
    for batch_size in (1, 2):
        r = {r.id: r for r in demo(batch_size).run_all([parsed, job(FREE[0], "free", max_tokens=8)])}["ordered"]
        assert r.ok and r.finish_reason == "stop", r.text
        assert list(json.loads(r.text)) == ["reasoning", "answer", "basis"], r.text


def test_jobs_with_one_schema_get_independent_matchers_built_once(demo, monkeypatch):
    """A schema keeps `templates` matchers, built by its first jobs (each build
    walks the whole vocabulary); later jobs get copies of them in turn,
    untouched by what the earlier jobs' matchers took."""
    e = demo(1)
    e.matcher_for(job("x", json_schema=JSON_OBJECT_SCHEMA))  # the engine's grammars made
    monkeypatch.setattr(e.grammars, "templates", 2)
    real, built = e.grammars.lib.LLMatcher, []

    def counting(*a, **k):
        built.append(1)
        return real(*a, **k)

    counting.grammar_from_json_schema = real.grammar_from_json_schema
    monkeypatch.setattr(e.grammars, "lib", SimpleNamespace(LLMatcher=counting))
    schema = json.dumps({**SCHEMAS["enums"], "title": "only here"})  # built by no other test
    text = e.tokenizer.encode('{"colour": "red", "size": "M"}')
    first = e.matcher_for(job("x", json_schema=schema))
    assert first.try_consume_tokens(text[:3]) == 3
    second = e.matcher_for(job("y", json_schema=schema))
    assert second.try_consume_tokens(text[:5]) == 5
    assert len(built) == 2
    later = [e.matcher_for(job(f"z{i}", json_schema=schema)) for i in range(3)]
    assert len(built) == 2 and len(e.grammars._kept[schema]) == 2
    for m in later:
        assert m.try_consume_tokens(text) == len(text) and m.is_accepting()
    assert first.try_consume_tokens(text[3:]) == len(text) - 3 and first.is_accepting()
    assert second.try_consume_tokens(text[5:]) == len(text) - 5 and second.is_accepting()


@pytest.mark.parametrize("schema, why", [({"type": "array", "uniqueItems": True}, "uniqueItems"),
                                         ({"type": "string", "pattern": "["}, "regex parse error: [ ^ error:")])
def test_a_schema_that_cannot_compile_is_an_error_line_before_any_generation(demo, monkeypatch, schema, why):
    """The job's error names why, on one line (llguidance's regex errors span several)."""
    e = demo(1)
    calls = []
    monkeypatch.setattr(e, "start_prompt", lambda *a: calls.append(a))
    r = e.run(job("x", json_schema=json.dumps(schema)))
    assert r.error.type == "invalid_schema" and why in r.error.message and "\n" not in r.error.message and not calls


def test_without_a_grammar_engine_schema_jobs_fail_alone(demo, monkeypatch):
    """llguidance missing (an import that fails): the schema job gets one error
    line naming the extra; the free job beside it runs."""
    e = demo(4, pool=False)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    monkeypatch.setattr(e, "_grammars", None)
    got = {r.id: r for r in e.run_all([job("Answer.", "s", json_schema=JSON_OBJECT_SCHEMA), job(FREE[0], "f", max_tokens=4)])}
    assert got["s"].error.type == "grammar_unavailable" and "batchgen[grammar]" in got["s"].error.message
    assert "\n" not in got["s"].error.message and got["f"].ok


# ---------------------------------------------------------------------------
# n samples


@pytest.mark.parametrize("batch_size", [1, 8])
def test_n_samples_share_one_prefill_and_seed_each_sample(demo, monkeypatch, batch_size):
    """n=4 with seed 7: four samples, sample i the text of a lone job seeded 7 + i;
    the prompt prefilled once (one prompt pass, counted once in usage)."""
    import batchgen.engine.core as eng

    e = demo(batch_size, pool=False)
    sampling = SamplingConfig(temperature=1.0, seed=7)
    parent = job(FREE[0], "n4", max_tokens=10, n=4, sampling=sampling)
    singles = [job(FREE[0], f"s{i}", max_tokens=10, sampling=SamplingConfig(temperature=1.0, seed=7 + i)) for i in range(4)]
    want = [r.text for r in demo(1, pool=False).run_all(singles)]
    passes = []
    real = eng.prefill
    monkeypatch.setattr(eng, "prefill", lambda model, cache, tokens, *a, **k: passes.append(len(tokens)) or real(model, cache, tokens, *a, **k))
    (r,) = list(e.run_all([parent]))
    prompt = len(e.prompt_tokens(parent))
    assert passes == [prompt]
    assert r.ok and r.text is None and [s.text for s in r.samples] == sorted(want, key=want.index)
    assert [s.text for s in r.samples] == want and len(set(want)) > 1
    assert (r.usage.prompt_tokens, r.usage.cached_tokens) == (prompt, 0)
    assert r.usage.completion_tokens == sum(s.completion_tokens for s in r.samples) == 40
    (again,) = list(e.run_all([parent]))
    assert [s.text for s in again.samples] == want


# ---------------------------------------------------------------------------
# logprobs


def plain_logprobs(model, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """log_softmax of plain decoding's logits (float32) before each of `tokens`:
    the prompt prefilled, then one token a step, as mlx-lm decodes."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    out = []
    for t in tokens:
        out.append(np.array(logits - mx.logsumexp(logits)))
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("draft,batch_size", [("none", 1), ("pld", 1), pytest.param("none", 4, marks=pytest.mark.slow)])
def test_logprobs_are_plain_decodings_log_softmax(demo, draft, batch_size):
    """Every token's logprob and top-5 against log_softmax of plain decoding's
    logits at its position, within 2e-5 (float32; a verify pass or a batch
    step sums in another order than a one-token pass). Under PLD most tokens
    come from verified drafts."""
    e = demo(batch_size, draft)
    jobs = [job(EDIT, "e", max_tokens=30, logprobs=True, top_logprobs=5), job(FREE[0], "f", max_tokens=12)]
    r = {x.id: x for x in e.run_all(jobs)}["e"]
    if draft == "pld":
        assert r.stats.pld_accepted >= 10
    ids = r.token_ids
    entries = r.logprobs
    assert len(entries) == len(ids) - (ids[-1] in e.tokenizer.eos_token_ids)
    ref = plain_logprobs(e.model, e.prompt_tokens(jobs[0]), ids)
    for i, (entry, lp) in enumerate(zip(entries, ref)):
        assert abs(entry["logprob"] - float(lp[ids[i]])) <= 2e-5, i
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(sorted(lp)[::-1][:5], abs=2e-5)
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    assert "".join(x["token"] for x in entries) == r.text


# ---------------------------------------------------------------------------
# penalties and bias


def test_bias_forces_a_token(demo):
    e = demo(1)
    token = e.tokenizer.encode("zebra")[0]
    r = e.run(job(FREE[0], max_tokens=5, logits=LogitsConfig(logit_bias=((token, 100.0),))))
    assert r.token_ids == [token] * 5


@pytest.mark.slow  # the fast suite has it on a tiny model: test_every_feature_batched_equals_one_at_a_time
def test_penalties_change_the_text_and_a_batch_equals_one_at_a_time(demo):
    """Penalized rows of every kind, greedy and sampled, batched beside a free
    row: the texts of one at a time (float32). The demo model copies this edit
    with such confidence that a presence penalty of 2 leaves it as it is; the
    others move it."""
    kinds = [LogitsConfig(presence_penalty=1.5), LogitsConfig(frequency_penalty=2.0),
             LogitsConfig(repetition_penalty=1.8, repetition_context_size=8),
             LogitsConfig(logit_bias=((30, 12.0),), presence_penalty=-0.5)]  # fmt: skip
    jobs = [job(EDIT, f"p{i}", max_tokens=20, logits=k) for i, k in enumerate(kinds)]
    jobs.append(job(EDIT, "sampled", max_tokens=20, logits=kinds[1], sampling=SamplingConfig(temperature=0.8, seed=3)))
    jobs.append(job(EDIT, "free", max_tokens=20))
    alone = {r.id: r.text for r in demo(1).run_all(jobs)}
    batched = {r.id: r.text for r in demo(8).run_all(jobs)}
    assert batched == alone
    assert all(alone[f"p{i}"] != alone["free"] for i in (1, 2, 3))


def test_pld_verifies_drafts_through_grammar_and_penalties_and_equals_plain(demo):
    """One at a time under PLD, a verify pass's rows are processed and masked as
    if the draft before them were generated: the greedy text is plain
    decoding's (float32), with drafts verified and accepted."""
    code = {"type": "object", "properties": {"code": {"type": "string", "maxLength": 60}},
            "required": ["code"], "additionalProperties": False}  # fmt: skip
    jobs = [job(EDIT, "pen", max_tokens=30, logits=LogitsConfig(frequency_penalty=0.3, repetition_penalty=1.1, logit_bias=((30, -2.0),))),
            job(EDIT, "json", max_tokens=60, json_schema=json.dumps(code))]  # fmt: skip
    plain = {r.id: r for r in demo(1, "none").run_all(jobs)}
    pld = {r.id: r for r in demo(1, "pld").run_all(jobs)}
    for i in ("pen", "json"):
        assert pld[i].text == plain[i].text, i
        assert pld[i].stats.draft == "pld" and pld[i].stats.pld_accepted > 0, i
    jsonschema.validate(json.loads(pld["json"].text), code)


# ---------------------------------------------------------------------------
# files end to end: the OpenAI client's models parse every body; resume


def run_batch_file(tmp_path, lines, rows: int) -> dict:
    """`batchgen run` over an OpenAI batch file of `lines` (float32, `rows` rows; one
    line refused: exit 1), then again, which resumes and writes nothing; the result
    lines by custom_id."""
    from test_cli import invoke, read_lines, write_jobs

    jobs = write_jobs(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "out.jsonl"
    args = ("run", str(jobs), "-o", str(out), "--dtype", "float32", "--batch-size", str(rows), "-q")
    r = invoke(*args)
    assert r.exit_code == 1, r.stderr
    before = out.read_bytes()
    r = invoke(*args)
    assert r.exit_code == 1 and out.read_bytes() == before
    return {l["custom_id"]: l for l in read_lines(out)}


def test_openai_batch_file_with_every_feature_parses_with_openai_models(tmp_path):
    """A batch file for dataset generation run through `batchgen run`: n
    choices, logprobs, schema output and penalties; every body parses with the
    openai client's ChatCompletion / Completion; a second run resumes (one
    line per custom_id, nothing written again)."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    schema = SCHEMAS["enums"]
    msgs = [{"role": "user", "content": "Pick a colour and a size."}]
    chat = lambda body: {"custom_id": body.pop("id"), "method": "POST", "url": "/v1/chat/completions",  # noqa: E731
                         "body": {"model": "demo", "messages": msgs, "max_tokens": 40, **body}}
    lines = [
        chat({"id": "schema-n2", "n": 2, "temperature": 0.9, "seed": 1, "logprobs": True, "top_logprobs": 3,
              "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}}),
        chat({"id": "penalized", "presence_penalty": 1.0, "frequency_penalty": 0.5, "logit_bias": {"30": -100}}),
        {"custom_id": "legacy", "method": "POST", "url": "/v1/completions",
         "body": {"model": "demo", "prompt": "def add(a, b):", "max_tokens": 6, "logprobs": 2, "n": 2}},
        chat({"id": "tools", "tools": [{"type": "function", "function": {"name": "f"}}]}),
        chat({"id": "predicted", "prediction": {"type": "content", "content": "Red, small."}, "store": False,
              "service_tier": "auto", "stream": False}),
    ]  # fmt: skip
    got = run_batch_file(tmp_path, lines, rows=4)
    body = ChatCompletion.model_validate(got["schema-n2"]["response"]["body"])
    assert [c.index for c in body.choices] == [0, 1]
    for c in body.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
        tokens = c.logprobs.content
        assert "".join(t.token for t in tokens) == c.message.content
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in tokens)
    assert body.usage.completion_tokens == sum(len(c.logprobs.content) + 1 for c in body.choices)  # each ends at EOS
    pen = ChatCompletion.model_validate(got["penalized"]["response"]["body"])
    assert pen.choices[0].logprobs is None and pen.usage.completion_tokens > 0
    legacy = Completion.model_validate(got["legacy"]["response"]["body"])
    assert len(legacy.choices) == 2 and legacy.usage.completion_tokens == 12
    for c in legacy.choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == 6 and all(len(t) == 2 for t in lp.top_logprobs)
        assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    assert got["tools"]["error"] == {"code": "unsupported", "message": "'body.tools' is not supported by batchgen", "line": 4}
    predicted = ChatCompletion.model_validate(got["predicted"]["response"]["body"])
    assert predicted.usage.completion_tokens > 0 and got["predicted"]["error"] is None
    details = predicted.usage.completion_tokens_details  # OpenAI's counts of the prediction's tokens
    tokens = len(load_tokenizer(DEMO_MODEL_DIR).encode("Red, small.", add_special_tokens=False))
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == tokens
    assert pen.usage.completion_tokens_details.accepted_prediction_tokens == 0  # no prediction


def test_responses_batch_file_parses_with_the_openai_response_model(tmp_path):
    """/v1/responses lines (OpenAI's newer endpoint, which its Batch API takes) through
    `batchgen run`: each body parses with the openai client's `Response`; schema
    output validates; logprobs spell the text; a text cut by max_output_tokens is an
    incomplete response; a refused key is the line's error; a rerun resumes."""
    from openai.types.responses import Response

    schema = SCHEMAS["enums"]
    line = lambda cid, body: {"custom_id": cid, "method": "POST", "url": "/v1/responses",  # noqa: E731
                              "body": {"model": "demo", "input": "Pick a colour and a size.", **body}}
    lines = [
        line("schema", {"max_output_tokens": 60, "include": ["message.output_text.logprobs"], "top_logprobs": 2,
                        "text": {"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}}}),
        line("cut", {"instructions": "Answer in Python.", "input": [{"role": "user", "content": [{"type": "input_text", "text": "def add(a, b):"}]}],
                     "max_output_tokens": 3, "metadata": {"task": "t1"}}),
        line("tools", {"tools": [{"type": "web_search"}]}),
    ]  # fmt: skip
    got = run_batch_file(tmp_path, lines, rows=2)
    made = Response.model_validate(got["schema"]["response"]["body"])
    assert made.status == "completed" and made.incomplete_details is None
    jsonschema.validate(json.loads(made.output_text), schema)
    (part,) = made.output[0].content
    assert "".join(t.token for t in part.logprobs) == made.output_text
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in part.logprobs)
    assert made.usage.output_tokens == len(part.logprobs) + 1  # ends at EOS, which has no entry
    cut = Response.model_validate(got["cut"]["response"]["body"])
    assert (cut.status, cut.incomplete_details.reason, cut.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    assert cut.metadata == {"task": "t1"} and cut.usage.total_tokens == cut.usage.input_tokens + 3
    assert got["tools"]["error"] == {"code": "unsupported", "message": "'body.tools' is not supported by batchgen", "line": 3}


def test_native_samples_line_resumes(tmp_path):
    from test_cli import invoke, read_lines, write_jobs

    jobs = write_jobs(tmp_path / "jobs.jsonl", [
        {"id": "a", "prompt": "def f(", "n": 3, "temperature": 1.0, "seed": 5, "max_tokens": 4, "logprobs": True},
        {"id": "b", "prompt": "import", "max_tokens": 3},
    ])  # fmt: skip
    out = tmp_path / "out.jsonl"
    assert invoke("run", str(jobs), "-o", str(out), "--dtype", "float32", "-q").exit_code == 0
    a, b = read_lines(out)
    assert set(a) == {"id", "samples", "usage", "stats", "metadata", "error"} and "text" in b
    assert [s["index"] for s in a["samples"]] == [0, 1, 2]
    assert all(set(s) == {"index", "text", "finish_reason", "completion_tokens", "logprobs"} for s in a["samples"])
    assert a["usage"]["completion_tokens"] == sum(s["completion_tokens"] for s in a["samples"])
    before = out.read_bytes()
    r = invoke("run", str(jobs), "-o", str(out), "--dtype", "float32")
    assert r.exit_code == 0 and "2 jobs already have results" in r.stderr and out.read_bytes() == before


# ---------------------------------------------------------------------------
# the matrices: every architecture, TurboQuant's batch (slow beyond the first)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_every_feature_batched_equals_one_at_a_time(model_dir, arch):
    """Penalties, bias, logprobs, a schema and n samples in one batch of a tiny
    model of each architecture: texts and logprobs as one at a time (float32)."""
    from test_batch import engine

    from tiny import CORPUS

    path = model_dir(arch)
    jobs = [job(CORPUS[0], "pen", max_tokens=12, logits=LogitsConfig(presence_penalty=1.0, repetition_penalty=1.3)),
            job(CORPUS[1], "bias", max_tokens=8, logits=LogitsConfig(logit_bias=((5, 3.0),), frequency_penalty=0.5)),
            job(CORPUS[2], "lp", max_tokens=8, logprobs=True, top_logprobs=3),
            job(CORPUS[3], "json", max_tokens=24, json_schema=json.dumps(SCHEMAS["enums"])),
            job(CORPUS[4], "n", max_tokens=6, n=3, sampling=SamplingConfig(temperature=1.0, seed=11), logprobs=True)]  # fmt: skip

    def run(e):
        out = {}
        for r in e.run_all(jobs):
            assert r.ok, r.error
            for s in r.samples or [r]:
                out[(r.id, len(out))] = (s.text, s.logprobs)
        return sorted(out.values(), key=str)

    alone, batched = run(engine(path, 1)), run(engine(path, 8))
    assert [t for t, _ in batched] == [t for t, _ in alone]
    for (_, a), (_, b) in zip(alone, batched):
        assert (a is None) == (b is None)
        if a is not None:
            assert [e["token"] for e in a] == [e["token"] for e in b]
            assert [e["logprob"] for e in b] == pytest.approx([e["logprob"] for e in a], abs=2e-5)


@pytest.mark.slow
def test_turboquant_batch_takes_every_feature(demo):
    """The batch over TurboQuant codes: schemas validate, samples and logprobs come back."""
    from batchgen.config import KVConfig

    cfg = EngineConfig(model=str(DEMO_MODEL_DIR), dtype="float32", batch_size=8, kv=KVConfig(kind="turboquant"),
                       decode=DecodeConfig(draft="none"))  # fmt: skip
    e = Engine.load(cfg)
    jobs = constrained_jobs() + [job(FREE[0], "n", max_tokens=8, n=3, logprobs=True, top_logprobs=2,
                                     sampling=SamplingConfig(temperature=0.7, seed=2))]  # fmt: skip
    got = {r.id: r for r in e.run_all(jobs)}
    check_constrained(got)
    assert all(s.completion_tokens - 1 <= len(s.logprobs) <= s.completion_tokens for s in got["n"].samples)
    assert len(got["n"].samples) == 3
