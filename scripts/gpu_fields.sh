#!/usr/bin/env bash
# Issue 18 on the lent H200 (after install-vllm.sh): a schema task through vLLM 0.26's
# structured outputs (xgrammar), end to end into typed fields, against the same task
# without its schema; each run its own process and engine, the same pages.
#   bash scripts/gpu_fields.sh [PAGES]      (default 200 W1 pages)
# Results as JSON under $OUT (fields-*.json), the fields table's schema in fields-table.txt.
# The bundle (../shared/device/fetch-vllm.sh) needs, beyond vLLM's own set: EXTRA_PKGS=
#   "pymupdf==1.28.2 polars==2.1.0 polars-runtime-32==2.1.0 diskcache==5.6.3 imagehash==4.3.2
#   pywavelets==1.10.0 pebble==5.2.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
#   referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 lm-format-enforcer==0.11.3
#   interegular==0.3.3 outlines_core==0.2.14 deltalake==1.6.6 arro3-core==0.9.1 deprecated==1.3.1
#   pypdfium2==5.15.2
#   wrapt==2.5.2"  (deltalake: the output tables; its abi3 wheel fits the device's pyarrow 25
#   and Python 3.12) (vLLM 0.26 imports the last three for every
#   structured request, whatever the backend), PART_MB=58: two parts. The run report's plots
#   need "matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1
#   pyparsing==3.3.3" too where the image lacks them (without, a run warns and writes no report).
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
PAGES=${1:-200}
python3 .gpu/models/make_model_dir.py 30b-a3b "$MODEL" > /dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import vllm, torch, importlib.metadata as m; print('vllm', vllm.__version__, 'torch', torch.__version__, 'xgrammar', m.version('xgrammar'))" | tee -a "$OUT/gpu.txt"
python3 scripts/make_pages.py /tmp/w1-pages "$PAGES" 10 > /dev/null
for kind in ${KINDS:-schema free}; do  # KINDS=schema: the schema run only
  $B job --model "$MODEL" --pages-dir /tmp/w1-pages --work "/tmp/$kind" --answers "$kind" > /dev/null
  step "fields-$kind" 250 $B vlbatch --job "/tmp/$kind/job.yaml" --fresh
done
python3 - <<'PY' | tee "$OUT/fields-table.txt"
import glob, polars as pl
parts = glob.glob("/tmp/schema/out/fields/invoice/*.parquet")
print("fields parts", len(parts))
if parts:
    df = pl.read_parquet(parts)
    print(df.schema)
    print(df.select("vendor", "total", "date", "paid", "currency").head(5))
res = pl.read_parquet("/tmp/schema/out/results/*.parquet")
print(res.group_by("status", "finish_reason", "attempt").len().sort("len", descending=True))
print(res.group_by(pl.col("error").str.slice(0, 60)).len().sort("len", descending=True).head(8))
print(res.filter(pl.col("status") == "ok").select("output").head(3))
print(res.filter(pl.col("status") == "error").select("error_output").head(3))
print(res.select(pl.col("output_tokens").mean().alias("mean output tokens")))
PY
for f in "$OUT"/fields-*.json; do python3 -c "import json; d=json.load(open('$f')); print('$(basename $f)', {k: d.get(k) for k in ('pages','pages_per_s','generation_s','engine_start_s','output_tokens','output_tokens_per_s','rows_ok','rows_error','retried','bad_answers','fields_rows','gpu_busy_pct','errors')})"; done
echo "elapsed $SECONDS s"
