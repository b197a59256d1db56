#!/usr/bin/env bash
# On the lent H200 (after install-vllm.sh): the sample documents through `vlbatch run` with a
# dummy-weight Qwen3-VL-30B-A3B, then W1 (400 A4 pages, 1 task, 256 tokens forced): raw
# vLLM vs vlbatch end to end, each in its own process. Results go to $OUT.
# Needs .gpu/models/ (a copy of shared/models/).   bash scripts/gpu_proof.sh [PAGES]
set -uo pipefail
PAGES=${1:-400}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
MODEL=/tmp/models/qwen3-vl-30b-a3b
python3 .gpu/models/make_model_dir.py 30b-a3b "$MODEL" >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"

# 1. the samples, as a user runs them
cat > /tmp/samples-gpu.yaml <<EOF
name: samples-gpu
inputs: ["$PWD/data/samples/*"]
output: /tmp/samples-out
cache: /tmp/samples-cache
model: $MODEL
tasks:
  - {name: markdown, prompt: "Convert this page to Markdown.", max_tokens: 256}
  - {name: summary, prompt: "Summarise this page in one sentence. Its text layer: {text_layer}", max_tokens: 64}
engine: {load_format: dummy, max_model_len: 4096}
EOF
cp /tmp/samples-gpu.yaml "$OUT/"
( time python3 -m vlbatch run /tmp/samples-gpu.yaml ) > "$OUT/samples-run.txt" 2>&1
echo "samples exit $?" | tee -a "$OUT/samples-run.txt"; tail -25 "$OUT/samples-run.txt"
python3 -c "
import polars as pl; df = pl.read_parquet('/tmp/samples-out/results/*.parquet')
print(df.group_by('status','cached').len()); print(df.select('source','page','task','status','output_tokens').sort('source','page','task'))
" > "$OUT/samples-rows.txt" 2>&1; cat "$OUT/samples-rows.txt" | head -30

# 2. W1: raw vLLM vs vlbatch, fresh engine each
python3 scripts/make_pages.py /tmp/w1-pages "$PAGES" 10
python3 scripts/bench_gpu.py job --model "$MODEL" --pages-dir /tmp/w1-pages --work /tmp/w1 --tasks 1
python3 scripts/bench_gpu.py vlbatch --job /tmp/w1/job.yaml --json "$OUT/w1-vlbatch.json" > "$OUT/w1-vlbatch.log" 2>&1
tail -2 "$OUT/w1-vlbatch.log"
python3 scripts/bench_gpu.py raw --job /tmp/w1/job.yaml --json "$OUT/w1-raw.json" > "$OUT/w1-raw.log" 2>&1
tail -2 "$OUT/w1-raw.log"
echo "elapsed $SECONDS s"
