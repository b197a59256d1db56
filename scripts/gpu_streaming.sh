#!/usr/bin/env bash
# Issue 6's proof on the lent H200 (after install-vllm.sh), each run its own process with a
# fresh engine. One device call (about 9 minutes): vlbatch W1 end to end (it pays the cold
# compile), raw vLLM with vlbatch's arguments, raw vLLM with its defaults, then the ratios
# (scripts/bench_ratios.py; whole-process ratios are fair only between warm runs). A second
# call on the same warm machine adds W3 and a repeat of the W1 pair (raw first this time);
# a third may try an engine setting (KEY=VALUE) on both sides.
# Results as JSON under $OUT.        needs .gpu/models/ (a copy of shared/models/)
#   bash scripts/gpu_streaming.sh [PAGES]
#   bash scripts/gpu_streaming.sh w3
#   bash scripts/gpu_streaming.sh setting max_num_batched_tokens=32768
set -uo pipefail
STAGE=w1; case "${1:-}" in w3|setting) STAGE=$1; shift;; esac
SETTING=""; [ $STAGE = setting ] && { SETTING=$1; shift; }
PAGES=${1:-400}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
MODEL=/tmp/models/qwen3-vl-30b-a3b
B="python3 scripts/bench_gpu.py"
step() {  # step NAME SECONDS COMMAND...: one bounded run, its last line shown
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s"; tail -1 "$OUT/$name.log" | cut -c1-400
}
if [ $STAGE = w1 ]; then
  python3 .gpu/models/make_model_dir.py 30b-a3b "$MODEL" >/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
  python3 scripts/make_pages.py /tmp/w1-pages "$PAGES" 10 > /dev/null
  $B job --model "$MODEL" --pages-dir /tmp/w1-pages --work /tmp/w1 --tasks 1 > /dev/null
  # the first run pays the cold compile; raw with vLLM's defaults compiles its own shapes
  step vlbatch-w1 220 $B vlbatch --job /tmp/w1/job.yaml
  step raw-vlbatch-args 120 $B raw --job /tmp/w1/job.yaml
  step raw-vllm-defaults 200 $B raw --job /tmp/w1/job.yaml --vllm-defaults
elif [ $STAGE = w3 ]; then
  $B job --model "$MODEL" --pages-dir /tmp/w1-pages --work /tmp/w4 --tasks 4 > /dev/null
  step vlbatch-w3 200 $B vlbatch --job /tmp/w4/job.yaml
  step raw-vlbatch-args-2 120 $B raw --job /tmp/w1/job.yaml
  step vlbatch-w1-2 130 $B vlbatch --job /tmp/w1/job.yaml
else  # a setting on both sides: new shapes may compile again, so each gets more time
  NAME=${SETTING%%=*}
  $B job --model "$MODEL" --pages-dir /tmp/w1-pages --work /tmp/w1s --tasks 1 \
    --engine "$SETTING" > /dev/null
  step "raw-$NAME" 200 $B raw --job /tmp/w1s/job.yaml
  step "vlbatch-w1-$NAME" 150 $B vlbatch --job /tmp/w1s/job.yaml
fi
python3 scripts/bench_ratios.py "$OUT" | tee "$OUT/ratios.txt"
echo "elapsed $SECONDS s"
