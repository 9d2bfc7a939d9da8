#!/usr/bin/env bash
# The peer for benchmarks/time_to_answer.py: kvpress 0.5.5 in a venv of its own (never a dependency of kvcli).
#   bash benchmarks/setup_kvpress.sh [VENV]     (default /work/kvpress-venv, or $KVPRESS_VENV)
# torch is pinned to 2.13.0 first (the CPU wheel where pip finds one, as here; an unpinned resolve pulls
# the CUDA build, gigabytes);
# gguf lets transformers load the GGUF kvcli runs (dequantised to float32).
set -euo pipefail
VENV=${1:-${KVPRESS_VENV:-/work/kvpress-venv}}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "torch==2.13.0"
"$VENV/bin/pip" install --quiet "kvpress==0.5.5" gguf
"$VENV/bin/python" -c "import kvpress, torch, transformers; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'torch', torch.__version__, 'transformers', transformers.__version__)"
