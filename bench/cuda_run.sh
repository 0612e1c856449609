#!/usr/bin/env bash
# The CUDA half of the side-by-side benchmark, for a GPU machine with no network.
#
#   bench/cuda_run.sh [OUT_DIR]
#
# 1. installs mindie-host (and the prefix_cache plugin) editable, without dependencies;
#    Python wheels missing on the machine can wait in $WHEELS (installed into /tmp/site first);
# 2. runs the CUDA tests (tests/test_cuda.py, tests/test_decode_graphs.py); the tiny test model
#    takes its tokenizer from $MINDIE_HOST_TEST_TOKENIZER where the default model is not installed;
# 3. times a new attention shape per SDPA kernel choice (bench/cuda_sdpa_first_call.py);
# 4. writes a random SmolLM2-1.7B (bench/make_random_llama.py) and runs bench/peers.py on it:
#    mindie-host with CUDA graphs (bench/configs/peers-cuda.json), mindie-host eager (built-in
#    defaults), transformers serve --continuous-batching, and HF generate, at concurrency 1, 16, 64.
# Logs, the results JSON and the table land in OUT_DIR.
set -uo pipefail
out=${1:-${OUT:-/tmp/cuda-bench}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/prefix_cache >"$out/install.log" 2>&1 \
  || { echo "install failed"; tail -20 "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"

echo "== tests"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_decode_graphs.py \
  >"$out/tests.log" 2>&1
echo "tests rc=$?"; tail -5 "$out/tests.log"

echo "== attention kernels"
timeout 120 python3 bench/cuda_sdpa_first_call.py 2>&1 | grep -v Warning | tee "$out/sdpa.md"

echo "== benchmark"
model=/tmp/smollm2-1.7b-random
# the default model's tokenizer, or $TOKENIZER (an HF tokenizer directory) where that package is not installed
python3 bench/make_random_llama.py "$model" --device cuda ${TOKENIZER:+--tokenizer "$TOKENIZER"} 2>&1 | tail -1
timeout "${BENCH_TIMEOUT:-420}" python3 bench/peers.py --model "$model" --device cuda --dtype bfloat16 \
  --config bench/configs/peers-cuda.json --systems "${SYSTEMS:-mindie,mindie-defaults,transformers,hf-generate}" \
  --conc "${CONC:-1,16,64}" --start-timeout 240 --logs "$out" --out "$out/peers-cuda.json" 2>&1 | tee "$out/bench.log"
