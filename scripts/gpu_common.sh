# Shared by the H200 scripts (gpu_streaming.sh, gpu_frontend.sh): the environment after
# install-vllm.sh, where results go, and one bounded benchmark step. Sourced, not run.
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
