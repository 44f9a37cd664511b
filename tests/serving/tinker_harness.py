"""The in-process gateway of `gateway_harness` with what the Tinker sampling route needs: Tinker
keys (`tml-<tenant>`) besides tenant keys (`clk_<tenant>`), a tenant's saved sampler paths, and a
fake vLLM that answers token-id completions the way vLLM does (and anything else as
`default_vllm`) (one choice per sample, a logprob
per sampled token, the prompt's logprobs keyed by token id, `stop_token_ids` honoured)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from clora.registry import ApiKeyPrincipal
from tests.serving.gateway_harness import FakeRegistry, Harness, default_vllm

SAMPLER_PATHS = {("acme", "tinker://s1:train:0/sampler_weights/final"): 7}
"""(tenant, path) -> the version it was published as."""


class TinkerRegistry(FakeRegistry):
    def authenticate_tinker(self, key: str) -> ApiKeyPrincipal | None:
        return ApiKeyPrincipal(tenant=key[4:], key_id="t") if key.startswith("tml-") else None

    def tinker_sampler_version(self, tenant: str, tinker_path: str) -> int | None:
        return SAMPLER_PATHS.get((tenant, tinker_path))


def sampled(prompt: list[int], index: int, max_tokens: int) -> list[int]:
    """The tokens the fake vLLM samples for choice `index` of `prompt` (before any stop)."""
    return [(sum(prompt) + 7 * index + j) % 50 + 3 for j in range(max_tokens)]


def prompt_logprob(position: int) -> float:
    return -1.0 - position / 10


def tinker_vllm(request: httpx.Request) -> httpx.Response:
    if request.url.path in ("/health", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        return httpx.Response(200, text="ok")
    body = json.loads(request.read())
    if not isinstance(body.get("prompt"), list):   # an OpenAI chat or text completion
        return default_vllm(request)
    prompt, stops = body["prompt"], set(body.get("stop_token_ids") or [])
    choices = []
    for i in range(body.get("n", 1)):
        tokens, finish = sampled(prompt, i, body["max_tokens"]), "length"
        for j, t in enumerate(tokens):
            if t in stops:
                tokens, finish = tokens[:j + 1], "stop"
                break
        choices.append({"index": i, "text": "x", "token_ids": tokens, "finish_reason": finish,
                        "logprobs": {"token_logprobs": [-0.5 - j / 100 for j in range(len(tokens))]},
                        "prompt_logprobs": None if body.get("prompt_logprobs") is None else
                        [None] + [{str(t): {"logprob": prompt_logprob(k), "rank": 1}}
                                  for k, t in enumerate(prompt) if k > 0]})
    return httpx.Response(200, json={"id": "cmpl-x", "object": "text_completion", "model": body["model"],
                                     "choices": choices, "usage": {"prompt_tokens": len(prompt),
                                                                   "completion_tokens": 1, "total_tokens": 1}})


def tinker_harness(tmp_path: Path, vllm=tinker_vllm, **gateway: Any) -> Harness:
    h = Harness(tmp_path, vllm, **gateway)
    h.gateway.registry = TinkerRegistry()
    return h


async def post(h: Harness, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=h.app), base_url="http://gateway") as c:
        return await c.post(path, json=body, headers=headers)
