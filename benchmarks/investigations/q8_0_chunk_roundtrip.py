"""Issue #46: is the q8_0 book store's 1 of 6 at 31k (read in a q8_0 cache) the re-quantisation of the carried
keys at every re-indexing, or q8_0 chunk files as such?

    .venv/bin/python benchmarks/investigations/q8_0_chunk_roundtrip.py eval chat --model qwen2.5-coder-0.5b \\
        --policies snapkv --budgets 1024 --lengths 31k --documents 1 --facts 6 --modes bounded --threads 2 \\
        --seed 46 --json-out benchmarks/results/investigation-q8_0-roundtrip-31k.json

Runs the kvcli command given with one change: the document is read in the float16 cache asked for (`--cache-type`
left at f16), and every stored chunk's state is put through q8_0 and back (kvcli/native/state.py convert_chunk)
before it is written, so the chunk files hold what a q8_0 store's hold, quantised once, while the carried cache is
never quantised. Found (2026-11-29, commit 1aad7f1): 6 of 6, where the q8_0 cache had answered 1 of 6; kvcli now
reads a q8_0 store in float16 (chunked_store.store_types).
"""
import sys

from kvcli.drivers import chunked_store
from kvcli.native.state import F16, Q8_0, convert_chunk

_cells_from = chunked_store.cells_from


def through_q8_0(state, first_pos):
    chunk, cells, end = _cells_from(state, first_pos)
    return convert_chunk(convert_chunk(chunk, Q8_0), F16), cells, end


chunked_store.cells_from = through_q8_0   # the read's chunk files (BoundedStore.read)

if __name__ == "__main__":
    from kvcli.cli import main
    sys.argv = ["kvcli"] + sys.argv[1:]
    main()
