#!/usr/bin/env bash
# Every GPU check in one run, for a CUDA host: the Triton kernel tests on the device, the kernel
# benchmarks (bench/kernels_gpu.py, bench/kernels_quant_gpu.py) and the engine's (bench/engine_gpu.py).
# Each step has its own time limit and log, so one that fails or hangs leaves the others' results.
#
#   bash bench/gpu_check.sh OUT_DIR [TOKENIZER_DIR] [ENGINE_SHAPES]
#
# TOKENIZER_DIR: a tokenizer folder for bench.engine_gpu (skipped without one); ENGINE_SHAPES: its --shapes.
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [TOKENIZER_DIR] [ENGINE_SHAPES]}
tokenizer=${2:-}
shapes=${3:-smollm2-135m}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}

step() {   # step NAME SECONDS COMMAND...: runs it, its output in OUT_DIR/NAME.log, and says how it ended
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? after $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $py -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} >"$out/steps.txt" 2>&1
step kernels_gpu 90 $py -m bench.kernels_gpu
step kernels_quant_gpu 120 $py -m bench.kernels_quant_gpu
# Compiling each kernel variant takes most of the tests' time: pytest-xdist, where it is installed, spreads it.
parallel=$($py -c "import xdist" 2>/dev/null && echo "-n 8")
step pytest_triton 120 $py -m pytest -v -p no:cacheprovider --timeout 110 $parallel -k "triton or Triton or graph" \
    tests/kernels/test_model_triton.py tests/kernels/test_paged_attention_triton.py \
    tests/kernels/test_elementwise_triton.py tests/kernels/test_quant_matmul_triton.py tests/kernels/test_kv_quant.py
if [ -n "$tokenizer" ]; then
    step engine_gpu 180 $py -m bench.engine_gpu --tokenizer "$tokenizer" --shapes "$shapes"
fi
