"""The gateway's Tinker sampling route: a token-id prompt in, sampled token ids and logprobs out.

    POST /v1/tinker/sample      X-API-Key: tml-...   (or Authorization: Bearer tml-...)

The Tinker-compatible training API (`clora.trainapi.sampling`) sends each SDK `asample` here,
with the **caller's own Tinker key**: the gateway authenticates it itself
(`Registry.authenticate_tinker`) and resolves `model` for that key's tenant only, as its OpenAI
routes do, so the training API holds no credential of its own and cannot sample another
tenant's weights whatever it sends. A Tinker key opens this route alone; a tenant key (`clk_`)
never opens it. Requests share the tenant's quota, version holds and engine leases with its
OpenAI traffic, and are not recorded as interactions (a research rollout is not user traffic,
and a token prompt has no messages).

`model` is the base model's name, `tenant@vN`, or a `tinker://<model id>/sampler_weights/<name>`
path the tenant saved. Example request and answer:

    {"model": "acme@v7", "prompt": [1, 42, 7], "num_samples": 2, "max_tokens": 3,
     "temperature": 1.0, "stop": [2], "prompt_logprobs": true}
    {"model": "acme@v7",
     "sequences": [{"tokens": [5, 9, 2], "logprobs": [-0.3, -1.2, -0.1], "stop_reason": "stop"},
                   {"tokens": [8, 8, 8], "logprobs": [-2.0, -0.5, -0.4], "stop_reason": "length"}],
     "prompt_logprobs": [null, -3.1, -0.7]}

`stop` follows Tinker's `SamplingParams.stop`: null stops at EOS; strings or token ids stop
there too; `[]` never stops before `max_tokens`, not even at EOS. `max_tokens` null is what
the context leaves (at most the tenant's `max_tokens` limit). A greedy request (temperature 0)
is generated once and its sequence repeated per sample. Logprobs are the engine's
(`EngineSettings.logprobs_mode`, raw by default: the temperature-1 distribution the learner
scores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from clora.serving.settings import TenantLimits

PATH = "/v1/tinker/sample"
KIND = "tinker_sample"
"""The `kind` label this route's requests carry in the gateway's metrics."""
MAX_TOKEN_ID = 2**31 - 1
"""Token ids are int32 on Tinker's wire."""


def stop_kind(v: Any) -> Any:
    """`v` if it is a Tinker `stop` (null, a string, strings, or token ids), else ValueError
    (a pydantic "before" validator, so a mixed list gets one clear message)."""
    ok = v is None or isinstance(v, str) or isinstance(v, list) and (
        all(isinstance(s, str) for s in v) or all(isinstance(s, int) and not isinstance(s, bool) for s in v))
    if not ok:
        raise ValueError("must be null, a string, a list of strings or a list of token ids")
    return v


class SampleRequest(BaseModel):
    """What the training API sends (module docstring); any other field is refused."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=1000)
    prompt: list[int] = Field(min_length=1)
    num_samples: int = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    """-1 (or 0): no limit."""
    seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)
    stop: str | list[str] | list[int] | None = None
    prompt_logprobs: bool = False

    @field_validator("prompt")
    @classmethod
    def _token_ids(cls, v: list[int]) -> list[int]:
        for i, t in enumerate(v):
            if not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(f"token {i} is {t}: token ids are 0..{MAX_TOKEN_ID}")
        return v

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_kind(cls, v: Any) -> Any:
        return stop_kind(v)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list | None) -> str | list | None:
        items = [v] if isinstance(v, str) else v or []
        if len(items) > 64:
            raise ValueError(f"at most 64 stop sequences, got {len(items)}")
        for i, s in enumerate(items):
            if isinstance(s, str) and not 0 < len(s) <= 256:
                raise ValueError(f"stop string {i} must be 1-256 characters")
            if isinstance(s, int) and not 0 <= s <= MAX_TOKEN_ID:
                raise ValueError(f"stop token {i} is {s}: token ids are 0..{MAX_TOKEN_ID}")
        return v


class Refused(ValueError):
    """A request this route will not serve; `field` names what was wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


GREEDY_BELOW = 1e-5
"""A temperature below this is greedy (vLLM's threshold): vLLM then refuses n > 1, so a greedy
request is sampled once and its one sequence repeated `num_samples` times."""


@dataclass(frozen=True)
class Admitted:
    """A checked request and the generation budget it was given."""

    request: SampleRequest
    max_tokens: int
    """`request.max_tokens`, or what the context and the tenant's limit leave when it is null."""

    @property
    def engine_n(self) -> int:
        """The sequences the engine generates (and the tenant's quota holds): 1 when greedy."""
        return 1 if self.request.temperature < GREEDY_BELOW else self.request.num_samples


