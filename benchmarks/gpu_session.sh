#!/usr/bin/env bash
# Run benchmarks/gpu_checks.sh on a bare lent GPU machine (Python 3.12 with CUDA torch, Triton,
# transformers; no network, no clora install). What must travel with the working tree, made here:
#   .whl/        cp312 wheels of what clora imports and the machine lacks (see the device notes for
#                `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`): pydantic,
#                pydantic-core, annotated-types, typing-inspection, typing-extensions >= 4.16,
#                pydantic-settings, python-dotenv, fastapi, starlette and redis (the learner's and
#                the tests' imports reach them), and megatron-core 0.16.1 for the megatron stage
#   .gpu/smollm2-shape/  SmolLM2's config, tokenizer and chat template, no weights
# The script installs the wheels into /tmp/site, makes `clora.<name>` importable from the working
# tree (pyproject's package-dir mapping, without an install: the package pins Python 3.11),
# writes random weights of SmolLM2's shape (timing does not need the real ones), then runs
# gpu_checks.sh with OUT as given.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
mkdir -p "$SITE/clora"
for f in core/*.py; do ln -sfn "$PWD/$f" "$SITE/clora/$(basename "$f")"; done
for d in ingest serving learner kernels agents infra; do ln -sfn "$PWD/$d" "$SITE/clora/$d"; done
export PYTHONPATH="$SITE"
MODEL_DIR=.gpu/smollm2-shape
python3 - "$MODEL_DIR" <<'EOF'
import sys, torch
from transformers import AutoConfig, LlamaForCausalLM
path = sys.argv[1]
torch.manual_seed(0)
LlamaForCausalLM(AutoConfig.from_pretrained(path)).save_pretrained(path)
print("random SmolLM2-shaped weights in", path)
EOF
PY=python3 MODEL="$MODEL_DIR" bash benchmarks/gpu_checks.sh
