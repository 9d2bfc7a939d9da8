"""Fixtures of the policy tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_session(tmp_path_factory):
    """A native session over a tiny random model (3 layers, GQA 2) with an f32 cache: rows land exactly."""
    from kvcli.native.session import NativeSession
    from kvcli.testing.tiny_gguf import write_tiny_llama
    path = write_tiny_llama(tmp_path_factory.mktemp("merge") / "tiny.gguf", n_layer=3, n_head=4, n_head_kv=2,
                            head_dim=16, seed=3)
    s = NativeSession(path, n_ctx=512, cache_type="f32", flash_attn=False)
    yield s
    s.close()
