"""Fixtures of the native cache tests: tiny random GGUF models (written once per session) and
sessions over them. Every test runs the real patched library (KVCLI_LIB_DIR or the installed one)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """3 layers, 4 query heads, 2 KV heads (GQA 2), head_dim 16, f32 weights."""
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layer=3, n_head=4, n_head_kv=2,
                            head_dim=16, seed=1)


@pytest.fixture(scope="session")
def tiny_model_64(tmp_path_factory):
    """head_dim 64 (whole q8_0/q4_0 blocks per head, and llama.cpp's Hadamard rotation of quantised K/V)."""
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny64") / "tiny64.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=64, seed=2)


@pytest.fixture(scope="session")
def other_tiny_model(tmp_path_factory):
    """Same shapes as tiny_model, other weights: a state saved with one must not load into the other."""
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_other") / "other.gguf", n_layer=3, n_head=4, n_head_kv=2,
                            head_dim=16, seed=7)


GEMMA_WINDOW = 16   # the sliding window of tiny_gemma and tiny_gemma2


def _tiny_sliding(tmp_path_factory, arch: str, seed: int):
    from kvcli.testing.tiny_gguf import write_tiny
    return write_tiny(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch, n_layer=4, n_head=4, n_head_kv=2,
                      head_dim=16, sliding_window=GEMMA_WINDOW, swa_pattern=2, seed=seed)


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory):
    """A tiny gemma3: 4 layers, 0 and 2 slide over 16 tokens, 1 and 3 are global (tests/native/npref.py: NpGemma)."""
    return _tiny_sliding(tmp_path_factory, "gemma3", 3)


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory):
    """A tiny gemma2 of the same layout, with attention and final logit soft caps of 4 and 8."""
    return _tiny_sliding(tmp_path_factory, "gemma2", 4)


@pytest.fixture(scope="session", autouse=True)
def _model_info_once():
    """read_model_info parses the whole GGUF header in Python (~10 s for the 49k-token vocabulary);
    the tests open the same few files many times, so read each once."""
    import functools

    import kvcli.native.session as ns
    orig = ns.read_model_info
    ns.read_model_info = functools.lru_cache(maxsize=8)(orig)
    yield
    ns.read_model_info = orig


@pytest.fixture()
def session_factory():
    from kvcli.native.session import NativeSession
    opened = []

    def make(path, **kw):
        kw.setdefault("n_ctx", 256)
        kw.setdefault("n_threads", 1)  # tiny models: one thread is fastest on a busy 2-core machine
        s = NativeSession(path, **kw)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()

