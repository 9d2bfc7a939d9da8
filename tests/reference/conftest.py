"""Shared fixtures of the reference-engine tests: tiny random GGUF models, written once per session."""
from __future__ import annotations

import pytest

from kvcli.testing.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """3 layers, 4 query heads over 2 KV heads (GQA), head_dim 16, f32."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
