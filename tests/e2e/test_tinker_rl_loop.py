"""The unchanged `tinker` SDK runs an RL loop on the whole platform, in the style of
tinker-cookbook's `rl_loop`, and the result serves on the OpenAI endpoint.

Each step: `save_weights_and_get_sampling_client` (the run's weights published as a version of
the tenant, not live) -> `sample` through the gateway and the shared vLLM engine, with the
sampled tokens' logprobs -> rewards and group-centred advantages on the client ->
`forward_backward(importance_sampling)` + `optim_step` on the learner, scheduled beside the
continuously learning tenants. The task is the letters task of `test_rl_loop`: the reward is the
fraction of sampled tokens that decode to ASCII letters, which a random tiny model rarely emits.

Then the run's final weights, saved for the sampler by name, answer on the OpenAI endpoint by
their `tinker://` path and as `tenant@vN`, the version's lineage says it came from Tinker, and
once promoted it serves as the tenant's own model.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
tinker = pytest.importorskip("tinker")

TENANT = "tinkerer"
GROUP, MAX_STEPS, RISE = 16, 20, 0.25


def test_an_sdk_rl_loop_raises_the_reward_and_its_weights_serve_on_the_openai_endpoint(platform, monkeypatch):
    from openai import OpenAI
    from transformers import AutoTokenizer

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    env, admin = platform["env"], {"Authorization": f"Bearer {platform['token']}"}
    out = subprocess.run([sys.executable, "-m", "clora.infra.cli", "tenant", "create", TENANT, "--json"], env=env,
                         capture_output=True, text=True, check=True)
    api_key = json.loads(out.stdout)["api_key"]
    r = httpx.post(f"{platform['console']}/api/tenants/{TENANT}/tinker-keys", headers=admin)
    assert r.status_code == 201, r.text
    tinker_key = r.json()["tinker_key"]

    tok = AutoTokenizer.from_pretrained(str(platform["model"]))
    letters = {i for i in range(len(tok)) if (t := tok.decode([i])) and t.isascii() and t.isalpha()}
    client = tinker.ServiceClient(base_url=platform["trainapi"], api_key=tinker_key)
    base = client.get_server_capabilities().supported_models[0].model_name
    training = client.create_lora_training_client(base_model=base, rank=int(env["CLORA_LEARNER_RANK"]))
    prompt = tok.encode("Write some letters:", add_special_tokens=False)
    params = tinker.SamplingParams(max_tokens=8, temperature=1.0)
    adam = tinker.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8)

    rewards, gaps = [], []
    while len(rewards) < MAX_STEPS and not (len(rewards) >= 6 and statistics.fmean(rewards[-3:])
                                              > statistics.fmean(rewards[:3]) + RISE):
        sampler = training.save_weights_and_get_sampling_client()
        result = sampler.sample(tinker.ModelInput.from_ints(prompt), GROUP, params).result()
        assert len(result.sequences) == GROUP
        scores = [sum(t in letters for t in s.tokens) / len(s.tokens) if s.tokens else 0.0 for s in result.sequences]
        mean = statistics.fmean(scores)
        rewards.append(mean)
        data = []
        for s, score in zip(result.sequences, scores):
            if not s.tokens:
                continue
            tokens = prompt + s.tokens
            assert s.logprobs is not None and len(s.logprobs) == len(s.tokens)
            n = len(prompt) - 1
            data.append(tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                                     loss_fn_inputs={"target_tokens": tokens[1:],
                                                     "logprobs": [0.0] * n + list(s.logprobs),
                                                     "advantages": [0.0] * n + [score - mean] * len(s.tokens)}))
        fb = training.forward_backward(data, "importance_sampling").result()
        # the sampler served exactly the weights the learner holds: its logprobs are the learner's
        for d, o, s in zip(data, fb.loss_fn_outputs, [s for s in result.sequences if s.tokens]):
            mine = o["logprobs"].to_numpy()[len(prompt) - 1:]
            gaps += [abs(float(a) - float(b)) for a, b in zip(mine, s.logprobs)]
        training.optim_step(adam).result()

    assert len(rewards) >= 6 and statistics.fmean(rewards[-3:]) > statistics.fmean(rewards[:3]) + RISE, rewards
    # vLLM (its kernels, fp32) and the learner (torch, fp32) agree on every sampled token's logprob
    assert max(gaps) < 0.05 and statistics.fmean(gaps) < 0.01, (max(gaps), statistics.fmean(gaps))

    path = training.save_weights_for_sampler("final").result().path
    versions = httpx.get(f"{platform['console']}/api/tenants/{TENANT}/versions", headers=admin).json()
    final = next(v for v in versions["versions"] if v.get("tinker_path") == path)
    assert final["source"] == "tinker" and versions["live"] != final["version"]   # published, not live
    openai = OpenAI(base_url=platform["gateway"] + "/v1", api_key=api_key, max_retries=2, timeout=120)
    for model in (path, f"{TENANT}@v{final['version']}"):
        answer = openai.completions.create(model=model, prompt="Write some letters:", max_tokens=8, temperature=0)
        assert answer.choices[0].text, model
    # the same version by both names: the same greedy text
    by_path = openai.completions.create(model=path, prompt="Write some letters:", max_tokens=8, temperature=0)
    pinned = openai.completions.create(model=f"{TENANT}@v{final['version']}", prompt="Write some letters:",
                                       max_tokens=8, temperature=0)
    assert by_path.choices[0].text == pinned.choices[0].text

    # promoted, it is the tenant's live version: its production name answers as the run does
    r = httpx.post(f"{platform['console']}/api/tenants/{TENANT}/versions/{final['version']}/promote", headers=admin)
    assert r.status_code == 200 and r.json()["live"] == final["version"], r.text
    deadline = time.monotonic() + 60
    while True:
        live = openai.completions.create(model=TENANT, prompt="Write some letters:", max_tokens=8, temperature=0)
        if live.choices[0].text == pinned.choices[0].text:
            break
        assert time.monotonic() < deadline, "the promoted Tinker version never served as the tenant's model"
        time.sleep(0.3)
