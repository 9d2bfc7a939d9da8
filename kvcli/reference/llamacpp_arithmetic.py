"""llama.cpp's CPU activation arithmetic, emulated in the float32 reference engine where a check needs it.

The reference engine stays float32 by design. Two of llama.cpp's roundings move a few tokens' K/V rows of some models
(gemma-3-270m) further than kvcli check's L2 threshold, and `kvcli check` consults this emulation for those rows only
(kvcli/drivers/check/allowances.py, L2's allowance):
- ggml-cpu rounds the activation row to the weight type's vec-dot type before every matmul with a quantised weight:
  Q8_0 (blocks of 32, one scale stored in f16) for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights, Q8_K (blocks of 256, an f32
  scale) for the K- and I-quants; f16 for F16 weights, bf16 for BF16; nothing for F32.
- its GELU reads an f16 table (ggml-cpu/vec.h GGML_GELU_FP16): the input rounded to f16, the output the tanh GELU of
  that value rounded to f16; 0 below -10, x above 10.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

# transformers' module name -> GGUF tensor name, per layer (fused phi3 projections included)
_MATMULS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_Q8_0_WEIGHTS = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1"}


class GgmlCpuGelu(torch.nn.Module):
    """The tanh GELU as ggml's CPU backend computes it (f16 input, f16 table)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.to(torch.float16).to(torch.float32)
        table = torch.nn.functional.gelu(half, approximate="tanh").to(torch.float16).to(x.dtype)
        return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, table))


def quantise_rows(x: torch.Tensor, block: int, f16_scale: bool) -> torch.Tensor:
    """Rows of x rounded as ggml-cpu quantises an activation to 8 bits, returned dequantised: per block the scale
    d = max |x| / 127 (stored in f16 for Q8_0), values round(x / d)."""
    shape = x.shape
    xb = x.reshape(*shape[:-1], shape[-1] // block, block)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d > 0, torch.round(xb / safe), torch.zeros_like(xb))
    if f16_scale:
        d = d.to(torch.float16).to(x.dtype)
    return (q * d).reshape(shape)


def activation_rounding(weight_type: str):
    """The rounding ggml-cpu gives a matmul's input for a weight of this GGUF type (None: none)."""
    if weight_type == "F32":
        return None
    if weight_type == "F16":
        return lambda x: x.to(torch.float16).to(x.dtype)
    if weight_type == "BF16":
        return lambda x: x.to(torch.bfloat16).to(x.dtype)
    if weight_type in _Q8_0_WEIGHTS:
        return lambda x: quantise_rows(x, 32, True) if x.shape[-1] % 32 == 0 else x
    return lambda x: quantise_rows(x, 256, False) if x.shape[-1] % 256 == 0 else x


@contextmanager
def llamacpp_activations(model, gguf_path):
    """Within the block, `model` (a transformers model loaded from `gguf_path`) rounds its matmul inputs and computes
    its tanh GELU as llama.cpp's CPU backend does; restored on exit."""
    import gguf  # noqa: PLC0415

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(Path(gguf_path))).tensors}
    hooks, swapped = [], []
    try:
        for il, layer in enumerate(model.model.layers):
            for hf_name, gguf_name in _MATMULS.items():
                ty = types.get(f"blk.{il}.{gguf_name}.weight")
                try:
                    mod = layer.get_submodule(hf_name)
                except AttributeError:
                    continue
                rounding = activation_rounding(ty) if ty else None
                if rounding is not None:
                    hooks.append(mod.register_forward_pre_hook(lambda m, a, r=rounding: (r(a[0]), *a[1:])))
            mlp = getattr(layer, "mlp", None)
            if getattr(model.config, "hidden_activation", None) == "gelu_pytorch_tanh" and mlp is not None:
                swapped.append((mlp, mlp.act_fn))
                mlp.act_fn = GgmlCpuGelu()
        yield
    finally:
        for h in hooks:
            h.remove()
        for mlp, act in swapped:
            mlp.act_fn = act


def use_ggml_cpu_gelu(model) -> None:
    """Give a transformers model whose config says tanh GELU (gemma3) ggml's f16-table GELU for good: the
    engine-agreement tests of GELU architectures then measure kvcli's attention, observation and compaction alone
    (the engines agree to ~1e-5, as for the SiLU architectures; with float32 GELU they differ by ~2e-4 relative in
    every layer after the first FFN, though nothing kvcli does is involved). The reference engine itself keeps
    transformers' float32 GELU."""
    if getattr(model.config, "hidden_activation", None) != "gelu_pytorch_tanh":
        raise ValueError(f"{model.config.model_type} does not use the tanh GELU")
    for layer in model.model.layers:
        layer.mlp.act_fn = GgmlCpuGelu()
