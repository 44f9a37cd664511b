"""The official openai client against the running gateway: chat, streaming, tool calls,
completions, model listing, every error case, and the interaction event each completion logs."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import socket
import time

import httpx
import openai
import pytest

from tests.keepalive import closed_after_idle

pytestmark = pytest.mark.integration

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["oslo", "paris"]}},
                   "required": ["city"], "additionalProperties": False}}}


def test_chat_returns_interaction_id_and_logs_event(serving, tenants, client_for, registry, interactions):
    tenant, key = tenants.create(11)
    c = client_for(key)
    r = c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "hello"}],
                                  max_tokens=8, temperature=0)
    assert r.id.startswith("chatcmpl-")
    assert r.model == f"{tenant}@v1"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].logprobs is None  # not asked for: stripped
    assert r.usage.completion_tokens == 8
    assert registry.interaction_owner(r.id) == tenant
    ev = interactions([r.id])[r.id]
    assert ev["tenant"] == tenant and ev["adapter"] == f"{tenant}@v1" and ev["adapter_version"] == 1
    assert ev["messages"] == [{"role": "user", "content": "hello", "name": None, "tool_calls": None,
                               "tool_call_id": None}]
    assert ev["response"]["content"] == r.choices[0].message.content
    assert len(ev["completion_token_ids"]) == 8 == len(ev["completion_logprobs"])
    assert all(lp <= 0 for lp in ev["completion_logprobs"])
    assert ev["sampling"]["max_tokens"] == 8 and ev["sampling"]["temperature"] == 0
    assert ev["latency_ms"] > 0


def test_logprobs_when_asked_match_the_event(serving, tenants, client_for, interactions):
    tenant, key = tenants.create(12)
    r = client_for(key).chat.completions.create(model=tenant, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    lps = [t.logprob for t in r.choices[0].logprobs.content]
    assert len(lps) == 5 and all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    assert interactions([r.id])[r.id]["completion_logprobs"] == pytest.approx(lps)


def test_a_seed_samples_alike_through_the_gateway(serving, tenants, client_for):
    """What `Agent.seed` (and `clora bench experiments`' paired modes) rest on: the gateway passes
    the seed to vLLM, a seeded request samples the same tokens again at temperature 1, and a
    group's samples (n) differ from each other."""
    tenant, key = tenants.create(14)
    c = client_for(key)

    def sample(seed: int) -> list[str]:
        r = c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "say anything"}],
                                      max_tokens=12, temperature=1.0, n=2, seed=seed)
        return [ch.message.content for ch in sorted(r.choices, key=lambda ch: ch.index)]

    first = sample(5)
    assert sample(5) == first
    assert first[0] != first[1]                      # vLLM seeds sample i with seed + i
    assert sample(50) != first


