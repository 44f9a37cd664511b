"""A τ-bench-style retail environment: long multi-turn tool use with a simulated customer.

Each problem is a store generated from its seed (`retail_store`), a customer of that store,
and the customer's hidden goal: cancel a pending order, change its address, return or
exchange an item of a delivered order, or (hard) something the policy forbids or no tool can
do. The agent talks to the customer (its plain replies) and uses the store's tools (its tool
calls); the customer (`Customer`) is rule-based: it opens with its request, answers the
agent's questions from its goal (its name and zip code, the order number, the new address, a
yes to a confirmation), and ends the conversation once its goal is met or refused, or when
the agent keeps going nowhere.

Difficulties vary what the customer volunteers and what it asks for:
- easy: it opens with its name, zip code, order number and request;
- medium: it opens with the request only and answers questions;
- hard: as medium, and the request breaks the policy (cancelling a delivered order: the
  agent must refuse and say why) or needs a human (a price adjustment: `transfer_to_human`),
  or it is an exchange, which needs the new variant's item id from `get_order`.

Reward, as τ-bench defines it: 1 only if the store's final state equals the goal's expected
state and the agent's last reply carries the required information (the refund, the price
difference, the order's status...), else 0. `breakdown` adds per-rule diagnostics (was the
customer identified before any write, did a confirmation precede each write, did any tool
refuse, did the customer end the conversation). Scoring replays the conversation's tool calls
on a fresh copy of the store (`replay`): the trace alone decides the reward.

The reference agent (`correction`) takes the right action from any point of a conversation:
the operator's correction at the first wrong turn. The unseen family has other customers,
who phrase their requests and answers otherwise.
"""

from __future__ import annotations

import copy
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from clora.agents.envs.base import DIFFICULTIES, Difficulty, Family, Problem, TaskEnv
from clora.agents.envs.retail_store import (CATALOG, PRODUCTS, WRITE_TOOLS, Store, StoreSession, item_name, make_store,
                                            money, order_total, random_address, store_tools)
from clora.agents.tools import ToolRegistry

SYSTEM = ("You are a store's customer service agent. Identify the customer by full name and zip code before "
          "looking at orders. Only pending orders can be cancelled or get a new address; only delivered orders can "
          "have items returned or exchanged. Confirm with the customer before any change. Transfer to a human what "
          "no tool can do.")

FIRST = ("Ana", "Ben", "Carla", "Dev", "Emma", "Felix", "Gina", "Hugo", "Iris", "Jon", "Kara", "Leo")
LAST = ("Lopez", "Smith", "Khan", "Novak", "Rossi", "Berg", "Okafor", "Silva")
UNSEEN_FIRST = ("Mona", "Nils", "Oona", "Pablo", "Quinn", "Rhea", "Sven", "Tara", "Umar", "Vera", "Wes", "Xena")
UNSEEN_LAST = ("Dubois", "Tanaka", "Murphy", "Haddad", "Kowalski", "Moreau", "Lindqvist", "Ibarra")

Kind = Literal["cancel", "address", "return", "exchange", "refuse_cancel", "transfer"]
KINDS: dict[Difficulty, tuple[Kind, ...]] = {
    "easy": ("cancel", "address", "return"),
    "medium": ("cancel", "address", "return", "exchange"),
    "hard": ("refuse_cancel", "transfer", "exchange"),
}
MAX_UNHELPFUL = 3
"""Agent replies the customer tolerates that neither ask it anything nor settle its goal."""


@dataclass(frozen=True)
class Goal:
    """What the customer wants, the store it lives in, and what a correct conversation leaves
    behind. `info` are the strings the agent's last reply must carry (a refund such as
    "$21.50", a status such as "delivered"); `expected` is the store's final state."""

    kind: Kind
    customer_id: str
    name: str
    zip: str
    order_id: str
    store: Store
    expected: Store
    info: tuple[str, ...]
    item: str | None = None
    """The item returned or exchanged."""
    new_item: str | None = None
    """The exchange's new variant."""
    new_address: str | None = None
    reason: str | None = None
    """Why the customer cancels (one of the tool's reasons)."""


