"""The tiny random GGUF loads in llama.cpp and in transformers, and both compute the same function."""
from __future__ import annotations

import numpy as np
import pytest

from kvcli.testing.tiny_gguf import write_tiny_llama

PROMPT = "<|im_start|>user\nThe quick brown fox jumps over the lazy dog.<|im_end|>\n<|im_start|>assistant\n"


def _llama_cpp_logits(path, prompt):
    from kvcli.native import load_llama_cpp

    llama_cpp = load_llama_cpp()
    # f32 cache (type 0): the default f16 cache alone costs ~1e-2 in the logits
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False,
                          n_threads=2, type_k=0, type_v=0)
    toks = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    llm.eval(toks)
    logits = np.array(llm.scores[: len(toks)], dtype=np.float32)
    llm.close()
    return toks, logits


def _hf_logits(path, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return m(torch.tensor([tokens])).logits[0].numpy()


def test_tiny_gguf_shapes(tiny_gguf):
    import gguf

    r = gguf.GGUFReader(str(tiny_gguf))
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.attention.head_count"].contents() == 4
    assert r.fields["llama.attention.head_count_kv"].contents() == 2
    names = {t.name: t for t in r.tensors}
    assert "output.weight" not in names  # tied, like SmolLM2
    assert tuple(names["blk.0.attn_k.weight"].shape) == (64, 32)  # ne = [n_embd, n_head_kv*head_dim]
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_tiny_gguf_engines_agree(tiny_gguf):
    """Same tokens in both tokenisers, next-token logits equal to float32 accuracy."""
    from transformers import AutoTokenizer

    toks, nat = _llama_cpp_logits(tiny_gguf, PROMPT)
    tok = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    assert tok(PROMPT, add_special_tokens=False)["input_ids"] == toks
    ref = _hf_logits(tiny_gguf, toks)
    assert ref.shape == nat.shape
    # measured ~4e-5 for logits of magnitude ~20: a convention mismatch (Q/K permutation,
    # rope type, eps, tying) would give errors of order one
    assert np.abs(ref - nat).max() < 1e-3
    assert (ref.argmax(1) == nat.argmax(1)).all()


def test_tiny_gguf_f16_untied_other_shape(tmp_path):
    """Another GQA ratio, f16 matrices and a separate output matrix also agree."""
    p = write_tiny_llama(tmp_path / "t16.gguf", n_layer=2, n_head=6, n_head_kv=2, head_dim=8, n_ff=32,
                         dtype="f16", tied=False, seed=3, rope_theta=100000.0)
    toks, nat = _llama_cpp_logits(p, PROMPT)
    ref = _hf_logits(p, toks)
    # llama.cpp converts activations to f16 for f16 matrices on CPU: looser than f32
    assert np.abs(ref - nat).max() < 5e-2
    assert (ref[-1].argmax() == nat[-1].argmax())


def test_tiny_gguf_rejects_bad_shapes(tmp_path):
    with pytest.raises(ValueError, match="multiple"):
        write_tiny_llama(tmp_path / "x.gguf", n_head=3, n_head_kv=2)
    with pytest.raises(ValueError, match="f32, f16 or q4_0"):
        write_tiny_llama(tmp_path / "x.gguf", dtype="q4")