def test_streaming_chat_matches_non_streaming(serving, tenants, client_for, interactions):
    tenant, key = tenants.create(13)
    c = client_for(key)
    msgs = [{"role": "user", "content": "stream please"}]
    whole = c.chat.completions.create(model=tenant, messages=msgs, max_tokens=12, temperature=0)
    chunks = list(c.chat.completions.create(model=tenant, messages=msgs, max_tokens=12, temperature=0, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    ids = {ch.id for ch in chunks}
    assert len(ids) == 1
    (rid,) = ids
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(getattr(ch.choices[0], "logprobs", None) is None for ch in chunks if ch.choices)
    ev = interactions([rid])[rid]
    assert ev["response"]["content"] == text and len(ev["completion_token_ids"]) == 12
    assert len(ev["completion_logprobs"]) == 12


def test_tool_calls_pass_through(serving, tenants, client_for, interactions):
    tenant, key = tenants.create(14)
    r = client_for(key).chat.completions.create(
        model=tenant, messages=[{"role": "user", "content": "weather in Oslo?"}], tools=[WEATHER_TOOL],
        tool_choice="required", max_tokens=400, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    ev = interactions([r.id])[r.id]
    assert ev["tools"] == [WEATHER_TOOL]
    assert ev["response"]["tool_calls"][0]["function"]["name"] == "get_weather"
    # The tool result goes back in as a tool message and the conversation continues.
    call = choice.message.tool_calls[0]
    r2 = client_for(key).chat.completions.create(model=tenant, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "weather in Oslo?"},
        # `index`: as a client that read the call from a stream may send it back
        {"role": "assistant", "content": None, "tool_calls": [{**call.model_dump(), "index": 0}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    assert r2.choices[0].message.content is not None
    ev2 = interactions([r2.id])[r2.id]  # recorded, in the OpenAI shape
    assert ev2["messages"][1]["tool_calls"] == [call.model_dump()] and ev2["messages"][2]["tool_call_id"] == call.id


def test_completions_and_n(serving, tenants, client_for, interactions):
    tenant, key = tenants.create(15)
    c = client_for(key)
    r = c.completions.create(model=tenant, prompt="Once upon", max_tokens=6, temperature=0)
    assert r.id.startswith("cmpl-") and r.choices[0].text and r.choices[0].logprobs is None
    ev = interactions([r.id])[r.id]
    assert ev["messages"][0]["content"] == "Once upon" and len(ev["completion_token_ids"]) == 6
    rn = c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "hi"}], n=3,
                                   max_tokens=4, temperature=1.0, seed=1)
    assert len(rn.choices) == 3
    evs = interactions([f"{rn.id}-{i}" for i in range(3)])
    assert len(evs) == 3 and {e["group_id"] for e in evs.values()} == {rn.id}
    # a caller's rollout group (metadata.group_id) spans its requests: every turn of a group's episodes
    grouped = [c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": q}], n=n, max_tokens=3,
                                         temperature=1.0, metadata={"group_id": "grp-7"}) for q, n in (("a", 2), ("b", 1))]
    evs = interactions([f"{grouped[0].id}-0", f"{grouped[0].id}-1", grouped[1].id])
    assert len(evs) == 3 and {e["group_id"] for e in evs.values()} == {"grp-7"}
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "a"}], max_tokens=3,
                                  metadata={"group_id": "no spaces allowed"})
    assert bad.value.body["param"] == "metadata.group_id"
    # an agent's later turns name the episode they continue (its first turn's interaction id)
    first = c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "a"}], max_tokens=3)
    later = c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "a"}], max_tokens=3,
                                      metadata={"episode_id": first.id})
    evs = interactions([first.id, later.id])
    assert evs[first.id].get("episode_id") is None and evs[later.id]["episode_id"] == first.id
    for bad_meta, n in (({"episode_id": "no spaces allowed"}, 1), ({"episode_id": first.id}, 2)):
        with pytest.raises(openai.BadRequestError) as bad:      # n > 1 starts n episodes: it continues none
            c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "a"}], max_tokens=3,
                                      n=n, metadata=bad_meta)
        assert bad.value.body["param"] == "metadata.episode_id"


def test_stop_and_base_model(serving, tenants, client_for):
    tenant, key = tenants.create(11)
    c = client_for(key)
    base = c.chat.completions.create(model="base", messages=[{"role": "user", "content": "q"}], max_tokens=10,
                                     temperature=0)
    text = base.choices[0].message.content
    assert base.model == "base" and len(text) >= 3
    stop = text[2]
    cut = c.chat.completions.create(model="base", messages=[{"role": "user", "content": "q"}], max_tokens=10,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_models_lists_only_callers_models(serving, tenants, client_for):
    a, key_a = tenants.create(11, 12)
    b, _ = tenants.create(13)
    ids = [m.id for m in client_for(key_a).models.list()]
    assert ids == ["base", a, f"{a}@v1", f"{a}@v2"]
    assert b not in " ".join(ids)
    assert client_for(key_a).models.retrieve(f"{a}@v1").id == f"{a}@v1"
    with pytest.raises(openai.NotFoundError):
        client_for(key_a).models.retrieve(b)


def test_pinned_version_serves_that_version(serving, tenants, client_for):
    tenant, key = tenants.create(11, 12)  # v1 = seed 11, v2 = seed 12 (live)
    other, key_o = tenants.create(11)
    c = client_for(key)
    msgs = [{"role": "user", "content": "pin"}]
    ask = lambda cl, m: cl.chat.completions.create(model=m, messages=msgs, max_tokens=10, temperature=0)  # noqa: E731
    v1, live = ask(c, f"{tenant}@v1"), ask(c, tenant)
    assert v1.model == f"{tenant}@v1" and live.model == f"{tenant}@v2"
    assert v1.choices[0].message.content == ask(client_for(key_o), other).choices[0].message.content  # same weights
    assert v1.choices[0].message.content != live.choices[0].message.content


def test_isolation_other_tenants_model_is_not_found(serving, tenants, client_for):
    a, key_a = tenants.create(11)
    b, key_b = tenants.create(12)
    c = client_for(key_a)
    for model in (b, f"{b}@v1", "no-such-model", f"{a}@v9"):
        with pytest.raises(openai.NotFoundError) as e:
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model=b, prompt="x", max_tokens=2)
    assert b not in [m.id for m in c.models.list()]


