"""`POST /v1/responses` (OpenAI's Responses API) through the official openai client and the
OpenAI Agents SDK, against the running gateway and CPU vLLM: a response is served, routed,
pinned and recorded exactly as the chat completion it is translated to; streaming gives the
documented events; what the gateway cannot serve statelessly is a 400 naming the field; and
every route, unknown ones included, answers errors in OpenAI's shape."""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from types import ModuleType

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
REPO_AGENTS = REPO / "agents"
"""The platform's agents package (`clora.agents`), which a bare `import agents` finds first
wherever the repository root is on `sys.path`."""

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["oslo", "paris"]}},
                               "required": ["city"], "additionalProperties": False}}
WEATHER_CHAT_TOOL = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
"""`WEATHER_TOOL` as the chat completion it is served as (and recorded as) carries it."""

STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done"]


def _message(role: str, content: str) -> dict:
    return {"role": role, "content": content, "name": None, "tool_calls": None, "tool_call_id": None}


def test_a_response_is_served_and_recorded_as_its_chat_completion_is(serving, tenants, client_for, registry,
                                                                     interactions):
    tenant, key = tenants.create(11)
    c = client_for(key)
    r = c.responses.create(model=tenant, instructions="Answer briefly.", input="hello", max_output_tokens=8,
                           temperature=0)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.model == f"{tenant}@v1"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # cut at 8 tokens
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.output_text and r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8 and r.usage.input_tokens > 0
    chat = c.chat.completions.create(model=tenant, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hello"}])
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens
    # recorded as the chat completion is: its id claimed for the tenant, its event on the topic
    assert registry.interaction_owner(r.id) == tenant
    ev = interactions([r.id])[r.id]
    assert ev["tenant"] == tenant and ev["adapter"] == f"{tenant}@v1" and ev["adapter_version"] == 1
    assert ev["messages"] == [_message("system", "Answer briefly."), _message("user", "hello")]
    assert ev["response"]["content"] == r.output_text
    assert len(ev["completion_token_ids"]) == 8 == len(ev["completion_logprobs"])
    assert all(lp <= 0 for lp in ev["completion_logprobs"])
    assert ev["sampling"]["max_tokens"] == 8 and ev["sampling"]["temperature"] == 0
    assert ev["latency_ms"] > 0


def test_a_streamed_response_gives_the_documented_events_and_is_recorded(serving, tenants, client_for,
                                                                         interactions):
    tenant, key = tenants.create(13)
    c = client_for(key)
    ask = dict(model=tenant, input=[{"role": "user", "content": [{"type": "input_text", "text": "stream please"}]}],
               max_output_tokens=12, temperature=0)
    whole = c.responses.create(**ask)
    events = list(c.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == STREAM_EVENTS[:4] + ["response.output_text.delta"] * deltas + STREAM_EVENTS[5:] + [
        "response.incomplete"]  # cut at max_output_tokens, as OpenAI ends such a stream
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    rid = events[0].response.id
    assert rid.startswith("resp_") and {e.response.id for e in events if hasattr(e, "response")} == {rid}
    assert events[-1].response.usage.output_tokens == 12
    ev = interactions([rid])[rid]
    assert ev["response"]["content"] == text and len(ev["completion_token_ids"]) == 12
    assert len(ev["completion_logprobs"]) == 12


def test_function_calls_and_a_follow_up_turn_with_their_output(serving, tenants, client_for, interactions):
    tenant, key = tenants.create(14)
    c = client_for(key)
    question = {"role": "user", "content": "weather in Oslo?"}
    r = c.responses.create(model=tenant, input=[question], tools=[WEATHER_TOOL], tool_choice="required",
                           max_output_tokens=400, temperature=0)
    assert r.status == "completed"
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    ev = interactions([r.id])[r.id]
    assert ev["tools"] == [WEATHER_CHAT_TOOL]
    assert ev["response"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": calls[0].arguments}
    assert ev["response"]["tool_calls"][0]["id"] == calls[0].call_id
    # streamed, through the client's `responses.stream` helper: the same call
    with c.responses.stream(model=tenant, input=[question], tools=[WEATHER_TOOL], tool_choice="required",
                            max_output_tokens=400, temperature=0) as stream:
        final = stream.get_final_response()
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(s.name, s.arguments) for s in streamed] == [(x.name, x.arguments) for x in calls]
    # the next turn carries the call and its output back; it is recorded in the chat shape
    call = calls[0]
    follow = c.responses.create(model=tenant, tools=[WEATHER_TOOL], max_output_tokens=4, temperature=0, input=[
        question, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.output and follow.id != r.id
    ev2 = interactions([follow.id])[follow.id]
    assert ev2["messages"][1]["tool_calls"] == [{"id": call.call_id, "type": "function",
                                                 "function": {"name": "get_weather", "arguments": call.arguments}}]
    assert ev2["messages"][2] == {**_message("tool", "sunny"), "tool_call_id": call.call_id}


def test_pinned_versions_and_rollout_metadata_work_as_in_chat(serving, tenants, client_for, interactions):
    tenant, key = tenants.create(11, 12)  # v2 live
    c = client_for(key)
    ask = dict(input="pin", max_output_tokens=6, temperature=0)
    v1, live = c.responses.create(model=f"{tenant}@v1", **ask), c.responses.create(model=tenant, **ask)
    assert v1.model == f"{tenant}@v1" and live.model == f"{tenant}@v2"
    first = c.responses.create(model=tenant, metadata={"group_id": "grp-r"}, **ask)
    later = c.responses.create(model=tenant, metadata={"group_id": "grp-r", "episode_id": first.id}, **ask)
    evs = interactions([v1.id, first.id, later.id])
    assert evs[v1.id]["adapter"] == f"{tenant}@v1"
    assert evs[first.id]["group_id"] == evs[later.id]["group_id"] == "grp-r"
    assert evs[first.id].get("episode_id") is None and evs[later.id]["episode_id"] == first.id
    with pytest.raises(openai.BadRequestError) as bad:
        c.responses.create(model=tenant, metadata={"group_id": "no spaces allowed"}, **ask)
    assert bad.value.body["param"] == "metadata.group_id"
    with pytest.raises(openai.NotFoundError) as gone:
        c.responses.create(model=f"{tenant}@v9", **ask)
    assert gone.value.code == "model_not_found" and gone.value.body["param"] == "model"


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": "x" * 250_000}]}, "input.0"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_what_the_gateway_cannot_serve_is_a_400_naming_the_field(serving, tenants, client_for, extra, param):
    tenant, key = tenants.create(11)
    with pytest.raises(openai.BadRequestError) as e:  # sent as they are, past the client's own checks
        client_for(key).responses.create(model=tenant, input="hi", max_output_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    if param == "previous_response_id":
        assert "keeps no response state; send the whole conversation as input" in e.value.body["message"]


def test_unknown_routes_and_wrong_methods_answer_in_openais_error_shape(serving, tenants):
    _, key = tenants.create(11)
    base = serving.url.removesuffix("/v1")
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.post(base + "/v1/no-such-route", json={}, headers=auth, timeout=30)
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "Invalid URL (POST /v1/no-such-route)", "type": "invalid_request_error",
                                  "param": None, "code": "unknown_url"}}
    r = httpx.get(base + "/v1/responses", headers=auth, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError) as e:  # as the client sees it
        openai.OpenAI(base_url=serving.url, api_key=key, max_retries=0).get("/nothing-here", cast_to=object)
    assert e.value.code == "unknown_url"


# --- the OpenAI Agents SDK ------------------------------------------------------------------

@functools.cache
def agents_sdk() -> ModuleType:
    """The OpenAI Agents SDK's `agents` package, never the repository's `agents/` folder (which
    `clora.agents` installs, and which shadows the SDK wherever the repository root is on
    `sys.path`): imported with the root and '' off the path, which is then put back as it was.

    The SDK stays in `sys.modules` under `agents` afterwards: it imports its own submodules
    lazily (at exit too, to flush traces), so removing it would break it. Nothing in clora
    imports a bare `agents` (the platform's is `clora.agents`); a repository `agents` imported
    by that name before this runs is set aside, and `sys.modules` otherwise left as it was."""
    def bare(name: str) -> bool:
        return name == "agents" or name.startswith("agents.")

    shadowing = [name for name, m in sys.modules.items()
                 if bare(name) and REPO_AGENTS in Path(getattr(m, "__file__", None) or "/").resolve().parents]
    for name in shadowing:
        del sys.modules[name]
    saved_path = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != REPO]
    try:
        sdk = importlib.import_module("agents")
    finally:
        sys.path[:] = saved_path
    assert REPO_AGENTS not in Path(sdk.__file__).resolve().parents, f"imported the repository's agents: {sdk.__file__}"
    return sdk


def test_an_openai_agents_sdk_agent_runs_on_the_gateway(serving, tenants, interactions):
    tenant, key = tenants.create(12)
    sdk = agents_sdk()
    sdk.set_tracing_disabled(True)  # nothing leaves for OpenAI's trace endpoint
    client = openai.AsyncOpenAI(base_url=serving.url, api_key=key, max_retries=0, timeout=120)
    model = sdk.OpenAIResponsesModel(model=tenant, openai_client=client)

    async def weather(_context, arguments: str) -> str:  # the tiny model's arguments need not fit the schema
        return f"sunny, for {arguments}"

    get_weather = sdk.FunctionTool(name="get_weather", description=WEATHER_TOOL["description"],
                                   params_json_schema=WEATHER_TOOL["parameters"], on_invoke_tool=weather)
    # A tool it must call (the tiny model never stops by itself before max_tokens, and the SDK
    # takes a response cut there, `incomplete`, for a failure): the run ends with the tool's result.
    agent = sdk.Agent(name="weather", model=model, tools=[get_weather],
                      tool_use_behavior="stop_on_first_tool",
                      model_settings=sdk.ModelSettings(max_tokens=400, temperature=0, tool_choice="required"))
    result = sdk.Runner.run_sync(agent, "weather in Oslo?")
    (raw,) = result.raw_responses
    (call,) = [item for item in raw.output if item.type == "function_call"]
    assert result.final_output == f"sunny, for {call.arguments}"
    ev = interactions([raw.response_id])[raw.response_id]  # recorded under the id the SDK got
    assert ev["tenant"] == tenant and ev["adapter"] == f"{tenant}@v1"
    assert ev["messages"] == [_message("user", "weather in Oslo?")]
    assert ev["response"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": call.arguments}
    assert ev["tools"][0]["function"]["name"] == "get_weather"
    import clora.agents.runtime  # the platform's own agents package still imports in this process

    assert Path(clora.agents.runtime.__file__).resolve().parent == REPO_AGENTS
