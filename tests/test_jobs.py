"""The job-file contract on literal lines: no model, no mlx."""

from pathlib import Path

import pytest

from batchgen.jobs import (
    CHAT, COMPLETION, NATIVE, BadJob, Defaults, Header, Job, JobFileError, parse_job, scan_jobs,
)  # fmt: skip

D = Defaults(Header(), max_tokens=64, seed=None)


def parse(line: str, fmt=NATIVE, d=D):
    return parse_job(line.encode(), 7, fmt, d)


def test_native_job_with_all_keys():
    job = parse(
        '{"id": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,'
        ' "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 3,'
        ' "stop": ["\\n\\n"], "metadata": {"k": [1]}, "draft": "none", "kv_cache": "turboquant", "kv_bits": 3}'
    )
    assert isinstance(job, Job)
    assert (job.id, job.line, job.max_tokens, job.stop, job.metadata) == ("a1", 7, 9, ("\n\n",), {"k": [1]})
    s = job.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.9, 40, 0.05, 3)
    assert (job.draft, job.kv_cache, job.kv_bits) == ("none", "turboquant", 3)


def test_defaults_id_from_line_and_max_tokens():
    job = parse('{"prompt": "x"}')
    assert job.id == "7" and job.max_tokens == 64 and job.prompt == "x" and job.messages is None
    assert job.sampling.greedy


def test_header_defaults_and_system_apply():
    d = Defaults(Header(system="SYS", defaults={"max_tokens": 5, "temperature": 0.3}), 64, 9)
    job = parse('{"messages": [{"role": "user", "content": "q"}]}', d=d)
    assert job.messages[0] == {"role": "system", "content": "SYS"}
    assert job.max_tokens == 5 and job.sampling.temperature == 0.3 and job.sampling.seed == 9
    own = parse('{"messages": [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}]}', d=d)
    assert [m["content"] for m in own.messages] == ["mine", "q"]
    raw = parse('{"prompt": "p"}', d=d)
    assert raw.prompt == "p" and raw.messages is None


@pytest.mark.parametrize(
    "line, kind, words",
    [
        ("{not json", "invalid_json", "not valid JSON"),
        ("[1, 2]", "invalid_job", "JSON object"),
        ('{"id": "x"}', "invalid_job", "exactly one of"),
        ('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "invalid_job", "exactly one of"),
        ('{"prompt": "a", "temprature": 0.5}', "unknown_key", "'temprature'"),
        ('{"prompt": "a", "max_tokens": -1}', "invalid_value", "max_tokens"),
        ('{"prompt": "a", "max_tokens": "5"}', "invalid_value", "max_tokens"),
        ('{"prompt": "a", "max_tokens": true}', "invalid_value", "max_tokens"),
        ('{"prompt": "a", "temperature": -0.1}', "invalid_value", "temperature"),
        ('{"prompt": "a", "top_p": 0}', "invalid_value", "top_p"),
        ('{"prompt": "a", "stop": [""]}', "invalid_value", "stop"),
        ('{"prompt": ""}', "invalid_value", "prompt"),
        ('{"prompt": "a", "draft": "eagle"}', "invalid_value", "draft"),
        ('{"prompt": "a", "kv_bits": 8}', "invalid_value", "kv_bits"),
        ('{"messages": []}', "invalid_job", "non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "invalid_job", "role"),
        ('{"messages": [{"role": "user"}]}', "invalid_job", "content"),
        ('{"messages": [{"role": "user", "content": 5}]}', "invalid_value", "content"),
        ('{"messages": [{"role": "user", "content": "x", "colour": 1}]}', "unknown_key", "colour"),
        ('{"id": 3.5, "prompt": "a"}', "invalid_value", "'id'"),
        ('{"batchgen": {}}', "invalid_job", "header"),
    ],
)
def test_bad_lines_become_bad_jobs(line, kind, words):
    bad = parse(line)
    assert isinstance(bad, BadJob)
    assert bad.kind == kind and bad.line == 7
    assert words in bad.message


def test_bad_job_keeps_its_id_when_readable():
    assert parse('{"id": "z9", "prompt": "a", "bogus": 1}').id == "z9"
    assert parse("nope").id == "7"


def test_openai_chat_and_completion_lines():
    chat = parse(
        '{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": '
        '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],'
        ' "max_completion_tokens": 12, "temperature": 0}}',
        fmt=CHAT,
    )
    assert (chat.id, chat.format, chat.max_tokens, chat.model_name) == ("r1", CHAT, 12, "m")
    assert chat.messages[-1]["content"] == "hi"
    comp = parse(
        '{"custom_id": "r2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "abc", "max_tokens": 3}}',
        fmt=CHAT,
    )
    assert (comp.format, comp.prompt, comp.max_tokens) == (COMPLETION, "abc", 3)


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"custom_id": "r", "method": "GET", "url": "/v1/completions", "body": {"prompt": "a"}}', "POST"),
        ('{"custom_id": "r", "method": "POST", "url": "/v1/embeddings", "body": {}}', "url"),
        ('{"custom_id": "r", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "echo": true}}', "body.echo"),
        ('{"custom_id": "r", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "n": 0}}', "'n'"),
        ('{"custom_id": "r", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m"}}', "body.messages"),
        ('{"prompt": "a"}', "native job"),
    ],
)
def test_bad_openai_lines(line, words):
    bad = parse(line, fmt=CHAT)
    assert isinstance(bad, BadJob) and words in bad.message
    if '"custom_id"' in line:
        assert bad.id == "r"


