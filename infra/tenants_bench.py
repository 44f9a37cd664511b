"""`clora bench tenants`: many tenants on one engine replica, each with its own adapter version,
when more adapters are in use than the replica holds at once.

    clora bench tenants [--base tiny|smollm2|<HF dir>] [--tenants 16,64,256] [--mix zipf,uniform]
                        [--working-sets 1,2,4] [--slots 8] [--registered 0] [--rounds 1]
                        [--requests 64] [--concurrency 8] [--max-tokens 16]
    clora bench tenants --tenants 64 --working-sets 4 --requests 48   # a few minutes on 2 CPUs
    python benchmarks/bench_tenants.py ...          # the same command

The real serving stack runs in this process (embedded broker + Redis, one vLLM replica, the
gateway), measured through the gateway with streamed chat completions of exactly `max_tokens`
tokens (`ignore_eos`). Interaction events are sent in the background (`durable_interactions` off:
their cost is `benchmarks/bench_serving.py`'s, not this one's). The replica keeps
`--registered` adapters loaded (`EngineSettings.max_registered_loras`, 256 by default) and lets
vLLM's own cache swap the `--slots` it keeps in memory; `--registered` equal to `--slots` makes
the gateway unload, load and verify every adapter beyond them instead.

The grid:
- **tenants** T (16, 64, 256): tenants in the registry, each with a live adapter version of its own
  (random rank-8 LoRA on every linear projection; the tenants beyond the largest working set are
  registered and idle). One service runs the whole time; tenants are added between the T steps.
- **working set** m x `slots` adapters in use (`slots` = the replica's adapter slots, vLLM
  `--max-cpu-loras`): requests go to the first W = m x slots tenants of the T (slots 8: 8, 16, 32
  adapters in use); a cell with W > T is skipped. m = 1 is the in-cache baseline (after a warm-up,
  every adapter in use stays resident) and always runs.
- **mix**: `zipf` (tenant k of the W drawn with weight 1 / (k + 1) ** s, s = `zipf_s`) or `uniform`.

Each cell: one warm-up request per tenant in use (untimed), then `requests` requests drawn with a
fixed seed, `concurrency` in flight; with `rounds` > 1 the working sets take turns and each cell
reports its median round. Reported per cell: tokens/s, p50/p99 latency and p50/p99 time
to first token, each as a ratio to the in-cache cell of the same T and mix, and the adapter work
the replica did (loads, canaries run and skipped: `Replica.adapter_ops`). The target: at 4x the
slots, throughput >= 0.5x in-cache and p99 latency <= 3x. Prints a table and writes JSON (`out`,
default bench-results/tenants.json).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import platform as platform_info
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console

from clora.freshness import percentile

MIXES = ("zipf", "uniform")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "Write a short story about a robot who learns to paint."


@dataclass(frozen=True)
class TenantsBenchConfig:
    """Every knob of one run (also written to the JSON)."""

    base: str = "tiny"
    """`tiny` (generated: 2 layers, hidden 256), `smollm2` (SmolLM2-135M-Instruct, converted once into
    `models_dir`) or a local HF model folder."""
    tenants: tuple[int, ...] = (16, 64, 256)
    mixes: tuple[str, ...] = MIXES
    working_sets: tuple[int, ...] = (1, 2, 4)
    """Multiples of `slots`; 1 (the in-cache baseline) is always run."""
    slots: int = 8
    """The replica's adapter slots (`EngineSettings.max_cpu_loras`)."""
    registered: int | None = None
    """`EngineSettings.max_registered_loras` (None: the engine's default, 256): adapters the
    replica keeps loaded, of which vLLM caches `slots` in memory and re-reads the others itself.
    Equal to `slots`: the gateway unloads, loads and verifies every adapter beyond them."""
    canary_every_load: bool = False
    """`EngineSettings.canary_every_load`: verify every re-load again (the engine's default verifies
    each version once per replica between restarts)."""
    rounds: int = 1
    """Each (tenants, mix) runs its working sets in turn this many times; a cell reports the
    median over its rounds (the in-cache baseline drifts with the machine's load as much as any)."""
    requests: int = 64
    """Measured requests per cell."""
    concurrency: int = 8
    max_tokens: int = 16
    zipf_s: float = 1.1
    seed: int = 0
    rank: int = 8
    models_dir: str = ".clora/models"
    out: str = "bench-results/tenants.json"

    def __post_init__(self) -> None:
        if not self.tenants or min(self.tenants) < 1:
            raise ValueError("--tenants must list tenant counts >= 1")
        if not set(self.mixes) <= set(MIXES) or not self.mixes:
            raise ValueError(f"--mix must list some of {', '.join(MIXES)}, got {','.join(self.mixes)}")
        if not self.working_sets or min(self.working_sets) < 1:
            raise ValueError("--working-sets must list multiples of the slots >= 1")
        if min(self.slots, self.requests, self.concurrency, self.max_tokens, self.rounds) < 1:
            raise ValueError("--slots, --requests, --concurrency, --max-tokens and --rounds must be >= 1")
        if self.registered is not None and self.registered < self.slots:
            raise ValueError(f"--registered {self.registered} must be >= --slots {self.slots}")
        if self.slots > min(self.tenants):
            raise ValueError(f"--slots {self.slots} exceeds the smallest tenant count {min(self.tenants)}: "
                             "its in-cache baseline needs a tenant per slot")

    @property
    def multiples(self) -> list[int]:
        return sorted({1, *self.working_sets})

    def working_set(self, multiple: int, tenants: int) -> int | None:
        """Adapters in use in a cell; None when it needs more tenants than there are."""
        w = multiple * self.slots
        return w if w <= tenants else None