def _choose_goal(rng: random.Random, kind: Kind, store: Store) -> Goal:
    orders = sorted(store["orders"].items())
    want = "pending" if kind in ("cancel", "address") else "delivered"
    if kind == "transfer":
        want = rng.choice(("pending", "delivered"))
    candidates = [(oid, o) for oid, o in orders if o["status"] == want]
    if kind == "exchange":
        candidates = [(oid, o) for oid, o in candidates
                      if any(_exchange_targets(store, i) for i in o["items"])]
    oid, order = rng.choice(candidates)
    c = store["customers"][order["customer"]]
    expected = copy.deepcopy(store)
    eo = expected["orders"][oid]
    item = new_item = new_address = reason = None
    info: tuple[str, ...] = ()
    if kind == "cancel":
        reason = rng.choice(("no longer needed", "ordered by mistake"))
        eo["status"] = "cancelled"
        info = (money(order_total(store, oid)),)
    elif kind == "address":
        new_address = random_address(rng)
        eo["address"] = new_address
        info = (new_address.rsplit(" ", 1)[1],)
    elif kind == "return":
        item = rng.choice(order["items"])
        eo["status"], eo["returned"] = "return requested", [item]
        info = (money(CATALOG[item]["price"]),)
    elif kind == "exchange":
        item = rng.choice([i for i in order["items"] if _exchange_targets(store, i)])
        new_item = rng.choice(_exchange_targets(store, item))
        eo["status"], eo["exchange"] = "exchange requested", {item: new_item}
        expected["stock"][new_item] -= 1
        info = (money(abs(CATALOG[new_item]["price"] - CATALOG[item]["price"])),)
    elif kind == "refuse_cancel":
        info = ("delivered",)
    elif kind == "transfer":
        item = rng.choice(order["items"])
        expected["transfers"] = ["*"]
        info = ("human",)
    return Goal(kind, order["customer"], c["name"], c["zip"], oid, store, expected, info, item, new_item, new_address,
                reason)


def _exchange_targets(store: Store, item: str) -> list[str]:
    return [j for j, v in CATALOG.items()
            if v["product"] == CATALOG[item]["product"] and j != item and store["stock"][j] > 0]


# --- what the customer says -----------------------------------------------------------------

SAYS: dict[Family, dict[str, str]] = {
    "same": {
        "cancel": "I want to cancel my order with the {items} because it is {reason_text}.",
        "address": "I need to change the shipping address of my order with the {items}.",
        "return": "I want to return the {item} from my order.",
        "exchange": "I want to exchange the {item} from my order for the {new_item}.",
        "refuse_cancel": "I want to cancel my order with the {items}.",
        "transfer": "The {item} I bought is on sale now and I want a price adjustment.",
        "identity": "My name is {name} and my zip code is {zip}.",
        "order": "The order number is #{order}.",
        "new_address": "The new address is {address}.",
        "yes": "Yes, please go ahead.",
        "again": "Sorry, I just want help with this: {request}",
        "open_known": "Hi, I am {name}, zip code {zip}. Order #{order}: {request}",
        "open": "Hi! {request}",
    },
    "unseen": {
        "cancel": "Please call off the purchase with the {items}, it was {reason_text}.",
        "address": "The parcel with the {items} has to go to a different place.",
        "return": "Could I send back the {item}? It is from one of my purchases.",
        "exchange": "Could I swap the {item} I received for the {new_item}?",
        "refuse_cancel": "Please call off the purchase with the {items}.",
        "transfer": "I saw the {item} at a lower price today, can I get the difference back?",
        "identity": "It's {name}, postal code {zip}.",
        "order": "It is #{order}.",
        "new_address": "Please send it to {address}.",
        "yes": "Sounds good, do it.",
        "again": "That does not help me. {request}",
        "open_known": "Hello, {name} here ({zip}), about purchase #{order}. {request}",
        "open": "Hello. {request}",
    },
}
REASON_TEXT = {"same": {"no longer needed": "no longer needed", "ordered by mistake": "ordered by mistake"},
               "unseen": {"no longer needed": "not needed anymore", "ordered by mistake": "a mistake"}}

_CONFIRM = re.compile(r"\b(proceed|confirm|shall i|should i|go ahead|would you like me|do you want me)\b")
_IDENTITY = re.compile(r"\b(name|zip|postal)\b")
_ORDER = re.compile(r"\b(order number|order id|which order|order #?\?)")
_ADDRESS = re.compile(r"\baddress\b")
_REFUSAL = re.compile(r"\b(cannot|can ?not|can't|unable|not able|not possible|not allowed)\b")


