#!/usr/bin/env bash
# The GPU checks of issues 11 and 12 in one run, for a lent GPU machine (the `device` tool):
#
#     run(command="bash tools/gpu_checks.sh", timeout_s=600)      # results under $OUT
#
# That machine has torch, triton and transformers but no internet and no weights, so every model is a
# random-weight model of a real shape (minivllm.bench.gpu_e2e writes it).  Each step has its own time box,
# so one slow part cannot eat the rest; summary.txt collects the last lines of each.  About 8 minutes on
# an H200.  A CPU dry run of the same steps: PYTHON=.venv/bin/python bash tools/gpu_checks.sh --dry-run
# (tiny model, about 1.5 minutes; it keeps the KV pool small, Triton's interpreter copies it at every launch).
set -u
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DRY=0; [ "${1:-}" = "--dry-run" ] && DRY=1
if [ $DRY = 1 ]; then
  export TRITON_INTERPRET=1; DEV=(--device cpu); ARCH=tiny; DT=float32; SCALE=0.02; SIM=(--scale 0.3)
  PARITY=(--max-prompt-len 48)
else
  DEV=(--device cuda); ARCH=llama-3.2-1b; DT=bfloat16; SCALE=1.0; SIM=(--scale 0.5); PARITY=()
fi

step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep its log, summarise
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $?" | tee -a "$OUT/summary.txt"
  grep -v "Warning\|warn(" "$OUT/$name.log" | tail -n 4 | sed 's/^/   /' | tee -a "$OUT/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  $PY -c "import triton; print('triton', triton.__version__)" 2>/dev/null; } > "$OUT/versions.txt" 2>&1

# 1. tests that only run on a GPU (CUDA-graph capture/replay, compiled Triton kernels), when pytest is there
if $PY -c "import pytest, hypothesis" 2>/dev/null && [ $DRY = 0 ]; then
  step tests 150 $PY -m pytest -q -x tests/test_cuda_graphs.py tests/test_triton_attention.py tests/test_cpu_linear.py
fi
# 2. issue 12: decode/prefill kernels against torch and against copy bandwidth (>= 80%)
[ $DRY = 0 ] && step attention 90 $PY -m minivllm.bench attention --json "$OUT/attention.json"
# 3. issue 12: nano-vllm's workload, minivllm (torch / triton backend, CUDA graphs / eager) vs HF generate
step e2e_nano 300 $PY -m minivllm.bench gpu_e2e --workload nano --arch $ARCH --dtype $DT "${DEV[@]}" \
     --scale $SCALE --json "$OUT/e2e_nano_$ARCH.json"
# 4. issue 12: torch and triton backends agree token for token (fp32 makes them exact enough to compare)
step e2e_parity 90 $PY -m minivllm.bench gpu_e2e --arch $ARCH --dtype float32 "${DEV[@]}" --prompts 8 \
     --max-tokens 32 "${PARITY[@]}" --json "$OUT/e2e_parity_fp32.json"
# 5. issue 11: calibrate the simulator on this GPU and validate it on the held-out workloads
step save_model 60 $PY -m minivllm.bench gpu_e2e --save-model "$OUT/model_$ARCH" --arch $ARCH
step sim_accuracy 240 $PY -m minivllm.bench sim_accuracy --model "$OUT/model_$ARCH" "${DEV[@]}" --dtype $DT \
     "${SIM[@]}" --out "$OUT/sim_accuracy_$ARCH.json" --save-profile "$OUT/profile_$ARCH.json"
rm -rf "$OUT/model_$ARCH"  # a 1B model is GBs: do not ship it back
echo "results in $OUT"