def write(tmp_path: Path, *lines: str) -> Path:
    p = tmp_path / "jobs.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_scan_counts_and_most_common_system(tmp_path):
    sys_a = '{"role": "system", "content": "A"}'
    path = write(
        tmp_path,
        f'{{"messages": [{sys_a}, {{"role": "user", "content": "1"}}]}}',
        "",
        f'{{"messages": [{sys_a}, {{"role": "user", "content": "2"}}]}}',
        '{"messages": [{"role": "system", "content": "B"}, {"role": "user", "content": "3"}]}',
        "garbage",
    )
    items = []
    scan, _ = scan_jobs(path, 16, None, on_item=items.append)
    assert (scan.jobs, scan.bad, scan.format) == (4, 1, NATIVE)
    assert (scan.common_system, scan.common_system_jobs) == ("A", 2)
    assert scan.ids == {"1", "3", "4", "5"}
    assert [b.line for b in items if isinstance(b, BadJob)] == [5]


def test_scan_header_and_format(tmp_path):
    path = write(
        tmp_path,
        '{"batchgen": {"system": "S", "defaults": {"max_tokens": 7}}}',
        '{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}',
    )
    scan, d = scan_jobs(path, 16, None)
    assert scan.header == Header("S", {"max_tokens": 7}) and scan.header_line == 1
    assert scan.format == CHAT and scan.jobs == 1 and scan.common_system == "S"


@pytest.mark.parametrize(
    "header, words",
    [
        ('{"batchgen": {"sytem": "S"}}', "unknown key 'sytem'"),
        ('{"batchgen": {"defaults": {"max_tokens": 0}}}', "max_tokens"),
        ('{"batchgen": {"defaults": {"id": "x"}}}', "unknown default"),
        ('{"batchgen": "S"}', "must be an object"),
    ],
)
def test_bad_header_makes_file_unusable(tmp_path, header, words):
    with pytest.raises(JobFileError, match=words):
        scan_jobs(write(tmp_path, header, '{"prompt": "a"}'), 16, None)


def test_duplicate_ids_make_file_unusable(tmp_path):
    path = write(tmp_path, '{"id": "a", "prompt": "x"}', '{"prompt": "y"}', '{"id": "a", "prompt": "z"}')
    with pytest.raises(JobFileError, match=r"duplicate job id 'a' on lines 1 and 3"):
        scan_jobs(path, 16, None)
    # an explicit id equal to another line's default id is a duplicate too
    path = write(tmp_path, '{"prompt": "x"}', '{"id": "1", "prompt": "y"}')
    with pytest.raises(JobFileError, match="duplicate job id '1'"):
        scan_jobs(path, 16, None)


def test_unreadable_file(tmp_path):
    with pytest.raises(JobFileError, match="cannot read job file"):
        scan_jobs(tmp_path / "missing.jsonl", 16, None)


