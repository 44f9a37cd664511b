"""One fixed LoRA run through the public `tinker` SDK, checked step by step; the same script for
every SDK version from 0.30.0 to 0.38.0, so each one's wire flow is tested against clora.

    python tests/trainapi/sdk_conformance.py --base-url http://127.0.0.1:8600 --api-key tml-... \\
        --base-model tiny --rank 8 --out result.json

A standalone script, not a test module: `test_sdk_versions.py` runs it under the current
interpreter (tinker 0.38) and under an older SDK's (`CLORA_TINKER_OLD_PYTHON`, tinker 0.30). It
imports nothing of clora, and of the SDK only what both versions have (docs/tinker-protocol.md §9):

    ServiceClient -> create_lora_training_client -> get_info, get_tokenizer
    N x (forward_backward(cross_entropy) + optim_step)   the summed loss falls, and equals the
                                                          client's own sum of -logprob * weight
    save_state("conformance") -> forward                 the loss at the saved weights
    one more step                                        its loss is that loss; then forward again
    create_training_client_from_state_with_optimizer     a new run from the save: its forward is
      -> forward, one step, forward                      the saved loss, and its next step lands
                                                          where the first run's did (Adam restored)
    save_weights_for_sampler("conformance-sampler")      a named `tinker://.../sampler_weights/...`

The restore is where the versions differ most: 0.30 asks `weights_info`, `create_model`, then
`load_weights` on the new model; 0.38 creates the model with `load_weights` alone. 0.38's
`create_*` return a future of the client, 0.30's the client itself (`_ready`).

Writes a JSON summary to --out (SDK version, losses, paths, model ids) and exits 0; on a failed
check it says which on stderr, writes the summary so far with "error" set, and exits 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import sys
from pathlib import Path

import tinker

ADAM = tinker.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8)
PROMPTS = ([10, 11, 12], [20, 21], [30, 31, 32, 33])
ANSWER = [40, 41, 42, 43]
"""Token ids below 100: the test base model is a tiny llama with a small vocabulary."""
REL_TOL = 1e-4
"""Two losses of the same weights on the same data agree to this (the server's float32 sums)."""


class ConformanceError(AssertionError):
    """A check the server failed; the message says which and with what numbers."""


def datum(prompt: list[int], answer: list[int]) -> tinker.Datum:
    """Position i predicts token i+1; only the answer's tokens weigh."""
    tokens = prompt + answer
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})


DATA = [datum(p, ANSWER) for p in PROMPTS]


def check(ok: bool, what: str) -> None:
    if not ok:
        raise ConformanceError(what)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-6)


def _ready(created):
    """The training client: 0.38's `create_*` return a future of it (`.result()`), 0.30's the client."""
    result = getattr(created, "result", None)
    return result() if callable(result) else created


def summed_loss(output, what: str) -> float:
    """The server's `loss:sum`, checked against the client's own sum of -logprob * weight."""
    loss = float(output.metrics["loss:sum"])
    check(math.isfinite(loss), f"{what}: loss:sum is {loss}")
    check(len(output.loss_fn_outputs) == len(DATA),
          f"{what}: {len(output.loss_fn_outputs)} loss_fn_outputs for {len(DATA)} datums")
    mine = 0.0
    for out, d in zip(output.loss_fn_outputs, DATA):
        logprobs, weights = out["logprobs"].tolist(), d.loss_fn_inputs["weights"].tolist()
        check(len(logprobs) == len(weights), f"{what}: {len(logprobs)} logprobs for {len(weights)} target tokens")
        mine -= sum(lp * w for lp, w in zip(logprobs, weights))
    check(close(loss, mine), f"{what}: loss:sum {loss} is not the sum of -logprob * weight {mine}")
    return loss


def step(training, what: str) -> float:
    """One forward_backward + optim_step; the forward_backward's summed loss."""
    fb = training.forward_backward(DATA, "cross_entropy")
    opt = training.optim_step(ADAM)
    loss = summed_loss(fb.result(), what)
    opt.result()
    return loss


def forward(training, what: str) -> float:
    return summed_loss(training.forward(DATA, "cross_entropy").result(), what)


