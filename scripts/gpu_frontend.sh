#!/usr/bin/env bash
# Issue 16's proof on the lent H200 (after install-vllm.sh): raw vLLM as a user writes it vs
# vlbatch end to end, W1, each run its own process, GPU busy sampled (nvidia-smi).
#   bash scripts/gpu_frontend.sh raw [PAGES]    set-up; raw as shipped (16-page warm-up in
#                                               its engine)
#   bash scripts/gpu_frontend.sh vlbatch        vlbatch W1 with input threads (the default)
#   bash scripts/gpu_frontend.sh nothreads      vlbatch W1 without (frontend_threads 0)
#   bash scripts/gpu_frontend.sh w3             vlbatch W3 (4 tasks a page)
#   bash scripts/gpu_frontend.sh w1-fp32        vlbatch W1, pixels as the processor makes them
#                                               (engine.pixels_in_model_dtype false)
#   bash scripts/gpu_frontend.sh w1-fp8 | w3-fp8   vlbatch W1 / W3 with engine.quantization fp8
#   bash scripts/gpu_frontend.sh w3-fp8-kvfp8   W3, fp8 weights and fp8 KV cache (the most requests
#                                               decoding at once; vLLM's max_num_seqs on H100/H200
#                                               offline is 1024 already)
#   bash scripts/gpu_frontend.sh w3-kvfp8       W3, engine.kv_cache_dtype fp8 (bf16 weights)
#   bash scripts/gpu_frontend.sh w3-kvfp8-share W3, fp8 KV, a page's later tasks held for its
#                                               first (engine.share_image_prefix true), at most
#                                               32 pages' firsts not yet decoding
#   bash scripts/gpu_frontend.sh w3-kvfp8-share-k64 | -k128 | -k512   the same with
#                                               engine.max_pages_starting 64 (the default) / 128 /
#                                               512 (no bound on 400 pages, as on 2026-12-07 12:00)
#   bash scripts/gpu_frontend.sh w3-kvfp8-share-s512   the same, at most 512 requests running
#                                               (vLLM's largest CUDA graph: decode batches above
#                                               it run without graphs)
#   bash scripts/gpu_frontend.sh w3-short | w3-short-share   W3 with 32-token answers (prefill
#                                               bound), fp8 KV, without / with the hold
#   bash scripts/gpu_frontend.sh w1-if128       W1, engine.max_in_flight 128: requests enter the
#                                               engine as others finish, not in one burst
#   bash scripts/gpu_frontend.sh w1-moe | w3-moe   vlbatch W1 / W3 (defaults, W3 with fp8 KV)
#                                               with vLLM's tuned fused-MoE tile configs of
#                                               the H200 used on this GPU where vLLM ships none
#                                               for it (VLLM_TUNED_CONFIG_FOLDER)
#   bash scripts/gpu_frontend.sh w1-gmu95       vlbatch W1, gpu_memory_utilization 0.95
#   bash scripts/gpu_frontend.sh w3-gmu95       W3 (fp8 KV, held, K 64), gpu_memory_utilization 0.95
#   bash scripts/gpu_frontend.sh w3-profile | w1-profile   W3 K 64 / W1 with py-spy (carried in
#                                               .gpu/pyspy) on the engine core and the run for
#                                               20 s of generation: profile-*.txt (collapsed)
#   bash scripts/gpu_frontend.sh w1-gmu95-moe | w3-gmu95-moe   both levers at once
#   bash scripts/gpu_frontend.sh w3-bf16        W3 (fp8 KV, held, K 64) with bfloat16 pixels
#                                               (engine.pixels_in_model_dtype true): half the
#                                               bytes the engine core copies a step
#   bash scripts/gpu_frontend.sh raw-again      raw W1 once more (its engine start warm)
#   bash scripts/gpu_frontend.sh raw-w3         raw as shipped on W3 (4 prompts a page, a
#                                               page's together): vLLM's own W3 rate
#   bash scripts/gpu_frontend.sh w1-bf16        vlbatch W1, engine.pixels_in_model_dtype true
#   bash scripts/gpu_frontend.sh w1-nocompile   vlbatch W1, engine.compile_mm_encoder false
#   bash scripts/gpu_frontend.sh shm            vlbatch with mm_tensor_ipc torch_shm (vlbatch
#                                               sets VLLM_WORKER_MULTIPROC_METHOD=spawn for it)
#   bash scripts/gpu_frontend.sh raw2000        2,000 W1 pages: set-up and raw as shipped
#   bash scripts/gpu_frontend.sh setup2000      2,000 W1 pages: set-up only
#   bash scripts/gpu_frontend.sh vlbatch2000    vlbatch on the same 2,000 pages
#   bash scripts/gpu_frontend.sh shm2000        the same with mm_tensor_ipc torch_shm
#   bash scripts/gpu_frontend.sh inflight2000   the same with max_in_flight 1024
# Results as JSON under $OUT; ratios: python3 scripts/bench_ratios.py $OUT.
set -uo pipefail
STAGE=${1:-raw}; shift || true
source "$(dirname "$0")/gpu_common.sh"
job() {  # job WORK TASKS [ENGINE SETTING...]: a job file on the W1 pages
  local work=$1 tasks=$2; shift 2
  $B job --model "$MODEL" --pages-dir "${PAGES_DIR:-/tmp/w1-pages}" --work "$work" --tasks "$tasks" \
    --max-tokens "${MAX_TOKENS:-256}" \
    $(for kv in "$@"; do echo --engine "$kv"; done) > /dev/null
}
moe_configs_of_h200() {  # a folder of vLLM's H200 fused-MoE configs named for this GPU
  python3 - <<'PY'
import glob, os, shutil, torch, vllm
name = torch.cuda.get_device_name().replace(" ", "_")
src = os.path.join(os.path.dirname(vllm.__file__), "model_executor/layers/fused_moe/configs")
dst = "/tmp/moe-configs"; os.makedirs(dst, exist_ok=True)
for f in glob.glob(os.path.join(src, "*device_name=NVIDIA_H200*.json")):
    to = os.path.basename(f).replace("device_name=NVIDIA_H200", "device_name=" + name)
    if not os.path.exists(os.path.join(src, to)):
        shutil.copy(f, os.path.join(dst, to))
print(dst)
PY
}
profile_engine_core() {  # profile_engine_core LOG SECONDS: py-spy on vLLM's engine core and
  # the run's own process once LOG shows generation under way (collapsed stacks under $OUT)
  local log=$1 seconds=$2
  local spy=/tmp/pyspy/py-spy
  mkdir -p /tmp/pyspy
  python3 -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('.gpu/pyspy/*.whl')[0]); \
