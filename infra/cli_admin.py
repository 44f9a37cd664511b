"""The admin commands of `clora` (mounted by `clora.infra.cli`): tenants, their keys, Tinker keys,
policy and the DLQ, all through the control API (`clora.infra.control_client`).

    clora tenant create acme [--json]          # the API key (and signing secret) shown once
    clora tenant list | delete acme [--yes] | pause acme | resume acme
    clora policy get acme | policy set acme learning_rate=1e-3 algorithm=sft
    clora dlq list | dlq replay EVENT_ID
    clora tenant list --url http://10.0.0.5:8090 --token $ADMIN   # a remote platform

Every command reaches the control API at `--url` with `--token` (or `CLORA_CONTROL_URL`,
`CLORA_CONTROL_TOKEN`), by default this machine's platform (the console port from the settings
and the admin token in the data dir). Exit codes: 0 ok, 2 usage, 3 not found, 4 refused by the
server (a conflict, a value that failed validation), 5 unreachable or a server error, 6
unauthorized; an error is one line on stderr, naming the field when the server named one.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clora.infra.control_client import (ControlClient, ControlError, NotFound, Refused, Unauthorized, Unreachable,
                                        local_control)

EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_UNAUTHORIZED = 3, 4, 5, 6
EXIT_USAGE = 2

tenant_app = typer.Typer(help="Tenants, their API keys and adapter versions", no_args_is_help=True)
tinker_key_app = typer.Typer(help="Tenants' keys for the Tinker-compatible training API (tml-...)",
                             no_args_is_help=True)
policy_app = typer.Typer(help="Tenants' learning policies", no_args_is_help=True)
dlq_app = typer.Typer(help="The dead-letter queue: events ingest could not store", no_args_is_help=True)

console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)

Url = Annotated[str | None, typer.Option("--url", envvar="CLORA_CONTROL_URL", show_envvar=True,
                                         help="The control API (http://host:port; default: this machine's)")]
Token = Annotated[str | None, typer.Option("--token", envvar="CLORA_CONTROL_TOKEN", show_envvar=True,
                                           help="The admin token (default: the platform's admin_token file)")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output")]
TenantId = Annotated[str, typer.Argument(help="The tenant's id")]


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """Print `error: message` on stderr; the caller raises the returned `typer.Exit(code)`."""
    errors.print(f"[red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code)


def exit_code(e: ControlError) -> int:
    if isinstance(e, NotFound):
        return EXIT_NOT_FOUND
    if isinstance(e, Unauthorized):
        return EXIT_UNAUTHORIZED
    if isinstance(e, Refused):
        return EXIT_REFUSED
    return EXIT_UNREACHABLE


@contextlib.contextmanager
def control(url: str | None, token: str | None) -> Iterator[ControlClient]:
    """The control API client; a `ControlError` inside becomes one line on stderr and its exit code."""
    try:
        with local_control(url, token) as client:
            yield client
    except ControlError as e:
        message = e.message
        named = isinstance(e, (NotFound, Unauthorized))   # "no tenant 'acme'" names what was not found
        if e.field and not named and not message.startswith(f"{e.field}:"):
            message = f"{e.field}: {message}"
        if isinstance(e, Unreachable) and e.status is None:
            message += ". Is `clora up` running, or --url / CLORA_CONTROL_URL set?"
        raise fail(message, exit_code(e)) from e


def emit(data: Any) -> None:
    print(json.dumps(data))


def _when(t: float | None) -> str:
    return "—" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


# --- tenants ------------------------------------------------------------------------------

@tenant_app.command("create")
def tenant_create(tenant_id: TenantId,
                  name: Annotated[str, typer.Option(help="Display name")] = "",
                  signing_secret: Annotated[bool, typer.Option(help="Require HMAC-signed feedback requests")] = False,
                  adapter: Annotated[str | None, typer.Option(
                      "--adapter", help="A PEFT LoRA adapter folder to start from (adapter_config.json + "
                      "adapter_model.safetensors) on the platform's disk; it becomes v1")] = None,
                  as_json: AsJson = False, url: Url = None, token: Token = None):
    """Create a tenant. Its API key is shown once, now."""
    init_adapter = str(Path(adapter).expanduser().resolve()) if adapter is not None else None
    with control(url, token) as c:
        made = c.create_tenant(tenant_id, name=name, init_adapter=init_adapter, signing_secret=signing_secret)
    secret = made.get("signing_secret")
    if as_json:
        emit({"tenant": made["tenant"]["id"], "api_key": made["api_key"], "signing_secret": secret,
              "init_adapter": made.get("init_adapter")})
        return
    start = (f", starting from the adapter in {made['init_adapter']} (published as v1)"
             if made.get("init_adapter") else "")
    console.print(f"tenant [bold]{made['tenant']['id']}[/] created{escape(start)}")
    console.print(f"API key (shown once): [bold green]{made['api_key']}[/]")
    if secret:
        console.print(f"signing secret (shown once): [bold yellow]{secret}[/]")


@tenant_app.command("list")
def tenant_list(as_json: AsJson = False, url: Url = None, token: Token = None):
    """List tenants with their policy and live adapter version."""
    with control(url, token) as c:
        data = c.list_tenants()
    if as_json:
        emit(data)
        return
    table = Table("tenant", "name", "algorithm", "paused", "live version", "active keys")
    for t in data["tenants"]:
        table.add_row(t["id"], escape(t["name"]), t["algorithm"], str(t["paused"]), str(t["live_version"]),
                      str(t.get("active_keys", "—")))
    console.print(table)


@tenant_app.command("show")
def tenant_show(tenant_id: TenantId, as_json: AsJson = False, url: Url = None, token: Token = None):
    """A tenant's detail: policy, keys, buffers, alerts."""
    with control(url, token) as c:
        t = c.get_tenant(tenant_id)
    if as_json:
        emit(t)
        return
    console.print(f"[bold]{t['id']}[/] {escape(t['name'])}: live "
                  f"{'base model' if t['live_version'] is None else 'v' + str(t['live_version'])}, "
                  f"{t['versions']} versions, {'paused' if t['paused'] else 'training'}"
                  + (f" ({escape(t['paused_reason'])})" if t.get("paused_reason") else ""))
    console.print("buffers: " + ", ".join(f"{k} {n}" for k, n in t["buffer_depth"].items()))
    console.print("keys: " + (", ".join(f"{k['key_id']} ({'active' if k['revoked_at'] is None else 'revoked'})"
                                        for k in t["keys"]) or "none"))


