"""Shared fixtures of the reference-engine tests: tiny random GGUF models, written once per session."""
from __future__ import annotations

import pytest

from kvcli.testing.tiny_gguf import default_model_path, write_tiny_llama


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """3 layers, 4 query heads over 2 KV heads (GQA), head_dim 16, f32."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def default_gguf():
    p = default_model_path()
    if not p.exists():
        pytest.skip(f"default model not installed ({p})")
    return p