@dataclass
class Customer:
    """The simulated customer of one conversation: it says `opening`, then `reply` answers each
    of the agent's plain replies (None: the conversation is over). Its state is what it has told
    the agent so far."""

    goal: Goal
    family: Family
    volunteers: bool
    patience: int = MAX_UNHELPFUL
    told: set[str] = field(default_factory=set)
    unhelpful: int = 0
    said_yes: bool = False
    """Its last message was a yes to a confirmation."""
    ended: bool = False

    def _say(self, what: str, **kw: Any) -> str:
        g = self.goal
        return SAYS[self.family][what].format(name=g.name, zip=g.zip, order=g.order_id, address=g.new_address, **kw)

    def request(self) -> str:
        g = self.goal
        items = " and the ".join(item_name(i) for i in g.store["orders"][g.order_id]["items"])
        return self._say(g.kind, items=items, item=item_name(g.item) if g.item else "",
                         new_item=item_name(g.new_item) if g.new_item else "",
                         reason_text=REASON_TEXT[self.family].get(g.reason or "", ""))

    def opening(self) -> str:
        if self.volunteers:
            self.told |= {"identity", "order"}
            return self._say("open_known", request=self.request())
        return self._say("open", request=self.request())

    def reply(self, text: str, session: StoreSession) -> str | None:
        """The customer's answer to the agent's reply `text`, given the store now."""
        self.said_yes = False
        if self.ended:
            return None
        t = (text or "").lower()
        if goal_met(self.goal, session.store) or _REFUSAL.search(t):
            self.ended = True
            return None
        if _CONFIRM.search(t):
            self.said_yes = True
            return self._say("yes")
        for topic, pattern in (("identity", _IDENTITY), ("order", _ORDER)):
            if pattern.search(t):
                self.told.add(topic)
                return self._say(topic)
        if self.goal.kind == "address" and _ADDRESS.search(t):
            self.told.add("new_address")
            return self._say("new_address")
        self.unhelpful += 1
        if self.unhelpful > self.patience:
            self.ended = True
            return None
        return self._say("again", request=self.request())


def goal_met(goal: Goal, store: Store) -> bool:
    """Whether `store` is the goal's expected final state (a transfer: any one transfer)."""
    if goal.kind == "transfer":
        return len(store["transfers"]) == 1 and _same(store, goal.expected, transfers=False)
    if goal.kind == "refuse_cancel":
        return False  # nothing to do: the customer ends only on a refusal
    return _same(store, goal.expected, transfers=True)


def _same(a: Store, b: Store, *, transfers: bool) -> bool:
    keys = ("customers", "orders", "stock") + (("transfers",) if transfers else ())
    return all(a[k] == b[k] for k in keys)