@tenant_app.command("delete")
def tenant_delete(tenant_id: TenantId,
                  yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
                  as_json: AsJson = False, url: Url = None, token: Token = None):
    """Delete a tenant and everything it owns: API and Tinker keys, replay buffers, adapter
    versions and their folders, checkpoints. It stops serving and training at once. Asks first."""
    if not yes and not typer.confirm(f"Delete tenant {tenant_id} and all its data (keys, buffers, adapters)?"):
        raise fail("not deleted", 1)
    with control(url, token) as c:
        out = c.delete_tenant(tenant_id)
    if as_json:
        emit(out)
        return
    console.print(f"tenant {tenant_id} deleted")


@tenant_app.command("pause")
def tenant_pause(tenant_id: TenantId, url: Url = None, token: Token = None):
    """Stop training a tenant (it keeps serving its live version)."""
    with control(url, token) as c:
        c.pause(tenant_id)
    console.print(f"{tenant_id}: paused")


@tenant_app.command("resume")
def tenant_resume(tenant_id: TenantId, url: Url = None, token: Token = None):
    """Train a paused tenant again."""
    with control(url, token) as c:
        c.resume(tenant_id)
    console.print(f"{tenant_id}: training")


@tenant_app.command("rotate-key")
def tenant_rotate_key(tenant_id: TenantId,
                      key_id: Annotated[str | None, typer.Option(help="Revoke only this key (default: all)")] = None,
                      as_json: AsJson = False, url: Url = None, token: Token = None):
    """Issue a new API key (shown once) and revoke the old one(s)."""
    with control(url, token) as c:
        key = c.rotate_key(tenant_id, key_id)["api_key"]
    if as_json:
        emit({"tenant": tenant_id, "api_key": key})
        return
    console.print(f"new API key (shown once): [bold green]{key}[/]")


@tenant_app.command("revoke-key")
def tenant_revoke_key(tenant_id: TenantId,
                      key_id: Annotated[str, typer.Argument(help="The key's id: the part after `clk_`")],
                      url: Url = None, token: Token = None):
    """Revoke one API key (its id is the part after `clk_`)."""
    with control(url, token) as c:
        c.revoke_key(tenant_id, key_id)
    console.print(f"key {key_id} of {tenant_id} revoked")


