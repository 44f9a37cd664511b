"""What the gateway does to a completion on its way through: the upstream request it sends
vLLM, the response it gives the client, and the interaction events it records.

vLLM is always asked for the completion token ids (`return_token_ids`) and the sampled
tokens' logprobs, because every interaction event carries them (the behaviour policy for
RL). When the client did not ask for them they are removed from its response.

`Recorder` collects one response — whole (`finish`) or as stream chunks (`chunk`) — and
builds the events. Worked example for a streamed chat with n=1: chunks carrying
`delta.content` "Hel", "lo" and `token_ids` [9, 4] give a response message "Hello" and
`completion_token_ids` [9, 4].
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from clora.ids import choice_ids
from clora.ingest.schemas import MAX_MESSAGES, InteractionEvent, Message
from clora.serving.aliases import AdapterRef

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "n", "stop", "seed",
                 "presence_penalty", "frequency_penalty", "tool_choice", "min_tokens", "repetition_penalty")
VLLM_EXTRAS = ("prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params",
               "metrics")
CHOICE_EXTRAS = ("token_ids", "routed_experts")


def upstream_body(body: dict[str, Any], kind: Kind, served_model: str, cache_salt: str | None = None) -> dict[str, Any]:
    """The request vLLM gets: the client's (its fields checked by `request_fields`), with the served name, token ids + logprobs on, and
    the caller's tenant's `cache_salt` (whatever the client sent): vLLM then reuses a cached
    prompt prefix only within one tenant, so no tenant can time its first token to learn what
    another recently sent to a model both share (the base model, or the zero adapter on CPU)."""
    up = dict(body, model=served_model, return_token_ids=True)
    for name in ("cache_salt", "metadata"):  # the tenant's salt replaces the client's; metadata is clora's
        up.pop(name, None)
    if cache_salt is not None:
        up["cache_salt"] = cache_salt
    if kind == "chat":
        if not body.get("logprobs"):
            up["logprobs"], up["top_logprobs"] = True, 0
    elif body.get("logprobs") is None:
        up["logprobs"] = 0
    return up


def _client_wants(body: dict[str, Any], kind: Kind) -> tuple[bool, bool]:
    """(wants logprobs, wants token ids) as the client asked."""
    lp = bool(body.get("logprobs")) if kind == "chat" else body.get("logprobs") is not None
    return lp, bool(body.get("return_token_ids"))


class Unrecordable(ValueError):
    """A request whose messages its interaction event could not record; `field` names the part."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def recorded_messages(body: dict[str, Any], kind: Kind) -> list[Message]:
    """The request's messages as its interaction event records them (content parts become their
    text; tool calls keep the OpenAI keys, without the `index` of stream deltas; an assistant
    turn with neither content nor tool calls has content ""). Raises
    `Unrecordable` naming the field of the first message that cannot be recorded: the gateway
    refuses such a request before serving it, since feedback on it could never join."""
    if kind == "completion":
        prompt = body.get("prompt")
        try:
            return [_message("prompt", role="user", content=prompt if isinstance(prompt, str) else str(prompt))]
        except Unrecordable as e:
            raise Unrecordable("prompt", e.message) from e
    raw = body.get("messages") or []
    if len(raw) > MAX_MESSAGES:
        raise Unrecordable("messages", f"at most {MAX_MESSAGES} messages are recorded, got {len(raw)}")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise Unrecordable(f"messages.{i}", "a message must be an object")
        content, calls = m.get("content"), _openai_keys(m.get("tool_calls")) or None
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str))
        if content is None and calls is None and m.get("role") == "assistant":
            content = ""  # an empty assistant turn an agent sent back: vLLM serves it
        out.append(_message(f"messages.{i}", role=m.get("role"), content=content, name=m.get("name"),
                            tool_calls=calls, tool_call_id=m.get("tool_call_id")))
    return out


def _message(field: str, **parts: Any) -> Message:
    try:
        return Message(**parts)
    except ValidationError as e:
        err = e.errors()[0]
        raise Unrecordable(".".join(str(x) for x in (field, *err["loc"])), err["msg"]) from e


def _openai_keys(calls: Any) -> Any:
    """Each tool call with only the keys of the OpenAI shape (anything else is left to fail validation)."""
    if not isinstance(calls, list):
        return calls
    return [{**_only(tc, ("id", "type")), "function": _only(tc.get("function"), ("name", "arguments"))}
            if isinstance(tc, dict) else tc for tc in calls]


def _only(d: Any, keys: tuple[str, ...]) -> Any:
    return {k: d[k] for k in keys if k in d} if isinstance(d, dict) else d


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


