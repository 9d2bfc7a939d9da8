# Sourced (bash) by the device scripts, from the repo root on the lent machine: unpacks what pack.sh put in .gpu/
# (the CUDA build into /tmp/kv/lib, the bindings and pure-Python wheels into /tmp/site) and sets the environment.
# The machine has Python 3.12 with numpy, torch, click, pytest but no network: the rest comes from .gpu/.
# A later call on the same warm machine, without .gpu/ (a carried path does not stay between calls; /tmp does):
# the first call's /tmp set-up is used as it is, and the code is the working tree's (SRC).
G=$PWD/.gpu
if [ -f "$G/lib.tar.xz" ]; then
    mkdir -p /tmp/kv/lib /tmp/site
    tar -xJf "$G/lib.tar.xz" -C /tmp/kv/lib || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$G"/whl/*.whl || return 1
    cp -r "$G/site/llama_cpp" /tmp/site/
    SRC=$G/src
elif [ -f /tmp/kv/lib/libllama.so ] && [ -d /tmp/site/llama_cpp ]; then
    SRC=$PWD
else
    echo "device_env.sh: neither .gpu/ (benchmarks/gpu/pack.sh) nor an earlier call's /tmp set-up" >&2; return 1
fi
# cudart / cuBLAS of the machine's CUDA 13 (toolkit or NVIDIA's wheels): the build's rpath names this machine's
# toolkit folder and the build machine's wheel folder
LIBS=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt -name 'libcublas.so.13*' -o -name 'libcudart.so.13*' \
       2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
export PYTHONPATH="/tmp/site:$SRC" KVCLI_LIB_DIR=/tmp/kv/lib KVCLI_TINY_TOKENIZER="$G/tokenizer.gguf"
export PYTHONUNBUFFERED=1
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ldd /tmp/kv/lib/libggml-cuda.so | grep -E "cuda|cublas|not found"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || echo "(no nvidia-smi: no GPU here)"