def draws(mix: str, in_use: int, n: int, s: float, rng: random.Random) -> list[int]:
    """`n` tenant indices in [0, in_use): zipf weights 1 / (k + 1) ** s, or uniform."""
    weights = [1.0 / (k + 1) ** s for k in range(in_use)] if mix == "zipf" else [1.0] * in_use
    return rng.choices(range(in_use), weights=weights, k=n)


def build_adapters(model_dir: Path, out: Path, n: int, rank: int, first_seed: int) -> list[Path]:
    """`n` random PEFT LoRA adapters (rank `rank`, every linear projection), adapter i drawn
    from seed `first_seed + i` (also `benchmarks/bench_serving.py`'s adapters)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                            target_modules=LORA_TARGETS, init_lora_weights=False))
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(first_seed + i)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        path = out / f"adapter{i}"
        peft.save_pretrained(path)
        paths.append(path)
    return paths


@dataclass(frozen=True)
class Tenant:
    """One benchmark tenant: its id (also the `model` its requests name) and its API key."""

    id: str
    key: str


async def load(base_url: str, jobs: list[Tenant], concurrency: int, max_tokens: int) -> dict:
    """Stream one chat completion per job (`concurrency` in flight): tokens/s, latency and time to
    first token percentiles, errors."""
    import httpx

    latencies: list[float] = []
    ttfts: list[float] = []
    tokens = errors = 0
    queue = list(reversed(jobs))
    first_error: str | None = None

    async def one(http: httpx.AsyncClient, t: Tenant) -> None:
        nonlocal tokens, errors, first_error
        body = {"model": t.id, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first = None
        used = 0
        async with http.stream("POST", base_url + "/chat/completions", json=body,
                               headers={"authorization": f"Bearer {t.key}"}) as r:
            if r.status_code != 200:
                errors += 1
                first_error = first_error or f"{r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors += 1
                    first_error = first_error or str(chunk["error"])[:300]
                    return
                if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - t0
                if chunk.get("usage"):
                    used = chunk["usage"]["completion_tokens"]
        latencies.append(time.perf_counter() - t0)
        ttfts.append(first if first is not None else latencies[-1])
        tokens += used

    async def worker(http: httpx.AsyncClient) -> None:
        while queue:
            await one(http, queue.pop())

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "p50_s": percentile(latencies, 50) if latencies else None,
            "p99_s": percentile(latencies, 99) if latencies else None,
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
            "requests": len(latencies), "errors": errors, "first_error": first_error, "wall_s": wall}


RATIOS = ("tokens_per_s", "p50_s", "p99_s", "ttft_p50_s", "ttft_p99_s")


def median_cell(runs: list[dict]) -> dict:
    """One cell from its rounds: the median of each measure, the sums of requests, errors and
    adapter work, and every round as it was (`rounds`)."""
    def median(k: str) -> float | None:
        xs = sorted(r[k] for r in runs if r[k] is not None)
        return xs[len(xs) // 2] if xs else None

    ops = sum((collections.Counter(r["adapter_ops"]) for r in runs), start=collections.Counter())
    return {k: runs[0][k] for k in ("tenants", "mix", "multiple", "in_use")} | {k: median(k) for k in RATIOS} | {
        "requests": sum(r["requests"] for r in runs), "errors": sum(r["errors"] for r in runs),
        "first_error": next((r["first_error"] for r in runs if r["first_error"]), None),
        "adapter_ops": dict(ops), "rounds": runs}


class TenantsBench:
    def __init__(self, c: TenantsBenchConfig, console: Console | None = None):
        self.c = c
        self.console = console or Console()
        self.root = Path(tempfile.mkdtemp(prefix="clora-bench-tenants-"))

    def say(self, what: str) -> None:
        self.console.print(f"  {what}", highlight=False)

    def model(self) -> Path:
        from clora.learner.base_model import make_tiny_model, prepare_base_model

        if self.c.base == "tiny":
            return make_tiny_model(self.root / "tiny", seed=0, hidden_size=256)
        return prepare_base_model(self.c.base, cache_dir=self.c.models_dir)

    def run(self) -> dict:
        import redis

        from clora.infra.settings import BrokerSettings, RedisSettings
        from clora.infra.stack import LocalStack
        from clora.ingest.producer import ensure_topics
        from clora.procs import free_port
        from clora.registry import Registry
        from clora.serving.service import ServingService
        from clora.serving.settings import EngineSettings, GatewaySettings
        from clora.settings import PlatformSettings

        c = self.c
        model = self.model()
        distinct = min(max(c.tenants), c.slots * max(c.multiples))
        self.say(f"building {distinct} random rank-{c.rank} adapters on {model}")
        pool = build_adapters(model, self.root / "pool", distinct, c.rank, c.seed * 100_003)
        stack = LocalStack(platform=PlatformSettings(data_dir=self.root / "data"),
                           broker=BrokerSettings(port=free_port()), redis=RedisSettings(port=free_port())).start()
        svc = None
        try:
            ensure_topics(stack.kafka_bootstrap, partitions=stack.broker.partitions)
            reg = Registry(redis.Redis.from_url(stack.redis_url))
            es = EngineSettings(model=str(model), ports=[free_port()], max_loras=min(c.slots, c.concurrency),
                                max_cpu_loras=c.slots, max_lora_rank=c.rank,
                                **({} if c.registered is None else {"max_registered_loras": c.registered}),
                                canary_every_load=c.canary_every_load,
                                max_model_len=512,
                                max_num_seqs=max(32, c.concurrency), log_dir=self.root / "logs")
            gs = GatewaySettings(port=0, metrics_port=None, spool_dir=self.root / "spool", tenant_concurrency=256,
                                 tenant_rate_per_s=10_000, tenant_burst=10_000, tenant_engine_share=1.0,
                                 shared_quotas=False, tenant_refresh_s=1.0, durable_interactions=False)
            t0 = time.perf_counter()
            svc = ServingService(es, gs, kafka_bootstrap=stack.kafka_bootstrap, redis_url=stack.redis_url).start()
            self.say(f"engine and gateway up in {time.perf_counter() - t0:.0f} s ({svc.url})")
            engine = svc.gateway.engine
            tenants: list[Tenant] = []
            cells: list[dict] = []
            for n_tenants in sorted(c.tenants):
                self._add_tenants(reg, tenants, n_tenants, pool)
                self._wait_live(svc, tenants)
                for mix in c.mixes:
                    sets = [(m, w) for m in c.multiples if (w := c.working_set(m, n_tenants)) is not None]
                    runs: dict[int, list[dict]] = {m: [] for m, _ in sets}
                    for _ in range(c.rounds):
                        for m, w in sets:
                            run = self._cell(svc.url, engine, tenants, n_tenants, mix, m, w)
                            runs[m].append(run)
                            self.say(f"T={n_tenants} {mix} {m}x ({w} in use): {run['tokens_per_s']:.1f} tok/s, "
                                     f"p99 {run['p99_s']:.2f} s, loads {run['adapter_ops'].get('load', 0)}, "
                                     f"errors {run['errors']}")
                    base = median_cell(runs[1])
                    for m, _ in sets:
                        cell = median_cell(runs[m])
                        cell["ratio"] = {k: (cell[k] / base[k]) if base[k] and cell[k] is not None else None
                                         for k in RATIOS}
                        cells.append(cell)
            return {"config": asdict(c) | {"model": str(model)},
                    "engine": {"max_cpu_loras": es.max_cpu_loras, "max_loras": es.max_loras,
                               "registered_loras": es.registered_loras, "canary_every_load": es.canary_every_load},
                    "machine": {"cores": len(os.sched_getaffinity(0)), "cpu": platform_info.processor() or "?"},
                    "cells": cells}
        finally:
            if svc is not None:
                svc.stop()
            stack.stop()

    def _add_tenants(self, reg, tenants: list[Tenant], n: int, pool: list[Path]) -> None:
        """Register tenants up to `n`, each with a live v1 in its own folder (the first `len(pool)`
        their own weights; the idle rest hard links to the pool's files)."""
        from clora.registry import AdapterVersion

        for i in range(len(tenants), n):
            tid = f"t{i:03d}"
            _, key = reg.create_tenant(tid)
            folder = self.root / "adapters" / tid / "v1"
            shutil.copytree(pool[i % len(pool)], folder, copy_function=os.link)
            reg.record_adapter_version(tid, AdapterVersion(version=1, path=str(folder), base_model=self.c.base))
            reg.set_live_version(tid, 1)
            tenants.append(Tenant(tid, key))

    def _wait_live(self, svc, tenants: list[Tenant], timeout_s: float = 1800) -> None:
        """Until the gateway serves every tenant's v1 (its hot-swap poll discovers and preloads each)."""
        t0 = time.perf_counter()
        aliases = svc.gateway.swapper.aliases
        while any(aliases.get(t.id) is None for t in tenants):
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"the gateway did not pick up {len(tenants)} tenants in {timeout_s} s")
            time.sleep(0.5)
        self.say(f"{len(tenants)} tenants live on the gateway after {time.perf_counter() - t0:.0f} s")

    def _cell(self, url: str, engine, tenants: list[Tenant], n_tenants: int, mix: str, m: int, w: int) -> dict:
        c = self.c
        rng = random.Random(f"{c.seed}-{n_tenants}-{mix}-{m}")
        asyncio.run(load(url, tenants[:w], c.concurrency, 2))  # warm-up: each adapter in use once
        before = sum((r.adapter_ops for r in engine.replicas), start=collections.Counter())
        jobs = [tenants[i] for i in draws(mix, w, c.requests, c.zipf_s, rng)]
        r = asyncio.run(load(url, jobs, c.concurrency, c.max_tokens))
        after = sum((r_.adapter_ops for r_ in engine.replicas), start=collections.Counter())
        return {"tenants": n_tenants, "mix": mix, "multiple": m, "in_use": w,
                "distinct_drawn": len({j.id for j in jobs}), **r, "adapter_ops": dict(after - before)}


