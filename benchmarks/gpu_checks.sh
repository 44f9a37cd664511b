#!/usr/bin/env bash
# Everything this repository can only check on a GPU, as one short script: a machine with CUDA,
# torch with Triton, and clora importable (this repository's .venv with CUDA torch, or
# benchmarks/gpu_session.sh on a bare lent machine). ~6-10 min on one H200. Writes under
# ${OUT:-bench-results/gpu}: log.txt (every stage's output, and its exit status), junit.xml,
# decode.json, fused.json, learner.json, kernels.json, learner-megatron.json.
#   1. decode tokens/s of a SmolLM2-shaped model with 1 and 8 mixed rank-8 LoRA adapters on all
#      seven linear modules vs the base model, batches 16/64/256 over a 512-token KV cache,
#      CUDA-graph replays and eager (target: 8 mixed >= 0.8x base, graphed)  -> decode.json
#   2. tests: the Triton kernels vs the torch reference compiled on the GPU (forward and every
#      gradient, fp32/fp16/bf16 x rank x hidden x the 5 popularity patterns), and the learner
#      on CUDA (pinned swaps through the side copy stream bit-identical to training alone,
#      CUDA steps == CPU steps for SFT/DPO/RL with dropout, fused Triton steps == solo steps)
#   3. fused K-tenant training step vs K serial steps, K = 2, 4, 8, micro-batches 1, 2, 8
#      on SmolLM2's shapes (target: fused >= 2x serial at K = 8)            -> fused.json
#   4. the learner's swap cost on CUDA: synchronous swap, and exposed swap per step with and
#      without prefetch for 1, 2, 4, 8 tenants                               -> learner.json
#   5. kernel time: Triton vs per-adapter loop vs gathered bmm on SmolLM2's shapes, with
#      achieved memory bandwidth for decode-sized batches                    -> kernels.json
#   6. the megatron learner backend on NCCL in bf16, T = the GPUs present (1 on one H200):
#      step time against the default backend in bf16 on the same GPU   -> learner-megatron.json
# Each stage has its own time limit and a failing stage does not stop the next; STAGES picks
# some (default: all six). Stages run in the order of this file, whatever the order in STAGES.
# MODEL: the prepared SmolLM2 by default; any HF model directory with SmolLM2's config does
# for timing (gpu_session.sh makes one with random weights, since 540 MB cannot travel).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/gpu}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-smollm2}
STAGES=" ${STAGES:-decode tests fused learner kernels megatron} "
mkdir -p "$OUT"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log its output and status
    local name=$1 limit=$2
    shift 2
    [[ $STAGES == *" $name "* ]] || return 0
    echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee -a "$LOG"
stage decode 300 "$PY" benchmarks/bench_decode.py --device cuda --out "$OUT/decode.json"
stage tests 240 "$PY" -m pytest -m gpu tests/kernels tests/learner/test_cuda.py -q -p no:warnings \
    --junitxml="$OUT/junit.xml"
stage fused 150 "$PY" benchmarks/bench_fused.py --model "$MODEL" --device cuda --rounds 2 --spread 0.5 \
    --out "$OUT/fused.json"
stage learner 90 "$PY" benchmarks/bench_learner.py --model "$MODEL" --device cuda --steps 8 --batch 8 \
    --out "$OUT/learner.json"
stage kernels 120 "$PY" benchmarks/bench_kernels.py --out "$OUT/kernels.json"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)
stage megatron 150 "$PY" benchmarks/bench_learner.py --backend megatron --tp "$NGPU" --device cuda --dtype bfloat16 \
    --model "$MODEL" --steps 8 --batch 8 --tenants 1,4 --out "$OUT/learner-megatron.json"
grep '^=== .*exit' "$LOG"