@tenant_app.command("versions")
def tenant_versions(tenant_id: TenantId, as_json: AsJson = False, url: Url = None, token: Token = None):
    """List a tenant's adapter versions: lineage, held-out loss, the reward each earned serving
    (mean, and how many scored episodes: an agent episode counts once however many turns it
    took), and the reward guard's rollbacks."""
    with control(url, token) as c:
        data = c.versions(tenant_id)
    if as_json:
        emit(data)
        return
    table = Table("version", "parent", "step", "examples", "held-out loss", "served reward", "notes")
    for v in reversed(data["versions"]):
        reward = v.get("served_reward")
        guard = v.get("rolled_back")
        table.add_row(f"v{v['version']}" + (" (live)" if v["version"] == data["live"] else ""),
                      "—" if v["parent_version"] is None else f"v{v['parent_version']}", str(v["step"]),
                      str(v["examples_seen"]), _num(v["eval_scores"].get("eval_loss")),
                      "—" if reward is None else f"{reward['mean']:.2f} ({reward['samples']})",
                      f"rolled back to v{guard['to']} by the reward guard: {guard['reason']}" if guard else "")
    console.print(table)
    base = data.get("base_reward")
    console.print(f"live: {'base model' if data['live'] is None else 'v' + str(data['live'])}"
                  + ("" if base is None else f"; the base model earned {base['mean']:.2f} ({base['samples']})"))


@tenant_app.command("rollback")
def tenant_rollback(tenant_id: TenantId,
                    to: Annotated[int | None, typer.Option("--to", help="The version to make live "
                                                           "(default: the live version's parent)")] = None,
                    url: Url = None, token: Token = None):
    """Make an earlier version live; serving swaps to it at once."""
    with control(url, token) as c:
        live = c.rollback(tenant_id, to)["live"]
    console.print(f"{tenant_id}: v{live} is live")


@tenant_app.command("promote")
def tenant_promote(tenant_id: TenantId, version: Annotated[int, typer.Argument(help="The version to make live")],
                   url: Url = None, token: Token = None):
    """Make any recorded version live (a newer one after a rollback, say); serving swaps at once."""
    with control(url, token) as c:
        live = c.promote(tenant_id, version)["live"]
    console.print(f"{tenant_id}: v{live} is live")


@tenant_app.command("policy")
def tenant_policy(tenant_id: TenantId,
                  reward_spec: Annotated[str | None, typer.Option(
                      "--reward-spec", help="Set the reward spec: JSON, @file.json, or 'none' to train on every "
                      "score as is (docs/events.md)")] = None,
                  as_json: AsJson = False, url: Url = None, token: Token = None):
    """Show a tenant's learning policy and the feedback its reward spec left untrained, or set
    its reward spec: the control API validates it (an error names the wrong field) and the
    ingest workers apply it within seconds."""
    if reward_spec is not None:
        spec = reward_spec_arg(reward_spec)
        with control(url, token) as c:
            policy, untrained = c.update_policy(tenant_id, {"reward_spec": spec}), None
    else:
        with control(url, token) as c:
            tenant = c.get_tenant(tenant_id)
        policy, untrained = tenant["policy"], tenant["untrained_feedback"]
    if as_json:
        emit({"policy": policy, "untrained_feedback": untrained})
        return
    show_policy(policy)
    if untrained:
        console.print("untrained feedback: " + ", ".join(f"{why} {n}" for why, n in sorted(untrained.items())))


def show_policy(policy: dict) -> None:
    console.print(", ".join(f"{k}={v}" for k, v in policy.items() if k != "reward_spec"))
    spec = policy.get("reward_spec")
    if spec is None:
        console.print("reward spec: none (every score trains as its own reward, whatever its key and source)")
        return
    table = Table("key", "type", "range", "invert", "weight", "sources", title="reward spec")
    for key, rule in spec["keys"].items():
        span = "0/1" if rule["type"] == "bool" else f"{rule['lo']:g} – {rule['hi']:g}"
        table.add_row(key, rule["type"], span, "yes" if rule["invert"] else "", f"{rule['weight']:g}",
                      ", ".join(rule["sources"]))
    console.print(table)


def reward_spec_arg(value: str) -> dict | None:
    """`--reward-spec`: 'none' (no spec), JSON, or @file holding JSON. Exits 2 saying what is wrong."""
    if value.strip().lower() in ("none", "null"):
        return None
    text = value
    if value.startswith("@"):
        try:
            text = Path(value[1:]).read_text()
        except OSError as e:
            raise fail(f"--reward-spec: cannot read {value[1:]} ({e})") from e
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise fail(f"--reward-spec is not JSON: {e}") from e
    if not isinstance(spec, dict):
        raise fail("--reward-spec must be a JSON object: {\"keys\": {...}}")
    return spec


# --- policy ---------------------------------------------------------------------------------

@policy_app.command("get")
def policy_get(tenant_id: TenantId, as_json: AsJson = False, url: Url = None, token: Token = None):
    """A tenant's learning policy."""
    with control(url, token) as c:
        policy = c.get_tenant(tenant_id)["policy"]
    if as_json:
        emit(policy)
        return
    show_policy(policy)


