"""llama.cpp's CPU GELU in torch, for engine-agreement tests of GELU models (gemma3) at float32 accuracy.

ggml's CPU backend computes GELU through a table of f16 values (ggml-cpu/vec.h, GGML_GELU_FP16): the input is
rounded to f16, the output read from `ggml_table_gelu_f16` (the tanh GELU of that f16 value, rounded to f16),
except for x <= -10 (0) and x >= 10 (x). That rounding puts the native engine ~2e-4 (relative) from any float32
GELU in every layer after the first FFN: more than the tight thresholds of the tiny-model tests, although
nothing kvcli does is involved. `use_ggml_cpu_gelu(model)` gives a reference model the same activation, so the
tests measure kvcli's attention, observation and compaction alone (the engines then agree to ~1e-5, as for the
SiLU architectures). The reference engine itself keeps transformers' float32 GELU.
"""
from __future__ import annotations

import torch


class GgmlCpuGelu(torch.nn.Module):
    """The tanh GELU as ggml's CPU backend computes it (f16 input, f16 table)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.to(torch.float16).to(torch.float32)
        table = torch.nn.functional.gelu(half, approximate="tanh").to(torch.float16).to(x.dtype)
        return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, table))


def use_ggml_cpu_gelu(model) -> None:
    """Replace the activation of every MLP of a transformers model whose config says tanh GELU (gemma3)."""
    if getattr(model.config, "hidden_activation", None) != "gelu_pytorch_tanh":
        raise ValueError(f"{model.config.model_type} does not use the tanh GELU")
    for layer in model.model.layers:
        layer.mlp.act_fn = GgmlCpuGelu()
