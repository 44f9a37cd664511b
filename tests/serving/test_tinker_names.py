"""Tinker weights through the gateway: a `tinker://<model id>/sampler_weights/<name>` path serves
the version it was published as, for its own tenant only (anyone else: the same 404 as a model
that does not exist); the Tinker sampling route takes only Tinker keys, forwards a token-id
prompt with the sampling parameters Tinker defines, answers tokens, logprobs and the prompt's
logprobs, and refuses bad input with a 400 naming the field. First against a fake vLLM
(`tinker_harness`), then against the session's real engine."""

from __future__ import annotations

import asyncio
import shutil

import httpx
import pytest

from tests.serving.gateway_harness import LIVE
from tests.serving.tinker_harness import post, prompt_logprob, sampled, tinker_harness

PATH = "tinker://s1:train:0/sampler_weights/final"
TINKER = {"x-api-key": "tml-acme"}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def harness(tmp_path):
    made = []

    def make(**kw):
        h = tinker_harness(tmp_path / f"h{len(made)}", **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def sample(h, body, headers=TINKER) -> httpx.Response:
    return asyncio.run(post(h, "/v1/tinker/sample", body, headers))


# --- names --------------------------------------------------------------------------------

def test_a_saved_sampler_path_serves_its_version_pinned_on_the_openai_routes(harness):
    h = harness()
    r = asyncio.run(h.call({"model": PATH, "messages": MSGS}))
    assert r.status == 200, r.body
    (_, up, _), = h.upstream
    assert up["model"] == "acme@v7"                # the version it was published as, not live (v2)
    assert r.json()["model"] == "acme@v7"
    assert h.held() == {"quota_slots": 0, "leases": 0, "pins": 0, "version_holds": 0}


@pytest.mark.parametrize("tenant, model", [
    ("beta", PATH),                                            # acme's path, asked by another tenant
    ("acme", "tinker://s1:train:0/sampler_weights/other"),     # never saved
    ("acme", "tinker://nonsense"),
])
def test_another_tenants_or_an_unknown_path_is_model_not_found(harness, tenant, model):
    h = harness()
    r = asyncio.run(h.call({"model": model, "messages": MSGS}, tenant=tenant))
    assert r.status == 404 and r.json()["error"]["code"] == "model_not_found" and r.error_param() == "model"
    assert h.upstream == []
    r = sample(h, {"model": model, "prompt": [1, 2]}, {"x-api-key": f"tml-{tenant}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# --- the Tinker sampling route ------------------------------------------------------------

def test_the_sampling_route_forwards_a_token_prompt_and_answers_tokens_and_logprobs(harness):
    h = harness()
    prompt = [1, 42, 7, 9]
    stop = sampled(prompt, 1, 8)[2]                 # sample 1 stops at its third token
    r = sample(h, {"model": PATH, "prompt": prompt, "num_samples": 2, "max_tokens": 8, "temperature": 0.7,
                   "top_p": 0.9, "top_k": 20, "seed": 5, "stop": [stop], "prompt_logprobs": True})
    assert r.status_code == 200, r.text
    (path, up, _), = h.upstream
    assert path == "/v1/completions"
    assert {k: up[k] for k in ("model", "prompt", "n", "max_tokens", "temperature", "top_p", "top_k", "seed",
                               "stop_token_ids", "logprobs", "prompt_logprobs", "return_token_ids")} == \
        {"model": "acme@v7", "prompt": prompt, "n": 2, "max_tokens": 8, "temperature": 0.7, "top_p": 0.9,
         "top_k": 20, "seed": 5, "stop_token_ids": [stop], "logprobs": 0, "prompt_logprobs": 0,
         "return_token_ids": True}
    assert "stop" not in up and "ignore_eos" not in up and up["cache_salt"]
    out = r.json()
    first, second = out["sequences"]
    assert stop not in sampled(prompt, 0, 8)
    assert first["tokens"] == sampled(prompt, 0, 8) and first["stop_reason"] == "length"
    assert second["tokens"] == sampled(prompt, 1, 8)[:3] and second["stop_reason"] == "stop"
    assert second["logprobs"] == pytest.approx([-0.5, -0.51, -0.52])
    assert out["prompt_logprobs"] == [None] + [pytest.approx(prompt_logprob(k)) for k in (1, 2, 3)]
    assert h.held()["quota_slots"] == 0 and h.gateway.quota.sequences_in_flight("acme") == 0


def test_a_greedy_request_is_generated_once_and_repeated_per_sample(harness):
    h = harness()   # vLLM refuses n > 1 at temperature 0; greedy samples are identical anyway
    r = sample(h, {"model": "acme", "prompt": [3, 4], "num_samples": 3, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert h.upstream[0][1]["n"] == 1
    assert [s["tokens"] for s in r.json()["sequences"]] == [sampled([3, 4], 0, 2)] * 3


@pytest.mark.parametrize("stop, upstream", [
    (None, {}),                                       # EOS stops, as vLLM does by default
    ([], {"ignore_eos": True}),                       # Tinker's []: nothing stops it, not even EOS
    ("###", {"stop": ["###"]}),
    (["a", "bc"], {"stop": ["a", "bc"]}),
])
def test_stop_follows_tinkers_meaning(harness, stop, upstream):
    h = harness()
    r = sample(h, {"model": "base", "prompt": [3, 4], "max_tokens": 2, "stop": stop})
    assert r.status_code == 200, r.text
    (_, up, _), = h.upstream
    assert {k: up[k] for k in ("stop", "stop_token_ids", "ignore_eos") if k in up} == upstream
    assert up["model"] == "base"


def test_no_max_tokens_generates_what_the_context_leaves(harness):
    h = harness(engine={"max_model_len": 64}, max_tokens_limit=4096)
    assert sample(h, {"model": "acme", "prompt": list(range(1, 11))}).status_code == 200
    assert h.upstream[0][1]["max_tokens"] == 54
    h = harness(engine={"max_model_len": 64}, max_tokens_limit=20)
    assert sample(h, {"model": "acme", "prompt": list(range(1, 11))}).status_code == 200
    assert h.upstream[0][1]["max_tokens"] == 20


@pytest.mark.parametrize("body, field", [
    ({"model": "acme", "prompt": []}, "prompt"),
    ({"model": "acme", "prompt": [1, -2]}, "prompt"),
    ({"model": "acme", "prompt": [1, 2**31]}, "prompt"),
    ({"model": "acme", "prompt": "hello"}, "prompt"),
    ({"model": "acme"}, "prompt"),
    ({"prompt": [1]}, "model"),
    ({"model": "acme", "prompt": [1], "num_samples": 0}, "num_samples"),
    ({"model": "acme", "prompt": [1], "num_samples": 17}, "num_samples"),   # the tenant's n limit is 16
    ({"model": "acme", "prompt": [1], "max_tokens": 0}, "max_tokens"),
    ({"model": "acme", "prompt": [1], "max_tokens": 5000}, "max_tokens"),
    ({"model": "acme", "prompt": [1] * 2040, "max_tokens": 10}, "max_tokens"),   # past the 2048-token context
    ({"model": "acme", "prompt": [1] * 2048}, "prompt"),
    ({"model": "acme", "prompt": [1], "temperature": -1}, "temperature"),
    ({"model": "acme", "prompt": [1], "top_p": 0}, "top_p"),
    ({"model": "acme", "prompt": [1], "top_k": -2}, "top_k"),
    ({"model": "acme", "prompt": [1], "stop": ["a", 1]}, "stop"),
    ({"model": "acme", "prompt": [1], "stop": [""]}, "stop"),
    ({"model": "acme", "prompt": [1], "seed": "x"}, "seed"),
    ({"model": "acme", "prompt": [1], "logprobs": 5}, "logprobs"),         # not a field of this route
    ([1, 2], None),                                                        # not an object
])
def test_bad_input_is_a_400_naming_the_field_and_reaches_no_engine(harness, body, field):
    h = harness()
    r = sample(h, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
    assert h.upstream == [] and h.held()["quota_slots"] == 0


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "clk_acme"}, {"authorization": "Bearer clk_acme"},
                                     {"x-api-key": "nope"}])
def test_the_sampling_route_opens_to_tinker_keys_only(harness, headers):
    h = harness()
    r = sample(h, {"model": "acme", "prompt": [1]}, headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert h.upstream == []


def test_a_tinker_key_also_works_as_a_bearer_but_never_opens_the_openai_routes(harness):
    h = harness()
    assert sample(h, {"model": "acme", "prompt": [1]}, {"authorization": "Bearer tml-acme"}).status_code == 200
    r = asyncio.run(post(h, "/v1/chat/completions", {"model": "acme", "messages": MSGS},
                         {"authorization": "Bearer tml-acme"}))
    assert r.status_code == 401


def test_another_tenants_pinned_version_is_model_not_found_on_the_sampling_route(harness):
    h = harness()
    r = sample(h, {"model": f"beta@v{LIVE}", "prompt": [1]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert h.upstream == []


def test_an_engine_answer_that_does_not_fit_the_request_is_a_502_and_releases_everything(harness):
    def short(request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/completions"):
            return httpx.Response(200, text="ok")
        return httpx.Response(200, json={"choices": [{"index": 0, "token_ids": [5, 6],
                                                      "logprobs": {"token_logprobs": [-0.1]},
                                                      "finish_reason": "length"}]})
    h = harness(vllm=short)
    r = sample(h, {"model": PATH, "prompt": [1], "max_tokens": 2})
    assert r.status_code == 502 and r.json()["error"]["code"] == "bad_engine_response"
    assert h.held() == {"quota_slots": 0, "leases": 0, "pins": 0, "version_holds": 0}


def test_an_engine_error_passes_through_in_openais_shape(harness):
    def refuse(request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/completions"):
            return httpx.Response(200, text="ok")
        return httpx.Response(400, json={"error": {"message": "Token id 99999 is out of vocabulary",
                                                   "type": "BadRequestError", "param": None, "code": 400}})
    h = harness(vllm=refuse)
    r = sample(h, {"model": "acme", "prompt": [99999]})
    assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"]


# --- against the real engine --------------------------------------------------------------

@pytest.mark.integration
def test_a_tinker_version_serves_pinned_and_by_path_for_its_tenant_only(serving, tenants, client_for, registry,
                                                                       adapter_pool, tmp_path):
    """A Tinker run's version (recorded, never live) is loaded on demand: by its path and as
    `tenant@vN` it answers exactly as pinned; another tenant's key gets 404 for both; the Tinker
    route samples it from token ids with logprobs and the prompt's logprobs."""
    import openai

    from clora.registry import AdapterVersion

    tenant, key = tenants.create(11)                       # v1, live
    other, other_key = tenants.create(12)
    path = "tinker://sess:train:0/sampler_weights/final"   # the Tinker run's weights, as v2
    shutil.copytree(adapter_pool[13], tmp_path / "v2")
    registry.record_adapter_version(tenant, AdapterVersion(version=2, path=str(tmp_path / "v2"), base_model="tiny",
                                                           source="tinker", tinker_path=path))
    registry.record_tinker_sampler(tenant, path, 2)
    assert registry.live_version(tenant) == 1

    c = client_for(key)
    ask = dict(prompt="The weather is", max_tokens=6, temperature=0)
    by_path, pinned, live = (c.completions.create(model=m, **ask) for m in (path, f"{tenant}@v2", tenant))
    assert by_path.choices[0].text == pinned.choices[0].text and by_path.model == f"{tenant}@v2"
    assert live.model == f"{tenant}@v1" and live.choices[0].text != pinned.choices[0].text   # live unchanged
    for model in (path, f"{tenant}@v2"):
        with pytest.raises(openai.NotFoundError):
            client_for(other_key).completions.create(model=model, **ask)

    tinker_key = registry.create_tinker_key(tenant)
    root = serving.url.removesuffix("/v1")
    gateway = httpx.Client(base_url=root, headers={"x-api-key": tinker_key}, timeout=120)
    prompt = [72, 101, 108, 108, 111]                      # byte-level token ids
    r = gateway.post("/v1/tinker/sample", json={"model": path, "prompt": prompt, "num_samples": 2,
                                                "max_tokens": 5, "temperature": 0, "prompt_logprobs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [len(s["tokens"]) for s in out["sequences"]] == [5, 5]
    assert out["sequences"][0]["tokens"] == out["sequences"][1]["tokens"]          # greedy
    assert all(len(s["logprobs"]) == 5 and all(lp <= 0 for lp in s["logprobs"]) for s in out["sequences"])
    assert out["sequences"][0]["stop_reason"] == "length"
    assert out["prompt_logprobs"][0] is None and len(out["prompt_logprobs"]) == len(prompt)
    assert all(lp <= 0 for lp in out["prompt_logprobs"][1:])
    # the first sampled token stops the next request: [] is Tinker's "never stop", a token id stops
    first = out["sequences"][0]["tokens"][0]
    stopped = gateway.post("/v1/tinker/sample", json={"model": path, "prompt": prompt, "max_tokens": 5,
                                                      "temperature": 0, "stop": [first]}).json()
    assert stopped["sequences"][0]["tokens"] == [first] and stopped["sequences"][0]["stop_reason"] == "stop"
    # the same request as another tenant's Tinker key: not found
    other_tinker = registry.create_tinker_key(other)
    r = httpx.post(f"{root}/v1/tinker/sample", headers={"x-api-key": other_tinker}, timeout=60,
                   json={"model": path, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 404
    # out of the engine's vocabulary: the engine's own 400, never a 5xx
    r = gateway.post("/v1/tinker/sample", json={"model": path, "prompt": [10**9], "max_tokens": 2})
    assert r.status_code == 400, r.text


@pytest.mark.integration
def test_the_training_apis_asample_runs_on_the_real_engine_with_the_callers_key(serving, tenants, registry, stack,
                                                                               adapter_pool, tmp_path):
    """`clora.trainapi.sampling` against this gateway: a session of a saved path samples that
    version with the caller's Tinker key, and the result is what the SDK decodes."""
    import redis.asyncio
    from fastapi import FastAPI
    from tinker.proto.response_conv import deserialize_sample_response

    from clora.registry import AdapterVersion
    from clora.trainapi import queue
    from clora.trainapi.sampling import install_sampling
    from clora.trainapi.settings import TrainApiSettings
    from clora.web import HttpError, install_error_handlers

    tenant, _ = tenants.create(11)
    path = "tinker://sess:train:0/sampler_weights/step-3"
    shutil.copytree(adapter_pool[14], tmp_path / "v2")
    registry.record_adapter_version(tenant, AdapterVersion(version=2, path=str(tmp_path / "v2"), base_model="tiny",
                                                           source="tinker", tinker_path=path))
    registry.record_tinker_sampler(tenant, path, 2)
    key = registry.create_tinker_key(tenant)

    class Api:   # the app's `TrainApi`, as far as sampling uses it
        settings = TrainApiSettings(base_model="tiny", gateway_url=serving.url.removesuffix("/v1"))

        def __init__(self, r):
            self.redis = r

        async def tenant(self, request):
            if request.headers.get("x-api-key") != key:
                raise HttpError(401, "unauthorized", "no", "X-API-Key")
            return tenant

        def session(self, t, session_id):
            return type("Session", (), {"session_id": session_id})()

    async def go():
        r = redis.asyncio.Redis.from_url(stack.redis_url)
        app = FastAPI()
        install_error_handlers(app, "clora")
        install_sampling(app, Api(r))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         headers={"x-api-key": key}, timeout=120) as c:
                sid = (await c.post("/api/v1/create_sampling_session", json={
                    "session_id": "sess", "sampling_session_seq_id": 0, "model_path": path})).json()["sampling_session_id"]
                answer = (await c.post("/api/v1/asample", json={
                    "sampling_session_id": sid, "seq_id": 0, "num_samples": 2, "prompt_logprobs": True,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [72, 101, 108, 108, 111]}]},
                    "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": 7}})).json()
                while (o := await queue.outcome(r, answer["request_id"])).state == "pending":
                    await asyncio.sleep(0.05)
                return answer, o
        finally:
            await r.aclose()

    answer, o = asyncio.run(go())
    assert o.state == "done", o.error
    out = deserialize_sample_response(o.result)
    assert len(out.sequences) == len(answer["sample_sequence_ids"]) == 2
    assert all(len(s.tokens) == len(s.logprobs) == 4 and max(s.logprobs) <= 0 for s in out.sequences)
    assert out.prompt_logprobs[0] is None and all(lp <= 0 for lp in out.prompt_logprobs[1:])
