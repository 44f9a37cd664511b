"""A failure on any rank of the megatron backend stops the whole group in seconds, not after the
group's collective timeout (300 s here): rank 0 raising inside a forward or a backward, while the
other ranks are inside its collectives, and a follower killed with -9 while the group trains.
Every rank exits, non-zero, well inside `BOUND_S`; the test waits on the processes themselves.

What happens next (the learner restarted from its checkpoints, no example trained twice) is
`test_megatron_learner.py`'s restart test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch

from . import megatron_job
from .helpers import sft_set

pytest.importorskip("megatron.core")

TIMEOUT_S = 300
"""The group's collective timeout in these jobs: what a rank left waiting would wait."""
BOUND_S = 30
"""How soon after the failure every rank must be gone (torchrun's own grace for a rank that
ignores its SIGTERM is 30 s more; the ranks here go on their own, within a second or two)."""


def _job(model_dir: Path, **drill) -> dict:
    from clora.learner.base_model import load_base_model
    from clora.learner.lora import LoraModel, LoraSpec

    spec = dict(rank=4, alpha=8.0)
    numel = LoraModel(load_base_model(model_dir)[0], LoraSpec(**spec)).layout.numel
    sft_p = dict(algorithm="sft", learning_rate=1e-2, batch_size=4)
    return {"model_dir": str(model_dir), "spec": spec, "flat": torch.zeros(numel), "timeout_s": TIMEOUT_S,
            "probe": sft_set("p", "yes", 2), "steps": [("a", 11, sft_p, sft_set("a", "yes"))] * 2, **drill}


def _start(job: dict, tp: int, dp: int, folder: Path) -> tuple[subprocess.Popen, Path]:
    log = folder / "torchrun.log"
    folder.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(megatron_job.command(job, tp, folder, dp), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    return proc, log


def _ranks(folder: Path, n: int, wait_for) -> list[psutil.Process]:
    pids = wait_for(lambda: [int((folder / f"rank{r}.pid").read_text()) for r in range(n)]
                    if all((folder / f"rank{r}.pid").exists() for r in range(n)) else None,
                    timeout=180, what="every rank up")
    return [psutil.Process(pid) for pid in pids]


def _assert_all_gone(proc: subprocess.Popen, ranks: list[psutil.Process], since: float, log: Path) -> float:
    try:
        code = proc.wait(timeout=TIMEOUT_S / 2)    # a group waiting out its timeout fails here
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            for rank in ranks:                         # torchrun runs each rank in a session of its own
                if rank.is_running():
                    rank.kill()
    took = time.time() - since
    text = log.read_text(errors="replace")
    _, alive = psutil.wait_procs(ranks, timeout=5)
    assert not alive, f"ranks {[p.pid for p in alive]} outlived the group\n{text[-3000:]}"
    assert code != 0, text[-3000:]
    assert took < BOUND_S, f"the group took {took:.1f} s to stop (timeout {TIMEOUT_S} s)\n{text[-3000:]}"
    return took


@pytest.mark.parametrize(("tp", "dp"), [(2, 1), (1, 2)], ids=["T2", "T1xD2"])
def test_rank_0_raising_inside_a_forward_stops_every_rank_in_seconds(tiny_model_dir, tmp_path, wait_for, tp, dp):
    """Forward 3 is a training step's (forward 1 is the probe's): the followers are inside its
    collectives (at T=2, the layers' all-reduces; at D=2, the gather) when rank 0's part raises."""
    proc, log = _start(_job(tiny_model_dir, fail_forward=3), tp, dp, tmp_path)
    ranks = _ranks(tmp_path, tp * dp, wait_for)
    wait_for(lambda: (tmp_path / "failing").exists() or proc.poll() is not None, timeout=180,
             what="rank 0's drill failure")
    _assert_all_gone(proc, ranks, float((tmp_path / "failing").read_text()), log)
    text = log.read_text(errors="replace")
    assert "drill: rank 0 fails in forward 3" in text and "broke during the forward on rank 0" in text
    assert not (tmp_path / "out.pt").exists()


def test_rank_0_raising_inside_a_backward_stops_every_rank_in_seconds(tiny_model_dir, tmp_path, wait_for):
    """At T=2 the follower is inside the backward's all-reduces when rank 0's part raises."""
    proc, log = _start(_job(tiny_model_dir, fail_backward=3), 2, 1, tmp_path)
    ranks = _ranks(tmp_path, 2, wait_for)
    wait_for(lambda: (tmp_path / "failing").exists() or proc.poll() is not None, timeout=180,
             what="rank 0's drill failure")
    _assert_all_gone(proc, ranks, float((tmp_path / "failing").read_text()), log)
    text = log.read_text(errors="replace")
    assert "drill: rank 0 fails in the backward of forward 3" in text
    assert "broke during the backward on rank 0" in text


def test_a_follower_killed_mid_training_stops_every_rank_in_seconds(tiny_model_dir, tmp_path, wait_for):
    proc, log = _start(_job(tiny_model_dir, loop=True), 1, 2, tmp_path)
    ranks = _ranks(tmp_path, 2, wait_for)
    wait_for(lambda: (tmp_path / "running").exists() or proc.poll() is not None, timeout=180,
             what="the group training")
    assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
    killed = time.time()
    ranks[1].send_signal(signal.SIGKILL)
    _assert_all_gone(proc, ranks, killed, log)
