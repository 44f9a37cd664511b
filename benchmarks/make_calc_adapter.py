"""An SFT warm start for `clora bench experiments --init-adapter`: a calc LoRA adapter that
already calls the tools, so RL on the arithmetic task gets a reward signal from step 1.

    python benchmarks/make_calc_adapter.py [--steps 12] [--lr 2e-3] [--batch 4] [--out DIR]

SmolLM2-135M-Instruct never calls a tool on its own: every arithmetic rollout of the base model
earns 0, every group has the same reward and GRPO has no gradient. The reference system's RL
starts from an instruct model that can already call tools; this is the same start, made here:
SFT on the environment's reference solutions (the calculator call, then `final_answer` after
the tool result; the corrections `clora demo`'s operator sends), outside the platform, with
the learner's own trainer, chat template and LoRA layout (rank 8, alpha 16, the default
modules: what `clora bench experiments` learners use).

Prints the held-out first-turn accuracy (greedy: a calculator call with exactly the reference
expression) every few steps, and writes a PEFT adapter folder.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from clora.agents.envs.arithmetic import ArithmeticEnv
from clora.agents.envs.base import Problem
from clora.ingest.schemas import Message, SFTExample
from clora.learner.adapter_store import AdapterStore
from clora.learner.base_model import load_base_model, prepare_base_model
from clora.learner.batches import ChatEncoder
from clora.learner.lora import LoraModel, LoraSpec
from clora.learner.peft_io import write_adapter
from clora.learner.trainer import Trainer, TrainerConfig, TrainingPolicy

_EXPRESSION = re.compile(r'"name":\s*"calculator".*?"expression":\s*"([^"]*)"', re.DOTALL)


def reference_examples(problems: list[Problem], tools: list[dict], tag: str) -> list[SFTExample]:
    """Both turns of each problem's reference solution as SFT examples."""
    out = []
    for k, p in enumerate(problems):
        call, result, final = p.reference
        for turn, (prompt, target) in enumerate(((list(p.messages), call),
                                                 ([*p.messages, call, result], final))):
            out.append(SFTExample(example_id=f"{tag}-{k}-{turn}", tenant="calc", interaction_id=f"{tag}-{k}-{turn}",
                                  feedback_event_id=f"{tag}-{k}-{turn}", time=time.time(), tools=tools,
                                  messages=[Message.model_validate(m) for m in prompt],
                                  target=Message.model_validate(target)))
    return out


@torch.no_grad()
def first_turn_accuracy(lora: LoraModel, tok, problems: list[Problem], tools: list[dict]) -> float:
    lora.eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    right = 0
    for p in problems:
        ids = tok.apply_chat_template(list(p.messages), tools=tools, add_generation_prompt=True, return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        out = lora.model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=end)
        m = _EXPRESSION.search(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        want = json.loads(p.reference[0]["tool_calls"][0]["function"]["arguments"])["expression"]
        right += m is not None and m.group(1).replace(" ", "") == want
    return right / len(problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch", type=int, default=4, help="examples per step (both turns of batch/2 problems)")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--eval-size", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=".clora/calc-sft-adapter")
    a = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    model_dir = prepare_base_model() if a.model == "smollm2" else Path(a.model)
    model, tok = load_base_model(model_dir)
    lora = LoraModel(model, LoraSpec(rank=8, alpha=16))
    store = AdapterStore(lora)
    trainer = Trainer(lora, ChatEncoder(tok, 512), store, TrainerConfig(micro_batch_size=8, max_seq_len=512))
    store.register("calc", 1)
    env = ArithmeticEnv(difficulties=("easy",))
    tools = env.tools.schemas()
    held = env.held_out()[:a.eval_size]
    policy = TrainingPolicy(algorithm="sft", learning_rate=a.lr, batch_size=a.batch)
    started = time.monotonic()
    for step in range(1, a.steps + 1):
        examples = reference_examples(env.train_problems((a.batch + 1) // 2, seed=step), tools, f"s{step}")[:a.batch]
        r = trainer.train_step("calc", examples, policy)
        line = f"step {step:3d}  loss {r.loss:.3f}  {r.seconds:.1f} s"
        if step % a.eval_every == 0 or step == a.steps:
            store.activate("calc")
            line += f"  held-out first-turn accuracy {first_turn_accuracy(lora, tok, held, tools):.2f}"
        print(line, f"({time.monotonic() - started:.0f} s)", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_adapter(out, lora.layout, store.state("calc").master, str(model_dir))
    print(f"wrote {out} (use: clora bench experiments --init-adapter {out})")


if __name__ == "__main__":
    main()
