"""Property-based fuzzing shared by the fuzz tests of the four HTTP doors (the gateway, the
feedback webhook, the control API and the Tinker training API): hypothesis strategies for odd
values, a JSON writer that sends them raw, and the invariant every door keeps.

The invariant (`assert_door_holds`): whatever the request, the door never answers 5xx, and
the keep-alive connection the request came on stays usable — a normal request sent next on
the same `httpx.Client` succeeds on the *same* connection (uvicorn closes it after a 500).

Odd values are JSON text, not Python values, because `json.dumps` refuses or rewrites what
matters here: `Raw("NaN")` is sent as the token NaN, `Raw('"\\ud800"')` as a lone surrogate,
`nested(10_000)` as ten thousand `[`. `dumps({"score": Raw("NaN")})` is `b'{"score":NaN}'`.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from hypothesis import HealthCheck, reject, settings
from hypothesis import strategies as st


def fuzz_settings(max_examples: int) -> settings:
    """Reproducible, no deadline (the doors talk to a real broker / vLLM), no example database."""
    return settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck), print_blob=False)


# --- raw JSON -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Raw:
    """JSON text written verbatim by `dumps`: `Raw("NaN")`, `Raw("1" + "0" * 400)`."""

    text: str
    name: str = ""

    def __repr__(self) -> str:  # hypothesis prints falsifying examples: keep 10,000 brackets short
        if self.name:
            return f"Raw<{self.name}>"
        return f"Raw({self.text!r})" if len(self.text) <= 80 else f"Raw({self.text[:60]!r}... {len(self.text)} chars)"


def dumps(value: Any) -> bytes:
    """`value` as JSON bytes, with every `Raw` inside written verbatim and strings escaped to
    ASCII (so a lone surrogate goes out as the six characters `\\ud800`)."""
    return _encode(value).encode("utf-8", "surrogatepass")


def _encode(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{_encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_encode(v) for v in value) + "]"
    if isinstance(value, float):
        return _float_token(value)
    return json.dumps(value)


def _float_token(x: float) -> str:
    if x != x:
        return "NaN"
    if x in (float("inf"), float("-inf")):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


def nested(depth: int, kind: str = "array") -> Raw:
    """`depth` nested arrays (`[[[...]]]`) or objects (`{"a":{"a":...0}}`)."""
    if kind == "array":
        return Raw("[" * depth + "]" * depth, f"{depth} nested arrays")
    return Raw('{"a":' * depth + "0" + "}" * depth, f"{depth} nested objects")


def json_string(s: str, name: str = "") -> Raw:
    """A JSON string literal, ASCII-escaped (surrogates and NUL as \\u escapes)."""
    return Raw(json.dumps(s, ensure_ascii=True), name)


ODD_TOKENS: list[Raw] = [
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"),
    Raw("1" + "0" * 400, "int of 401 digits"), Raw("-" + "9" * 5000, "int of 5000 digits"),
    Raw("18446744073709551616"), Raw("-9223372036854775809"), Raw("2147483648"), Raw("1e-400"), Raw("-0"),
    Raw('"\\ud800"'), Raw('"\\udfff\\ud800x"'), Raw('"a\\u0000b"'), Raw('"\\u0000"'),
    nested(10_000), nested(10_000, "object"), nested(200), nested(200, "object"),
    json_string("x" * 100_000, "string of 100,000 chars"), json_string("é" * 5_000 + "\U0001f600", "non-ASCII"),
    Raw("true"), Raw("false"), Raw("null"), Raw("[]"), Raw("{}"), Raw('""'), Raw("0"), Raw("-1"), Raw("1.5"),
    Raw('"1"'), Raw('[null]'), Raw('{"": null}'), Raw('["a", 1, null, {}]'),
]
"""Values every field of every door must survive: non-finite numbers, numbers no 64-bit type
holds, lone surrogates and NUL, nesting that exhausts the recursion limit, huge strings and
every JSON type where another is expected."""

ODD_IDS: list[str] = ["abc\n", "abc:", ":", "a/b", "../../etc/passwd", "a b", "é", "a\x00b", "", " ", "x" * 129,
                      "x" * 10_000, "@", "a@v0", "a@v99999999999", "a\r\n", "%2F", "A", "\ud800", "-", "_", "a:b:c",
                      "a@", "a@v", "a@v-1", "\t", "null", "0"]
"""Ids (tenant, interaction, event, key, model names) with trailing newlines, separators,
path characters, surrogates, NUL, nothing at all or far too much."""


def odd_floats() -> st.SearchStrategy[Raw]:
    return st.floats(allow_nan=True, allow_infinity=True).map(lambda x: Raw(_float_token(x)))


def huge_ints() -> st.SearchStrategy[Raw]:
    big = st.integers(min_value=2**63 - 1, max_value=10**60) | st.integers(min_value=-(10**60), max_value=-(2**63))
    return big.map(lambda n: Raw(str(n)))


def odd_strings() -> st.SearchStrategy[Raw]:
    """Strings that include lone surrogates, NUL and other control characters."""
    chars = st.characters(codec=None, categories=["Cs", "Cc", "Lo", "So", "Zs", "Nd"])
    return st.text(chars, max_size=40).map(json_string)


def odd_values() -> st.SearchStrategy[Raw]:
    """Any odd JSON value: a listed token, a float (NaN and ±Infinity included), a huge int,
    a string with surrogates / control characters, or an odd id."""
    return st.one_of(st.sampled_from(ODD_TOKENS), odd_floats(), huge_ints(), odd_strings(),
                     st.sampled_from(ODD_IDS).map(json_string))


def odd_bodies() -> st.SearchStrategy[bytes]:
    """Whole bodies that are not one JSON object: odd values, invalid JSON, invalid UTF-8."""
    junk = st.sampled_from([b"", b"{", b"{\"a\":}", b"\xff\xfe{}", b"{\"a\": \"\xff\"}", b"\x00", b"[" * 100_000,
                            b"{\"a\": 1}" * 3, b"{\"a\": 1, \"a\": 2}", b"\xef\xbb\xbf{}"])
    return st.one_of(odd_values().map(dumps), junk)


# --- mutations of a valid body ------------------------------------------------------------

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Mutation:
    """A valid body with one place changed: `path` set to `value` (`path` () replaces the
    whole body); shows as `messages.0.content = Raw<...>` in a falsifying example."""

    path: Path
    value: Any

    def apply(self, body: dict[str, Any]) -> Any:
        if not self.path:
            return self.value
        out = copy.deepcopy(body)
        node = out
        for step in self.path[:-1]:
            node = node[step]
        last = self.path[-1]
        if isinstance(node, list) and isinstance(last, int) and last >= len(node):
            node.append(self.value)   # a path one past the end adds an item
        else:
            node[last] = self.value
        return out

    def __repr__(self) -> str:
        return f"{'.'.join(map(str, self.path)) or '<body>'} = {self.value!r}"


def mutations(paths: Sequence[Path], values: st.SearchStrategy[Any] | None = None) -> st.SearchStrategy[Mutation]:
    """One of `paths` (fields of a valid body, or new ones) set to an odd value."""
    return st.builds(Mutation, st.sampled_from(list(paths)), values if values is not None else odd_values())


@dataclass(frozen=True)
class Removal:
    """A valid body with the field at `path` left out; shows as `del lora_config.rank`."""

    path: Path

    def apply(self, body: dict[str, Any]) -> Any:
        out = copy.deepcopy(body)
        node = out
        for step in self.path[:-1]:
            node = node[step]
        del node[self.path[-1]]
        return out

    def __repr__(self) -> str:
        return f"del {'.'.join(map(str, self.path))}"


def removals(paths: Sequence[Path]) -> st.SearchStrategy[Removal]:
    """One of `paths` (fields of a valid body; not `()`) left out."""
    return st.builds(Removal, st.sampled_from([p for p in paths if p]))


def paths_in(body: Any, at: Path = ()) -> list[Path]:
    """Every place in `body` a value sits, nested ones included:
    `paths_in({"a": {"b": [1]}})` is `[("a",), ("a", "b"), ("a", "b", 0)]`."""
    items = body.items() if isinstance(body, dict) else enumerate(body) if isinstance(body, list) else ()
    out: list[Path] = []
    for key, value in items:
        out += [(*at, key), *paths_in(value, (*at, key))]
    return out


# --- headers ------------------------------------------------------------------------------

_HEADER_BYTES = bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100)) + b"\t"

ODD_HEADER_VALUES: list[bytes] = [
    b"Bearer \xe9", "Bearer clé".encode(), b"Bearer clk_\xff\xfe", b"Bearer clk_" + b"x" * 8000, b"Bearer",
    b"Bearer ", b"bearer  clk_", b"BEARER clk_x", b"Basic Zm9vOmJhcg==", b"Bearer \t clk_a", b"\x80",
    b"Bearer clk_abc def", b"Bearer clk_\xc3\xa9", b"Bearer null", b"Bearer clk_%00", b"Bearer clk_../..",
]
"""Authorization values: non-ASCII (sent as raw bytes, read back as latin-1), the wrong
scheme, empty, and far too long."""


def header_values() -> st.SearchStrategy[bytes]:
    """Bytes a header value may carry on the wire (no CR, LF, NUL or other controls but tab),
    listed odd ones first."""
    free = st.binary(max_size=64).map(lambda b: bytes(c for c in b if c in _HEADER_BYTES).strip(b" \t"))
    return st.sampled_from(ODD_HEADER_VALUES) | free | free.map(lambda b: b"Bearer " + b)


ODD_TIMESTAMPS: list[bytes] = [b"nan", b"NaN", b"inf", b"-inf", b"Infinity", b"1e309", b"-1e309", b"9" * 400,
                               b"0x10", b"1_700_000_000", b"\xd9\xa1\xd9\xa2", b"\xe9", b"", b" ", b"1.5e9abc",
                               b"-0", b"1" + b"0" * 30]
"""X-Clora-Timestamp values: non-finite (which no age comparison refuses), overflowing,
non-ASCII, empty."""

ODD_SIGNATURES: list[bytes] = [b"sha256=\xe9", "sha256=é".encode(), b"sha256=" + b"\xff" * 64, b"sha256=",
                               b"sha256=" + b"0" * 64, b"sha256=" + b"0" * 10_000, b"\x80", b"md5=abc", b"sha256"]
"""X-Clora-Signature values: non-ASCII (a latin-1 str on the server), empty, too long."""


# --- server logs ----------------------------------------------------------------------------

class ErrorLog(logging.Handler):
    """Keeps the ERROR records (with traces) the in-process servers log, so a failure can quote
    the server's side of a 5xx."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[str] = []
        self.lock_ = threading.Lock()
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        with self.lock_:
            self.records.append(self.format(record))

    def take(self) -> str:
        with self.lock_:
            out, self.records = self.records, []
        return "\n".join(out)[-6000:]


