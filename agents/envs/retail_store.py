"""The retail environment's store: a small database generated from a seed, and the tools an
agent uses on it, each with a JSON schema, argument checks and the store's policy.

The catalog (`CATALOG`) is fixed: products with variants (a mug in blue, red or green), each
variant an item with its own id and price. A store (`make_store`) holds customers, their
orders (items, shipping address, status) and the stock of each item. Everything is plain
JSON-able data, so a store is copied with `copy.deepcopy` and compared with `==`.

Tools run on one store (`store_tools`). The policy, modelled on τ-bench's retail domain:

- the agent must identify the customer (`find_customer` by name and zip code) before it may
  read or change any order, and only that customer's orders;
- `cancel_order`: only a pending order, for a reason the customer gave ("no longer needed"
  or "ordered by mistake");
- `change_address`: only a pending order;
- `return_items`: only items of a delivered order;
- `exchange_items`: only items of a delivered order, each for another variant of the same
  product that is in stock;
- an order is changed at most once: a cancelled, returned or exchanged order refuses all of
  the above;
- `transfer_to_human` hands the conversation over (for what no tool can do).

A refusal is a `ToolError`, whose message the model sees as the tool's result.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from clora.agents.tools import Tool, ToolError, ToolRegistry

Store = dict[str, Any]

PRODUCTS: dict[str, tuple[str, dict[str, float]]] = {
    "t-shirt": ("size", {"S": 19.0, "M": 19.0, "L": 21.5}),
    "mug": ("color", {"blue": 9.5, "red": 9.5, "green": 11.0}),
    "desk lamp": ("color", {"black": 34.0, "white": 36.5}),
    "backpack": ("size", {"small": 45.0, "large": 55.0}),
    "headphones": ("color", {"black": 79.0, "silver": 85.5}),
    "water bottle": ("size", {"500 ml": 12.0, "1 l": 15.25}),
    "notebook": ("paper", {"lined": 6.5, "dotted": 7.0}),
    "umbrella": ("color", {"navy": 24.0, "yellow": 22.5}),
}
"""product -> (option name, {option value: price})."""


def _catalog() -> dict[str, dict[str, Any]]:
    out, n = {}, 1001
    for product, (option, variants) in PRODUCTS.items():
        for value, price in variants.items():
            out[f"I{n}"] = {"product": product, "option": option, "value": value, "price": price}
            n += 1
    return out


CATALOG: dict[str, dict[str, Any]] = _catalog()
"""item id -> {product, option, value, price}; the same in every store."""

CANCEL_REASONS = ("no longer needed", "ordered by mistake")
STATUSES = ("pending", "delivered")
"""What a generated order starts as; tools move them to cancelled, return requested, exchange requested."""

STREETS = ("Oak St", "Maple Ave", "Pine Rd", "Cedar Ln", "Elm St", "Birch Way", "Lake Dr", "Hill Rd")
CITIES = ("Springfield", "Riverton", "Fairview", "Georgetown", "Salem", "Madison")


def item_name(item_id: str) -> str:
    """"blue mug", "size M t-shirt": how a customer names an item."""
    item = CATALOG[item_id]
    return f"{item['value']} {item['product']}" if item["option"] == "color" else \
        f"{item['product']} ({item['option']} {item['value']})"


def money(amount: float) -> str:
    return f"${amount:.2f}"


def random_address(rng: random.Random) -> str:
    return f"{rng.randint(1, 999)} {rng.choice(STREETS)}, {rng.choice(CITIES)} {rng.randint(10000, 99999)}"


def make_store(rng: random.Random, names: tuple[str, ...], customers: int = 4) -> Store:
    """A store of `customers` customers (names drawn from `names`), each with 2-3 orders of 1-3
    items, pending or delivered; every item in stock except one variant."""
    store: Store = {"customers": {}, "orders": {}, "stock": {i: rng.randint(1, 5) for i in CATALOG},
                    "transfers": []}
    store["stock"][rng.choice(sorted(CATALOG))] = 0
    for full_name in rng.sample(names, customers):
        cid = f"C{rng.randint(1000, 9999)}"
        while cid in store["customers"]:
            cid = f"C{rng.randint(1000, 9999)}"
        address = random_address(rng)
        store["customers"][cid] = {"name": full_name, "zip": address.rsplit(" ", 1)[1], "address": address}
        for status in rng.sample(STATUSES * 2, rng.randint(2, 3)):
            oid = f"W{rng.randint(1000000, 9999999)}"
            while oid in store["orders"]:
                oid = f"W{rng.randint(1000000, 9999999)}"
            products = rng.sample(sorted(PRODUCTS), rng.randint(1, 3))
            items = [rng.choice([i for i, it in CATALOG.items() if it["product"] == p]) for p in products]
            store["orders"][oid] = {"customer": cid, "status": status, "items": items, "address": address}
    return store


def order_total(store: Store, order_id: str) -> float:
    return round(sum(CATALOG[i]["price"] for i in store["orders"][order_id]["items"]), 2)


@dataclass
class StoreSession:
    """One conversation's view of a store: the store itself (changed by the write tools) and
    the customer the agent identified. Example: `find_customer("Ana Lopez", "12345")` sets
    `customer` to Ana's id; `get_order` then answers only for her orders."""

    store: Store
    customer: str | None = None
    refused: int = 0
    """How many calls the tools refused (bad arguments or the policy)."""
    writes: list[str] = field(default_factory=list)
    """The write tools that succeeded, in order."""
    looked_up: set[str] = field(default_factory=set)
    """Orders `get_order` showed."""

    # --- checks ---------------------------------------------------------------------------

    def _order(self, order_id: Any) -> tuple[str, dict[str, Any]]:
        if not isinstance(order_id, str) or not order_id.strip():
            raise ToolError("order_id must be an order number such as 'W1234567'")
        if self.customer is None:
            raise ToolError("identify the customer with find_customer first")
        oid = order_id.strip().lstrip("#").upper()
        order = self.store["orders"].get(oid)
        if order is None or order["customer"] != self.customer:
            raise ToolError(f"no order {order_id!r} for this customer")
        return oid, order

    @staticmethod
    def _item_ids(value: Any, field_name: str) -> list[str]:
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise ToolError(f"{field_name} must be a non-empty list of item ids such as ['I1001']")
        ids = [v.strip().upper() for v in value]
        unknown = [v for v in ids if v not in CATALOG]
        if unknown:
            raise ToolError(f"{field_name}: unknown item ids {unknown}")
        return ids

    @staticmethod
    def _status(oid: str, order: dict[str, Any], wanted: str, action: str) -> None:
        if order["status"] != wanted:
            raise ToolError(f"order {oid} is {order['status']}: only a {wanted} order can be {action}")

    # --- tools ----------------------------------------------------------------------------

    def find_customer(self, name: Any = None, zip: Any = None) -> str:
        if not isinstance(name, str) or not isinstance(zip, str) or not name.strip() or not zip.strip():
            raise ToolError("find_customer needs the customer's full name and zip code as strings")
        for cid, c in self.store["customers"].items():
            if c["name"].lower() == " ".join(name.split()).lower() and c["zip"] == zip.strip():
                self.customer = cid
                return json.dumps({"customer_id": cid, "name": c["name"]})
        raise ToolError(f"no customer named {name!r} with zip code {zip!r}")

    def list_orders(self, customer_id: Any = None) -> str:
        if self.customer is None:
            raise ToolError("identify the customer with find_customer first")
        if customer_id != self.customer:
            raise ToolError(f"customer_id must be the identified customer's id ({self.customer})")
        return json.dumps([{"order_id": oid, "status": o["status"], "items": [item_name(i) for i in o["items"]]}
                           for oid, o in self.store["orders"].items() if o["customer"] == self.customer])

    def get_order(self, order_id: Any = None) -> str:
        oid, order = self._order(order_id)
        items = []
        for i in order["items"]:
            it = CATALOG[i]
            others = {v["value"]: j for j, v in CATALOG.items() if v["product"] == it["product"] and j != i}
            items.append({"item_id": i, "name": item_name(i), "price": it["price"],
                          "exchange_options": {k: j for k, j in others.items() if self.store["stock"][j] > 0}})
        self.looked_up.add(oid)
        return json.dumps({"order_id": oid, "status": order["status"], "items": items, "address": order["address"],
                           "total": order_total(self.store, oid)})

    def cancel_order(self, order_id: Any = None, reason: Any = None) -> str:
        oid, order = self._order(order_id)
        if reason not in CANCEL_REASONS:
            raise ToolError(f"reason must be one of {list(CANCEL_REASONS)}")
        self._status(oid, order, "pending", "cancelled")
        order["status"] = "cancelled"
        self.writes.append("cancel_order")
        return f"Order {oid} cancelled. Refund of {money(order_total(self.store, oid))} to the original payment method."

    def change_address(self, order_id: Any = None, address: Any = None) -> str:
        oid, order = self._order(order_id)
        if not isinstance(address, str) or len(address.strip()) < 8:
            raise ToolError("address must be the full new address as one string")
        self._status(oid, order, "pending", "changed")
        order["address"] = " ".join(address.split())
        self.writes.append("change_address")
        return f"The shipping address of order {oid} is now {order['address']}."

    def return_items(self, order_id: Any = None, item_ids: Any = None) -> str:
        oid, order = self._order(order_id)
        ids = self._item_ids(item_ids, "item_ids")
        self._status(oid, order, "delivered", "returned")
        missing = [i for i in ids if i not in order["items"]]
        if missing or len(set(ids)) != len(ids):
            raise ToolError(f"item_ids must be distinct items of order {oid}: {missing or ids} are not")
        order["status"], order["returned"] = "return requested", sorted(ids)
        self.writes.append("return_items")
        refund = round(sum(CATALOG[i]["price"] for i in ids), 2)
        return f"Return of {len(ids)} item(s) from order {oid} accepted. Refund of {money(refund)} once received."

    def exchange_items(self, order_id: Any = None, item_ids: Any = None, new_item_ids: Any = None) -> str:
        oid, order = self._order(order_id)
        old, new = self._item_ids(item_ids, "item_ids"), self._item_ids(new_item_ids, "new_item_ids")
        self._status(oid, order, "delivered", "exchanged")
        if len(old) != len(new):
            raise ToolError("item_ids and new_item_ids must have the same length")
        for a, b in zip(old, new):
            if a not in order["items"]:
                raise ToolError(f"item {a} is not in order {oid}")
            if CATALOG[a]["product"] != CATALOG[b]["product"] or a == b:
                raise ToolError(f"item {b} is not another variant of {item_name(a)}")
            if self.store["stock"][b] <= 0:
                raise ToolError(f"item {b} ({item_name(b)}) is out of stock")
        for b in new:
            self.store["stock"][b] -= 1
        order["status"], order["exchange"] = "exchange requested", dict(sorted(zip(old, new)))
        self.writes.append("exchange_items")
        diff = round(sum(CATALOG[b]["price"] - CATALOG[a]["price"] for a, b in zip(old, new)), 2)
        side = "to pay" if diff > 0 else "to refund"
        return f"Exchange for order {oid} accepted. Price difference {side}: {money(abs(diff))}."

    def transfer_to_human(self, summary: Any = None) -> str:
        if not isinstance(summary, str) or not summary.strip():
            raise ToolError("summary must say, in one sentence, what the customer needs")
        self.store["transfers"].append(summary.strip()[:500])
        self.writes.append("transfer_to_human")
        return "Transferred. Tell the customer a human agent will contact them."


