"""Fast unit tests of the serving building blocks (no engine, no broker)."""

from __future__ import annotations

import json

import pytest
from kafka.errors import InvalidRecordError, KafkaTimeoutError, MessageSizeTooLargeError

from clora.ingest.producer import BrokerUnavailable
from clora.ingest.schemas import InteractionEvent, Message
from clora.serving.aliases import AdapterRef, AliasTable, parse_model
from clora.serving.completions import Recorder, Unrecordable, recorded_messages, upstream_body
from clora.serving.errors import ApiError
from clora.serving.interactions import InteractionLogger
from clora.serving.quota import TenantQuota
from clora.serving.residency import CapacityError, ResidentSet
from clora.serving.settings import EngineSettings
from clora.serving.spool import DiskSpool


def test_parse_model():
    assert parse_model("acme") == ("acme", None)
    assert parse_model("acme@v7") == ("acme", 7)
    assert parse_model("acme@v") == ("acme@v", None)
    assert parse_model("Acme@v7") == ("Acme@v7", None)


def test_alias_switch_returns_previous():
    t = AliasTable()
    v1, v2 = AdapterRef("a", 1, "/p1"), AdapterRef("a", 2, "/p2")
    assert t.switch("a", v1) is None and t.get("a") == v1
    assert t.switch("a", v2) == v1 and t.get("a").name == "a@v2"
    assert t.switch("a", None) == v2 and t.get("a") is None


def test_lru_evicts_least_recently_used_idle_adapter():
    rs = ResidentSet(3)
    for n in "abc":
        rs.add(n, "/" + n)
    rs.pin("a")
    rs.unpin("a")  # a is now the most recent
    assert rs.full() and rs.victim() == "b"
    rs.pin("b")  # in use: never evicted
    assert rs.victim() == "c"
    rs.pin("c")
    rs.pin("a")
    with pytest.raises(CapacityError, match="all 3 resident adapters"):
        rs.victim()
    with pytest.raises(CapacityError, match="3 of 3"):
        rs.add("d", "/d")


def test_engine_settings_validate_lora_slots():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineSettings(max_loras=8, max_cpu_loras=4)


def test_quota_concurrency_and_rate():
    now = [0.0]
    q = TenantQuota(concurrency=2, rate_per_s=1.0, burst=3, clock=lambda: now[0])
    q.acquire("a")
    q.acquire("a")
    with pytest.raises(ApiError) as e:
        q.acquire("a")
    assert e.value.status == 429 and "in flight" in e.value.message
    q.acquire("b")  # other tenants are unaffected
    q.release("a")
    q.release("a")
    q.acquire("a")
    q.release("a")  # 3 tokens spent
    with pytest.raises(ApiError, match="requests/s"):
        q.acquire("a")
    now[0] = 1.0
    q.acquire("a")


def test_spool_append_ack_reopen(tmp_path):
    s = DiskSpool(tmp_path)
    s.append([("t", "k1", "v1"), ("t", "k2", "v2")])
    s.append([("t", "k3", "v3")])
    recs = s.pending(2)
    assert [r.value for r in recs] == ["v1", "v2"]
    s.ack(recs[-1].end)
    s.close()
    s = DiskSpool(tmp_path)  # survives a restart, offset included
    assert [r.value for r in s.pending()] == ["v3"] and s.count() == 1
    with open(s.data, "ab") as f:
        f.write(b'{"topic": "t", "key"')  # a torn write from a crash is not replayed
    assert [r.value for r in s.pending()] == ["v3"]
    s.ack(s.pending()[-1].end)
    assert s.count() == 0


def test_spool_cuts_a_torn_last_line_before_appending_after_it(tmp_path):
    """A crash mid-append leaves half a line; the next append must not be glued to it (the glued
    line could never be read, and every later event would queue behind it)."""
    s = DiskSpool(tmp_path)
    s.append([("t", "k1", "v1")])
    s.close()
    with open(s.data, "ab") as f:
        f.write(b'{"topic": "t", "key"')  # the crash
    s = DiskSpool(tmp_path)
    s.append([("t", "k2", "v2")])
    assert [r.value for r in s.pending()] == ["v1", "v2"] and s.count() == 2
    s.close()
    with open(s.data, "wb") as f:
        f.write(b'{"topic": "t"')  # nothing whole at all
    s = DiskSpool(tmp_path)
    assert s.empty() and s.size() == 0