def test_auth_and_validation_errors(serving, tenants, client_for):
    tenant, key = tenants.create(11)
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.AuthenticationError) as e:
        client_for("clk_nope_bad").chat.completions.create(model=tenant, messages=msgs, max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client_for("clk_nope_bad").models.list()
    c = client_for(key)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=tenant, messages=msgs, max_tokens=10**6)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=tenant, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"
    # What its interaction event could not record is refused before it is served: feedback on
    # an interaction that was never recorded would be lost.
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=tenant, max_tokens=2, messages=[*msgs, {"role": "tool", "content": None}])
    assert e.value.body["param"] == "messages.1" and "content or tool_calls" in e.value.body["message"]
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "x" * 2_000_000}], max_tokens=2)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"
    # Beyond the model's context: vLLM's 400, passed through in OpenAI's shape.
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "y" * 3000}], max_tokens=2)
    assert isinstance(e.value.body, dict) and e.value.body.get("message")


def test_concurrency_quota_answers_429(serving, tenants, client_for, redis_client, wait_for):
    """`limit` streams held open (each has sent its first chunk, so each was admitted and is
    generating) fill the tenant's concurrency: every further request gets 429 with a
    Retry-After until the streams close.

    A fast engine can finish a held stream (it generates on while the client does not read)
    before the extra requests arrive, and then one of them is rightly served. So the verdict
    is read against the gateway's own leases in Redis: when every held stream's lease is
    still there after the extra requests, all of them must have been refused; when one ended
    first, at most that many may have been served, and the round is tried again."""
    from clora.serving.tenant_slots import slots_key

    tenant, key = tenants.create(11)
    limit = serving.gateway_settings.tenant_concurrency
    client = client_for(key)

    def leases() -> set[bytes]:
        return set(redis_client.zrange(slots_key(tenant), 0, -1))

    def extra(_):
        try:
            client_for(key).completions.create(model="base", prompt="go", max_tokens=2)
            return 200
        except openai.RateLimitError as e:
            assert e.code == "rate_limit_exceeded"
            assert e.response.headers.get("retry-after")
            return 429

    for _round in range(5):
        streams = []
        try:
            for _ in range(limit):
                stream = client.completions.create(model="base", prompt="go", max_tokens=480, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
                next(iter(stream))            # admitted: its first chunk is here, and it generates on
                streams.append(stream)
            held = leases()
            with cf.ThreadPoolExecutor(6) as pool:
                codes = list(pool.map(extra, range(6)))
            ended = held - leases()
        finally:
            for stream in streams:
                stream.close()
        assert len(held) <= limit, held
        assert codes.count(200) <= len(ended) + limit - len(held), (codes, held, ended)
        if len(held) == limit and not ended:
            assert codes == [429] * 6, codes
            break
        # A held stream finished before the extra requests were answered: wait until its
        # slot and the others' are free (they were closed), and hold them all again.
        wait_for(lambda: not leases(), 60, what="the tenant's slots freed after its streams closed")
    else:
        pytest.fail("in 5 rounds, a held stream always finished before the extra requests were answered")
    # Once the streams are closed the tenant is served again (their slots free as the gateway
    # sees each disconnect).
    deadline = time.monotonic() + 60
    while True:
        try:
            assert client_for(key).completions.create(model="base", prompt="go", max_tokens=2).choices
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the tenant's slots were not freed after its streams closed"
            time.sleep(0.2)


def test_health_endpoint(serving):
    r = httpx.get(serving.url.removesuffix("/v1") + "/health")
    assert r.status_code == 200 and r.json()["healthy_replicas"] == 1


def test_idle_connections_stay_open_longer_than_clients_reuse_them(serving):
    """The gateway reuses an idle connection to a replica for up to half the replica's keep-alive,
    and clients reuse theirs to the gateway for up to 5 s (httpx, the openai SDK). Neither server
    may close such a connection first: a request sent on a connection the server is closing at
    that moment fails (vLLM's default keep-alive is 5 s, as short as the clients' reuse, so the
    replicas are started with a longer one)."""
    engine = serving.gateway.engine
    replica = f"http://{engine.settings.host}:{engine.replicas[0].port}/health"
    gateway = serving.url.removesuffix("/v1") + "/health"
    idle = max(engine.settings.keep_alive_s / 2, 5) + 0.5
    assert closed_after_idle([replica, gateway], idle) == []


def test_new_tenant_model_serves_the_base_until_its_first_version(serving, registry, client_for):
    """A tenant's model exists from creation: before any version is live it answers like base."""
    import uuid

    tid = f"fresh-{uuid.uuid4().hex[:6]}"
    _, key = registry.create_tenant(tid)
    c = client_for(key)
    assert tid in [m.id for m in c.models.list()]
    ask = dict(messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    mine = c.chat.completions.create(model=tid, **ask)
    base = c.chat.completions.create(model="base", **ask)
    assert mine.choices[0].message.content == base.choices[0].message.content


def test_gateway_metrics_count_requests_tokens_and_replicas(serving, tenants, client_for, registry):
    from prometheus_client.parser import text_string_to_metric_families

    tenant, key = tenants.create(11)
    c = client_for(key)
    r = c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                  temperature=0)
    chunks = list(c.chat.completions.create(model=tenant, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, stream=True))
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=tenant, messages=[], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client_for("clk_nope_bad").chat.completions.create(model=tenant, messages=[{"role": "user", "content": "x"}])

    text = httpx.get(f"http://127.0.0.1:{serving.metrics_port}/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}

    def m(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0)

    assert m("clora_gateway_requests_total", tenant=tenant, kind="chat", status="200") == 2  # the stream too
    assert m("clora_gateway_requests_total", tenant=tenant, kind="chat", status="400") == 1
    assert m("clora_gateway_requests_total", tenant="-", kind="chat", status="401") >= 1  # no tenant named
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    assert m("clora_gateway_completion_tokens_total", tenant=tenant) == 2 * r.usage.completion_tokens  # greedy: same
    assert m("clora_gateway_prompt_tokens_total", tenant=tenant) == 2 * r.usage.prompt_tokens
    assert m("clora_gateway_in_flight", tenant=tenant) == 0
    assert m("clora_gateway_unrecorded_interactions_total", tenant=tenant) == 0
    assert m("clora_gateway_first_token_seconds_count") >= 1
    assert m("clora_engine_replica_healthy", replica="0") == 1
    assert m("clora_engine_resident_adapters", replica="0") >= 1
    assert m("clora_gateway_swaps_total", tenant=tenant) == 1  # its v1 went live
    assert m("clora_gateway_interactions_sent_total") >= 2 and m("clora_gateway_interactions_rejected_total") == 0
    # The console's per-minute counts, through Redis.
    serving.call(serving.gateway.metrics.rollup.flush())
    minutes = registry.traffic(tenant, minutes=5)
    total = {k: sum(mn.get(k, 0) for mn in minutes) for k in ("requests", "ok", "refused", "errors", "completion_tokens")}
    assert total == {"requests": 3, "ok": 2, "refused": 1, "errors": 0, "completion_tokens": 2 * r.usage.completion_tokens}


def test_a_stream_whose_client_left_before_its_first_chunk_frees_its_slot(serving, tenants, client_for, wait_for):
    """A client that gives up while its stream is still being set up (say, its timeout fired while
    the engine was busy) must not keep its quota slot, its adapter pin or the engine's stream:
    enough of them would lock its tenant out with 429s for good."""
    tenant, key = tenants.create(11)
    body = json.dumps({"model": tenant, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                       "stream": True, "ignore_eos": True}).encode()
    host, port = serving.gateway_settings.host, serving.port
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    for _ in range(4):
        with socket.create_connection((host, port)) as s:
            s.sendall(request)  # and hang up at once
    engine, quota = serving.gateway.engine, serving.gateway.quota
    wait_for(lambda: quota.in_flight(tenant) == 0 and sum(r.in_flight for r in engine.replicas) == 0,
             timeout=60, what="the abandoned streams to free their slots")
    assert client_for(key).chat.completions.create(model=tenant, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2).choices


def test_a_cached_prompt_prefix_is_reused_within_a_tenant_never_across(serving, tenants, client_for):
    """Every tenant's requests carry its own `cache_salt`: vLLM reuses a cached prefix only for
    the same tenant, so the time to a first token tells no tenant what another sent to a model
    both share (here the base model)."""
    replica = serving.gateway.engine.replicas[0]

    def hits() -> float:
        text = httpx.get(replica.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:prefix_cache_hits_total"))

    (_, key_a), (_, key_b) = tenants.create(11), tenants.create(12)
    prompt = " ".join(f"w{i}" for i in range(60))  # spans several cache blocks

    def ask(key: str, salt: str | None = None) -> None:
        extra = {"extra_body": {"cache_salt": salt}} if salt else {}
        client_for(key).completions.create(model="base", prompt=prompt, max_tokens=1, **extra)

    ask(key_a, salt="one")  # a client's own salt is replaced by its tenant's
    before = hits()
    ask(key_a, salt="two")
    within = hits() - before
    ask(key_b, salt="one")
    across = hits() - before - within
    assert within > 0 and across == 0, (within, across)


def test_one_tenant_cannot_pin_every_adapter_slot_with_its_old_versions(serving, tenants, client_for):
    """Each in-flight request to an old version holds an adapter slot: a tenant may have requests
    to at most `tenant_pinned_versions` (2) versions other than its live one at once.

    Two requests in flight to v1 and v2 hold their quota slots on the gateway's loop exactly as
    `_complete` holds a real one's (a real stream can finish server-side before the next request
    arrives: a first version of this test raced that way in CI)."""
    from clora.serving.tenant_slots import Occupancy

    tenant, key = tenants.create(11, 12, 13, 14)  # v4 is live
    c = client_for(key)
    gw, stack = serving.gateway, contextlib.AsyncExitStack()

    async def hold(*versions: int) -> None:
        for v in versions:
            stack.push_async_callback(gw.quota.release, await gw.quota.acquire(tenant, 1, pinned=v))

    serving.call(hold(1, 2))
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=f"{tenant}@v3", prompt="go", max_tokens=2)
    assert "v1, v2" in e.value.message and e.value.response.headers.get("retry-after")
    assert c.completions.create(model=f"{tenant}@v1", prompt="go", max_tokens=2).choices  # already held
    assert c.completions.create(model=tenant, prompt="go", max_tokens=2).choices  # the live one, always
    serving.call(stack.aclose())  # both requests end
    assert c.completions.create(model=f"{tenant}@v3", prompt="go", max_tokens=2).choices
    streamed = list(c.completions.create(model=f"{tenant}@v2", prompt="go", max_tokens=4, stream=True))
    # The client sees [DONE] a moment before the gateway releases what the stream held: wait for
    # the gateway's own release, then check that real requests release everything they held.
    holds = serving.call(gw.wait_released(tenant, timeout_s=30))
    assert streamed and holds.empty(), holds
    assert serving.call(gw.quota_store.slots.occupancy(tenant)) == Occupancy(0, 0, ())  # nothing left in Redis


def test_the_engines_port_refuses_every_caller_but_the_gateway(serving, tenants, client_for):
    """The replica's `/v1/*` (completions, listing, loading and unloading adapters) needs the
    engine manager's key; only the gateway holds it."""
    tenant, key = tenants.create(11)
    assert client_for(key).chat.completions.create(model=tenant, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2).choices  # the gateway's calls carry it
    engine = serving.gateway.engine
    url = engine.replicas[0].url
    calls = [("GET", "/v1/models", None),
             ("POST", "/v1/load_lora_adapter", {"lora_name": "intruder@v1", "lora_path": "/tmp/nothing"}),
             ("POST", "/v1/unload_lora_adapter", {"lora_name": f"{tenant}@v1"}),
             ("POST", "/v1/completions", {"model": "base", "prompt": "x", "max_tokens": 1})]
    for method, path, body in calls:
        for auth in ({}, {"authorization": "Bearer not-the-key"}):
            r = httpx.request(method, url + path, json=body, headers=auth, timeout=30)
            assert r.status_code == 401, (path, auth, r.status_code, r.text[:200])
    assert f"{tenant}@v1" in engine.resident_names()[0]  # the unload was refused
    ok = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {engine.api_key}"}, timeout=30)
    assert ok.status_code == 200


def test_a_field_vllm_would_fail_on_is_refused_and_the_replica_serves_on(serving, tenants, client_for):
    """`structured_outputs: true` made vLLM answer 500 and drop the connection, and the gateway
    took the replica out for every tenant: now it never leaves the gateway."""
    (a, key_a), (b, key_b) = tenants.create(11), tenants.create(12)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client_for(key_a).chat.completions.create(model=a, messages=msgs, max_tokens=2,
                                                  extra_body={"structured_outputs": True})
    assert e.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as e:
        client_for(key_a).completions.create(model=a, prompt=["one", "two"], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    assert client_for(key_b).chat.completions.create(model=b, messages=msgs, max_tokens=2).choices
