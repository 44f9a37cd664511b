"""Fuzz the OpenAI-compatible gateway (`/v1/chat/completions`, `/v1/completions`,
`/v1/responses`, `/v1/models`, with the real CPU vLLM engine behind it): whatever the body, the sampling fields
vLLM alone knows, the model name or the key, it never answers 5xx — not as a status and not as
an error event inside a stream — and the keep-alive connection stays usable
(`tests.fuzz.assert_door_holds`; the valid request after each is a 1-token chat completion).

The gateway's /openapi.json does not describe its bodies, so schemathesis covers paths, path
parameters and methods, and hypothesis strategies (`tests.fuzz`) carry the bodies: odd values
in each field of a valid request, unknown extra fields, prompt lists, and a table of named odd
sampling requests (`top_k: -5`, `logprobs: 1e9`, `min_tokens` > `max_tokens`, ...).
"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
import schemathesis
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import (ODD_IDS, Raw, assert_door_holds, dumps, fuzz_settings, header_values, keepalive_client,
                        mutations, odd_bodies, odd_values, send_case, server_errors)

pytestmark = pytest.mark.integration

SAMPLING_FIELDS = ["max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k", "min_p", "logprobs",
                   "top_logprobs", "min_tokens", "stop", "stop_token_ids", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "response_format", "structured_outputs",
                   "guided_json", "guided_regex", "guided_choice", "tools", "tool_choice", "parallel_tool_calls",
                   "stream", "stream_options", "metadata", "user", "cache_salt", "priority", "request_id",
                   "ignore_eos", "skip_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "bad_words",
                   "allowed_token_ids", "include_stop_str_in_output", "best_of", "use_beam_search", "length_penalty",
                   "vllm_xargs", "kv_transfer_params", "logits_processors", "return_tokens_as_token_ids"]
"""OpenAI's sampling fields and vLLM's own extras, each of which a client may send."""
CHAT_ONLY = ["chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents",
             "mm_processor_kwargs", "echo"]
COMPLETION_ONLY = ["suffix", "echo", "prompt_embeds", "add_special_tokens"]

SAMPLING_VALUES = st.sampled_from([-5, -1, 0, 1, 10**9, 2**31, 2**63, 1e9, -0.5, 0.5, 100.0, True, "", "x", [], {},
                                   [-1], [10**9], {"1": 100}, {"99999999": 1}, {"x": Raw("NaN")}])
"""Typed but out-of-range values for sampling fields (odd_values() adds the untyped ones)."""

STOP_10K = Raw(json.dumps([f"s{i}" for i in range(10_000)]), "stop of 10,000 strings")


def chat_body(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def completion_body(model: str) -> dict:
    return {"model": model, "prompt": "hi", "max_tokens": 2, "temperature": 0}


CHAT_PATHS = ([(), ("model",), ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
               ("messages", 0, "name"), ("messages", 0, "tool_calls"), ("messages", 0, "tool_call_id"),
               ("messages", 1)] + [(f,) for f in SAMPLING_FIELDS + CHAT_ONLY])
COMPLETION_PATHS = [(), ("model",), ("prompt",)] + [(f,) for f in SAMPLING_FIELDS + COMPLETION_ONLY]

RESPONSES_FIELDS = ["model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature",
                    "top_p", "max_output_tokens", "metadata", "stream", "stream_options", "user", "store", "background",
                    "previous_response_id", "conversation", "prompt", "include", "text", "reasoning", "truncation",
                    "top_logprobs", "service_tier", "max_tool_calls"]
"""Every field of a Responses request (and a few clora does not take)."""


def responses_body(model: str) -> dict:
    return {"model": model, "instructions": "be brief", "max_output_tokens": 2, "temperature": 0,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "metadata": {"group_id": "g-1"}, "text": {"format": {"type": "text"}},
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}


RESPONSES_PATHS = ([(), ("input", 0), ("input", 0, "role"), ("input", 0, "content"), ("input", 0, "content", 0),
                    ("input", 0, "content", 0, "type"), ("input", 0, "content", 0, "text"), ("input", 0, "type"),
                    ("input", 1, "call_id"), ("input", 1, "name"), ("input", 1, "arguments"), ("input", 1, "type"),
                    ("input", 2, "call_id"), ("input", 2, "output"), ("input", 3), ("tools", 0),
                    ("tools", 0, "type"), ("tools", 0, "name"), ("tools", 0, "parameters"), ("tools", 0, "strict"),
                    ("tools", 0, "description"), ("metadata", "group_id"), ("metadata", "episode_id"),
                    ("text", "format")] + [(f,) for f in RESPONSES_FIELDS])

PROMPTS = st.sampled_from([
    Raw('["a", "b"]'), Raw("[1, 2, 3]"), Raw("[[1, 2], [3]]"), Raw("[]"), Raw('[""]'), Raw("[[]]"), Raw("[-1]"),
    Raw("[1000000000]"), Raw("[18446744073709551616]"), Raw('["a", 1]'), Raw('[["a"]]'), Raw('[null]'),
    Raw(json.dumps(["p"] * 100), "100 prompts"), Raw(json.dumps([[1]] * 100), "100 token prompts"),
    Raw(json.dumps("hi " * 2000), "prompt longer than max_model_len")])
"""`prompt` as a list: several prompts, token ids (in and out of the vocabulary), mixed, nested."""

NAMED_CASES = {
    "top_k -5": {"top_k": -5},
    "logprobs 1e9 (chat)": {"logprobs": True, "top_logprobs": Raw("1e9")},
    "top_logprobs 10**9": {"logprobs": True, "top_logprobs": 10**9},
    "min_tokens > max_tokens": {"min_tokens": 5, "max_tokens": 2},
    "min_tokens 10**9": {"min_tokens": 10**9},
    "stop of 10,000 strings": {"stop": STOP_10K},
    "stop of one huge string": {"stop": "x" * 100_000},
    "structured_outputs true": {"structured_outputs": True},
    "structured_outputs json NaN": {"structured_outputs": {"json": Raw("NaN")}},
    "response_format junk": {"response_format": {"type": "json_schema", "json_schema": {"schema": Raw("NaN")}}},
    "guided_regex invalid": {"guided_regex": "(("},
    "temperature NaN": {"temperature": Raw("NaN")},
    "temperature Infinity": {"temperature": Raw("Infinity")},
    "top_p -Infinity": {"top_p": Raw("-Infinity")},
    "seed 2**64": {"seed": 2**64},
    "seed -1": {"seed": -1},
    "n 0": {"n": 0},
    "best_of 10**6": {"best_of": 10**6},
    "logit_bias NaN": {"logit_bias": {"1": Raw("NaN")}},
    "logit_bias bad token": {"logit_bias": {"99999999": 1}},
    "stop_token_ids -1": {"stop_token_ids": [-1]},
    "allowed_token_ids empty": {"allowed_token_ids": []},
    "bad_words 10,000": {"bad_words": STOP_10K},
    "truncate_prompt_tokens -5": {"truncate_prompt_tokens": -5},
    "prompt_logprobs 10**9": {"prompt_logprobs": 10**9},
    "priority 10**30": {"priority": 10**30},
    "repetition_penalty 0": {"repetition_penalty": 0},
    "presence_penalty 1e300": {"presence_penalty": 1e300},
    "max_tokens true": {"max_tokens": True},
    "stream + logprobs 1e9": {"stream": True, "logprobs": True, "top_logprobs": Raw("1e9")},
    "stream + top_k -5": {"stream": True, "top_k": -5},
    "stream_options junk": {"stream": True, "stream_options": {"include_usage": "yes"}},
    "vllm_xargs junk": {"vllm_xargs": {"a": [Raw("NaN")]}},
    "kv_transfer_params junk": {"kv_transfer_params": {"do_remote_decode": "x"}},
    "cache_salt empty": {"cache_salt": ""},
    "metadata NaN": {"metadata": {"group_id": Raw("NaN")}},
    "metadata episode id with newline": {"metadata": {"episode_id": "ep\n"}},
    "chat_template_kwargs junk": {"chat_template_kwargs": {"tools": Raw("NaN")}},
    "chat_template injection": {"chat_template": "{{ ''.__class__ }}{% for %}"},
    "tools not a list": {"tools": {"type": "function"}},
    "tool_choice unknown function": {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
    "content parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    "content image part": {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                       "image_url": {"url": "file:///etc/passwd"}}]}]},
    "assistant prefill": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                          "continue_final_message": True, "add_generation_prompt": False},
    "1000 messages": {"messages": [{"role": "user", "content": "hi"}] * 1000},
    "1001 messages": {"messages": [{"role": "user", "content": "hi"}] * 1001},
    "content surrogate": {"messages": [{"role": "user", "content": Raw('"\\ud800"')}]},
    "content NUL": {"messages": [{"role": "user", "content": "a\x00b"}]},
    "prompt list (completions)": {"prompt": ["a", "b"]},
    "prompt token ids out of vocab (completions)": {"prompt": [10**9]},
    "prompt ids mixed (completions)": {"prompt": [[1, 2], "a"]},
    "echo + logprobs (completions)": {"echo": True, "logprobs": 5},
    "logprobs 1e9 (completions)": {"logprobs": Raw("1e9")},
    "suffix (completions)": {"suffix": "x"},
    "prompt surrogate (completions)": {"prompt": Raw('"\\ud800"')},
    "prompt_embeds junk (completions)": {"prompt_embeds": "AAAA"},
}
"""Named odd requests, each merged into a valid request of the route its name says (chat
unless marked "(completions)")."""


@pytest.fixture
def door(serving, tenants):
    """(client, valid request, error log, tenant): one keep-alive connection to the gateway
    with a tenant's key, and a 1-token chat completion sent on it."""
    tenant, key = tenants.create(11)

    def valid():
        return client.post("/v1/chat/completions", json={**chat_body(tenant), "max_tokens": 1})

    with keepalive_client(serving.url.removesuffix("/v1"), timeout_s=120) as client, server_errors() as log:
        client.headers["Authorization"] = f"Bearer {key}"
        assert valid().status_code == 200
        yield client, valid, log, tenant


