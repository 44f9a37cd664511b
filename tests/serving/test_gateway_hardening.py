"""The gateway's door against a fake vLLM (tests/serving/gateway_harness.py): only known,
validated fields are forwarded; bad input is a 400 naming the field, never a 5xx; one
request's engine error does not take a replica out for others; whatever a request holds is
released on every path; recorded bytes are bounded and rate limited per tenant; the tenant's
sequences are capped by a share of the engine; an answer leaves only once its interaction
event is durable."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.serving.gateway_harness import LIVE, STREAM, FakeProducer, Harness, default_vllm, sse

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def harness(tmp_path):
    made: list[Harness] = []

    def make(*args, **kw) -> Harness:
        h = Harness(tmp_path / f"h{len(made)}", *args, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# --- 1. the allow-list ---------------------------------------------------------------------

def test_a_field_the_gateway_does_not_know_is_refused_naming_it_and_never_forwarded(harness):
    h = harness()
    r = asyncio.run(h.call({"model": "acme", "messages": MSGS, "structured_outputs": True}))
    assert r.status == 400 and r.error_param() == "structured_outputs"
    assert h.upstream == []


def test_only_known_fields_are_forwarded(harness):
    h = harness()
    body = {"model": "acme", "messages": MSGS, "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
            "seed": 3, "stop": ["\n"], "ignore_eos": True, "min_tokens": 1, "user": "u1"}
    r = asyncio.run(h.call(body))
    assert r.status == 200, r.body
    (_, up, _), = h.upstream
    assert set(up) <= set(body) | {"model", "return_token_ids", "logprobs", "top_logprobs", "cache_salt"}
    assert up["temperature"] == 0.5 and up["ignore_eos"] is True


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', "temperature"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}', "top_p"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "top_k": 2.5}', "top_k"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "seed": "x"}', "seed"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": "yes"}', "ignore_eos"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "min_tokens": -1}', "min_tokens"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "stop": ["a","b","c","d","e"]}', "stop"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50}', "top_logprobs"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "max_tokens": true}', "max_tokens"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "stream_options": {"x": 1}}',
     "stream_options.x"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "tool_choice": 7}', "tool_choice"),
])
def test_odd_values_in_known_fields_are_refused_at_the_door(harness, raw, param):
    h = harness()
    r = asyncio.run(h.call(raw))
    assert r.status == 400 and r.error_param() == param, r.body
    assert h.upstream == []


def test_completions_refuse_a_chat_field_and_odd_logprobs(harness):
    h = harness()
    r = asyncio.run(h.call({"model": "acme", "prompt": "go", "tools": []}, path="/v1/completions"))
    assert r.status == 400 and r.error_param() == "tools"
    r = asyncio.run(h.call({"model": "acme", "prompt": "go", "logprobs": 99}, path="/v1/completions"))
    assert r.status == 400 and r.error_param() == "logprobs"


# --- 4. bounded records --------------------------------------------------------------------

def _nested(depth: int):
    v: object = "x"
    for _ in range(depth):
        v = {"a": v}
    return v


@pytest.mark.parametrize("make, param", [
    (lambda: {"tools": [{"type": "function", "function": {"name": "f", "parameters": _nested(40)}}]}, "tools"),
    (lambda: (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function",'
              b' "function": {"name": "f", "parameters": ' + b'{"a": ' * 5000 + b'1' + b'}' * 5000 + b'}}]}'),
     "tools"),  # too deep for the JSON parser itself
    (lambda: {"tools": [{"type": "function", "function": {"name": "f", "description": "d" * 300_000}}]}, "tools"),
    (lambda: {"messages": [{"role": "user", "content": "x" * 300_000}]}, "messages"),
])
def test_records_nesting_deeper_or_larger_than_the_bound_are_refused(harness, make, param):
    h = harness(max_body_bytes=2_000_000)
    made = make()
    r = asyncio.run(h.call(made if isinstance(made, bytes) else {"model": "acme", "messages": MSGS, **made}))
    assert r.status == 400 and r.error_param() is not None and r.error_param().startswith(param), r.body
    assert h.upstream == [] and h.held() == dict.fromkeys(h.held(), 0)


@pytest.mark.parametrize("raw, param", [
    (b'{"model": "acme", "messages": [{"role": "user", "content": "\\ud800 lone"}]}', "messages.0.content"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     b'"function": {"name": "f", "parameters": {"default": Infinity}}}]}', "tools.0.function.parameters.default"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     b'"function": {"name": "f", "parameters": {"max": 1e400}}}]}', "tools.0.function.parameters.max"),
    (b'{"model": "acme", "messages": [{"role": "user", "content": "hi"}], "metadata": {"\\udfff": 1}}', "metadata"),
])
def test_non_finite_numbers_and_lone_surrogates_are_refused_not_a_500(harness, raw, param):
    h = harness()
    r = asyncio.run(h.call(raw))
    assert r.status == 400 and r.error_param() == param, r.body
    assert h.upstream == []


def test_recorded_bytes_are_rate_limited_per_tenant_with_retry_after(harness):
    h = harness(tenant_recorded_bytes_per_s=2500, tenant_recorded_burst_s=1, max_recorded_bytes=1024)
    big = [{"role": "user", "content": "y" * 900}]  # about 950 recorded bytes

    async def go():
        mine = [await h.call({"model": "acme", "messages": big}) for _ in range(3)]
        other = await h.call({"model": "globex", "messages": big}, tenant="globex")
        return mine, other

    mine, other = asyncio.run(go())
    assert [r.status for r in mine] == [200, 200, 429] and other.status == 200
    assert int(mine[2].headers["retry-after"]) >= 1 and "recorded bytes" in mine[2].json()["error"]["message"]


# --- 5. prompt lists -----------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [["a"] * 64, [1, 2, 3], [[1, 2], [3]]])
def test_a_prompt_list_is_refused_naming_prompt(harness, prompt):
    h = harness()
    r = asyncio.run(h.call({"model": "acme", "prompt": prompt}, path="/v1/completions"))
    assert r.status == 400 and r.error_param() == "prompt", r.body
    assert h.upstream == []


# --- 6. limits derived from the engine -----------------------------------------------------

def test_n_is_capped_by_the_tenants_share_of_the_engine(harness):
    h = harness(max_n=64, tenant_engine_share=0.5, engine={"max_num_seqs": 32})
    r = asyncio.run(h.call({"model": "acme", "messages": MSGS, "n": 17}))
    assert r.status == 400 and r.error_param() == "n" and "16" in r.json()["error"]["message"], r.body
    assert asyncio.run(h.call({"model": "acme", "messages": MSGS, "n": 16})).status == 200


def test_a_tenants_sequences_in_flight_are_capped_by_its_share_of_the_engine(harness):
    """n x requests in flight: 16 sequences of 32 for one tenant; another tenant is unaffected."""
    gate = asyncio.Event()

    def vllm(request: httpx.Request):
        if request.url.path.endswith("completions"):
            async def body():
                await gate.wait()
                yield sse(STREAM)
            return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})
        return default_vllm(request)

    h = harness(vllm, max_n=16, tenant_engine_share=0.5, engine={"max_num_seqs": 32})

    async def go():
        held = [asyncio.create_task(h.call({"model": "acme", "messages": MSGS, "n": 8, "stream": True}))
                for _ in range(2)]
        await asyncio.sleep(0.2)
        over = await h.call({"model": "acme", "messages": MSGS})
        other = asyncio.create_task(h.call({"model": "globex", "messages": MSGS, "n": 8, "stream": True},
                                           tenant="globex"))
        await asyncio.sleep(0.2)
        gate.set()
        return over, await asyncio.gather(*held, other)

    over, rest = asyncio.run(go())
    assert over.status == 429 and "sequences" in over.json()["error"]["message"], over.body
    assert [r.status for r in rest] == [200, 200, 200]


def test_derived_limits_follow_the_engine_and_refuse_a_share_that_leaves_nothing():
    from clora.serving.settings import EngineSettings, GatewaySettings, tenant_limits

    lim = tenant_limits(EngineSettings(ports=[1, 2], max_num_seqs=32, max_model_len=1024),
                        GatewaySettings(tenant_engine_share=0.25, max_n=64, tenant_concurrency=100,
                                        max_tokens_limit=4096))
    assert (lim.sequences, lim.n, lim.requests, lim.max_tokens) == (16, 16, 16, 1024)
    with pytest.raises(ValueError, match="max_num_seqs"):
        tenant_limits(EngineSettings(max_num_seqs=2), GatewaySettings(tenant_engine_share=0.1))


# --- 2. one request's engine error ---------------------------------------------------------

def test_an_engine_error_on_one_request_does_not_take_the_replica_out_for_others(harness):
    def vllm(request: httpx.Request):
        if request.url.path.endswith("completions") and json.loads(request.read()).get("seed") == 666:
            raise httpx.RemoteProtocolError("server disconnected without sending a response")
        return default_vllm(request)

    h = harness(vllm)

    async def go():
        bad = await h.call({"model": "acme", "messages": MSGS, "seed": 666})
        bad_stream = await h.call({"model": "acme", "messages": MSGS, "seed": 666, "stream": True})
        other = [await h.call({"model": "globex", "messages": MSGS}, tenant="globex") for _ in range(5)]
        return bad, bad_stream, other

    bad, bad_stream, other = asyncio.run(go())
    assert bad.status == 503 and bad_stream.status == 503, (bad.body, bad_stream.body)
    assert b"no healthy engine replica" not in bad.body + bad_stream.body
    assert [r.status for r in other] == [200] * 5
    assert all(r.healthy for r in h.engine.replicas)


def test_a_reported_replica_is_taken_out_only_when_its_health_check_fails(tmp_path):
    from clora.serving.engine import EngineManager
    from clora.serving.settings import EngineSettings

    healthy = {"answer": 200}

    async def go():
        eng = EngineManager(EngineSettings(model=str(tmp_path), ports=[1], base_via_zero_adapter=False,
                                           log_dir=tmp_path, health_interval_s=30, restart=False))
        eng.http = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(healthy["answer"])))
        replica = eng.replicas[0]
        replica.healthy, replica.alive = True, lambda: True
        eng._monitor = asyncio.create_task(eng._monitor_loop())
        eng.report_error(replica, "a request's connection dropped")
        await asyncio.sleep(0.2)
        still = replica.healthy
        healthy["answer"] = 500
        eng.report_error(replica, "another dropped")
        await asyncio.sleep(0.2)
        out = replica.healthy
        eng._monitor.cancel()
        await eng.http.aclose()
        return still, out

    assert asyncio.run(go()) == (True, False)


# --- 3. everything a request holds is released on every path -------------------------------

def _failing_logger(h: Harness) -> None:
    def submit(event):
        raise RecursionError("maximum recursion depth exceeded while encoding a JSON object")
    h.logger.submit = submit


def _mid_stream_break(request: httpx.Request):
    if request.url.path.endswith("completions"):
        async def body():
            yield f"data: {json.dumps(STREAM[0])}\n\n".encode()
            raise httpx.ReadError("connection reset by peer")
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})
    return default_vllm(request)


def _slow_stream(request: httpx.Request):
    if request.url.path.endswith("completions") and json.loads(request.read()).get("stream"):
        async def body():
            for c in STREAM * 20:
                yield f"data: {json.dumps(c)}\n\n".encode()
                await asyncio.sleep(0.02)
            yield b"data: [DONE]\n\n"
        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})
    return default_vllm(request)


def _upstream_500(request: httpx.Request):
    if request.url.path.endswith("completions"):
        return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})
    return default_vllm(request)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("case", ["recording fails", "upstream breaks mid-stream", "client disconnects",
                                  "validation fails", "upstream 500", "served"])
def test_every_path_releases_slots_leases_pins_and_version_holds(harness, case, stream):
    vllm = {"upstream breaks mid-stream": _mid_stream_break, "client disconnects": _slow_stream,
            "upstream 500": _upstream_500}.get(case, default_vllm)
    h = harness(vllm)
    if case == "recording fails":
        _failing_logger(h)
    body = {"model": "acme@v1", "messages": MSGS, "stream": stream}  # an old version: held and pinned
    if case == "validation fails":
        body["temperature"] = -3

    async def go():
        try:
            r = await h.call(body, disconnect_after=1 if case == "client disconnects" else None)
        except Exception:  # noqa: BLE001 - a path that raised must still have released
            r = None
        await asyncio.sleep(0.1)
        return r, h.held()

    for _ in range(3):  # and repeatedly: nothing piles up
        _, held = asyncio.run(go())
        assert held == {"quota_slots": 0, "leases": 0, "pins": 0, "version_holds": 0}, (case, held)
    assert asyncio.run(h.call({"model": "acme", "messages": MSGS})).status != 429  # not locked out


def test_an_unrecordable_stream_is_answered_with_an_error_not_a_done(harness):
    h = harness()
    _failing_logger(h)
    r = asyncio.run(h.call({"model": "acme", "messages": MSGS, "stream": True}))
    assert r.status == 200 and b"[DONE]" not in r.body and b'"error"' in r.body


# --- 8. nothing served is unrecorded -------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_answer_is_sent_only_once_its_interaction_event_is_durable(harness, stream):
    """The broker takes 0.3 s to acknowledge: the answer (for a stream, its `[DONE]`) waits for
    the ack, so a crash right after the answer cannot lose the event."""
    producer = FakeProducer(ack_delay_s=0.3)
    h = harness(producer=producer)
    r = asyncio.run(h.call({"model": "acme", "messages": MSGS, "stream": stream}))
    assert r.status == 200
    iid = r.json()["id"] if not stream else json.loads(r.body.split(b"\n\n")[0][6:])["id"]
    assert producer.interaction_ids() == [iid]


def test_an_answer_is_durable_in_the_spool_when_the_broker_is_down(harness, tmp_path):
    class Down(FakeProducer):
        def send(self, topic, key, value):
            from clora.ingest.producer import BrokerUnavailable
            raise BrokerUnavailable("broker down")

    h = harness(producer=Down())
    r = asyncio.run(h.call({"model": "acme", "messages": MSGS}))
    assert r.status == 200
    assert [json.loads(x.value)["interaction_id"] for x in h.logger.spool.pending()] == [r.json()["id"]]


# --- 7. the engine's key -------------------------------------------------------------------

def test_every_call_to_a_replica_carries_the_engines_key(harness):
    h = harness()
    key = h.engine.api_key
    assert len(key) >= 32 and h.engine.replicas[0].env()["VLLM_API_KEY"] == key
    assert key not in " ".join(h.engine.replicas[0].argv())  # argv is world-readable (ps)
    seen: list[tuple[str, str | None]] = []
    inner = h.engine.http._transport

    class Spy(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            seen.append((request.url.path, request.headers.get("authorization")))
            return await inner.handle_async_request(request)

    h.engine.http._transport = Spy()

    async def go():
        assert (await h.call({"model": "acme", "messages": MSGS})).status == 200
        await h.engine.replicas[0].unload_adapter(h.engine.http, f"acme@v{LIVE}")
        await h.engine.replicas[0].check_health(h.engine.http)

    asyncio.run(go())
    paths = {p for p, _ in seen}
    assert {"/v1/load_lora_adapter", "/v1/chat/completions", "/v1/unload_lora_adapter", "/health"} <= paths
    assert all(auth == f"Bearer {key}" for _, auth in seen), seen