def test_a_damaged_spool_line_is_set_aside_not_blocking_the_rest(tmp_path):
    s = DiskSpool(tmp_path)
    with open(s.data, "ab") as f:  # damaged by the disk: whole lines that are not records
        f.write(b"\x00\x00garbage\n")
    s.close()
    s = DiskSpool(tmp_path)
    s.append([("t", "k1", "v1")])
    with open(s.data, "ab") as f:
        f.write(b'{"topic": "t"}\n')
    s.append([("t", "k2", "v2")])
    recs = s.pending()
    assert [r.value for r in recs] == ["v1", "v2"]
    s.ack(recs[-1].end)
    assert s.empty()
    rejected = (tmp_path / "rejected.jsonl").read_text().splitlines()
    assert len(rejected) == 2 and "garbage" in rejected[0]


class FlakyProducer:
    def __init__(self):
        self.up = False
        self.got: list[str] = []

    def send(self, topic, key, value):
        if not self.up:
            raise KafkaTimeoutError("broker down")
        self.got.append(json.loads(value)["interaction_id"])
        return _Done()

    def close(self):
        pass


class _Done:
    def get(self, timeout=None):
        return None


def _event(i: int) -> InteractionEvent:
    return InteractionEvent(tenant="acme", interaction_id=f"i{i}", messages=[Message(role="user", content="q")],
                            response=Message(role="assistant", content="a"))


def test_logger_spools_while_broker_down_and_sends_in_order_later(tmp_path):
    import time

    prod = FlakyProducer()
    lg = InteractionLogger(lambda: prod, DiskSpool(tmp_path), retry_s=0.05).start()
    for i in range(5):
        lg.submit(_event(i))
    deadline = time.time() + 5
    while lg.spool.count() < 5 and time.time() < deadline:
        time.sleep(0.02)
    assert lg.spool.count() == 5 and prod.got == []
    prod.up = True
    lg.submit(_event(5))
    deadline = time.time() + 5
    while len(prod.got) < 6 and time.time() < deadline:
        time.sleep(0.02)
    assert prod.got == [f"i{i}" for i in range(6)]
    assert lg.spool.count() == 0
    lg.stop()


class PickyProducer(FlakyProducer):
    """Refuses for good what kafka-python would: a record too large to send (at `send`, as
    `EventProducer` reports it) or one the broker rejects (at the ack)."""

    def send(self, topic, key, value):
        iid = json.loads(value)["interaction_id"]
        if iid == "i1":
            raise BrokerUnavailable("could not queue a record") from MessageSizeTooLargeError("1.2 MB")
        if iid == "i2":
            return _Refused()
        return super().send(topic, key, value)


class _Refused:
    def get(self, timeout=None):
        raise InvalidRecordError("broker refused the record")