def assert_stream_holds(r: httpx.Response) -> None:
    """A streamed answer carries no error event with a 5xx code (vLLM puts the status there),
    nor, on `/v1/responses`, a `response.failed` for a server error."""
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        return
    for line in r.text.splitlines():
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            event = json.loads(line[6:])
            if event.get("type") == "response.failed":
                assert event["response"]["error"]["code"] != "server_error", f"the stream failed: {line[:1500]}"
            error = event.get("error")
            code = error.get("code") if isinstance(error, dict) else None
            assert error is None or not (isinstance(code, int) and code >= 500 or error.get("type") ==
                                         "server_error"), f"the stream carried a server error: {line[:1500]}"


def send(client, valid, log, path: str, body) -> httpx.Response:
    r = assert_door_holds(client, "POST", path, valid, content=dumps(body),
                          headers={"Content-Type": "application/json"}, log=log)
    assert_stream_holds(r)
    return r


def test_schemathesis_requests_never_5xx_and_keep_the_connection(serving, door):
    client, valid, log, _ = door
    schema = schemathesis.openapi.from_url(f"{str(client.base_url).rstrip('/')}/openapi.json")
    strategy = st.one_of(*(op.ok().as_strategy(generation_mode=mode) for op in schema.get_all_operations()
                           for mode in schemathesis.GenerationMode))
    seen: set[tuple[str, str]] = set()

    @fuzz_settings(40)
    @given(case=strategy)
    def run(case):
        seen.add((case.method, case.path))
        send_case(client, case, valid, headers=dict(client.headers), log=log)

    run()
    assert ("POST", "/v1/chat/completions") in seen and ("GET", "/v1/models/{model}") in seen, seen


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_odd_values_in_any_field_never_5xx(door, path):
    client, valid, log, tenant = door
    chat = path == "/v1/chat/completions"
    body, places = (chat_body(tenant), CHAT_PATHS) if chat else (completion_body(tenant), COMPLETION_PATHS)
    values = odd_values() | SAMPLING_VALUES | st.just(STOP_10K) | (st.nothing() if chat else PROMPTS)

    @fuzz_settings(60)
    @given(change=mutations(places, values))
    def run(change):
        send(client, valid, log, path, change.apply(body))

    run()