open('$spy', 'wb').write(z.read(next(n for n in z.namelist() if n.endswith('scripts/py-spy'))))"
  chmod +x "$spy"
  ( for _ in $(seq 600); do grep -q "progress .*[1-9][0-9]* generated" "$log" 2>/dev/null && break; sleep 0.5; done
    core=$(pgrep -f EngineCore | head -1); main=$(pgrep -f "^python3 scripts/bench_gpu.py vlbatch" | head -1)
    echo "engine core $core, main $main" > "$OUT/profile.txt"
    $spy record -d "$seconds" -r 50 --nonblocking --idle --threads --format raw -o "$OUT/profile-core.txt" -p "$core" >> "$OUT/profile.txt" 2>&1 &
    $spy record -d "$seconds" -r 50 --nonblocking --threads --format raw -o "$OUT/profile-main.txt" -p "$main" >> "$OUT/profile.txt" 2>&1
    wait ) &
}
case $STAGE in
  raw)
    python3 .gpu/models/make_model_dir.py 30b-a3b "$MODEL" > /dev/null
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
    nproc | tee -a "$OUT/gpu.txt"
    python3 scripts/make_pages.py /tmp/w1-pages "${1:-400}" 10 > /dev/null
    python3 scripts/processor_time.py "$MODEL" "$(ls /tmp/w1-pages/*.pdf | head -1)" | tee "$OUT/processor.txt"
    job /tmp/w1 1; job /tmp/w1-nothreads 1 frontend_threads=0; job /tmp/w3 4
    job /tmp/w1-shm 1 mm_tensor_ipc=torch_shm
    job /tmp/w1-fp32 1 pixels_in_model_dtype=false
    job /tmp/w1-nocompile 1 compile_mm_encoder=false
    job /tmp/w1-bf16 1 pixels_in_model_dtype=true
    job /tmp/w1-fp8 1 quantization=fp8; job /tmp/w3-fp8 4 quantization=fp8
    job /tmp/w3-fp8-kvfp8 4 quantization=fp8 kv_cache_dtype=fp8
    job /tmp/w3-kvfp8 4 kv_cache_dtype=fp8
    job /tmp/w1-if128 1 max_in_flight=128
    job /tmp/w1-gmu95 1 gpu_memory_utilization=0.95
    job /tmp/w3-gmu95 4 kv_cache_dtype=fp8 gpu_memory_utilization=0.95
    job /tmp/w3-bf16 4 kv_cache_dtype=fp8 pixels_in_model_dtype=true
    job /tmp/w3-kvfp8-share 4 kv_cache_dtype=fp8 share_image_prefix=true
    job /tmp/w3-kvfp8-share-s512 4 kv_cache_dtype=fp8 share_image_prefix=true max_num_seqs=512
    job /tmp/w3-kvfp8-share-k64 4 kv_cache_dtype=fp8 share_image_prefix=true max_pages_starting=64
    job /tmp/w3-kvfp8-share-k128 4 kv_cache_dtype=fp8 share_image_prefix=true max_pages_starting=128
    job /tmp/w3-kvfp8-share-k512 4 kv_cache_dtype=fp8 share_image_prefix=true max_pages_starting=512
    MAX_TOKENS=32 job /tmp/w3-short 4 kv_cache_dtype=fp8
    MAX_TOKENS=32 job /tmp/w3-short-share 4 kv_cache_dtype=fp8 share_image_prefix=true
    step raw-vllm-defaults 320 $B raw --job /tmp/w1/job.yaml --vllm-defaults --warmup 16 ;;
  vlbatch) step vlbatch-w1 260 $B vlbatch --job /tmp/w1/job.yaml --fresh ;;
  nothreads) step vlbatch-w1-nothreads 160 $B vlbatch --job /tmp/w1-nothreads/job.yaml --fresh ;;
  w3) step vlbatch-w3 330 $B vlbatch --job /tmp/w3/job.yaml --fresh ;;
  w1-fp8) step vlbatch-w1-fp8 260 $B vlbatch --job /tmp/w1-fp8/job.yaml --fresh ;;
  w3-fp8) step vlbatch-w3-fp8 330 $B vlbatch --job /tmp/w3-fp8/job.yaml --fresh ;;
  w1-if128) step vlbatch-w1-if128 260 $B vlbatch --job /tmp/w1-if128/job.yaml --fresh ;;
  w3-kvfp8) step vlbatch-w3-kvfp8 330 $B vlbatch --job /tmp/w3-kvfp8/job.yaml --fresh ;;
  w3-kvfp8-share) step vlbatch-w3-kvfp8-share 330 $B vlbatch --job /tmp/w3-kvfp8-share/job.yaml --fresh ;;
  w3-kvfp8-share-s512) step vlbatch-w3-kvfp8-share-s512 330 $B vlbatch --job /tmp/w3-kvfp8-share-s512/job.yaml --fresh ;;
  w3-kvfp8-share-k64) step vlbatch-w3-kvfp8-share-k64 330 $B vlbatch --job /tmp/w3-kvfp8-share-k64/job.yaml --fresh ;;
  w3-kvfp8-share-k128) step vlbatch-w3-kvfp8-share-k128 330 $B vlbatch --job /tmp/w3-kvfp8-share-k128/job.yaml --fresh ;;
  w3-kvfp8-share-k512) step vlbatch-w3-kvfp8-share-k512 330 $B vlbatch --job /tmp/w3-kvfp8-share-k512/job.yaml --fresh ;;
  w3-short) step vlbatch-w3-short 260 $B vlbatch --job /tmp/w3-short/job.yaml --fresh ;;
  w3-short-share) step vlbatch-w3-short-share 260 $B vlbatch --job /tmp/w3-short-share/job.yaml --fresh ;;
  w3-fp8-kvfp8) step vlbatch-w3-fp8-kvfp8 330 $B vlbatch --job /tmp/w3-fp8-kvfp8/job.yaml --fresh ;;
  w1-fp32) step vlbatch-w1-fp32 180 $B vlbatch --job /tmp/w1-fp32/job.yaml --fresh ;;
  raw-w3) step raw-vllm-defaults-w3 380 $B raw --job /tmp/w3/job.yaml --vllm-defaults --warmup 16 ;;
  w1-bf16) step vlbatch-w1-bf16 200 $B vlbatch --job /tmp/w1-bf16/job.yaml --fresh ;;
  w1-nocompile) step vlbatch-w1-nocompile 200 $B vlbatch --job /tmp/w1-nocompile/job.yaml --fresh ;;
  w1-moe) moe_dir=$(moe_configs_of_h200) && VLLM_TUNED_CONFIG_FOLDER=$moe_dir \
      step vlbatch-w1-moe 260 $B vlbatch --job /tmp/w1/job.yaml --fresh ;;
  w3-moe) moe_dir=$(moe_configs_of_h200) && VLLM_TUNED_CONFIG_FOLDER=$moe_dir \
      step vlbatch-w3-moe 330 $B vlbatch --job /tmp/w3-kvfp8-share-k64/job.yaml --fresh ;;
  w1-gmu95-moe) moe_dir=$(moe_configs_of_h200) && VLLM_TUNED_CONFIG_FOLDER=$moe_dir \
      step vlbatch-w1-gmu95-moe 260 $B vlbatch --job /tmp/w1-gmu95/job.yaml --fresh ;;
  w3-gmu95-moe) moe_dir=$(moe_configs_of_h200) && VLLM_TUNED_CONFIG_FOLDER=$moe_dir \
      step vlbatch-w3-gmu95-moe 330 $B vlbatch --job /tmp/w3-gmu95/job.yaml --fresh ;;
  w3-bf16) step vlbatch-w3-bf16 330 $B vlbatch --job /tmp/w3-bf16/job.yaml --fresh ;;
  w3-gmu95) step vlbatch-w3-gmu95 330 $B vlbatch --job /tmp/w3-gmu95/job.yaml --fresh ;;
  w3-profile) profile_engine_core "$OUT/vlbatch-w3-profile.log" 20
      step vlbatch-w3-profile 330 $B vlbatch --job /tmp/w3-kvfp8-share-k64/job.yaml --fresh; wait ;;
  w1-profile) profile_engine_core "$OUT/vlbatch-w1-profile.log" 15
      step vlbatch-w1-profile 260 $B vlbatch --job /tmp/w1/job.yaml --fresh; wait ;;
  w1-gmu95) step vlbatch-w1-gmu95 260 $B vlbatch --job /tmp/w1-gmu95/job.yaml --fresh ;;
  raw-again) step raw-vllm-defaults-2 380 $B raw --job /tmp/w1/job.yaml --vllm-defaults --warmup 16 ;;
  shm)
    step vlbatch-w1-shm 220 $B vlbatch --job /tmp/w1-shm/job.yaml --fresh ;;
  raw2000)
    python3 scripts/make_pages.py /tmp/w1-2000-pages 2000 10 > /dev/null
    PAGES_DIR=/tmp/w1-2000-pages job /tmp/w1-2000 1
    PAGES_DIR=/tmp/w1-2000-pages job /tmp/w1-2000-shm 1 mm_tensor_ipc=torch_shm
    PAGES_DIR=/tmp/w1-2000-pages job /tmp/w1-2000-if1024 1 max_in_flight=1024
    step raw-vllm-defaults-2000 560 $B raw --job /tmp/w1-2000/job.yaml --vllm-defaults --warmup 16 ;;
  setup2000)
    python3 scripts/make_pages.py /tmp/w1-2000-pages 2000 10 > /dev/null
    PAGES_DIR=/tmp/w1-2000-pages job /tmp/w1-2000 1 ;;
  vlbatch2000) step vlbatch-w1-2000 560 $B vlbatch --job /tmp/w1-2000/job.yaml --fresh ;;
  shm2000) step vlbatch-w1-2000-shm 560 $B vlbatch --job /tmp/w1-2000-shm/job.yaml --fresh ;;
  inflight2000) step vlbatch-w1-2000-if1024 560 $B vlbatch --job /tmp/w1-2000-if1024/job.yaml --fresh ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
python3 scripts/bench_ratios.py "$OUT" 2>/dev/null | tee "$OUT/ratios.txt"
for f in "$OUT"/*.json; do python3 -c "import json,sys; d=json.load(open('$f')); print('$(basename $f)', {k: d.get(k) for k in ('pages','pages_per_s','generation_s','generate_s','engine_start_s','gpu_busy_pct','gpu_busy_pct_window','process_s','first_request_processing_s','errors')})"; done
echo "elapsed $SECONDS s"
