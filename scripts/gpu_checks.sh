#!/usr/bin/env bash
# GPU checks and benchmarks on one H200; results go to $OUT (or ./out). Usage:
#   bash scripts/gpu_checks.sh [tests] [offline L] [serve L QUANT]
# Each step prints the exact command it ran into its result file.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export M3SERVE_CACHE=/tmp/m3cache
step() { local name=$1; shift; echo "\$ $*" > "$OUT/$name.txt"; ( "$@" ) >> "$OUT/$name.txt" 2>&1; echo "[$name rc=$?]" >> "$OUT/$name.txt"; }
case "${1:-tests}" in
  tests)
    step kernel_tests timeout 240 python -m pytest tests/kernels -q -m gpu -p no:cacheprovider
    step model_gpu_tests timeout 300 python -m pytest tests/model/test_gpu_model.py -q -m gpu -s -p no:cacheprovider ;;
  offline)
    L=${2:-4}
    python -m m3serve bench make-realshape /tmp/rs$L --layers $L > /dev/null
    step offline_L$L timeout 420 python -m m3serve bench offline --model /tmp/rs$L --load-format dummy \
      --points 1024:1,8,32 8192:4,16,64 --osl 64 --max-model-len 9472 \
      --max-num-seqs 64 --max-num-batched-tokens 16384 ${3:+--quantization $3} ;;
esac