def policy_changes(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs as policy changes; a value that parses as JSON (numbers, true/false,
    null, objects) is that value, anything else a string. Exits 2 on a pair without `=`."""
    changes: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise fail(f"{pair!r}: write each change as key=value (learning_rate=1e-3)")
        try:
            changes[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            changes[key.strip()] = raw
    return changes


@policy_app.command("set")
def policy_set(tenant_id: TenantId,
               changes: Annotated[list[str], typer.Argument(help="key=value changes: learning_rate=1e-3 "
                                                            "algorithm=sft paused=true")],
               as_json: AsJson = False, url: Url = None, token: Token = None):
    """Change a tenant's learning policy; the control API validates every value (an error names
    the field) and changes nothing unless all are valid."""
    body = policy_changes(changes)
    with control(url, token) as c:
        policy = c.update_policy(tenant_id, body)
    if as_json:
        emit(policy)
        return
    console.print(f"{tenant_id}: " + ", ".join(f"{k}={policy[k]}" for k in body if k in policy))


# --- Tinker keys ------------------------------------------------------------------------------

TinkerTenant = Annotated[str, typer.Option("--tenant", help="The tenant the key trains as")]


@tinker_key_app.command("create")
def tinker_key_create(tenant: TinkerTenant, as_json: AsJson = False, url: Url = None, token: Token = None):
    """Issue a Tinker key (shown once, now): the official `tinker` SDK trains LoRA runs as this
    tenant with it (`TINKER_API_KEY`, and `TINKER_BASE_URL` the training API's address)."""
    with control(url, token) as c:
        made = c.create_tinker_key(tenant)
    if as_json:
        emit({"tenant": tenant, "key_id": made["key_id"], "tinker_key": made["tinker_key"]})
        return
    console.print(f"Tinker key {made['key_id']} for [bold]{tenant}[/] (shown once): "
                  f"[bold green]{made['tinker_key']}[/]")


@tinker_key_app.command("list")
def tinker_key_list(tenant: TinkerTenant, as_json: AsJson = False, url: Url = None, token: Token = None):
    """List a tenant's Tinker keys (ids and state; the keys themselves are stored hashed)."""
    with control(url, token) as c:
        keys = c.list_tinker_keys(tenant)["tinker_keys"]
    if as_json:
        emit({"tenant": tenant, "tinker_keys": keys})
        return
    table = Table("key id", "created", "state")
    for k in keys:
        table.add_row(k["key_id"], _when(k["created_at"]),
                      "active" if k["revoked_at"] is None else f"revoked {_when(k['revoked_at'])}")
    console.print(table)


@tinker_key_app.command("revoke")
def tinker_key_revoke(key_id: Annotated[str, typer.Argument(help="The part between `tml-` and the next `_`")],
                      tenant: TinkerTenant, url: Url = None, token: Token = None):
    """Revoke one Tinker key (its id is the part between `tml-` and the next `_`)."""
    with control(url, token) as c:
        c.revoke_tinker_key(tenant, key_id)
    console.print(f"Tinker key {key_id} of {tenant} revoked")


# --- DLQ ------------------------------------------------------------------------------------

@dlq_app.command("list")
def dlq_list(n: Annotated[int, typer.Option("--n", min=1, help="The newest this many")] = 100,
             as_json: AsJson = False, url: Url = None, token: Token = None):
    """The newest dead letters: events ingest could not store, and why."""
    with control(url, token) as c:
        data = c.dead_letters(n)
    if as_json:
        emit(data)
        return
    table = Table("event id", "topic", "tenant", "reason")
    for d in data["dead_letters"]:
        table.add_row(str(d.get("event_id")), str(d.get("source_topic")), str(d.get("key") or "—"),
                      escape(str(d.get("reason") or d.get("error") or "")))
    console.print(table)


@dlq_app.command("replay")
def dlq_replay(event_id: Annotated[str, typer.Argument(help="The dead letter's event id")],
               as_json: AsJson = False, url: Url = None, token: Token = None):
    """Send a dead letter back to the topic it came from (after fixing what refused it)."""
    with control(url, token) as c:
        out = c.replay_dead_letter(event_id)
    if as_json:
        emit(out)
        return
    console.print(f"{event_id} replayed to {out['topic']}")


def mount(app: typer.Typer) -> None:
    """Add the admin command groups to `app` (the `clora` command)."""
    app.add_typer(tenant_app, name="tenant")
    app.add_typer(tinker_key_app, name="tinker-key")
    app.add_typer(policy_app, name="policy")
    app.add_typer(dlq_app, name="dlq")
