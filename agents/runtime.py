"""The tool-using agent loop on the OpenAI chat-completions API, and its `EpisodeTrace`.

An episode sends the messages and the tool schemas, executes the tool calls the model
returns, appends their results as `tool` messages and asks again, until the model calls
a final tool (`final_answer`), answers without calling a tool, or `max_turns` model calls
were made. Every turn keeps the interaction id the gateway gave it (the response `id`),
which is what feedback refers to.

The client is injected: anything with `client.chat.completions.create(**kwargs)` that
answers like `openai.OpenAI` (sync `Agent`) or `openai.AsyncOpenAI` (`AsyncAgent`). Tests
run it against a fake OpenAI-compatible server; integration with the real gateway and
vLLM lives in the platform's end-to-end tests.

Group rollouts (GRPO): `run_group(messages, n)` asks for `n` samples of the first turn in
one request (`n=n`) and continues each sample as its own episode; every request carries
the group id in `metadata.group_id`. With `n > 1` the gateway names choice `i`'s
interaction `{response.id}-{i}` (see serving/completions.py), and so does the trace. An
episode's later turns carry its first turn's interaction id in `metadata.episode_id`, so the
platform counts an episode's reward once however many turns it took.

Seeded sampling: with `seed`, every call carries a sampling seed derived from it, the
episode's branch in its group and the conversation so far (roles, contents, tool names and
arguments; not the ids the server made up). Two agents with the same seed that see the same
conversation sample alike, whatever order their calls run in: `clora bench experiments` so
gives experiment i the same episodes in both of its modes, as long as the model does too. A
group's first call asks for `n` samples with one seed; vLLM seeds sample `i` with seed + i.

Conversations: with a `session` (an environment's, `TaskEnv.session`), the tool calls run on
the session's own state and a plain reply goes to the session's user, whose answer is appended
as a `user` message and the episode goes on, until the user ends it or `max_turns`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from clora.agents.tools import ToolError, ToolRegistry, format_number

Stop = Literal["final_answer", "reply", "max_turns"]


class AgentError(RuntimeError):
    """A model call failed mid-episode; the message names the model, turn and group."""


@dataclass(frozen=True)
class ExecutedCall:
    """One tool call the model made and what the tool answered (`error` when it refused)."""

    id: str
    name: str
    arguments: str
    """JSON-encoded, as the API carried it."""
    result: str | None
    """None for the final tool, whose call ends the episode instead of answering."""
    error: bool = False


@dataclass(frozen=True)
class Turn:
    """One model call. Its assistant message is `trace.messages[message_index]` and its
    prompt is `trace.messages[:message_index]`.

    Example: [system, user] → the model calls the calculator → turn 0 has message_index 2,
    the tool result lands at 3, the model calls final_answer → turn 1 has message_index 4.
    """

    interaction_id: str
    message_index: int
    calls: tuple[ExecutedCall, ...]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class EpisodeTrace:
    """Everything one episode did, in order."""

    messages: tuple[dict[str, Any], ...]
    """The whole conversation in OpenAI shape: prompt, assistant turns, tool results."""
    turns: tuple[Turn, ...]
    answer: str | None
    """final_answer's `answer` when the agent has a final tool; otherwise the last reply's text."""
    stop: Stop
    group_id: str | None = None

    @property
    def interaction_ids(self) -> list[str]:
        return [t.interaction_id for t in self.turns]

    @property
    def tool_calls(self) -> list[ExecutedCall]:
        return [c for t in self.turns for c in t.calls]

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.turns)

    @property
    def completion_tokens(self) -> int:
        return sum(t.completion_tokens for t in self.turns)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def prompt_of(self, turn: Turn) -> list[dict[str, Any]]:
        return list(self.messages[: turn.message_index])

    def response_of(self, turn: Turn) -> dict[str, Any]:
        return self.messages[turn.message_index]


def choice_interaction_id(response_id: str, index: int, n: int) -> str:
    """The gateway's interaction id for choice `index` of a response with `n` choices."""
    return response_id if n == 1 else f"{response_id}-{index}"


def assistant_message(message: Any) -> dict[str, Any]:
    """An OpenAI SDK `ChatCompletionMessage` as a plain OpenAI-shaped dict."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    calls = getattr(message, "tool_calls", None) or []
    if calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments or ""}}
                             for c in calls]
    elif out["content"] is None:
        out["content"] = ""
    return out


SEED_SPAN = 2**31 - 2**16
"""Call seeds lie in [0, SEED_SPAN): a group's samples (seed + i) stay below 2**31."""