def check_info(training, args: argparse.Namespace, what: str) -> dict:
    info = training.get_info()
    check(info.model_data.model_name == args.base_model,
          f"{what}: get_info model_name {info.model_data.model_name!r}, created on {args.base_model!r}")
    check(info.lora_rank == args.rank, f"{what}: get_info lora_rank {info.lora_rank}, created with {args.rank}")
    check(info.model_id == training.model_id,
          f"{what}: get_info model_id {info.model_id!r} is not {training.model_id!r}")
    return {"model_id": info.model_id, "model_name": info.model_data.model_name, "lora_rank": info.lora_rank,
            "tokenizer_id": info.model_data.tokenizer_id}


def run(args: argparse.Namespace, summary: dict) -> None:
    """Every check, in order, filling `summary` as it goes."""
    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    training = _ready(service.create_lora_training_client(base_model=args.base_model, rank=args.rank))
    summary["info"] = check_info(training, args, "new run")
    ids = training.get_tokenizer().encode("hello")
    check(bool(ids) and all(isinstance(i, int) for i in ids), f"get_tokenizer: 'hello' encodes to {ids!r}")

    losses = summary["losses"] = []
    for i in range(args.steps):
        losses.append(step(training, f"step {i + 1}"))
    check(losses[-1] < losses[0], f"the summed loss did not decrease over {args.steps} steps: {losses}")

    saved = summary["checkpoint_path"] = training.save_state("conformance").result().path
    check(saved.startswith("tinker://") and training.model_id in saved and saved.endswith("/conformance"),
          f"save_state path {saved!r} is not tinker://{training.model_id}/.../conformance")
    at_save = summary["loss_at_save"] = forward(training, "forward at the save")
    check(at_save < losses[-1], f"the loss after the last step ({at_save}) is not below its own ({losses[-1]})")
    moved = step(training, "the step after the save")
    check(close(moved, at_save), f"forward changed the weights: the next step's loss {moved} is not {at_save}")
    after = summary["loss_one_step_after_save"] = forward(training, "forward one step after the save")

    resumed = _ready(service.create_training_client_from_state_with_optimizer(saved))
    summary["resumed_info"] = check_info(resumed, args, "run restored from the save")
    check(resumed.model_id != training.model_id, f"the restored run reuses model id {resumed.model_id!r}")
    restored = summary["resumed_loss_at_save"] = forward(resumed, "forward of the restored run")
    check(close(restored, at_save), f"the restored run's loss {restored} is not the saved weights' {at_save}")
    step(resumed, "the restored run's step")
    again = summary["resumed_loss_one_step_after"] = forward(resumed, "forward one step after the restore")
    check(close(again, after), f"one step from the restore gives loss {again}, one step from the save gave {after}: "
          "the optimizer state was not restored with the weights")

    sampler = summary["sampler_path"] = training.save_weights_for_sampler("conformance-sampler").result().path
    check(sampler == f"tinker://{training.model_id}/sampler_weights/conformance-sampler",
          f"save_weights_for_sampler path {sampler!r} is not tinker://{training.model_id}/sampler_weights/"
          "conformance-sampler")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the training API, e.g. http://127.0.0.1:8600")
    parser.add_argument("--api-key", required=True, help="a tenant's Tinker key (tml-...)")
    parser.add_argument("--base-model", required=True, help="the base model name the server trains")
    parser.add_argument("--rank", type=int, required=True, help="the LoRA rank the server trains")
    parser.add_argument("--steps", type=int, default=4, help="training steps before the save (at least 2)")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON summary goes")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the loss must have room to decrease)")
    summary: dict = {"sdk_version": importlib.metadata.version("tinker"), "python": sys.version.split()[0],
                     "base_url": args.base_url, "base_model": args.base_model, "rank": args.rank, "error": None}
    try:
        run(args, summary)
    except ConformanceError as e:
        summary["error"] = str(e)
    except Exception as e:  # noqa: BLE001 - any SDK error is a failed run: reported with its type
        summary["error"] = f"{type(e).__name__}: {e}"
    args.out.write_text(json.dumps(summary, indent=2))
    if summary["error"] is not None:
        print(f"sdk_conformance (tinker {summary['sdk_version']}) FAILED: {summary['error']}", file=sys.stderr)
        return 1
    print(f"sdk_conformance (tinker {summary['sdk_version']}) passed: losses {summary['losses']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
