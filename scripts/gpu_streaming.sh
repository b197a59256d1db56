#!/usr/bin/env bash
# On the lent H200 (after install-vllm.sh), issue 6's proof in two device calls on one warm
# machine, each step its own process with a fresh engine, results as JSON under $OUT:
#   bash scripts/gpu_streaming.sh a [PAGES]   raw vLLM with its defaults (cold compile cache),
#                                             raw with vlbatch's arguments, the same with the
#                                             vision encoder compiled, vlbatch W1
#   bash scripts/gpu_streaming.sh b           vlbatch W1 with the vision encoder compiled, W3
# Needs .gpu/models/ (a copy of shared/models/).
set -uo pipefail
STAGE=${1:-a}; PAGES=${2:-400}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
MODEL=/tmp/models/qwen3-vl-30b-a3b
B="python3 scripts/bench_gpu.py"
step() {  # step NAME SECONDS COMMAND...: one bounded run, its last lines shown
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s"; tail -1 "$OUT/$name.log"
}
if [ "$STAGE" = a ]; then
  python3 .gpu/models/make_model_dir.py 30b-a3b "$MODEL" >/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
  python3 scripts/make_pages.py /tmp/w1-pages "$PAGES" 10 > /dev/null
  for name in w1 w1-mmc; do
    extra=(); [ $name = w1-mmc ] && extra=(--engine compile_mm_encoder=true)
    $B job --model "$MODEL" --pages-dir /tmp/w1-pages --work /tmp/$name --tasks 1 "${extra[@]}" > /dev/null
    rm -rf /tmp/$name/out /tmp/$name/cache
  done
  step raw-vllm-defaults 220 $B raw --job /tmp/w1/job.yaml --vllm-defaults
  step raw-vlbatch-args 140 $B raw --job /tmp/w1/job.yaml
  step raw-vlbatch-args-mmc 170 $B raw --job /tmp/w1-mmc/job.yaml
else
  step vlbatch-w1 150 $B vlbatch --job /tmp/w1/job.yaml
  step vlbatch-w1-mmc 150 $B vlbatch --job /tmp/w1-mmc/job.yaml
  $B job --model "$MODEL" --pages-dir /tmp/w1-pages --work /tmp/w3 --tasks 4 > /dev/null
  step vlbatch-w3 200 $B vlbatch --job /tmp/w3/job.yaml
fi
echo "stage $STAGE elapsed $SECONDS s"
