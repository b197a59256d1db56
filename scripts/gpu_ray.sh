#!/usr/bin/env bash
# Issue 9, for a multi-GPU kind (nvidia-h200-x2 or larger), after install-vllm.sh with Ray in
# the bundle (EXTRA_PKGS: ray and the dependencies the device lacks). W1 (400 A4 pages, one
# task, 256 tokens forced) with executor: ray on 1 GPU and on N GPUs, one vLLM actor per GPU,
# each its own process; pages/s of each and the ratio. On one H200 (2026-12-02) a 1-GPU run
# did not finish within 230 s on a cold compile cache (see docs/benchmarks.md).
#   bash scripts/gpu_ray.sh N [PAGES]
set -uo pipefail
N=${1:-2}; PAGES=${2:-400}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
MODEL=/tmp/models/qwen3-vl-30b-a3b
python3 .gpu/models/make_model_dir.py 30b-a3b "$MODEL" >/dev/null
python3 scripts/make_pages.py /tmp/w1-pages "$PAGES" 10 > /dev/null
for workers in 1 "$N"; do
  python3 scripts/bench_gpu.py job --model "$MODEL" --pages-dir /tmp/w1-pages --work /tmp/ray$workers \
    --tasks 1 --set executor=ray --set "ray={workers: $workers}" > /dev/null
  # the first run pays vLLM's cold compile (about 2 minutes) on a fresh machine
  timeout 400 python3 scripts/bench_gpu.py vlbatch --debug --job /tmp/ray$workers/job.yaml \
    --json "$OUT/ray-$workers-gpus.json" > "$OUT/ray-$workers-gpus.log" 2>&1
  echo "ray, $workers GPU(s): exit $?"; tail -1 "$OUT/ray-$workers-gpus.log"
done
