"""`CpuMeter`: the core-seconds of a platform's processes, by role, from real child processes."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from clora.infra.bench_platform import CoreSeconds, CpuMeter

BURN = """
import sys, time
from pathlib import Path
seconds, marker = float(sys.argv[1]), Path(sys.argv[2])
while time.process_time() < seconds:
    pass
marker.write_text("done")
time.sleep(120)
"""

# the serving service: the gateway burns 0.5 s itself and starts one replica that burns 0.2 s
SERVING = """
import subprocess, sys
from pathlib import Path
here = Path(sys.argv[1])
subprocess.Popen([sys.executable, "-c", (here / "burn.py").read_text(), "0.2", str(here / "replica")])
exec((here / "burn.py").read_text().replace("float(sys.argv[1])", "0.5").replace("Path(sys.argv[2])",
                                                                             "here / 'gateway'"))
"""


@dataclass
class _Service:
    pid: int


@dataclass
class _Platform:
    services: dict[str, _Service]


def _wait_for(*markers: Path) -> None:
    deadline = time.monotonic() + 120                  # a bound a loaded machine never meets; not a timing
    while not all(m.exists() for m in markers):
        assert time.monotonic() < deadline, f"the children never wrote {markers}"
        time.sleep(0.05)


def test_the_meter_counts_the_replicas_as_engine_the_learner_as_learner_and_the_gateway_as_other(tmp_path):
    (tmp_path / "burn.py").write_text(BURN)
    procs = []
    try:
        serving = subprocess.Popen([sys.executable, "-c", SERVING, str(tmp_path)])
        learner = subprocess.Popen([sys.executable, "-c", BURN, "0.3", str(tmp_path / "learner")])
        procs += [serving, learner]
        meter = CpuMeter(_Platform({"serving": _Service(serving.pid), "learner": _Service(learner.pid)}))
        _wait_for(tmp_path / "replica", tmp_path / "gateway", tmp_path / "learner")
        used = meter.read()
        # the kernel's accounting is in clock ticks (10 ms), a little behind the burners' own clock;
        # each child's start-up (an interpreter) comes on top of what it burned
        assert 0.18 <= used.engine < 0.45
        assert 0.28 <= used.learner < 0.55
        assert used.other >= 0.48                        # the gateway and this test's process
        later = meter.read()
        assert later.engine - used.engine < 0.1         # asleep: a difference of two reads is what ran between
        assert (later - used).wall_s > 0
    finally:
        for p in procs:
            for child in _children(p.pid):
                child.kill()
            p.kill()
            p.wait()


def _children(pid: int):
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_core_seconds_add_and_subtract_by_role():
    a = CoreSeconds(engine=5.0, learner=3.0, other=1.0, wall_s=10.0)
    b = CoreSeconds(engine=1.0, learner=0.5, other=0.25, wall_s=4.0)
    assert a - b == CoreSeconds(4.0, 2.5, 0.75, 6.0)
    assert a + b == CoreSeconds(6.0, 3.5, 1.25, 14.0)


@pytest.mark.parametrize("service", ["serving", "learner"])
def test_a_platform_without_a_service_reads_its_role_as_zero(service):
    meter = CpuMeter(_Platform({service: _Service(2 ** 22 + 7)}))    # a pid that is no child of this process
    used = meter.read()
    assert used.engine == 0.0 and used.learner == 0.0 and used.other > 0