def _wait(predicate, timeout_s=5.0):
    import time

    deadline = time.time() + timeout_s
    while not predicate() and time.time() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_record_the_broker_refuses_for_good_is_set_aside_and_the_rest_flow(tmp_path):
    prod = PickyProducer()
    lg = InteractionLogger(lambda: prod, DiskSpool(tmp_path), retry_s=0.05).start()
    for i in range(4):  # broker down: all four go to the spool
        lg.submit(_event(i))
    assert _wait(lambda: lg.spool.count() == 4)
    prod.up = True
    lg.submit(_event(4))
    assert _wait(lambda: prod.got == ["i0", "i3", "i4"]), prod.got
    assert _wait(lambda: lg.spool.empty()) and lg.rejected == 2
    rejected = [json.loads(line) for line in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    assert [json.loads(r["value"])["interaction_id"] for r in rejected] == ["i1", "i2"]
    assert "MessageSizeTooLargeError" in rejected[0]["error"]
    lg.submit(_event(5))  # not blocked behind them
    assert _wait(lambda: prod.got[-1:] == ["i5"])
    lg.stop()


class _FailingOnceSpool(DiskSpool):
    def __init__(self, dir):
        super().__init__(dir)
        self.failures = 1

    def append(self, records):
        if self.failures:
            self.failures -= 1
            raise OSError(28, "No space left on device")
        super().append(records)


def test_the_logger_outlives_an_unexpected_error_and_keeps_the_batch(tmp_path):
    prod = FlakyProducer()
    lg = InteractionLogger(lambda: prod, _FailingOnceSpool(tmp_path), retry_s=0.05).start()
    lg.submit(_event(0))  # broker down, and the spool's first write fails
    assert _wait(lambda: lg.spool.count() == 1)  # kept and spooled on the next round
    prod.up = True
    lg.submit(_event(1))
    assert _wait(lambda: prod.got == ["i0", "i1"]), prod.got
    lg.stop()


class _FailingOnceReadSpool(DiskSpool):
    def __init__(self, dir):
        super().__init__(dir)
        self.failures = 0

    def pending(self, limit=1000):
        if self.failures:
            self.failures -= 1
            raise OSError(5, "Input/output error")
        return super().pending(limit)


def test_a_batch_already_spooled_is_not_spooled_again_when_the_drain_fails(tmp_path):
    prod = FlakyProducer()
    lg = InteractionLogger(lambda: prod, _FailingOnceReadSpool(tmp_path), retry_s=0.05).start()
    lg.submit(_event(0))  # broker down: spooled
    assert _wait(lambda: lg.spool.count() == 1)
    lg.spool.failures = 1
    lg.submit(_event(1))  # appended to the spool, then the drain's read fails once
    assert _wait(lambda: lg.spool.failures == 0 and lg.spool.count() == 2)
    prod.up = True
    assert _wait(lambda: prod.got == ["i0", "i1"]), prod.got  # each once
    lg.stop()


class _Hanging:
    def get(self, timeout=None):
        import time

        time.sleep(timeout)
        raise KafkaTimeoutError("no ack")


class HangingProducer(FlakyProducer):
    """A broker that takes records and never acknowledges them."""

    def send(self, topic, key, value):
        return _Hanging()


def test_stop_spools_what_a_silent_broker_did_not_take_in_time(tmp_path):
    lg = InteractionLogger(lambda: HangingProducer(), DiskSpool(tmp_path), retry_s=0.05, ack_timeout_s=0.5).start()
    for i in range(3):
        lg.submit(_event(i))
    lg.stop(timeout_s=0.1)  # the thread is still waiting for acks: stop gives the broker up, then closes
    assert not lg._thread.is_alive()
    assert [json.loads(r.value)["interaction_id"] for r in DiskSpool(tmp_path).pending()] == ["i0", "i1", "i2"]


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
    the next turn, whose prompt carries that call back (bench: a lost interaction left its
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


def test_a_stream_vllm_failed_is_passed_on_counted_as_an_error_and_not_recorded():
    """vLLM reports a generation that failed mid-stream as an error event, then `[DONE]`: the
    client gets the error, and the cut-off completion is neither recorded (it would train) nor
    counted as answered."""
    import asyncio
    import contextlib
    import time
    from types import SimpleNamespace

    import httpx

    from clora.serving.gateway import Gateway
    from clora.serving.settings import GatewaySettings

    sse = (b'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [1]}]}\n\n'
           b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n'
           b"data: [DONE]\n\n")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=sse))
    submitted: list = []
    engine = SimpleNamespace(http=httpx.AsyncClient(transport=transport), mark_failed=lambda *a: None)
    gw = Gateway(GatewaySettings(), None, engine, None, SimpleNamespace(submit=submitted.append), None)
    body = {"model": "acme", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    rec = Recorder(kind="chat", body=body, tenant="acme", interaction_id="chatcmpl-e", ref=None, client_model="base")

    async def relay() -> list[bytes]:
        lease = SimpleNamespace(replica=SimpleNamespace(index=0))
        response = await gw._stream("http://engine/v1/chat/completions", {}, rec, lease,
                                    contextlib.AsyncExitStack(), time.monotonic())
        return [chunk async for chunk in response.body_iterator]

    chunks = asyncio.run(relay())
    assert any(b"engine died" in c for c in chunks) and chunks[-1] == b"data: [DONE]\n\n"
    assert submitted == []
    def counted(status: str) -> float | None:
        return gw.metrics.registry.get_sample_value("clora_gateway_requests_total",
                                                    {"tenant": "acme", "kind": "chat", "status": status})

    assert counted("500") == 1 and counted("200") is None
