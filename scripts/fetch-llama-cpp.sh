#!/usr/bin/env bash
# Unpacks llama.cpp's own HF-to-GGUF converter (convert_hf_to_gguf.py, its conversion/ package and gguf-py) from
# llama-cpp-python's sdist, where the GGUF tests (plugins/models/tests/test_gguf_families.py, through
# mindie_host.testing.llama_cpp_converter) and bench/build_llama_server.sh look for llama.cpp's sources:
#   $LLAMA_BUILD_DIR (default ~/.cache/mindie-bench/llama.cpp)/src/llama_cpp_python-$VERSION/vendor/llama.cpp
# Usage: scripts/fetch-llama-cpp.sh [all]   (all: the whole sdist, as the llama-server build needs it)
set -euo pipefail
OUT=${LLAMA_BUILD_DIR:-$HOME/.cache/mindie-bench/llama.cpp}
VERSION=0.3.36
TOP="llama_cpp_python-$VERSION"
SRC="$OUT/src/$TOP/vendor/llama.cpp"
TARBALL="$OUT/src/$TOP.tar.gz"
mkdir -p "$OUT/src"
if [ ! -f "$TARBALL" ]; then
  "${PYTHON:-python3}" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT/src"
fi
if [ "${1:-}" = all ]; then
  [ -f "$SRC/CMakeLists.txt" ] || tar -xzf "$TARBALL" -C "$OUT/src"
elif [ ! -d "$SRC/conversion" ]; then
  tar -xzf "$TARBALL" -C "$OUT/src" "$TOP/vendor/llama.cpp/convert_hf_to_gguf.py" "$TOP/vendor/llama.cpp/conversion" \
    "$TOP/vendor/llama.cpp/gguf-py"
fi
echo "llama.cpp sources: $SRC"
