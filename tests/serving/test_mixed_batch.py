"""Multi-tenant batching: concurrent greedy requests from several tenants and the base model
give exactly what each gives alone; more tenants than vLLM keeps in memory are served, by vLLM's
own re-reads (the default) or by the gateway's LRU evictions and reloads."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from clora.serving.replica import cpu_build

pytestmark = pytest.mark.integration

PROMPTS = ["tell me a story", "what is 2+2?"]


def _ask(client, model: str, prompt: str) -> str:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=16, temperature=0)
    return r.choices[0].message.content


def test_mixed_batch_equals_each_adapter_alone(serving, tenants, client_for):
    # First cycle more adapters than --max-loras through the engine, so every LoRA slot holds
    # one: vLLM's CPU ops then apply the last slot to base rows unless the gateway prevents it.
    for seed in (11, 12, 13, 14, 15):
        t, k = tenants.create(seed)
        _ask(client_for(k), t, "warm")
    ts = [tenants.create(seed) for seed in (11, 12, 13)]
    jobs = [(key, t, p) for t, key in ts for p in PROMPTS] + [(ts[0][1], "base", p) for p in PROMPTS]
    alone = {(m, p): _ask(client_for(k), m, p) for k, m, p in jobs}
    # The adapters really change the output (otherwise this test could not fail).
    for p in PROMPTS:
        assert len({alone[(m, p)] for _, m, pp in jobs if pp == p}) == 4
    with cf.ThreadPoolExecutor(len(jobs) * 2) as pool:
        futs = {pool.submit(_ask, client_for(k), m, p): (m, p) for k, m, p in jobs * 2}
        mixed = [(futs[f], f.result()) for f in cf.as_completed(futs)]
    for key, text in mixed:
        assert text == alone[key], key
    # And the base model served by the gateway is the plain base model of vLLM, run alone.
    replica = serving.gateway.engine.replicas[0]
    for p in PROMPTS:
        r = httpx.post(replica.url + "/v1/chat/completions", timeout=60, json={
            "model": "base", "messages": [{"role": "user", "content": p}], "max_tokens": 16, "temperature": 0},
            headers={"Authorization": f"Bearer {serving.gateway.engine.api_key}"})  # only the gateway holds it
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == alone[("base", p)]
    # On a CPU build the outputs above came from clora's LoRA path: the replica's hook patched the
    # process that runs the model (vLLM spawns it; patching the parent would not reach it).
    # The same hook made its shared-memory queue readers poll asleep instead of yielding in a loop.
    if cpu_build():
        log = replica.log_path.read_text(errors="replace")
        assert "PunicaWrapperCPU.add_lora_linear" in log
        assert "shared-memory queue readers poll at most every" in log


def test_more_tenants_than_vllm_keeps_in_memory_stay_loaded_and_vllm_rereads_them(serving, tenants, client_for):
    """The default (`max_registered_loras` 256 > `max_cpu_loras`): every adapter stays loaded, vLLM
    keeps the `max_cpu_loras` used last in memory and re-reads an older one's folder itself, with
    no unload or load from the gateway, and the same output."""
    cap = serving.engine_settings.max_cpu_loras
    assert serving.engine_settings.registered_loras > cap + 2
    seeds = [11, 12, 13, 14, 15, 16]
    ts = [tenants.create(seeds[i % len(seeds)]) for i in range(cap + 2)]
    first = {t: _ask(client_for(k), t, "hi") for t, k in ts}
    engine = serving.gateway.engine
    replica = engine.replicas[0]
    assert {f"{t}@v1" for t, _ in ts} <= set(engine.resident_names()[0])
    ops = dict(replica.adapter_ops)
    for t, k in ts[:2]:  # out of vLLM's memory by now (cap + 2 used since): re-read by vLLM
        assert _ask(client_for(k), t, "hi") == first[t]
    assert dict(replica.adapter_ops) == ops, "the gateway loaded or unloaded an adapter that stayed registered"


def test_with_as_many_loaded_as_vllm_keeps_in_memory_the_gateway_evicts_and_reloads(serving, tenants, client_for):
    """`max_registered_loras` = `max_cpu_loras` (None): the gateway evicts the least recently used
    idle adapter and reloads it on demand, with the same output. The replica's resident set is
    what that setting sizes (`Replica.resident`); this test narrows it on the shared engine."""
    engine = serving.gateway.engine
    replica = engine.replicas[0]
    cap = replica.resident.cached
    registered = replica.resident.capacity
    replica.resident.capacity = cap
    try:
        seeds = [11, 12, 13, 14, 15, 16]
        ts = [tenants.create(seeds[i % len(seeds)]) for i in range(cap + 2)]
        first = {t: _ask(client_for(k), t, "hi") for t, k in ts}
        resident = engine.resident_names()[0]
        assert len(resident) <= cap
        assert f"{ts[0][0]}@v1" not in resident  # evicted (LRU)...
        loads = replica.adapter_ops["load"]
        for t, k in ts[:2]:  # ...and reloaded on demand, with the same output
            assert _ask(client_for(k), t, "hi") == first[t]
        assert f"{ts[0][0]}@v1" in engine.resident_names()[0]
        assert replica.adapter_ops["load"] == loads + 2
    finally:
        replica.resident.capacity = registered