WRITE_TOOLS = ("cancel_order", "change_address", "return_items", "exchange_items", "transfer_to_human")

_STR = {"type": "string"}
_IDS = {"type": "array", "items": {"type": "string"}}
SCHEMAS: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "find_customer": ("Find the customer by full name and zip code.", {"name": _STR, "zip": _STR}, ("name", "zip")),
    "list_orders": ("List the customer's orders.", {"customer_id": _STR}, ("customer_id",)),
    "get_order": ("Show an order: status, items, address, total.", {"order_id": _STR}, ("order_id",)),
    "cancel_order": ("Cancel a pending order.", {"order_id": _STR, "reason": {"type": "string",
                                                                             "enum": list(CANCEL_REASONS)}},
                     ("order_id", "reason")),
    "change_address": ("Change a pending order's shipping address.", {"order_id": _STR, "address": _STR},
                       ("order_id", "address")),
    "return_items": ("Return items of a delivered order.", {"order_id": _STR, "item_ids": _IDS},
                     ("order_id", "item_ids")),
    "exchange_items": ("Exchange items of a delivered order for other variants of the same products.",
                       {"order_id": _STR, "item_ids": _IDS, "new_item_ids": _IDS},
                       ("order_id", "item_ids", "new_item_ids")),
    "transfer_to_human": ("Hand the conversation to a human agent.", {"summary": _STR}, ("summary",)),
}


def store_tools(session: StoreSession | None) -> ToolRegistry:
    """The eight tools, bound to `session` (None: schemas only; calling one is refused)."""

    def bound(name: str):
        def call(**kwargs: Any) -> str:
            if session is None:
                raise ToolError(f"{name} runs only inside a retail conversation")
            unknown = sorted(set(kwargs) - set(SCHEMAS[name][1]))
            if unknown:
                session.refused += 1
                raise ToolError(f"{name}: unknown arguments {unknown}")
            try:
                return getattr(session, name)(**kwargs)
            except ToolError:
                session.refused += 1
                raise
        return call

    return ToolRegistry.of(
        Tool(name, description, {"type": "object", "properties": props, "required": list(required)}, bound(name))
        for name, (description, props, required) in SCHEMAS.items())
