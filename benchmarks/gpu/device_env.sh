# Sourced (bash) by the device scripts, from the repo root on the lent machine: unpacks what pack.sh put in .gpu/
# (the CUDA build into /tmp/kv/lib, the bindings and pure-Python wheels into /tmp/site) and sets the environment.
# The machine has Python 3.12 with numpy, torch, click, pytest but no network: the rest comes from .gpu/.
G=$PWD/.gpu
mkdir -p /tmp/kv/lib /tmp/site
tar -xJf "$G/lib.tar.xz" -C /tmp/kv/lib || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$G"/whl/*.whl || return 1
cp -r "$G/site/llama_cpp" /tmp/site/
# cudart / cuBLAS of the machine's CUDA 13 (toolkit or NVIDIA's wheels): the build's rpath names this machine's
# toolkit folder and the build machine's wheel folder
LIBS=$(find /usr/local/cuda*/ /usr/lib/x86_64-linux-gnu /opt -name 'libcublas.so.13*' -o -name 'libcudart.so.13*' \
       2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
export PYTHONPATH="/tmp/site:$G/src" KVCLI_LIB_DIR=/tmp/kv/lib KVCLI_TINY_TOKENIZER="$G/tokenizer.gguf"
export PYTHONUNBUFFERED=1
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ldd /tmp/kv/lib/libggml-cuda.so | grep -E "cuda|cublas|not found"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || echo "(no nvidia-smi: no GPU here)"
