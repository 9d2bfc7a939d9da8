#!/usr/bin/env bash
# Packs what a lent GPU machine needs into .gpu/ (ignored by git through .git/info/exclude; the device tool's
# `carry`): the CUDA build of the patched library (xz), llama-cpp-python's Python bindings and the pure-Python
# wheels the machine lacks (gguf, diskcache), the default model's tokenizer (tiny test models copy it), and a
# snapshot of kvcli, its tests and benchmarks at COMMIT, or as the working tree has them (COMMIT = worktree): the
# Python code the library was built with (the build copies native/ from the working tree).
#   benchmarks/gpu/pack.sh LIB_DIR [COMMIT|worktree]        e.g. benchmarks/gpu/pack.sh /work/gpu/lib HEAD
# Then, on the device: bash .gpu/src/benchmarks/gpu/run_on_device.sh (results under $OUT).
set -euo pipefail
cd "$(dirname "$0")/../.."
LIB=${1:?LIB_DIR: a CUDA build, e.g. KVCLI_LIB_DIR=DIR python -m kvcli.native.build --cuda --cuda-arch 90}
COMMIT=${2:-HEAD}
VPY=.venv/bin/python
rm -rf .gpu/src .gpu/site .gpu/whl .gpu/lib.tar.xz
mkdir -p .gpu/src .gpu/site .gpu/whl
if [ "$COMMIT" = worktree ]; then
    git ls-files -co --exclude-standard kvcli benchmarks tests examples pytest.ini | tar -cf - -T - | tar -x -C .gpu/src
else
    git archive "$COMMIT" kvcli benchmarks tests examples pytest.ini | tar -x -C .gpu/src
fi
tar -cJf .gpu/lib.tar.xz -C "$LIB" .
# (found, not imported: importing the bindings loads a library)
SITE=$($VPY -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llama_cpp').origin).parent)")
cp -r "$SITE" .gpu/site/llama_cpp && rm -rf .gpu/site/llama_cpp/__pycache__ .gpu/site/llama_cpp/lib
v() { $VPY -c "import importlib.metadata as m; print(m.version('$1'))"; }
$VPY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .gpu/whl \
    "gguf==$(v gguf)" "diskcache==$(v diskcache)"
$VPY benchmarks/gpu/write_tokenizer.py .gpu/tokenizer.gguf
du -sh .gpu/* | sort -h