def call_seed(seed: int, branch: int, messages: list[dict[str, Any]]) -> int:
    """The sampling seed of a call that continues `messages` on `branch` of its group (-1: a
    group's first call, for all of its samples) under the agent's `seed`. It depends on the
    roles, contents and tool calls' names and arguments, not on their ids (the server's).
    Example: `call_seed(3, 0, msgs) == call_seed(3, 0, copy_of_msgs)`, and != with branch 1."""
    said = [(m.get("role"), m.get("content"),
             [(c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
              for c in m.get("tool_calls") or []]) for m in messages]
    digest = hashlib.blake2b(json.dumps([seed, branch, said], default=str).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % SEED_SPAN


def _answer_text(value: Any) -> str:
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return format_number(value)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


@dataclass
class _Episode:
    """Mutable state of one running episode; `trace()` freezes it."""

    messages: list[dict[str, Any]]
    tools: ToolRegistry
    max_turns: int
    group_id: str | None
    session: Any | None = None
    """The environment's conversation (`TaskEnv.session`): its tools run the calls, and its
    user answers plain replies until it ends the episode."""
    turns: list[Turn] = field(default_factory=list)
    answer: str | None = None
    stop: Stop | None = None
    branch: int = 0
    """Which of its group's samples this episode continues (0 alone)."""

    def __post_init__(self) -> None:
        if self.session is not None:
            self.tools = self.session.tools

    def fork(self, branch: int = 0) -> "_Episode":
        return _Episode([dict(m) for m in self.messages], self.tools, self.max_turns, self.group_id,
                        self.session.fork() if self.session is not None else None, branch=branch)

    def take(self, interaction_id: str, message: dict[str, Any], finish_reason: str | None,
             prompt_tokens: int, completion_tokens: int) -> None:
        """Record the model's message, run its tool calls, decide whether the episode ended."""
        index = len(self.messages)
        self.messages.append(message)
        calls = []
        for call in message.get("tool_calls") or []:
            executed = self._execute(call)
            calls.append(executed)
            if self.stop == "final_answer":
                break
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": executed.result})
        self.turns.append(Turn(interaction_id, index, tuple(calls), finish_reason, prompt_tokens, completion_tokens))
        if self.stop is None and not calls and self.session is not None and len(self.turns) >= self.max_turns:
            self.stop = "max_turns"  # the user is not asked: no turn is left to answer it
        if self.stop is None and not calls:
            said = self.session.reply(message.get("content") or "") if self.session is not None else None
            if said is None:
                self.stop = "reply"
                self.answer = None if self.tools.has_final else message.get("content")
            else:
                self.messages.append({"role": "user", "content": said})
        if self.stop is None and len(self.turns) >= self.max_turns:
            self.stop = "max_turns"

    def _execute(self, call: dict[str, Any]) -> ExecutedCall:
        fn = call["function"]
        name, arguments = fn["name"], fn.get("arguments") or ""
        try:
            tool = self.tools.get(name)
            if tool.final:
                args = json.loads(arguments or "{}")
                if not isinstance(args, dict) or "answer" not in args:
                    raise ToolError(f"{name}: arguments must be an object with 'answer', got {arguments[:200]!r}")
                self.answer, self.stop = _answer_text(args["answer"]), "final_answer"
                return ExecutedCall(call["id"], name, arguments, None)
            return ExecutedCall(call["id"], name, arguments, self.tools.call(name, arguments))
        except json.JSONDecodeError as e:
            return ExecutedCall(call["id"], name, arguments, f"error: {name}: arguments are not valid JSON ({e.msg})",
                                error=True)
        except ToolError as e:
            return ExecutedCall(call["id"], name, arguments, f"error: {e}", error=True)

    def trace(self) -> EpisodeTrace:
        assert self.stop is not None, "episode still running"
        return EpisodeTrace(tuple(self.messages), tuple(self.turns), self.answer, self.stop, self.group_id)


@dataclass(frozen=True)
class _AgentConfig:
    client: Any
    """`openai.OpenAI` (Agent) or `openai.AsyncOpenAI` (AsyncAgent), or anything shaped like them."""
    model: str
    """The tenant's model name at the gateway."""
    tools: ToolRegistry = field(default_factory=ToolRegistry)
    max_turns: int = 4
    temperature: float = 0.7
    max_tokens: int = 64
    extra: dict[str, Any] = field(default_factory=dict)
    """More `create` keywords (top_p, seed, logprobs, ...)."""
    seed: int | None = None
    """Seeds every call from this, the episode's branch and the conversation (`call_seed`); None:
    unseeded (a `seed` in `extra` is sent as it is either way)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")

    def _request(self, episodes: list[_Episode], messages: list[dict[str, Any]], n: int) -> dict[str, Any]:
        kw: dict[str, Any] = dict(model=self.model, messages=messages, temperature=self.temperature,
                                  max_tokens=self.max_tokens, **self.extra)
        if len(self.tools):
            kw["tools"] = self.tools.schemas()
        if n > 1:
            kw["n"] = n
        ep = episodes[0]
        if self.seed is not None and "seed" not in kw:
            kw["seed"] = call_seed(self.seed, ep.branch if n == 1 else -1, messages)
        ids = {"group_id": ep.group_id,
               "episode_id": ep.turns[0].interaction_id if n == 1 and ep.turns else None}
        ids = {k: v for k, v in ids.items() if v is not None}
        if ids:
            body = dict(kw.get("extra_body") or {})
            body["metadata"] = {**(body.get("metadata") or {}), **ids}
            kw["extra_body"] = body
        return kw

    def _new(self, messages: list[dict[str, Any]], group_id: str | None, session: Any | None = None) -> _Episode:
        return _Episode([dict(m) for m in messages], self.tools, self.max_turns, group_id, session)

    def _fail(self, ep: _Episode, e: Exception) -> AgentError:
        return AgentError(f"model {self.model!r}: call {len(ep.turns) + 1} of the episode (group "
                          f"{ep.group_id}) failed: {e}")

    @staticmethod
    def _take(episodes: list[_Episode], response: Any) -> None:
        """Feed choice i of `response` to episodes[i]."""
        n = len(episodes)
        usage = getattr(response, "usage", None)
        prompt = getattr(usage, "prompt_tokens", 0) or 0
        completion = getattr(usage, "completion_tokens", 0) or 0
        choices = sorted(response.choices, key=lambda c: c.index)
        if len(choices) != n:
            raise AgentError(f"response {response.id} has {len(choices)} choices, asked for {n}")
        for ep, choice in zip(episodes, choices):
            ep.take(choice_interaction_id(response.id, choice.index, n), assistant_message(choice.message),
                    choice.finish_reason, prompt, round(completion / n))


class Agent(_AgentConfig):
    """Runs episodes with a sync OpenAI-compatible client; a group's branches continue
    concurrently, one thread each, after their shared first call."""

    def run(self, messages: list[dict[str, Any]], *, group_id: str | None = None,
            session: Any | None = None) -> EpisodeTrace:
        return self.run_group(messages, 1, group_id=group_id, session=session)[0]

    def respond(self, messages: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        """One model call on `messages`: (interaction id, assistant message). The call runs in a
        throwaway one-turn episode (which executes its tool calls and is then discarded); the
        caller decides what follows the message."""
        ep = self._new(messages, None)
        ep.max_turns = 1
        self._call([ep], ep.messages, 1)
        turn = ep.turns[0]
        return turn.interaction_id, ep.messages[turn.message_index]

    def run_group(self, messages: list[dict[str, Any]], n: int, *, group_id: str | None = None,
                  session: Any | None = None) -> list[EpisodeTrace]:
        """`n` episodes from the same prompt sharing `group_id` (a fresh one when None and n > 1),
        each in its own copy of `session` (the environment's conversation, when it has one)."""
        group_id = group_id or (f"grp-{uuid.uuid4().hex}" if n > 1 else None)
        first = self._new(messages, group_id, session)
        episodes = [first.fork(i) for i in range(n)]
        self._call(episodes, first.messages, n)
        open_ = [ep for ep in episodes if ep.stop is None]
        if len(open_) > 1:  # the branches' later turns at once: the engine batches them
            with ThreadPoolExecutor(max_workers=len(open_), thread_name_prefix="agent-turns") as pool:
                for done in [pool.submit(self._finish, ep) for ep in open_]:
                    done.result()
        else:
            for ep in open_:
                self._finish(ep)
        return [ep.trace() for ep in episodes]

    def _finish(self, ep: _Episode) -> None:
        while ep.stop is None:
            self._call([ep], ep.messages, 1)

    def _call(self, episodes: list[_Episode], messages: list[dict[str, Any]], n: int) -> None:
        try:
            response = self.client.chat.completions.create(**self._request(episodes, messages, n))
        except Exception as e:
            raise self._fail(episodes[0], e) from e
        self._take(episodes, response)


class AsyncAgent(_AgentConfig):
    """Runs episodes with an async OpenAI-compatible client; a group's branches run concurrently."""

    async def run(self, messages: list[dict[str, Any]], *, group_id: str | None = None,
                  session: Any | None = None) -> EpisodeTrace:
        return (await self.run_group(messages, 1, group_id=group_id, session=session))[0]

    async def run_group(self, messages: list[dict[str, Any]], n: int, *, group_id: str | None = None,
                        session: Any | None = None) -> list[EpisodeTrace]:
        group_id = group_id or (f"grp-{uuid.uuid4().hex}" if n > 1 else None)
        first = self._new(messages, group_id, session)
        episodes = [first.fork(i) for i in range(n)]
        await self._call(episodes, first.messages, n)

        async def finish(ep: _Episode) -> None:
            while ep.stop is None:
                await self._call([ep], ep.messages, 1)

        await asyncio.gather(*(finish(ep) for ep in episodes))
        return [ep.trace() for ep in episodes]

    async def _call(self, episodes: list[_Episode], messages: list[dict[str, Any]], n: int) -> None:
        try:
            response = await self.client.chat.completions.create(**self._request(episodes, messages, n))
        except Exception as e:
            raise self._fail(episodes[0], e) from e
        self._take(episodes, response)
