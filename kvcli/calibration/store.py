"""Calibration results in GGUF: a small side-car file of `kvcli.*` metadata keys next to the model.

Why a side-car and not a copy of the model with the keys added: the result is a few kB, the model
is 100 MB to many GB; a copy doubles the disk use, must be redone for every re-calibration and
hides which file is the original. The side-car is itself a valid GGUF (architecture
"kvcli-calibration", no tensors), so `gguf`/`gguf-dump` read it, and the very same keys are also
honoured when found inside a model file (someone may add them with gguf's metadata tools).

Where kvcli looks for a model's calibration, first match wins:
  1. $KVCLI_CALIBRATION (a side-car path, for experiments);
  2. `kvcli.calibration.*` keys inside the model file itself;
  3. `<model without .gguf>.kvcal.gguf` next to the model (what `kvcli calibrate` writes);
  4. the user cache `$KVCLI_CACHE/calibration/` (default ~/.cache/kvcli; used when the model's
     folder is read-only) and the calibrations shipped in kvcli/data/, matched by model hash.
A file found by 1-3 that belongs to another model (other shapes or another model hash) is refused
with a clear message, never used and never skipped silently.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcli.errors import KvcliError
from kvcli.models import model_hash, read_model_info

FORMAT = 1                  # layout of the keys below; bump when it changes
METHOD_VERSION = 1          # the compresskv calibration procedure (kvcli/calibration/); bump when results change
ARCH = "kvcli-calibration"
SUFFIX = ".kvcal.gguf"
K = "kvcli.calibration."
C = "kvcli.compresskv."
DATA_DIR = Path(__file__).resolve().parents[1] / "data"


@dataclass
class Calibration:
    """What `kvcli calibrate compresskv` found for one model."""

    model_hash: str
    model_name: str
    n_layer: int
    n_head: int
    n_head_kv: int
    head_scores: np.ndarray              # float64 [n_layer, n_head]: mean span attention over successful probes
    layer_scores: np.ndarray             # float64 [n_layer]: normalised error profile, sums to 1
    probes: int                          # needle probes run
    probes_ok: int                       # ... of which the model answered (only these score heads)
    settings: dict = field(default_factory=dict)
    kvcli_version: str = ""
    method_version: int = METHOD_VERSION
    created: str = ""
    seconds: float = 0.0
    source: str = ""                     # the file it was read from ("" before writing)

    def srh(self, k: int) -> list[int]:
        """The top-k query heads of each layer (best first, ties to the lower head), flattened."""
        if k > self.n_head:
            raise KvcliError(f"policy 'compresskv': srh_k={k} is more than the model's {self.n_head} query heads")
        return [int(h) for h in rank_heads(self.head_scores)[:, :k].reshape(-1)]

    def summary(self) -> str:
        heads = f"{self.probes_ok}/{self.probes} probes answered"
        return (f"compresskv (method v{self.method_version}, kvcli {self.kvcli_version or '?'}, {heads}, "
                f"{self.seconds / 60:.1f} min) from {self.source or '?'}")

    def as_json(self) -> dict:
        return {"method": "compresskv", "method_version": self.method_version, "kvcli_version": self.kvcli_version,
                "created": self.created, "seconds": self.seconds, "source": self.source,
                "model": {"hash": self.model_hash, "name": self.model_name, "n_layer": self.n_layer,
                          "n_head": self.n_head, "n_head_kv": self.n_head_kv},
                "probes": self.probes, "probes_ok": self.probes_ok, "settings": self.settings,
                "layer_scores": self.layer_scores.tolist(), "head_scores": self.head_scores.tolist()}


# ---------------------------------------------------------------------------------------- writing
def rank_heads(scores: np.ndarray) -> np.ndarray:
    """Per layer, the query heads by descending score (ties: lower head first) -> int [n_layer, n_head]."""
    return np.stack([np.argsort(-row, kind="stable") for row in np.asarray(scores, dtype=np.float64)])


def write(cal: Calibration, path: Path) -> Path:
    """Write the side-car atomically: a temporary file in the same folder, then a rename."""
    import gguf  # noqa: PLC0415
    path = Path(path)
    validate(cal, str(path))
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        w = gguf.GGUFWriter(str(tmp), ARCH)
        T = gguf.GGUFValueType
        w.add_uint32(K + "format", FORMAT)
        w.add_string(K + "method", "compresskv")
        w.add_uint32(K + "method_version", int(cal.method_version))
        w.add_string(K + "kvcli_version", cal.kvcli_version)
        w.add_string(K + "created", cal.created)
        w.add_float64(K + "seconds", float(cal.seconds))
        w.add_string(K + "model.hash", cal.model_hash)
        w.add_string(K + "model.name", cal.model_name)
        w.add_uint32(K + "model.n_layer", cal.n_layer)
        w.add_uint32(K + "model.n_head", cal.n_head)
        w.add_uint32(K + "model.n_head_kv", cal.n_head_kv)
        w.add_key_value(C + "head_scores", [float(x) for x in cal.head_scores.reshape(-1)], T.ARRAY, T.FLOAT64)
        w.add_key_value(C + "layer_scores", [float(x) for x in cal.layer_scores], T.ARRAY, T.FLOAT64)
        w.add_uint32(C + "probes", int(cal.probes))
        w.add_uint32(C + "probes_ok", int(cal.probes_ok))
        w.add_string(C + "settings", json.dumps(cal.settings, sort_keys=True))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# ---------------------------------------------------------------------------------------- reading
def read(path: Path) -> Calibration:
    """Read and check a side-car (or a model carrying the keys); KvcliError for anything wrong."""
    import gguf  # noqa: PLC0415
    path = Path(path)
    if not path.is_file():
        raise KvcliError(f"calibration file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # the reader raises many kinds for a damaged file
        raise KvcliError(f"calibration file {path} is not a readable GGUF (truncated or corrupted?): "
                         f"{str(e).splitlines()[0][:160]}") from None
    return from_fields(_fields(reader, path), str(path))


def _fields(reader, path) -> dict:
    out = {}
    for name, f in reader.fields.items():
        if name.startswith("kvcli."):
            try:
                out[name] = f.contents()
            except Exception:
                raise KvcliError(f"calibration file {path}: key {name} cannot be decoded (corrupted?)") from None
    return out


def from_fields(f: dict, source: str) -> Calibration:
    """Build a Calibration from `kvcli.*` key values (as gguf's field.contents() returns them)."""
    def get(key, kind):
        if key not in f:
            raise KvcliError(f"calibration {source}: key {key} is missing (not a kvcli compresskv calibration, or "
                             "written by another kvcli version)")
        v = f[key]
        ok = {"int": isinstance(v, int) and not isinstance(v, bool), "str": isinstance(v, str),
              "num": isinstance(v, (int, float)) and not isinstance(v, bool),
              "list": isinstance(v, list)}[kind]
        if not ok:
            raise KvcliError(f"calibration {source}: key {key} holds {type(v).__name__}, expected {kind} (corrupted?)")
        return v

    fmt = get(K + "format", "int")
    if fmt != FORMAT:
        raise KvcliError(f"calibration {source} has format {fmt}; this kvcli reads format {FORMAT}: re-run "
                         "kvcli calibrate compresskv")
    method = get(K + "method", "str")
    if method != "compresskv":
        raise KvcliError(f"calibration {source} is for method '{method}', not compresskv")
    n_layer, n_head = get(K + "model.n_layer", "int"), get(K + "model.n_head", "int")
    try:
        settings = json.loads(get(C + "settings", "str"))
    except json.JSONDecodeError:
        raise KvcliError(f"calibration {source}: key {C}settings is not valid JSON (corrupted?)") from None
    cal = Calibration(
        model_hash=get(K + "model.hash", "str"), model_name=get(K + "model.name", "str"), n_layer=n_layer,
        n_head=n_head, n_head_kv=get(K + "model.n_head_kv", "int"),
        head_scores=_array(get(C + "head_scores", "list"), source, "head_scores"),
        layer_scores=_array(get(C + "layer_scores", "list"), source, "layer_scores"),
        probes=get(C + "probes", "int"), probes_ok=get(C + "probes_ok", "int"), settings=settings,
        kvcli_version=get(K + "kvcli_version", "str"), method_version=get(K + "method_version", "int"),
        created=get(K + "created", "str"), seconds=float(get(K + "seconds", "num")), source=source)
    if cal.head_scores.size == n_layer * n_head:
        cal.head_scores = cal.head_scores.reshape(n_layer, n_head)
    validate(cal, source)
    return cal


def _array(v, source, name) -> np.ndarray:
    try:
        a = np.asarray(v, dtype=np.float64)
    except (TypeError, ValueError):
        raise KvcliError(f"calibration {source}: {name} holds non-numbers (corrupted?)") from None
    return a


def validate(cal: Calibration, source: str) -> None:
    """Every value inside its range; KvcliError naming the first one that is not."""
    where = f"calibration {source}"
    if not (0 < cal.n_layer < 100000 and 0 < cal.n_head < 100000 and 0 < cal.n_head_kv <= cal.n_head):
        raise KvcliError(f"{where}: impossible model shape {cal.n_layer} layers, {cal.n_head} heads, "
                         f"{cal.n_head_kv} KV heads (corrupted?)")
    hs = np.asarray(cal.head_scores)
    if hs.shape != (cal.n_layer, cal.n_head):
        raise KvcliError(f"{where}: head_scores has {hs.size} values, expected {cal.n_layer} layers x "
                         f"{cal.n_head} heads (corrupted?)")
    if not np.all(np.isfinite(hs)) or np.any(hs < 0):
        raise KvcliError(f"{where}: head_scores must be finite and >= 0 (corrupted?)")
    ls = np.asarray(cal.layer_scores)
    if ls.shape != (cal.n_layer,):
        raise KvcliError(f"{where}: layer_scores has {ls.size} values, expected {cal.n_layer} (corrupted?)")
    if not np.all(np.isfinite(ls)) or np.any(ls < 0) or abs(float(ls.sum()) - 1.0) > 1e-6:
        raise KvcliError(f"{where}: layer_scores must be finite, >= 0 and sum to 1 (they sum to "
                         f"{float(ls.sum()):.6g}; corrupted?)")
    if not (0 <= cal.probes_ok <= cal.probes):
        raise KvcliError(f"{where}: {cal.probes_ok} successful probes out of {cal.probes} (corrupted?)")
    if not math.isfinite(cal.seconds) or cal.seconds < 0:
        raise KvcliError(f"{where}: bad duration {cal.seconds} (corrupted?)")


# ---------------------------------------------------------------------------------------- finding
def sidecar_path(model_path: Path) -> Path:
    p = Path(model_path)
    stem = p.name[:-5] if p.name.lower().endswith(".gguf") else p.name
    return p.with_name(stem + SUFFIX)


def user_dir() -> Path:
    return Path(os.environ.get("KVCLI_CACHE", Path.home() / ".cache" / "kvcli")) / "calibration"


def default_output(model_path: Path, model_hash: str) -> Path:
    """Next to the model when its folder is writable, else in the user cache (also searched)."""
    side = sidecar_path(model_path)
    if os.access(side.parent, os.W_OK):
        return side
    stem = side.name[: -len(SUFFIX)]
    return user_dir() / f"{stem}.{model_hash}{SUFFIX}"


def check_matches(cal: Calibration, info, model_hash: str) -> None:
    """Refuse a calibration made for another model, with the reason."""
    shape, want = (cal.n_layer, cal.n_head, cal.n_head_kv), (info.n_layer, info.n_head, info.n_head_kv)
    if shape != want:
        raise KvcliError(f"calibration {cal.source} was made for a model with {shape[0]} layers, {shape[1]} heads, "
                         f"{shape[2]} KV heads ({cal.model_name}); {Path(info.path).name} has {want[0]}, {want[1]}, "
                         f"{want[2]}: re-run kvcli calibrate compresskv --model {info.path}")
    if cal.model_hash != model_hash:
        raise KvcliError(f"calibration {cal.source} belongs to another model file ({cal.model_name}, hash "
                         f"{cal.model_hash}; {Path(info.path).name} has hash {model_hash}): re-run kvcli calibrate "
                         f"compresskv --model {info.path}")


def find(model_path: Path) -> Calibration | None:
    """The calibration of `model_path`, checked against it; None when there is none anywhere."""
    model_path = Path(model_path)
    info = read_model_info(model_path)
    mhash = model_hash(model_path)
    env = os.environ.get("KVCLI_CALIBRATION")
    if env:
        cal = read(Path(env).expanduser())
    elif any(k.startswith(K) for k in info.kv_metadata):
        cal = from_fields(info.kv_metadata, str(model_path))
        # keys inside the model: the hash of the file that holds them cannot be stored in it
        cal.model_hash = mhash
    elif sidecar_path(model_path).is_file():
        cal = read(sidecar_path(model_path))
    else:
        cal = _find_by_hash(mhash)
        if cal is None:
            return None
    check_matches(cal, info, mhash)
    return cal


def _find_by_hash(mhash: str) -> Calibration | None:
    for folder in (user_dir(), DATA_DIR):
        if not folder.is_dir():
            continue
        for p in sorted(folder.glob(f"*.{mhash}{SUFFIX}")):
            return read(p)
    return None
