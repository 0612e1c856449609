#!/usr/bin/env bash
# Builds llama.cpp's llama-server twice from llama-cpp-python 0.3.36's sdist (the peer bench/peers.py measures):
#   native/  GGML_NATIVE=ON: everything this CPU has (AVX-512 here);
#   avx2/    GGML_NATIVE=OFF GGML_AVX2=ON GGML_FMA=ON GGML_F16C=ON, every AVX-512 option OFF: llama.cpp as it runs on
#            an AVX2 CPU (what `bench/peers.py --profile avx2` runs, through $LLAMA_SERVER_AVX2 or this folder).
# Usage: bench/build_llama_server.sh [native|avx2|both]   (default both; about 10 minutes each on 2 cores)
# Output: $LLAMA_BUILD_DIR (default ~/.cache/mindie-bench/llama.cpp)/{native,avx2}/bin/llama-server
set -euo pipefail
WHICH=${1:-both}
OUT=${LLAMA_BUILD_DIR:-$HOME/.cache/mindie-bench/llama.cpp}
VERSION=0.3.36
SRC="$OUT/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
mkdir -p "$OUT/src"
LLAMA_BUILD_DIR="$OUT" bash "$(dirname "$0")/../scripts/fetch-llama-cpp.sh" all  # the whole sdist, unpacked once
COMMON=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF)
build() {  # build NAME FLAGS...
  local name=$1; shift
  cmake -S "$SRC" -B "$OUT/build-$name" "${COMMON[@]}" "$@"
  cmake --build "$OUT/build-$name" --target llama-server -j "$(nproc)"
  mkdir -p "$OUT/$name/bin"
  cp "$OUT/build-$name/bin/llama-server" "$OUT/$name/bin/llama-server"
  echo "built $OUT/$name/bin/llama-server"
}
if [ "$WHICH" = native ] || [ "$WHICH" = both ]; then
  build native -DGGML_NATIVE=ON
fi
if [ "$WHICH" = avx2 ] || [ "$WHICH" = both ]; then
  build avx2 -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  # the avx2 build must hold no AVX-512 instruction (its zmm registers)
  if objdump -d "$OUT/avx2/bin/llama-server" | grep -q zmm; then
    echo "the avx2 llama-server uses AVX-512 registers" >&2
    exit 1
  fi
fi