def test_native_generation_features():
    job = parse(
        '{"prompt": "x", "n": 3, "logprobs": true, "top_logprobs": 4, "presence_penalty": 0.5,'
        ' "frequency_penalty": -1, "repetition_penalty": 1.2, "repetition_context_size": 8,'
        ' "logit_bias": {"12": -100, "3": 2.5}, "json_schema": {"type": "object", "b": 1, "a": 2}}'
    )
    assert (job.n, job.logprobs, job.top_logprobs) == (3, True, 4)
    lc = job.logits
    assert (lc.presence_penalty, lc.frequency_penalty, lc.repetition_penalty, lc.repetition_context_size) == (0.5, -1.0, 1.2, 8)
    assert lc.logit_bias == ((3, 2.5), (12, -100.0)) and lc.active
    assert job.json_schema == '{"type":"object","b":1,"a":2}'  # the keys' order kept: it orders the output's
    assert parse('{"prompt": "x", "json_schema": true}').json_schema == "{}"  # any JSON, in the form the grammar takes
    assert job.needs_logits and not parse('{"prompt": "x"}').needs_logits


@pytest.mark.parametrize(
    "body, schema",
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, '{"type":"object"}'),
        ({"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {"type": "integer"}}},
         '{"type":"integer"}'),
    ],
)
def test_response_format_in_both_formats(body, schema):
    import json

    native = parse(json.dumps({"prompt": "x", "response_format": body}))
    chat = parse(json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"messages": [{"role": "user", "content": "q"}], "response_format": body}}), fmt=CHAT)  # fmt: skip
    assert native.json_schema == chat.json_schema == schema


def test_openai_bodies_take_samples_logprobs_and_penalties():
    chat = parse(
        '{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages":'
        ' [{"role": "user", "content": "q"}], "n": 2, "logprobs": true, "top_logprobs": 2, "presence_penalty": 1,'
        ' "frequency_penalty": 0.5, "logit_bias": {"7": 3}, "seed": 4}}',
        fmt=CHAT,
    )
    assert (chat.n, chat.logprobs, chat.top_logprobs, chat.sampling.seed) == (2, True, 2, 4)
    assert (chat.logits.presence_penalty, chat.logits.frequency_penalty, chat.logits.logit_bias) == (1.0, 0.5, ((7, 3.0),))
    legacy = parse('{"custom_id": "l", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "logprobs": 3}}', fmt=CHAT)
    assert (legacy.format, legacy.logprobs, legacy.top_logprobs) == (COMPLETION, True, 3)


@pytest.mark.parametrize(
    "line, kind, words",
    [
        ('{"prompt": "a", "n": 0}', "invalid_value", "'n' must be an integer in 1..128"),
        ('{"prompt": "a", "n": 129}', "invalid_value", "1..128"),
        ('{"prompt": "a", "logprobs": 1}', "invalid_value", "'logprobs' must be true or false"),
        ('{"prompt": "a", "top_logprobs": 2}', "invalid_value", "'top_logprobs' needs 'logprobs': true"),
        ('{"prompt": "a", "logprobs": true, "top_logprobs": 21}', "invalid_value", "0..20"),
        ('{"prompt": "a", "presence_penalty": 2.5}', "invalid_value", "[-2, 2]"),
        ('{"prompt": "a", "repetition_penalty": 0}', "invalid_value", "> 0"),
        ('{"prompt": "a", "logit_bias": {"x": 1}}', "invalid_value", "token id"),
        ('{"prompt": "a", "logit_bias": {"5": 101}}', "invalid_value", "[-100, 100]"),
        ('{"prompt": "a", "response_format": {"type": "yaml"}}', "invalid_value", "'yaml'"),
        ('{"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}', "invalid_value", "'schema'"),
        ('{"prompt": "a", "response_format": {"type": "json_object", "schema": {}}}', "unknown_key", "response_format.schema"),
        ('{"prompt": "a", "json_schema": {"type": "object"}, "response_format": {"type": "json_object"}}', "invalid_job", "one of"),
        ('{"prompt": "a", "json_schema": "object"}', "invalid_value", "a JSON schema"),
        ('{"prompt": "a", "json_schema": false}', "invalid_value", "a JSON schema (an object), got False"),
    ],
)
def test_bad_feature_values(line, kind, words):
    bad = parse(line)
    assert isinstance(bad, BadJob) and bad.kind == kind and words in bad.message, bad


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"messages": [{"role": "user", "content": "q"}], "tools": []}', "'body.tools' is not supported by batchgen"),
        ('{"messages": [{"role": "user", "content": "q"}], "audio": {}}', "'body.audio' is not supported by batchgen"),
        ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]}',
         "messages[0].content[1] has type 'image_url'; batchgen takes text parts only"),
        ('{"messages": [{"role": "user", "content": "q"}], "repetition_penalty": 1.1}', "unknown key 'body.repetition_penalty'"),
    ],
)
def test_what_openai_allows_and_batchgen_does_not_is_named(body, message):
    bad = parse('{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": ' + body + "}", fmt=CHAT)
    assert isinstance(bad, BadJob) and bad.message == message


