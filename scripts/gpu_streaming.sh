#!/usr/bin/env bash
# Issue 6's proof on the lent H200 (after install-vllm.sh): raw vLLM vs vlbatch, each run its
# own process with a fresh engine. Only warm runs are compared: the first run of an engine
# configuration on a machine compiles, and it is slower while it generates too (H200,
# 2026-12-03: 9.84 vs 10.98 pages/s), so each configuration first gets a short warm-up run.
# Stages, each one device call under 7 minutes; all but w1 and init expect a machine that
# ran w1 (the machine goes back 30 s after a call: chain them):
#   bash scripts/gpu_streaming.sh w1 [PAGES]   W1: raw with vlbatch's arguments, vlbatch
#   bash scripts/gpu_streaming.sh defaults     W3, then raw with vLLM's defaults
#   bash scripts/gpu_streaming.sh vllm-defaults  raw with vLLM's defaults, then vlbatch again
#   bash scripts/gpu_streaming.sh cudagraph    raw and vlbatch with the encoder's CUDA graphs
#   bash scripts/gpu_streaming.sh repeat       the W1 pair again, raw first; defaults again
#   bash scripts/gpu_streaming.sh setting KEY=VALUE   any engine setting, raw and vlbatch
#   bash scripts/gpu_streaming.sh init [PAGES]  vlbatch only, cold then warm (engine start)
# Results as JSON under $OUT, ratios from scripts/bench_ratios.py.
# Needs .gpu/models/ (a copy of shared/models/).
set -uo pipefail
STAGE=${1:-w1}; shift || true
source "$(dirname "$0")/gpu_common.sh"
WARMUP_PAGES=48
job() {  # job WORK TASKS [ENGINE SETTING]: a job file over the W1 pages
  $B job --model "$MODEL" --pages-dir /tmp/w1-pages --work "$1" --tasks "$2" \
    ${3:+--engine "$3"} > /dev/null
}
warm_up() {  # warm_up NAME JOB: compile this configuration on a few pages (not compared)
  step "warmup-$1" 240 $B vlbatch --job "$2" --fresh --limit $WARMUP_PAGES
}
set_up() {  # set_up PAGES: the model folder, the W1 pages and the job files
  python3 .gpu/models/make_model_dir.py 30b-a3b "$MODEL" > /dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
  python3 scripts/make_pages.py /tmp/w1-pages "$1" 10 > /dev/null
  job /tmp/w1 1; job /tmp/w4 4; job /tmp/w1c 1 cudagraph_mm_encoder=true
}
raw_vllm_defaults() {  # raw with vLLM's defaults, after its own warm-up (it compiles apart)
  step warmup-raw-vllm-defaults 200 $B raw --job /tmp/w1/job.yaml --vllm-defaults --limit $WARMUP_PAGES
  step raw-vllm-defaults 150 $B raw --job /tmp/w1/job.yaml --vllm-defaults
}
case $STAGE in
  w1|init)  # init: vlbatch only, cold then warm, for its engine start (cpu_busy_cores)
    set_up "${1:-400}"
    warm_up w1 /tmp/w1/job.yaml
    [ "$STAGE" = w1 ] && step raw-vlbatch-args 150 $B raw --job /tmp/w1/job.yaml
    step vlbatch-w1 170 $B vlbatch --job /tmp/w1/job.yaml --fresh ;;
  defaults)  # W3 shares W1's engine configuration, so it is warm already
    step vlbatch-w3 170 $B vlbatch --job /tmp/w4/job.yaml --fresh
    raw_vllm_defaults ;;
  vllm-defaults)  # raw with vLLM's defaults only; then the vlbatch run again
    raw_vllm_defaults
    step vlbatch-w1-2 170 $B vlbatch --job /tmp/w1/job.yaml --fresh ;;
  cudagraph)
    warm_up cudagraph /tmp/w1c/job.yaml
    step raw-cudagraph 150 $B raw --job /tmp/w1c/job.yaml
    step vlbatch-w1-cudagraph 170 $B vlbatch --job /tmp/w1c/job.yaml --fresh ;;
  repeat)
    step raw-vlbatch-args-2 150 $B raw --job /tmp/w1/job.yaml
    step vlbatch-w1-2 170 $B vlbatch --job /tmp/w1/job.yaml --fresh
    step raw-vllm-defaults-2 150 $B raw --job /tmp/w1/job.yaml --vllm-defaults ;;
  setting)
    NAME=${1%%=*}
    job /tmp/w1s 1 "$1"
    warm_up "$NAME" /tmp/w1s/job.yaml
    step "raw-$NAME" 150 $B raw --job /tmp/w1s/job.yaml
    step "vlbatch-w1-$NAME" 170 $B vlbatch --job /tmp/w1s/job.yaml --fresh ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
python3 scripts/bench_ratios.py "$OUT" | tee "$OUT/ratios.txt"
echo "elapsed $SECONDS s"