class Recorder:
    """One request's response as it passes through; builds its interaction events."""

    def __init__(self, *, kind: Kind, body: dict[str, Any], tenant: str, interaction_id: str,
                 ref: AdapterRef | None, client_model: str, messages: list[Message] | None = None):
        """`messages`: the body's `recorded_messages`, when the caller has them already (the
        gateway checks them before serving); computed here otherwise (raises `Unrecordable`)."""
        self.kind, self.body, self.tenant, self.interaction_id = kind, body, tenant, interaction_id
        self.messages = messages if messages is not None else recorded_messages(body, kind)
        self.ref, self.client_model = ref, client_model
        self.wants_logprobs, self.wants_token_ids = _client_wants(body, kind)
        self.choices: dict[int, _Choice] = {}
        self.prompt_token_ids: list[int] | None = None
        self.started = time.monotonic()

    # --- collecting ---------------------------------------------------------------------

    def _choice(self, index: int) -> _Choice:
        return self.choices.setdefault(index, _Choice())

    def _take_logprobs(self, ch: _Choice, raw: dict[str, Any]) -> None:
        lp = raw.get("logprobs")
        if not lp:
            return
        if self.kind == "chat":
            ch.logprobs += [t["logprob"] for t in lp.get("content") or []]
        else:
            ch.logprobs += [x for x in lp.get("token_logprobs") or []]

    def _strip(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj["id"] = self.interaction_id
        obj["model"] = self.client_model
        for k in VLLM_EXTRAS:
            if not (k == "prompt_token_ids" and self.wants_token_ids):
                obj.pop(k, None)
        for c in obj.get("choices") or []:
            if not self.wants_token_ids:
                for k in CHOICE_EXTRAS:
                    c.pop(k, None)
            if not self.wants_logprobs:
                c["logprobs"] = None
        return obj

    def finish(self, resp: dict[str, Any]) -> dict[str, Any]:
        """Take a whole (non-streamed) response; returns what the client gets."""
        self.prompt_token_ids = resp.get("prompt_token_ids")
        for c in resp.get("choices") or []:
            ch = self._choice(c["index"])
            ch.token_ids = list(c.get("token_ids") or [])
            self._take_logprobs(ch, c)
            ch.finish_reason = c.get("finish_reason")
            if self.kind == "chat":
                msg = c.get("message") or {}
                ch.text = [msg.get("content") or ""]
                for i, tc in enumerate(msg.get("tool_calls") or []):
                    ch.tool_calls[i] = {"id": tc.get("id"), "name": tc["function"]["name"],
                                        "arguments": tc["function"].get("arguments") or ""}
            else:
                ch.text = [c.get("text") or ""]
        return self._strip(resp)

    def chunk(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Take one streamed chunk; returns the chunk the client gets."""
        if obj.get("prompt_token_ids"):
            self.prompt_token_ids = obj["prompt_token_ids"]
        for c in obj.get("choices") or []:
            ch = self._choice(c.get("index", 0))
            ch.token_ids += c.get("token_ids") or []
            self._take_logprobs(ch, c)
            if c.get("finish_reason"):
                ch.finish_reason = c["finish_reason"]
            if self.kind == "chat":
                delta = c.get("delta") or {}
                if delta.get("content"):
                    ch.text.append(delta["content"])
                for tc in delta.get("tool_calls") or []:
                    acc = ch.tool_calls.setdefault(tc.get("index", 0), {"id": None, "name": "", "arguments": ""})
                    acc["id"] = tc.get("id") or acc["id"]
                    fn = tc.get("function") or {}
                    acc["name"] += fn.get("name") or ""
                    acc["arguments"] += fn.get("arguments") or ""
            elif c.get("text"):
                ch.text.append(c["text"])
        return self._strip(obj)

    # --- events -------------------------------------------------------------------------

    def generated_tokens(self) -> int:
        """Tokens generated so far, over every choice."""
        return sum(len(c.token_ids) for c in self.choices.values())

    @property
    def choices_asked(self) -> int:
        return int(self.body.get("n") or 1)

    def interaction_ids(self) -> list[str]:
        return choice_ids(self.interaction_id, self.choices_asked)

    def events(self) -> list[InteractionEvent]:
        latency_ms = (time.monotonic() - self.started) * 1000
        sampling = {k: self.body[k] for k in SAMPLING_KEYS if self.body.get(k) is not None}
        ids = self.interaction_ids()
        # the caller's rollout group (`metadata.group_id`, checked by the gateway) spans every
        # turn of a group's episodes; without one, the n choices of one request form a group.
        # `metadata.episode_id` (checked too) names the episode a later turn continues
        metadata = self.body.get("metadata") or {}
        group = metadata.get("group_id") or (self.interaction_id if len(ids) > 1 else None)
        try:
            out = []
            for index, ch in sorted(self.choices.items()):
                calls = [{"id": tc["id"] or f"call-{self.interaction_id}-{i}", "type": "function",
                          "function": {"name": tc["name"], "arguments": tc["arguments"]}}
                         for i, tc in sorted(ch.tool_calls.items())]
                response = Message(role="assistant", content="".join(ch.text) if ch.text or not calls else None,
                                   tool_calls=calls or None)
                lps = ch.logprobs if len(ch.logprobs) == len(ch.token_ids) else None
                out.append(InteractionEvent(
                    tenant=self.tenant, interaction_id=ids[index] if index < len(ids) else f"{self.interaction_id}-{index}",
                    adapter=self.ref.name if self.ref else None, adapter_version=self.ref.version if self.ref else None,
                    messages=self.messages, tools=self.body.get("tools"), response=response,
                    prompt_token_ids=self.prompt_token_ids, completion_token_ids=ch.token_ids,
                    completion_logprobs=lps, sampling=sampling, group_id=group, latency_ms=latency_ms,
                    episode_id=metadata.get("episode_id"),
                ))
            return out
        except ValidationError as e:  # the messages were checked before serving: the response failed
            log.error("interaction %s (tenant %s) cannot be recorded as an event: %s", self.interaction_id,
                      self.tenant, e)
            return []
