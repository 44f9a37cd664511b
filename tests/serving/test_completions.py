"""What the gateway does to a completion (clora.serving.completions): the upstream body, stream
chunks accumulated and stripped, and messages recorded in OpenAI's shape or refused naming the
field."""

from __future__ import annotations

import pytest

from clora.serving.aliases import AdapterRef
from clora.serving.completions import Recorder, Unrecordable, recorded_messages, upstream_body


def test_recorder_stream_accumulates_and_strips():
    body = {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    up = upstream_body(body, "chat", "acme@v3")
    assert up["model"] == "acme@v3" and up["return_token_ids"] and up["logprobs"] and up["top_logprobs"] == 0
    rec = Recorder(kind="chat", body=body, tenant="acme", interaction_id="chatcmpl-x",
                   ref=AdapterRef("acme", 3, "/p"), client_model="acme@v3")
    c1 = rec.chunk({"id": "up-1", "model": "acme@v3", "prompt_token_ids": [1, 2], "choices": [
        {"index": 0, "delta": {"content": "Hel"}, "token_ids": [9],
         "logprobs": {"content": [{"token": "Hel", "logprob": -0.5}]}}]})
    rec.chunk({"id": "up-1", "choices": [{"index": 0, "delta": {"content": "lo"}, "token_ids": [4],
                                          "logprobs": {"content": [{"token": "lo", "logprob": -0.25}]},
                                          "finish_reason": "stop"}]})
    assert c1["id"] == "chatcmpl-x" and "prompt_token_ids" not in c1
    assert c1["choices"][0]["logprobs"] is None and "token_ids" not in c1["choices"][0]
    (ev,) = rec.events()
    assert ev.response.content == "Hello" and ev.completion_token_ids == [9, 4]
    assert ev.completion_logprobs == [-0.5, -0.25] and ev.prompt_token_ids == [1, 2]
    assert ev.adapter == "acme@v3" and ev.adapter_version == 3


def test_recorder_stream_tool_call_deltas():
    body = {"model": "acme", "messages": [{"role": "user", "content": "w"}], "tools": [{"type": "function"}]}
    rec = Recorder(kind="chat", body=body, tenant="acme", interaction_id="chatcmpl-y", ref=None, client_model="base")
    rec.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call1", "function": {"name": "get_weather", "arguments": '{"ci'}}]}}]})
    rec.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]},
                            "finish_reason": "tool_calls"}]})
    (ev,) = rec.events()
    assert ev.response.tool_calls[0].function.arguments == '{"city": 1}'
    assert ev.response.tool_calls[0].id == "call1" and ev.adapter is None


def test_recorded_messages_keep_the_openai_shape():
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
    msgs = recorded_messages({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{**call, "index": 0}]},  # `index`: from a stream delta
        {"role": "tool", "tool_call_id": "c1", "content": "4"}]}, "chat")
    assert msgs[0].content == "ab"
    assert msgs[1].tool_calls[0].model_dump() == call
    assert msgs[2].tool_call_id == "c1"
    empty = recorded_messages({"messages": [{"role": "assistant", "content": None, "tool_calls": []},
                                            {"role": "user", "content": [{"type": "text", "text": None}]}]}, "chat")
    assert [(m.content, m.tool_calls) for m in empty] == [("", None), ("", None)]
    assert recorded_messages({"prompt": [1, 2]}, "completion")[0].content == "[1, 2]"


@pytest.mark.parametrize("body, kind, field", [
    ({"messages": [{"role": "tool", "content": None}]}, "chat", "messages.0"),
    ({"messages": [{"role": "function", "content": "q"}]}, "chat", "messages.0.role"),
    ({"messages": ["q"]}, "chat", "messages.0"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "", "function": {"name": "f", "arguments": ""}}]}]},
     "chat", "messages.0.tool_calls.0.id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "chat", "messages.0.tool_calls.0.function"),
    ({"messages": [{"role": "user", "content": "x" * 200_001}]}, "chat", "messages.0.content"),
    ({"messages": [{"role": "user", "content": "q"}] * 1001}, "chat", "messages"),
    ({"prompt": "x" * 200_001}, "completion", "prompt"),
])
def test_a_request_whose_messages_cannot_be_recorded_names_the_field(body, kind, field):
    """The gateway refuses these before serving them: an interaction it served but could not
    record would take its feedback with it."""
    with pytest.raises(Unrecordable) as e:
        recorded_messages(body, kind)
    assert e.value.field == field


def test_recorder_records_a_tool_call_the_model_left_unnamed():
    """A small model can emit a tool call with an empty name. The interaction must still be
    recorded (it is what the model did, and its reward is what RL learns from), and so must
    the next turn, whose prompt carries that call back (a lost interaction would leave its
    feedback parked and the tenant's learner waiting for it)."""
    body = {"model": "acme", "messages": [{"role": "user", "content": "w"}], "tools": [{"type": "function"}]}
    rec = Recorder(kind="chat", body=body, tenant="acme", interaction_id="chatcmpl-z", ref=None, client_model="base")
    rec.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call1", "function": {"name": "", "arguments": '{"x": 1}'}}]}, "finish_reason": "tool_calls"}]})
    (ev,) = rec.events()
    assert ev.response.tool_calls[0].function.name == ""
    later = {**body, "messages": [*body["messages"], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call1", "type": "function", "function": {"name": "", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call1", "content": "error: unknown tool ''"}]}
    rec = Recorder(kind="chat", body=later, tenant="acme", interaction_id="chatcmpl-z2", ref=None, client_model="base")
    rec.chunk({"choices": [{"index": 0, "delta": {"content": "4"}, "finish_reason": "stop"}]})
    (ev,) = rec.events()
    assert ev.messages[1].tool_calls[0].function.name == ""
