"""The whole continuous-learning loop through `clora up`, as a user drives it, on a tiny model:

chat through the OpenAI gateway (served by vLLM) -> operator corrections through the webhook
-> Kafka -> ingest worker -> Redis buffer -> learner trains and publishes v1 (PEFT folder)
-> serving hot-swaps it in -> the next answers come from v1, and vLLM's logprobs for them
match the learner-side model (transformers + PEFT loading the same folder). The version's
first completion measures how long its corrections took to be served (freshness).

Every service is the real one, started by `clora up` in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clora.ids import served_name

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_corrections_train_a_version_that_serving_swaps_in(platform, wait_for):
    from openai import OpenAI

    env = platform["env"]
    out = subprocess.run([sys.executable, "-m", "clora.infra.cli", "tenant", "create", "acme", "--json"], env=env,
                         capture_output=True, text=True, check=True)
    key = json.loads(out.stdout)["api_key"]
    admin = {"Authorization": f"Bearer {platform['token']}"}
    r = httpx.patch(f"{platform['console']}/api/tenants/acme/policy", headers=admin,
                    json={"batch_size": 4, "min_new_examples": 4, "learning_rate": 0.02})
    assert r.status_code == 200, r.text

    client = OpenAI(base_url=platform["gateway"] + "/v1", api_key=key, max_retries=0, timeout=120)
    prompts = [f"favourite colour {i}?" for i in range(8)]
    first_feedback = time.time()
    for p in prompts:  # served by the base model: the tenant has no version yet
        resp = client.chat.completions.create(model="acme", messages=[{"role": "user", "content": p}],
                                              max_tokens=8, temperature=0)
        fb = httpx.post(platform["webhook"] + "/v1/feedback", headers={"Authorization": f"Bearer {key}"},
                        json={"interaction_id": resp.id, "source": "operator",
                              "correction": {"role": "assistant", "content": "blue"}}, timeout=60)
        assert fb.status_code == 202, fb.text

    versions = lambda: httpx.get(f"{platform['console']}/api/tenants/acme/versions", headers=admin).json()
    wait_for(lambda: versions()["live"] is not None, 300, interval=0.5, what="the learner to publish a version")
    # pause learning so the live version stops moving (a step already running may still publish)
    assert httpx.post(f"{platform['console']}/api/tenants/acme/pause", headers=admin).json()["paused"]
    served = lambda: {m.id: m for m in client.models.list()}["acme"].model_extra.get("root")
    seen = {}

    def serving_the_live_version() -> bool:  # read together: the live version may move on meanwhile
        seen["live"] = versions()["live"]
        return served() == served_name("acme", seen["live"])

    wait_for(serving_the_live_version, 60, interval=0.5, what="the gateway to serve the live acme version")
    live = seen["live"]
    folder = Path(next(v["path"] for v in versions()["versions"] if v["version"] == live))
    assert (folder / "adapter_model.safetensors").exists()

    # vLLM serving the published folder == transformers + PEFT loading it (same tokens' logprobs)
    ask = [{"role": "user", "content": prompts[0]}]
    resp = client.chat.completions.create(model=served_name("acme", live), messages=ask, max_tokens=6, temperature=0, logprobs=True,
                                          extra_body={"return_tokens_as_token_ids": True})
    content = resp.choices[0].logprobs.content
    served_lp = [t.logprob for t in content]
    token_ids = [int(t.token.removeprefix("token_id:")) for t in content]
    assert served_lp
    expected = _peft_logprobs(platform["model"], folder, ask, token_ids)
    assert len(expected) == len(served_lp)
    for a, b in zip(served_lp, expected):
        assert abs(a - b) < 2e-3, (served_lp, expected)
    # ... and the learner's own model with that adapter picks the same greedy tokens
    assert _learner_greedy(platform["model"], folder, ask, len(token_ids)) == token_ids

    # lineage: the version knows the feedback window it was trained on: within this test's
    # corrections. (Its examples need not fill a batch: under the default `auto` policy a step
    # takes the oldest examples of every kind up to the batch size, and a correction's SFT example
    # and its preference pair may fall either side of the cut.)
    meta = next(v for v in versions()["versions"] if v["version"] == live)
    start, end = meta["feedback_window"]
    assert first_feedback - 1 <= start <= end <= time.time(), (meta["feedback_window"], first_feedback)
    assert 1 <= meta["examples_seen"] <= 2 * len(prompts)          # an SFT example and a pair per correction

    # freshness: the pinned completion above was the live version's first; its gateway measured
    # every correction first trained in it, from the correction's 202 to that completion
    freshness = lambda: httpx.get(f"{platform['console']}/api/tenants/acme/freshness", headers=admin).json()
    summary = wait_for(lambda: next((v for v in freshness()["versions"] if v["version"] == live), None), 60,
                       interval=0.5, what=f"acme v{live}'s freshness summary")
    elapsed = time.time() - first_feedback
    assert summary["events"] >= 1 and 0 < summary["p50_s"] <= summary["p99_s"] < elapsed, (summary, elapsed)
    assert 0 <= summary["published_to_served_s"] < summary["p50_s"]
    metrics = httpx.get(f"http://127.0.0.1:{platform['env']['CLORA_GATEWAY_METRICS_PORT']}/metrics").text
    observed = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith('clora_feedback_to_served_seconds_count{tenant="acme"}'))
    assert observed == freshness()["events"] == sum(v["events"] for v in freshness()["versions"])


def _learner_greedy(model_dir: Path, adapter: Path, messages, n: int) -> list[int]:
    import torch

    from clora.learner.base_model import load_base_model
    from clora.learner.lora import LoraModel, LoraSpec
    from clora.learner.peft_io import read_adapter

    base, tok = load_base_model(model_dir)
    config = json.loads((adapter / "adapter_config.json").read_text())
    lm = LoraModel(base, LoraSpec(rank=config["r"], alpha=config["lora_alpha"],
                                  target_modules=tuple(config["target_modules"])))
    lm.bind(lm.layout.views(read_adapter(adapter, lm.layout)))
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(lm(torch.tensor([ids + out]))[0, -1].argmax())
            out.append(nxt)
            if nxt == tok.eos_token_id:
                break
    return out


def _peft_logprobs(model_dir: Path, adapter: Path, messages, c_ids: list[int]) -> list[float]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p_ids + c_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(p_ids) - 1:-1]
    lp = torch.log_softmax(logits.float(), -1)
    return [float(lp[i, t]) for i, t in enumerate(c_ids)]