def test_scan_counts_the_rows_samples_take(tmp_path):
    path = write(tmp_path, '{"prompt": "a", "n": 4}', '{"prompt": "b"}', '{"prompt": "c", "n": 0}')
    report, _ = scan_jobs(path, 16, None)
    assert (report.jobs, report.bad, report.extra_samples) == (3, 1, 3)


def chat_line(body: str) -> str:
    return '{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": ' + body + "}"


def test_keys_for_openai_s_service_alone_are_taken_and_change_nothing():
    q = '"messages": [{"role": "user", "content": "q"}], "max_tokens": 9'
    plain = parse(chat_line("{" + q + "}"), fmt=CHAT)
    served = parse(chat_line("{" + q + ', "store": false, "service_tier": "flex", "prompt_cache_key": "k1", "prompt_cache_retention": "24h", '
                             '"safety_identifier": "u-1", "parallel_tool_calls": true, "stream": false, '
                             '"stream_options": null}'), fmt=CHAT)  # fmt: skip
    assert isinstance(served, Job) and served == plain
    legacy = parse('{"custom_id": "l", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "stream": null}}', fmt=CHAT)
    assert isinstance(legacy, Job)


@pytest.mark.parametrize(
    "extra, kind, message",
    [
        ('"stream": true', "unsupported", "'body.stream' must be false or null: batchgen writes whole result lines"),
        ('"stream_options": {"include_usage": true}', "unsupported", "'body.stream_options' needs streaming, which batchgen does not do"),
        ('"store": "yes"', "invalid_value", "'body.store' must be true, false or null, got 'yes'"),
        ('"service_tier": 3', "invalid_value", "'body.service_tier' must be a string or null, got 3"),
        ('"prediction": {"type": "text", "content": "x"}', "invalid_value", "'prediction' must be an object with 'type': 'content'"),
        ('"prediction": {"type": "content", "content": [{"type": "image_url"}]}', "unsupported",
         "prediction.content[0] has type 'image_url'; batchgen takes text parts only"),
        ('"prediction": {"type": "content", "content": "x", "extra": 1}', "unknown_key", "unknown key 'prediction.extra'"),
    ],
)
def test_service_keys_and_predictions_with_bad_values_are_named(extra, kind, message):
    bad = parse(chat_line('{"messages": [{"role": "user", "content": "q"}], ' + extra + "}"), fmt=CHAT)
    assert isinstance(bad, BadJob) and (bad.kind, bad.message[: len(message)]) == (kind, message), bad


def test_a_prediction_is_the_text_of_the_expected_output():
    as_text = parse(chat_line('{"messages": [{"role": "user", "content": "q"}], "prediction": {"type": "content", "content": "def f(): pass"}}'), fmt=CHAT)
    as_parts = parse(chat_line('{"messages": [{"role": "user", "content": "q"}], "prediction": {"type": "content", '
                               '"content": [{"type": "text", "text": "def f(): "}, {"type": "text", "text": "pass"}]}}'), fmt=CHAT)  # fmt: skip
    native = parse('{"prompt": "q", "prediction": "def f(): pass"}')
    assert as_text.prediction == as_parts.prediction == native.prediction == "def f(): pass"
    assert parse('{"prompt": "q"}').prediction is None
    # the completions endpoint has no predicted outputs
    legacy = parse('{"custom_id": "l", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", "prediction": "x"}}', fmt=CHAT)
    assert isinstance(legacy, BadJob) and legacy.message == "unknown key 'body.prediction'"


def responses_line(body: str) -> str:
    return '{"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": ' + body + "}"