def test_odd_values_in_any_responses_field_never_5xx(door):
    """`/v1/responses`: any odd JSON value in any field (or item, part or tool), whole or
    streamed, is answered; every 4xx in OpenAI's error shape."""
    client, valid, log, tenant = door

    @fuzz_settings(80)
    @given(change=mutations(RESPONSES_PATHS, odd_values() | SAMPLING_VALUES), stream=st.booleans())
    def run(change, stream):
        body = change.apply({**responses_body(tenant), "stream": stream})
        r = send(client, valid, log, "/v1/responses", body)
        if r.status_code >= 400:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), r.text

    run()


def test_prompt_lists_never_5xx(door):
    client, valid, log, tenant = door

    @fuzz_settings(30)
    @given(prompt=PROMPTS | odd_values())
    def run(prompt):
        send(client, valid, log, "/v1/completions", {**completion_body(tenant), "prompt": prompt})

    run()


@pytest.mark.parametrize("name", list(NAMED_CASES))
def test_named_odd_requests_never_5xx(door, name):
    client, valid, log, tenant = door
    path, body = (("/v1/completions", completion_body(tenant)) if name.endswith("(completions)")
                  else ("/v1/chat/completions", chat_body(tenant)))
    send(client, valid, log, path, {**body, **NAMED_CASES[name]})


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_odd_bodies_never_5xx(door, path):
    client, valid, log, _ = door

    @fuzz_settings(30)
    @given(content=odd_bodies())
    def run(content):
        assert_door_holds(client, "POST", path, valid, content=content, headers={"Content-Type": "application/json"},
                          log=log)

    run()