@contextmanager
def server_errors() -> Iterator[ErrorLog]:
    """Collect ERROR logs from every logger (uvicorn's "Exception in ASGI application" included)."""
    handler = ErrorLog()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]   # uvicorn's loggers do not propagate
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


# --- the invariant --------------------------------------------------------------------------

def keepalive_client(base_url: str, timeout_s: float = 60.0) -> httpx.Client:
    """One connection, kept alive: each request after the first reuses it unless the server closed it."""
    return httpx.Client(base_url=base_url, timeout=timeout_s, limits=httpx.Limits(max_connections=1,
                        max_keepalive_connections=1, keepalive_expiry=300))


def assert_door_holds(client: httpx.Client, method: str, url: str, valid: Callable[[], httpx.Response], *,
                      content: bytes | None = None, headers: dict[str, Any] | None = None,
                      params: dict[str, Any] | None = None, log: ErrorLog | None = None) -> httpx.Response:
    """Send the fuzzed request, then `valid()` on the same client: the first must not answer
    5xx, the second must succeed on the connection the first came back on. Returns the
    fuzzed request's response. A request httpx itself refuses to send is rejected (hypothesis
    draws another). After a failure the client's connection is dropped, so the next example
    starts on a fresh one instead of failing on the connection this one broke."""
    try:
        return _door_holds(client, method, url, valid, content=content, headers=headers, params=params, log=log)
    except AssertionError:
        client._transport.close()   # the pool opens a new connection for the next request
        raise


