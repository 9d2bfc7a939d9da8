#!/usr/bin/env python3
"""Rewrite a GGUF with its weight matrices in another type: the same model for a kernel comparison.

    python benchmarks/convert_gguf.py SRC.gguf DST.gguf --type f32|f16|q8_0

Every tensor is dequantised to float32 (gguf.quants); 2-D weight matrices are then stored as --type, the
rest (norms, biases) as float32; every metadata field is copied, general.file_type updated. From a Q4_1
source, `--type f32` holds exactly the values llama.cpp computes with and kvpress loads (transformers
dequantises a GGUF to float32), so a time-to-answer comparison on it compares the engines, not the weight
formats; f16 and q8_0 round them once more. llama.cpp's CPU backend multiplies f32/f16 matrices with its
tinyBLAS GEMM and Q8_0 with its own kernels, where Q4_1 takes the generic `vec_dot_q4_1_q8_1` path.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import gguf
import numpy as np

FILE_TYPES = {"f32": (gguf.LlamaFileType.ALL_F32, None),
              "f16": (gguf.LlamaFileType.MOSTLY_F16, None),
              "q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0)}
SKIP = {"general.architecture", "general.file_type"}   # written by GGUFWriter / set below


def _copy_field(w: gguf.GGUFWriter, field) -> None:
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        w.add_key_value(field.name, list(field.contents()), vtype, sub_type=sub)
    else:
        w.add_key_value(field.name, field.contents(), vtype)


def convert(src: Path, dst: Path, kind: str) -> None:
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name in SKIP:
            continue
        _copy_field(w, field)
    file_type, qtype = FILE_TYPES[kind]
    w.add_file_type(int(file_type))
    for t in r.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if x.ndim < 2:
            w.add_tensor(t.name, x)
        elif kind == "f16":
            w.add_tensor(t.name, x.astype(np.float16))
        elif qtype is not None:
            w.add_tensor(t.name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(dst)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--type", choices=sorted(FILE_TYPES), default="f32")
    a = ap.parse_args(argv)
    convert(a.src, a.dst, a.type)
    print(f"{a.dst}: {a.dst.stat().st_size / 1e6:.1f} MB ({a.type})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