def parse(body: Any, limits: TenantLimits, max_model_len: int) -> Admitted:
    """Validate `body` (a decoded JSON value) against the request shape and the tenant's limits;
    `Refused` naming the first wrong field."""
    if not isinstance(body, dict):
        raise Refused("body", "must be a JSON object")
    try:
        req = SampleRequest.model_validate(body)
    except ValidationError as e:   # named by the top-level field: a union's member names mean nothing here
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"] if isinstance(p, int) or p in SampleRequest.model_fields)
        field = str(err["loc"][0]) if err["loc"] else "body"
        raise Refused(field, err["msg"] if where == field else f"{err['msg']} (at {where})") from e
    if req.num_samples > limits.n:
        raise Refused("num_samples", f"at most {limits.n} samples per request, got {req.num_samples}")
    room = max_model_len - len(req.prompt)
    if room < 1:
        raise Refused("prompt", f"{len(req.prompt)} tokens leave no room to generate in the engine's "
                                f"{max_model_len}-token context")
    if req.max_tokens is None:
        return Admitted(req, min(room, limits.max_tokens))
    if req.max_tokens > limits.max_tokens:
        raise Refused("max_tokens", f"at most {limits.max_tokens}, got {req.max_tokens}")
    if req.max_tokens > room:
        raise Refused("max_tokens", f"{len(req.prompt)} prompt tokens + {req.max_tokens} exceed the engine's "
                                    f"{max_model_len}-token context")
    return Admitted(req, req.max_tokens)


def upstream_body(a: Admitted, served_model: str, cache_salt: str) -> dict[str, Any]:
    """The vLLM `/v1/completions` request: the token prompt, `n`, token ids and each sampled
    token's logprob always, the prompt's when asked; the tenant's prefix-cache salt."""
    r = a.request
    up: dict[str, Any] = {"model": served_model, "prompt": r.prompt, "n": a.engine_n, "max_tokens": a.max_tokens,
                          "temperature": r.temperature, "top_p": r.top_p, "logprobs": 0, "return_token_ids": True,
                          "skip_special_tokens": False, "cache_salt": cache_salt}
    if r.top_k > 0:
        up["top_k"] = r.top_k
    if r.seed is not None:
        up["seed"] = r.seed
    if r.prompt_logprobs:
        up["prompt_logprobs"] = 0
    stop = [r.stop] if isinstance(r.stop, str) else r.stop
    if stop == []:
        up["ignore_eos"] = True
    elif stop and isinstance(stop[0], str):
        up["stop"] = stop
    elif stop:
        up["stop_token_ids"] = stop
    return up


class BadEngineResponse(ValueError):
    """vLLM answered 200 with something that is not the completion asked for."""


def sample_result(resp: dict[str, Any], a: Admitted) -> dict[str, Any]:
    """The route's answer from vLLM's completion `resp` (module docstring's shape): one sequence
    per choice in index order (a greedy request's one choice repeated), each with as many logprobs
    as tokens."""
    choices = sorted(resp.get("choices") or [], key=lambda c: c["index"])
    if len(choices) != a.engine_n:
        raise BadEngineResponse(f"{len(choices)} choices for {a.engine_n} samples")
    sequences = []
    for c in choices:
        tokens = [int(t) for t in c.get("token_ids") or []]
        logprobs = [_logprob(x) for x in ((c.get("logprobs") or {}).get("token_logprobs") or [])]
        if len(logprobs) != len(tokens):
            raise BadEngineResponse(f"choice {c['index']}: {len(logprobs)} logprobs for {len(tokens)} tokens")
        stop_reason: Literal["stop", "length"] = "length" if c.get("finish_reason") == "length" else "stop"
        sequences.append({"tokens": tokens, "logprobs": logprobs, "stop_reason": stop_reason})
    if len(sequences) < a.request.num_samples:   # greedy: every sample is the one sequence
        sequences = [dict(sequences[0]) for _ in range(a.request.num_samples)]
    out: dict[str, Any] = {"model": a.request.model, "sequences": sequences, "prompt_logprobs": None}
    if a.request.prompt_logprobs:
        out["prompt_logprobs"] = _prompt_logprobs(choices[0].get("prompt_logprobs"), a.request.prompt)
    return out


MIN_LOGPROB = -9999.0
"""Minus infinity as vLLM writes a sampled token's logprob (JSON has no infinities)."""


def _logprob(x: Any) -> float:
    """A logprob as vLLM writes it in JSON: a number, or null for minus infinity (which, like
    vLLM's sampled logprobs, becomes `MIN_LOGPROB`)."""
    if x is None:
        return MIN_LOGPROB
    value = float(x)
    if math.isnan(value):
        raise BadEngineResponse("a logprob is NaN")
    return max(value, MIN_LOGPROB)


def _prompt_logprobs(raw: Any, prompt: list[int]) -> list[float | None]:
    """Each prompt token's logprob given the tokens before it, None where there is none
    (position 0). vLLM gives one entry per position: null, or {token id: {"logprob": ...}}
    holding the prompt's own token."""
    if not isinstance(raw, list) or len(raw) != len(prompt):
        raise BadEngineResponse(f"prompt_logprobs has {len(raw) if isinstance(raw, list) else 'no'} entries for "
                                f"{len(prompt)} prompt tokens")
    out: list[float | None] = []
    for token, entry in zip(prompt, raw):
        if entry is None:
            out.append(None)
            continue
        found = entry.get(str(token)) if isinstance(entry, dict) else None
        if not isinstance(found, dict):
            raise BadEngineResponse(f"prompt_logprobs names no logprob for prompt token {token}")
        out.append(_logprob(found.get("logprob")))
    return out
