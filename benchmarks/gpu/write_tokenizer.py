"""Write a GGUF that holds only the default model's tokenizer.* keys (about 2 MB, no tensors).

    python benchmarks/gpu/write_tokenizer.py OUT.gguf

Tiny random models (kvcli.testing.tiny_gguf) copy their tokenizer from the default model; where its 98 MB cannot
travel (a lent GPU machine takes 64 MiB per call), $KVCLI_TINY_TOKENIZER=OUT.gguf gives them the same tokenizer.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gguf  # noqa: E402

from kvcli.testing.tiny_gguf import _default_tokenizer_source, _tokenizer_fields  # noqa: E402


def main(out: str) -> int:
    fields, _ = _tokenizer_fields(str(_default_tokenizer_source()))
    w = gguf.GGUFWriter(out, "llama")
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, vtype, sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{out}: {Path(out).stat().st_size} bytes, {len(fields)} tokenizer keys")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