def _door_holds(client: httpx.Client, method: str, url: str, valid: Callable[[], httpx.Response], *,
                content: bytes | None, headers: dict[str, Any] | None, params: dict[str, Any] | None,
                log: ErrorLog | None) -> httpx.Response:
    what = f"{method} {url}" + (f" params={params!r}" if params else "")
    if headers:
        what += f" headers={_short(headers)}"
    if content is not None:
        what += f" body={_short(content)}"
    try:
        r = client.request(method, url, content=content, headers=headers, params=params)
    except (httpx.LocalProtocolError, httpx.InvalidURL, UnicodeEncodeError):
        reject()
    except httpx.TransportError as e:
        server = log.take() if log else ""
        raise AssertionError(f"{what}: the server dropped the connection without answering ({e!r})\n{server}") from e
    server = log.take() if log else ""
    assert r.status_code < 500, f"{what}: answered {r.status_code}: {r.text[:1500]}\nserver log:\n{server}"
    stream = r.extensions.get("network_stream")
    try:
        after = valid()
    except httpx.TransportError as e:
        raise AssertionError(f"{what} answered {r.status_code} {r.text[:300]!r}; the valid request after it "
                             f"failed: {e!r}\nserver log:\n{server}") from e
    assert after.is_success, (f"{what} answered {r.status_code}; the valid request after it answered "
                              f"{after.status_code}: {after.text[:500]}")
    assert after.extensions.get("network_stream") is stream, (
        f"{what} answered {r.status_code} {r.text[:300]!r} and the server closed the keep-alive connection "
        f"(Connection: {r.headers.get('connection')!r})\nserver log:\n{server}")
    return r


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def send_case(client: httpx.Client, case, valid: Callable[[], httpx.Response], *, headers: dict[str, Any],
              log: ErrorLog | None = None) -> httpx.Response:
    """A schemathesis case through `assert_door_holds`, on `client`'s keep-alive connection,
    with `headers` (the credentials) over the case's own."""
    kw = case.as_transport_kwargs(base_url=str(client.base_url).rstrip("/"))
    sent = {k: v for k, v in kw["headers"].items() if k.lower() not in ("connection", "content-length")}
    sent.update(headers)
    content = None
    if "json" in kw:
        content = dumps(kw["json"])
    elif kw.get("data") is not None:
        content = kw["data"] if isinstance(kw["data"], bytes) else str(kw["data"]).encode()
    return assert_door_holds(client, kw["method"], kw["url"], valid, content=content, headers=sent,
                             params=kw.get("params") or None, log=log)
