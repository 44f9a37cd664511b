"""The ingest benchmark's CPU accounting (`benchmarks/bench_ingest.py`, `CpuTimes`): a child
that exits between two reads keeps counting what it had used, so a role's CPU never falls (Redis
forks one for each snapshot; the 200-event single run read -1,900 ms per 1,000 events)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ingest.py"

BURN_S = 0.3
CHILD = ("import sys, time\n"
         f"t = time.process_time()\nwhile time.process_time() - t < {BURN_S}: pass\n"
         "print('burnt', flush=True)\n"
         "sys.stdin.readline()\n")            # exits when its parent closes its stdin
PARENT = ("import subprocess, sys\n"
          f"c = subprocess.Popen([sys.executable, '-c', {CHILD!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
          "c.stdout.readline()\n"
          "print('burnt', flush=True)\n"
          "sys.stdin.readline()\n"            # the test reads once with the child alive
          "c.stdin.close()\n"
          "c.wait()\n"
          "print('exited', flush=True)\n"
          "sys.stdin.readline()\n")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_ingest", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_child_that_exits_between_two_reads_keeps_its_cpu():
    bench = _bench()
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "burnt"
        cpu = bench.CpuTimes({"redis": [parent.pid]})
        before = cpu.read()["redis"]
        assert before >= BURN_S                                     # the live child is counted
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "exited"        # the child is gone
        assert cpu.read()["redis"] >= before
    finally:
        parent.kill()
        parent.wait()