def test_responses_requests_read_as_chat_jobs_do():
    from batchgen.jobs import RESPONSES

    d = Defaults(Header(system="house system"), max_tokens=64, seed=None)
    text = parse(responses_line('{"input": "q", "max_output_tokens": 9, "temperature": 0.5, "model": "m"}'), fmt=CHAT, d=d)
    assert (text.format, text.max_tokens, text.sampling.temperature, text.model_name) == (RESPONSES, 9, 0.5, "m")
    assert text.messages == ({"role": "system", "content": "house system"}, {"role": "user", "content": "q"})
    items = parse(responses_line(
        '{"instructions": "be brief", "input": [{"role": "developer", "content": "d"}, {"type": "message", "role": "user",'
        ' "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},'
        ' {"role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]}]}'), fmt=CHAT, d=d)  # fmt: skip
    assert items.messages == ({"role": "system", "content": "be brief"}, {"role": "developer", "content": "d"},
                              {"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"})  # fmt: skip
    assert items.max_tokens == 64 and items.json_schema is None and not items.logprobs
    schema = parse(responses_line('{"input": "q", "text": {"format": {"type": "json_schema", "name": "x", "strict": true,'
                                  ' "schema": {"type": "object", "properties": {"b": {}, "a": {}}}}},'
                                  ' "include": ["message.output_text.logprobs"], "top_logprobs": 3}'), fmt=CHAT)  # fmt: skip
    assert schema.json_schema == '{"type":"object","properties":{"b":{},"a":{}}}'
    assert (schema.logprobs, schema.top_logprobs) == (True, 3)
    assert parse(responses_line('{"input": "q", "text": {"format": {"type": "json_object"}}}'), fmt=CHAT).json_schema == '{"type":"object"}'
    assert parse(responses_line('{"input": "q", "top_logprobs": 2}'), fmt=CHAT).logprobs  # alternatives ask for logprobs
    served = parse(responses_line('{"input": "q", "store": false, "truncation": "disabled", "prompt_cache_retention": "24h", '
                                  '"text": {"format": {"type": "text"}}}'), fmt=CHAT)  # fmt: skip
    assert isinstance(served, Job) and served.json_schema is None


def test_a_header_s_n_does_not_apply_to_responses_requests():
    d = Defaults(Header(defaults={"n": 3}), max_tokens=64, seed=None)
    bad = parse(responses_line('{"input": "q"}'), fmt=CHAT, d=d)
    assert isinstance(bad, BadJob) and bad.message == "a responses request has one output: the header's 'n' does not apply to it"
    assert parse(chat_line('{"messages": [{"role": "user", "content": "q"}]}'), fmt=CHAT, d=d).n == 3


@pytest.mark.parametrize(
    "body, kind, message",
    [
        ('{"input": "q", "tools": [{"type": "web_search"}]}', "unsupported", "'body.tools' is not supported by batchgen"),
        ('{"input": "q", "previous_response_id": "resp_1"}', "unsupported", "'body.previous_response_id' is not supported by batchgen"),
        ('{"input": "q", "reasoning": {"effort": "low"}}', "unsupported", "'body.reasoning' is not supported by batchgen"),
        ('{"input": "q", "include": ["reasoning.encrypted_content"]}', "unsupported",
         "'body.include' entry 'reasoning.encrypted_content' is not supported by batchgen"),
        ('{"input": "q", "truncation": "auto"}', "unsupported", "'body.truncation' 'auto' is not supported by batchgen (only 'disabled')"),
        ('{"input": "q", "text": {"verbosity": "low"}}', "unsupported", "'body.text.verbosity' is not supported by batchgen"),
        ('{"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}', "unsupported",
         "input[0] has type 'function_call_output'; batchgen takes messages only"),
        ('{"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}', "unsupported",
         "input[0].content[0] has type 'input_image'; batchgen takes text parts only"),
        ('{"input": [{"role": "tool", "content": "x"}]}', "invalid_job", "input[0].role must be one of system, developer, user, assistant"),
        ('{"instructions": "x"}', "invalid_job", "a responses request needs 'body.input'"),
        ('{"input": ""}', "invalid_job", "'input' must be a non-empty string or list"),
        ('{"input": "q", "max_output_tokens": 0}', "invalid_value", "'max_output_tokens' must be an integer in 1.."),
        ('{"input": "q", "text": {"format": {"type": "json_schema", "name": "x"}}}', "invalid_value",
         "'text.format' must be a json_schema format with a 'schema'"),
        ('{"input": "q", "messages": []}', "unknown_key", "unknown key 'body.messages'"),
    ],
)
def test_responses_requests_name_what_batchgen_does_not_do(body, kind, message):
    bad = parse(responses_line(body), fmt=CHAT)
    assert isinstance(bad, BadJob) and (bad.kind, bad.message[: len(message)]) == (kind, message), bad
