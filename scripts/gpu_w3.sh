#!/usr/bin/env bash
# On the H200, after gpu_proof.sh in the same warm machine: W3 (the W1 pages, 4 tasks each)
# through vlbatch end to end. Compare its requests/s with raw vLLM's W1 requests/s.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
python3 scripts/bench_gpu.py job --model /tmp/models/qwen3-vl-30b-a3b --pages-dir /tmp/w1-pages --work /tmp/w3 --tasks 4
python3 scripts/bench_gpu.py vlbatch --job /tmp/w3/job.yaml --json "$OUT/w3-vlbatch.json" > "$OUT/w3-vlbatch.log" 2>&1
tail -2 "$OUT/w3-vlbatch.log"