def table(report: dict) -> str:
    """The cells as fixed-width text, each measure with its ratio to the in-cache cell (x)."""
    cfg, eng = report["config"], report["engine"]
    lines = [f"clora bench tenants: {report['machine']['cores']} cores, {cfg['base']} base, slots {cfg['slots']} "
             f"(max_cpu_loras {eng['max_cpu_loras']}, resident {eng['registered_loras']}, "
             f"max_loras {eng['max_loras']}"
             f"{', canary on every load' if eng['canary_every_load'] else ''}), "
             f"{cfg['concurrency']} concurrent, {cfg['requests']} x {cfg['max_tokens']} tokens per cell, "
             f"median of {cfg['rounds']} round(s)",
             f"{'tenants':>7} {'mix':<7} {'in use':>9} {'tok/s':>7} {'x':>5} {'p50 s':>6} {'x':>5} {'p99 s':>6} "
             f"{'x':>5} {'ttft50':>6} {'x':>5} {'ttft99':>6} {'x':>5} {'loads':>5} {'canary':>6} {'skip':>4} "
             f"{'err':>3}"]

    def f(v: float | None, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    for cell in report["cells"]:
        q, ops = cell["ratio"], cell["adapter_ops"]
        lines.append(
            f"{cell['tenants']:>7} {cell['mix']:<7} {str(cell['multiple']) + 'x=' + str(cell['in_use']):>9} "
            f"{f(cell['tokens_per_s'], '{:.1f}'):>7} {f(q['tokens_per_s']):>5} "
            f"{f(cell['p50_s']):>6} {f(q['p50_s']):>5} "
            f"{f(cell['p99_s']):>6} {f(q['p99_s']):>5} {f(cell['ttft_p50_s']):>6} {f(q['ttft_p50_s']):>5} "
            f"{f(cell['ttft_p99_s']):>6} {f(q['ttft_p99_s']):>5} {ops.get('load', 0):>5} "
            f"{ops.get('canary', 0):>6} {ops.get('canary_skipped', 0):>4} {cell['errors']:>3}")
    return "\n".join(lines)


def main(c: TenantsBenchConfig) -> dict:
    console = Console()
    bench = TenantsBench(c, console)
    console.print(f"[bold]clora bench tenants[/]: tenants {list(c.tenants)}, mixes {list(c.mixes)}, working sets "
                  f"{[f'{m}x = {m * c.slots}' for m in c.multiples]} adapters (slots {c.slots})")
    try:
        report = bench.run()
    except BaseException:
        console.print(f"[red]failed[/]: logs kept under {bench.root}")
        raise
    shutil.rmtree(bench.root, ignore_errors=True)
    console.print(table(report), highlight=False, soft_wrap=True)
    out = Path(c.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    console.print(f"wrote {out}")
    return report
