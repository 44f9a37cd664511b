"""One scenario on the learner's model, run the same way on the default backend (in the test's
process) and on the megatron backend (here, under `torchrun`, T x D processes: T tensor-parallel
ranks in each of D data-parallel replicas). Rank 0 writes what it measured to `<out>` (torch.save).

    python -m torch.distributed.run --standalone --nproc-per-node=T*D tests/learner/megatron_job.py JOB OUT

JOB is a torch.save'd dict: `model_dir`, `tp`, `dp`, `spec` (LoraSpec kwargs) and the scenario's
inputs (see `run`). The followers run `MegatronLoraModel.follow` until rank 0 is done.

Fault drills (the fail-fast tests): `fail_forward` = n makes rank 0's own part of its n-th
forward raise, `fail_backward` = n its part of that forward's backward; `loop` = True repeats the steps until the group breaks. Every rank writes its pid
to `rank<r>.pid`, and rank 0 writes `running` once it has taken its steps and `failing` (the
time) just before the drill's failure.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch


def run(model, tokenizer, job: dict, out_dir: Path | None = None) -> dict:
    """The scenario on `model` (a LoraModel or a MegatronLoraModel, rank 0):

    1. `probe`: with the flat adapter `job["flat"]` bound, per-token logprobs of `job["probe"]`
       (SFT examples) and the gradient of their SFT loss (through `fold_grads`, as a step does);
    2. `steps`: `job["steps"]` = [(tenant, seed, policy kwargs, examples)] trained in order with
       the learner's own Trainer and store (from `job["init"][tenant]`'s weights where given); the
       StepResults and each tenant's final (4, P) state;
    3. `published`: each tenant's adapter written as a PEFT folder under `out_dir` (if given).
    """
    from clora.learner.adapter_store import AdapterStore
    from clora.learner.batches import ChatEncoder
    from clora.learner.losses import sft_loss
    from clora.learner.peft_io import write_adapter
    from clora.learner.trainer import Trainer, TrainingPolicy, target_logprobs

    torch.manual_seed(0)
    store = AdapterStore(model, prefetch=False)
    trainer = Trainer(model, ChatEncoder(tokenizer, 128), store)
    out: dict = {}

    store.register("probe", seed=1)
    slot = store.activate("probe")
    slot.master.copy_(job["flat"])
    slot.sync_weights()
    batch = trainer.encoder.sft(job["probe"])
    lp = target_logprobs(model, None, batch)
    sft_loss(lp, batch.loss_mask).backward()
    slot.fold_grads()
    out["probe_logprobs"], out["probe_mask"] = lp.detach().clone(), batch.loss_mask.clone()
    out["probe_grad"] = slot.grad.clone()
    slot.grad.zero_()

    results = []
    for tenant, seed, policy, examples in job["steps"]:
        if tenant not in store.tenants():
            store.register(tenant, seed=seed, master=job.get("init", {}).get(tenant))
        r = trainer.train_step(tenant, examples, TrainingPolicy(**policy))
        results.append((tenant, r.step, r.loss, r.grad_norm))
    out["steps"] = results
    out["states"] = {t: store.state(t).buffer.clone() for t in store.tenants() if t != "probe"}
    if out_dir is not None:
        for t in out["states"]:
            folder = out_dir / f"adapter-{t}"
            folder.mkdir(parents=True, exist_ok=True)
            write_adapter(folder, model.layout, store.state(t).master, "tiny")
    return out


def command(job: dict, tp: int, folder: Path, dp: int = 1) -> list[str]:
    """The torchrun command line running `job` at T=`tp`, D=`dp` (written to `folder`)."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({**job, "tp": tp, "dp": dp}, folder / "job.pt")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp * dp}",
            "--max-restarts=0", __file__, str(folder / "job.pt"), str(folder / "out.pt")]


def torchrun(job: dict, tp: int, folder: Path, dp: int = 1) -> dict:
    """`job` on the megatron backend at tensor parallel size `tp` and data parallel size `dp`
    (torchrun, `tp` x `dp` processes); rank 0's result. The adapters it publishes land in `folder`."""
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command(job, tp, folder, dp), env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(folder / "out.pt", weights_only=False)


def main(job_path: str, out_path: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from clora.learner import megatron_tp as mt
    from clora.learner.lora import LoraSpec

    job = torch.load(job_path, weights_only=False)
    folder = Path(out_path).parent
    mt.die_with_launcher()   # as `clora learner` does: no rank outlives torchrun
    mt.init_parallel(job["tp"], job.get("dp", 1), timeout_s=job.get("timeout_s", 120))
    model = mt.MegatronLoraModel(job["model_dir"], LoraSpec(**job["spec"]))
    model.exit_on_failure = True   # as `clora learner` runs it
    (folder / f"rank{model.rank}.pid").write_text(str(os.getpid()))
    if model.rank != 0:
        model.follow()
        mt.shutdown_parallel()
        return
    if job.get("fail_forward") or job.get("fail_backward"):
        _fail_at(model, job.get("fail_forward"), job.get("fail_backward"), folder)
    try:
        tok = AutoTokenizer.from_pretrained(str(job["model_dir"]))
        result = run(model, tok, job, folder)
        (folder / "running").touch()
        while job.get("loop"):
            run(model, tok, job)
        torch.save(result, out_path)
    finally:
        model.stop_followers()
    mt.shutdown_parallel()


def _fail_at(model, forward: int | None, backward: int | None, folder: Path) -> None:
    """Rank 0's own part of its `forward`-th forward raises (after the header and inputs went out:
    the followers are inside that forward's collectives), or of the backward of its `backward`-th
    forward (the followers are inside that backward's)."""
    import time

    own, calls = model._shard_logits, [0]

    def fail(what: str) -> None:
        (folder / "failing").write_text(repr(time.time()))
        raise RuntimeError(f"drill: rank 0 fails in {what}")

    def shard_logits(*args, **kwargs):
        calls[0] += 1
        if calls[0] == forward:
            fail(f"forward {forward}")
        shard = own(*args, **kwargs)
        if calls[0] == backward and shard.requires_grad:
            shard.register_hook(lambda grad: fail(f"the backward of forward {backward}"))
        return shard

    model._shard_logits = shard_logits


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