def test_odd_model_names_never_5xx(door):
    """Model names with a trailing newline, ':', '/', another tenant's pinned version, in the
    body of both completion routes and in `/v1/models/{model}`."""
    client, valid, log, tenant = door
    names = (st.sampled_from(ODD_IDS) | st.text(max_size=30)
             | st.sampled_from([f"{tenant}@v1\n", f"{tenant}@v0", f"{tenant}@v999999999", f"{tenant}@v1:x",
                                f"{tenant}/x", f"{tenant}\n", f"{tenant}@v01", f"{tenant}@v1 ", "tiny\n"]))

    @fuzz_settings(40)
    @given(name=names, where=st.sampled_from(["chat", "completion", "models"]))
    def run(name, where):
        if where == "models":
            assert_door_holds(client, "GET", "/v1/models/" + quote(name, safe="", errors="surrogatepass"), valid,
                              log=log)
        elif where == "chat":
            send(client, valid, log, "/v1/chat/completions", {**chat_body(tenant), "model": name})
        else:
            send(client, valid, log, "/v1/completions", {**completion_body(tenant), "model": name})

    run()


@pytest.mark.parametrize("route", ["POST /v1/chat/completions", "GET /v1/models"])
def test_odd_api_keys_answer_401(door, route):
    client, valid, log, tenant = door
    method, path = route.split()

    @fuzz_settings(30)
    @given(value=header_values())
    def run(value):
        r = assert_door_holds(client, method, path, valid, content=dumps(chat_body(tenant)) if method == "POST"
                              else None, headers={"Authorization": value, "Content-Type": "application/json"},
                              log=log)
        assert r.status_code == 401, (value, r.status_code, r.text)

    run()
