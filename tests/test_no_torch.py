"""The native path without the reference engine's packages (`pip install kvcli` without the `reference` extra).

Each command runs in a subprocess whose PYTHONPATH starts with stub `torch`, `transformers` and `accelerate`
packages that raise ModuleNotFoundError when imported, as on a machine where they are not installed: the CLI
imports, `kvcli chat --help` shows its help and `kvcli run` answers on the default model; a command that needs the
reference engine says in one line how to install it and exits 2.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]   # (not from conftest: tests/reference has a conftest too)
EXAMPLES = ROOT / "examples"
KVCLI = [sys.executable, "-m", "kvcli.cli"]


BLOCKED = ("torch", "transformers", "accelerate")
HINT = "pip install 'kvcli[reference]'"


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory):
    stubs = tmp_path_factory.mktemp("no-torch")
    for name in BLOCKED:
        (stubs / name).mkdir()
        (stubs / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}' (blocked by tests/test_no_torch.py)\", "
            f"name={name!r})\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(stubs), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _run(env, *args, timeout=300):
    return subprocess.run([*KVCLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def test_stubs_block_torch(no_torch_env):
    r = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, text=True, env=no_torch_env)
    assert r.returncode == 1 and "blocked by tests/test_no_torch.py" in r.stderr


def test_cli_imports_without_torch(no_torch_env):
    code = ("import sys, kvcli.cli; bad = [m for m in sys.modules if m.split('.')[0] in %r]; "
            "assert not bad, bad; print('ok')" % (BLOCKED,))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=no_torch_env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


@pytest.mark.parametrize("command", ["chat", "run", "compress", "serve", "batch", "documents", "models", "bench",
                                     "eval", "check", "calibrate"])
def test_help_without_torch(no_torch_env, command):
    r = _run(no_torch_env, command, "--help", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Usage:" in r.stdout


def test_info_without_torch(no_torch_env):
    r = _run(no_torch_env, "info", "--json", timeout=120)
    assert r.returncode == 0, r.stderr


def test_run_native_without_torch(no_torch_env):
    """The main job's command on the default model (a 1k-word excerpt of the logbook, to stay quick)."""
    doc = (EXAMPLES / "station-log.txt").read_text()
    r = subprocess.run([*KVCLI, "run", "--policy", "snapkv", "--budget", "256", "-n", "8",
                        "What is this document about?"], input=doc[:6000], capture_output=True, text=True,
                       timeout=300, env=no_torch_env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


@pytest.mark.parametrize("args", [["check", "--policy", "snapkv"],
                                  ["run", "--engine", "reference", "--doc", EXAMPLES / "station-log.txt", "hi"],
                                  ["calibrate", "compresskv"]])
def test_reference_commands_say_how_to_install(no_torch_env, args):
    r = _run(no_torch_env, *args, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert HINT in lines[0]
    assert "Traceback" not in r.stderr