class RetailSession:
    """One conversation: the store, the tools bound to it, and the customer. The runtime calls
    `reply` with each plain agent reply; `tools` runs the agent's tool calls."""

    def __init__(self, problem: Problem, patience: int = MAX_UNHELPFUL):
        self.problem, self.patience = problem, patience
        goal: Goal = problem.expected
        self.store = StoreSession(copy.deepcopy(goal.store))
        self.customer = Customer(goal, problem.family, volunteers=problem.difficulty == "easy", patience=patience)
        self.customer.opening()
        self.tools: ToolRegistry = store_tools(self.store)
        self.confirmed_writes = 0
        self.writes_seen = 0
        self.identified_before_writes = True

    def fork(self) -> "RetailSession":
        return RetailSession(self.problem, self.patience)

    def reply(self, text: str) -> str | None:
        return self.customer.reply(text, self.store)

    def after_tool(self, name: str) -> None:
        """Bookkeeping for the breakdown after a successful call of tool `name`."""
        if name in WRITE_TOOLS and len(self.store.writes) > self.writes_seen:
            self.writes_seen = len(self.store.writes)
            self.confirmed_writes += self.customer.said_yes
            self.identified_before_writes &= self.store.customer is not None

    @classmethod
    def replay(cls, problem: Problem, messages: list[dict[str, Any]],
               patience: int = MAX_UNHELPFUL) -> "RetailSession":
        """The session as it stands after `messages` (the conversation after the problem's own
        messages): every tool call run again, every plain reply shown to the customer again."""
        s = cls(problem, patience)
        for m in messages:
            if m.get("role") == "assistant":
                s.take(m)
        return s

    def take(self, message: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Run the agent's `message` here: the results of its tool calls (a refusal as its
        error text, as the runtime shows it), or the customer's answer to a plain reply; None
        once the customer ends the conversation."""
        calls = message.get("tool_calls") or []
        if not calls:
            said = self.reply(message.get("content") or "")
            return None if said is None else [{"role": "user", "content": said}]
        out = []
        for call in calls:
            fn = call.get("function") or {}
            name = fn.get("name") or ""
            try:
                result = self.tools.call(name, fn.get("arguments") or "")
                self.after_tool(name)
            except Exception as e:  # noqa: BLE001 - a refused call changes nothing, as in the episode
                result = f"error: {e}"
            out.append({"role": "tool", "tool_call_id": call.get("id"), "content": result})
        return out


class RetailEnv(TaskEnv):
    name = "retail"
    tools = store_tools(None)
    max_turns = 10
    """Model calls an episode may take: the reference needs at most 8."""

    def __init__(self, difficulties: tuple[Difficulty, ...] = DIFFICULTIES, patience: int = MAX_UNHELPFUL):
        super().__init__(difficulties)
        self.patience = patience
        """Replies that go nowhere the customer tolerates before it leaves."""

    def _make(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        return self._problem(rng, difficulty, "same")

    def _make_unseen(self, rng: random.Random, difficulty: Difficulty) -> Problem:
        return self._problem(rng, difficulty, "unseen")

    def _problem(self, rng: random.Random, difficulty: Difficulty, family: Family) -> Problem:
        first, last = (FIRST, LAST) if family == "same" else (UNSEEN_FIRST, UNSEEN_LAST)
        names = tuple(f"{f} {l}" for f in first for l in last)
        kind = rng.choice(KINDS[difficulty])
        while True:  # a store with no order fit for the goal (rare): draw another
            store = make_store(rng, names)
            try:
                goal = _choose_goal(rng, kind, store)
                break
            except IndexError:
                continue
        customer = Customer(goal, family, volunteers=difficulty == "easy")
        opening = customer.opening()
        messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": opening})
        problem = Problem(self.name, difficulty, opening, messages, goal, (), family)
        return Problem(self.name, difficulty, opening, messages, goal, tuple(reference_conversation(problem)), family)

    def session(self, problem: Problem) -> RetailSession:
        return RetailSession(problem, self.patience)

    def reward(self, problem: Problem, answer: str | None) -> float:
        raise TypeError("retail: the reward needs the whole conversation; use score(problem, trace)")

    def score(self, problem: Problem, trace: Any) -> float:
        return self.breakdown(problem, list(trace.messages))["reward"]

    def breakdown(self, problem: Problem, messages: list[dict[str, Any]]) -> dict[str, float]:
        """Per-rule results of a whole conversation (`messages`, the problem's own first), each
        1.0 or 0.0; `reward` is `state` and `info` together."""
        s = RetailSession.replay(problem, messages[len(problem.messages):], self.patience)
        goal: Goal = problem.expected
        replies = [m.get("content") or "" for m in messages[len(problem.messages):]
                   if m.get("role") == "assistant" and not m.get("tool_calls")]
        last = replies[-1] if replies else ""
        state = goal_met(goal, s.store.store) or (goal.kind == "refuse_cancel"
                                                  and _same(s.store.store, goal.expected, transfers=True))
        info = bool(replies) and all(_carries(last, want) for want in goal.info)
        writes = len(s.store.writes)
        return {"reward": float(state and info), "state": float(state), "info": float(info),
                "identified_first": float(s.identified_before_writes),
                "confirmed_writes": float(s.confirmed_writes == writes) if writes else 1.0,
                "no_refusals": float(s.store.refused == 0), "customer_ended": float(s.customer.ended)}

    def correction(self, problem: Problem, prompt: list[dict[str, Any]]) -> dict[str, Any]:
        """The reference agent's next message after `prompt` (the problem's messages first)."""
        return reference_action(problem, RetailSession.replay(problem, prompt[len(problem.messages):], self.patience))

    def follow(self, problem: Problem, prompt: list[dict[str, Any]],
               message: dict[str, Any]) -> list[dict[str, Any]] | None:
        """What follows `message` after `prompt`: its tool results, or the customer's answer to a
        plain reply; None once the conversation is over."""
        return RetailSession.replay(problem, prompt[len(problem.messages):], self.patience).take(message)


def _carries(reply: str, want: str) -> bool:
    """Whether `reply` carries `want`: a money amount as a number ("$21.50", "21.5"), anything
    else as a word, case-insensitively."""
    if want.startswith("$"):
        amount = float(want[1:])
        return any(abs(float(x) - amount) < 0.005 for x in re.findall(r"\d+(?:\.\d+)?", reply.replace(",", "")))
    return re.search(rf"\b{re.escape(want.lower())}\b", reply.lower()) is not None


# --- the reference agent --------------------------------------------------------------------

def _call(tool: str, call_id: str, **arguments: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(arguments)}}]}


def _say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def reference_action(problem: Problem, s: RetailSession) -> dict[str, Any]:
    """The right next message in the conversation `s` stands at."""
    g: Goal = problem.expected
    told, store = s.customer.told, s.store
    if store.customer is None:
        if "identity" in told:
            return _call("find_customer", "call_find", name=g.name, zip=g.zip)
        return _say("Could you tell me your full name and zip code, please?")
    if "order" not in told:
        return _say("Which order is this about? Please give me the order number.")
    if g.order_id not in store.looked_up:
        return _call("get_order", "call_get", order_id=g.order_id)
    if g.kind == "refuse_cancel":
        return _say(f"I'm sorry, order #{g.order_id} has already been delivered, so it cannot be cancelled. "
                    "You can return its items instead.")
    if g.kind == "address" and "new_address" not in told:
        return _say("What is the new shipping address?")
    if not goal_met(g, store.store):
        proposal, write, _ = _script(g)
        return write if s.customer.said_yes else _say(f"{proposal} Shall I proceed?")
    return _say(_script(g)[2])


def _script(g: Goal) -> tuple[str, dict[str, Any], str]:
    """The reference's proposal (before "Shall I proceed?"), its write call, and its closing
    reply for the goal (`refuse_cancel` has none: it is refused before any proposal)."""
    order = f"order #{g.order_id}"
    item, new = (item_name(g.item) if g.item else ""), (item_name(g.new_item) if g.new_item else "")
    info = g.info[0] if g.info else ""
    write = lambda tool, **args: _call(tool, "call_write", order_id=g.order_id, **args)  # noqa: E731
    return {
        "cancel": (f"I can cancel {order} and refund {money(order_total(g.store, g.order_id))}.",
                   write("cancel_order", reason=g.reason),
                   f"{order[0].upper()}{order[1:]} is cancelled. {info} will be refunded to your original payment "
                   "method."),
        "address": (f"I can ship {order} to {g.new_address} instead.", write("change_address", address=g.new_address),
                    f"Done: {order} will ship to {g.new_address}."),
        "return": (f"I can return the {item} from {order}.", write("return_items", item_ids=[g.item]),
                   f"Your return is accepted. {info} will be refunded once we receive the {item}."),
        "exchange": (f"I can exchange the {item} for the {new}.",
                     write("exchange_items", item_ids=[g.item], new_item_ids=[g.new_item]),
                     f"Your exchange is accepted. The price difference is {info}."),
        "transfer": ("A human agent can help with a price adjustment, I can transfer you.",
                     _call("transfer_to_human", "call_write",
                           summary=f"Customer {g.name} wants a price adjustment on the {item} of {order}."),
                     "I have transferred you to a human agent, who will contact you about the price adjustment."),
    }[g.kind]


def reference_conversation(problem: Problem, max_turns: int = 16) -> list[dict[str, Any]]:
    """The reference agent's whole conversation with the customer after the problem's messages."""
    s = RetailSession(problem)
    out: list[dict[str, Any]] = []
    for _ in range(max_turns):
        message = reference_action(problem, s)
        out.append(message)
        following = s.take(message)
        if following is None:
            return out
        out += following
    raise RuntimeError(f"retail: the reference agent did not finish {problem.key!r} in {max_turns} turns")
