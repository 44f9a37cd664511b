"""Verifying an adapter a replica has just loaded: the replica answers the version's canary
prompt under the adapter's name and under the base, and `clora.canary` judges the two answers
(against the learner's numbers when the version carries a canary, else adapter vs base).

    verdict = await run_canary(http, replica, ref, base_model="base", timeout_s=30)
    verdict.passed, verdict.outcome, verdict.reason

Without a canary the prompt is `FALLBACK_PROMPT`: a few token ids every vocabulary has (the
byte-level and BPE vocabularies alike keep their first ids for bytes and specials).
"""

from __future__ import annotations

import httpx

from clora.canary import CanaryVerdict, check_applied
from clora.serving.aliases import AdapterRef
from clora.serving.replica import Replica

FALLBACK_PROMPT = [17, 42, 71, 100, 33, 88, 54, 120, 65, 99, 110, 32]
"""Token ids asked for when a version has no canary (any vocabulary of more than 120 tokens)."""


async def run_canary(http: httpx.AsyncClient, replica: Replica, ref: AdapterRef, *, base_model: str,
                     timeout_s: float) -> CanaryVerdict:
    """Ask `replica` for the canary prompt's log-probabilities under `ref`'s adapter, then under
    `base_model` (one after the other: not batched together, where vLLM's own CPU LoRA ops would
    give the base row an adapter), and judge them. Raises `ReplicaError` when the replica does
    not answer."""
    replica.adapter_ops["canary"] += 1
    prompt = ref.canary.prompt_token_ids if ref.canary is not None else FALLBACK_PROMPT
    adapter = await replica.prompt_logprobs(http, ref.name, prompt, timeout_s)
    base = await replica.prompt_logprobs(http, base_model, prompt, timeout_s)
    return ref.canary.check(adapter, base) if ref.canary is not None else check_applied(adapter, base)
