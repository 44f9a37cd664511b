"""The ingest worker's CPU per event on its hot path, with Python's default garbage collector
settings (the baseline) and with `clora.procs.tune_gc` (what `clora ingest-worker` runs), in one
run.

    .venv/bin/python benchmarks/bench_worker_cpu.py [--events 5000] [--batch 500] [--reps 3] [--out F]

It starts a Redis and calls `IngestWorker.handle` in-process on consumer records made here (no
broker: this is the worker's own Python and its Redis round trips, which the end-to-end
`bench_ingest.py` cannot separate from the webhook's and the broker's). Two stages per rep:
- interactions: `--events` interactions stored, in polls of `--batch` records;
- feedback: a score on each, joined with its stored interaction into an RL example.

It reports this process's CPU time per event (`time.process_time`: what the worker costs the
machine, steady under other load on the box) and the wall rate. Each variant runs in its own
process, since collector settings are process-wide. Prints a table and writes JSON (default
bench-results/worker_cpu.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
import uuid
from collections import namedtuple
from pathlib import Path

Record = namedtuple("Record", "topic partition offset key value")
VARIANTS = ("default gc", "tune_gc")


def measure(variant: str, redis_url: str, events: int, batch: int) -> dict:
    """One rep of one variant in this process: CPU us/event and events/s of each stage."""
    from clora.ingest.schemas import TOPIC_FEEDBACK, TOPIC_INTERACTIONS, InteractionEvent
    from clora.ingest.settings import IngestSettings
    from clora.ingest.worker import IngestWorker
    from clora.procs import tune_gc

    tenant = f"b-{uuid.uuid4().hex[:8]}"
    worker = IngestWorker(IngestSettings(), "127.0.0.1:1", redis_url)    # no broker call on this path
    ids = [uuid.uuid4().hex for _ in range(events)]

    def interactions(part: list[str]) -> list[Record]:
        return [Record(TOPIC_INTERACTIONS, 0, i, tenant.encode(), InteractionEvent(
            tenant=tenant, interaction_id=iid, messages=[{"role": "user", "content": "What is 17*3?"}],
            response={"role": "assistant", "content": "51"}, completion_token_ids=[1, 2, 3],
            completion_logprobs=[-0.1, -0.2, -0.3]).model_dump_json().encode()) for i, iid in enumerate(part)]

    def feedback(part: list[str]) -> list[Record]:
        return [Record(TOPIC_FEEDBACK, 0, i, tenant.encode(), json.dumps(
            {"tenant": tenant, "interaction_id": iid, "event_id": f"fb-{iid}", "time": time.time(), "score": 1.0,
             "source": "environment"}).encode()) for i, iid in enumerate(part)]

    if variant == "tune_gc":
        tune_gc()
    out = {}
    for stage, make in (("interactions", interactions), ("feedback", feedback)):
        wall = cpu = 0.0
        for at in range(0, events, batch):
            records = make(ids[at:at + batch])     # one poll's records alive at a time, as in the worker
            w0, c0 = time.perf_counter(), time.process_time()
            worker.handle(records)
            wall, cpu = wall + time.perf_counter() - w0, cpu + time.process_time() - c0
            del records
        out[stage] = {"cpu_us_per_event": cpu / events * 1e6, "events_per_s": events / wall}
    stored = sum(worker.r.zcard(f"clora:t:{{{tenant}}}:{where}:rl") for where in ("buf", "held"))  # held out too
    if stored != events:
        raise SystemExit(f"{variant}: {stored} of {events} feedback events stored as RL examples")
    worker.r.close()
    gc.unfreeze()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=500, help="records per poll")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-results/worker_cpu.json"))
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "REDIS_URL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.events, args.batch)))
        return

    from clora.infra.stack import redis_server_binary
    from clora.procs import free_port, port_open

    port = free_port()
    server = subprocess.Popen([str(redis_server_binary()), "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not port_open("127.0.0.1", port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.05)
        url = f"redis://127.0.0.1:{port}/0"
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for _ in range(args.reps):
            for variant in VARIANTS:     # interleaved: a slow spell on the box hits both alike
                child = subprocess.run([sys.executable, __file__, "--events", str(args.events), "--batch",
                                        str(args.batch), "--child", variant, url],
                                       capture_output=True, text=True)
                if child.returncode:
                    raise SystemExit(f"{variant} failed:\n{child.stderr[-3000:]}")
                runs[variant].append(json.loads(child.stdout.strip().splitlines()[-1]))
    finally:
        server.terminate()
        server.wait(10)
    rows = []
    for variant in VARIANTS:
        for stage in ("interactions", "feedback"):
            cpu = statistics.median(r[stage]["cpu_us_per_event"] for r in runs[variant])
            rate = statistics.median(r[stage]["events_per_s"] for r in runs[variant])
            rows.append({"variant": variant, "stage": stage, "cpu_us_per_event": cpu, "events_per_s": rate})
    base = {r["stage"]: r["cpu_us_per_event"] for r in rows if r["variant"] == VARIANTS[0]}
    print(f"worker hot path, {args.events} events in polls of {args.batch}, median of {args.reps} reps")
    print(f"{'variant':<12} {'stage':<13} {'CPU us/event':>13} {'vs default':>11} {'events/s':>10}")
    for r in rows:
        r["cpu_vs_default"] = r["cpu_us_per_event"] / base[r["stage"]]
        print(f"{r['variant']:<12} {r['stage']:<13} {r['cpu_us_per_event']:>13.1f} {r['cpu_vs_default']:>10.2f}x "
              f"{r['events_per_s']:>10.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"events": args.events, "batch": args.batch, "reps": args.reps, "rows": rows,
                                    "runs": runs}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
