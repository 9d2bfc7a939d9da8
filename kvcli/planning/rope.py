"""RoPE as llama.cpp rotates Q and K rows, in llama.cpp's dimension order: what expected attention needs to undo the
rotation of the observed queries (their statistics are taken before RoPE) and to average the rotation of the
positions still to come (docs/design/methods/expected_attention.md).

Rotary pair j turns by the angle `pos * freqs[j]` (llama.cpp's theta: freq_scale x base^(-2j/n_rot), divided by the
file's `rope_freqs` factors where the architecture reads them). Its two dimensions are (2j, 2j+1) where llama.cpp's
converter permuted the Q/K rows for "normal" RoPE (llama), (j, j + d/2) for NEOX RoPE (qwen2, qwen3, phi3): the
pairing of kvcli.reference.attention.hf_to_gguf_dims. Both engines fill Observation.rope from `rope_of(info)`; the
native planner gets the same description (kvcli_rope) and computes `freqs` as `Rope.freqs` does. Models whose RoPE is
not a plain rotation of every dimension (YaRN, LongRoPE, an attention factor, partial rotary dimensions, the
per-layer bases of sliding-window models) are refused in one line (`refusal`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvcli.errors import KvcliError

NEOX_ARCHS = ("qwen2", "qwen3", "phi3")   # llama.cpp's LLAMA_ROPE_TYPE_NEOX among kvcli's architectures
NORM_ARCHS = ("llama",)                   # LLAMA_ROPE_TYPE_NORM (the GGUF's Q/K rows permuted)


@dataclass(frozen=True, eq=False)
class Rope:
    """How positions rotate the rows: llama.cpp's parameters (kvcli_rope in native/include/kvcli.h)."""
    neox: bool                           # pairs (j, j + d/2); else (2j, 2j + 1)
    n_rot: int                           # rotated dimensions (kvcli supports head_dim only)
    freq_base: float
    freq_scale: float = 1.0              # 1 / the linear scaling factor
    factors: np.ndarray | None = None    # [n_rot // 2] float32: the file's rope_freqs (Llama 3.x), or None

    @property
    def freqs(self) -> np.ndarray:
        """[n_rot // 2] float64: the angle per position of rotary pair j, with the operations of the native planner
        (math.pow is the C library's pow), so both engines start from the same doubles."""
        f = np.array([self.freq_scale * math.pow(self.freq_base, -(2 * j) / self.n_rot)
                      for j in range(self.n_rot // 2)])
        return f if self.factors is None else f / np.asarray(self.factors, np.float64)

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(a, b): the two dimensions of each rotary pair, [n_rot // 2] each."""
        h = self.n_rot // 2
        j = np.arange(h)
        return (j, j + h) if self.neox else (2 * j, 2 * j + 1)

    def turn(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [..., d] with every pair (a, b) turned: a' = cos a - sin b, b' = sin a + cos b (cos, sin broadcast
        against [..., d/2]); float64."""
        a, b = self.pairs()
        x = np.asarray(x, np.float64)
        out = np.empty_like(x)
        out[..., a] = cos * x[..., a] - sin * x[..., b]
        out[..., b] = sin * x[..., a] + cos * x[..., b]
        return out

    def unrotate(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """rows [..., w, d] rotated at `positions` [w] -> the rows before RoPE (float64)."""
        ang = np.asarray(positions, np.float64)[:, None] * self.freqs[None, :]     # [w, d/2]
        return self.turn(rows, np.cos(ang), -np.sin(ang))


def refusal(info) -> str | None:
    """Why expected attention cannot undo this model's RoPE (None when it can)."""
    from kvcli.models import header_values, longrope  # noqa: PLC0415  (reads the GGUF header)
    arch = info.architecture
    if info.sliding_layers:
        return "sliding-window layers (their RoPE base differs per layer)"
    if arch not in NEOX_ARCHS + NORM_ARCHS:
        return f"architecture '{arch}'"
    meta = header_values(info.path)
    scaling = str(meta.get(f"{arch}.rope.scaling.type") or "linear")
    if scaling not in ("none", "linear"):
        return f"RoPE scaling '{scaling}'"
    if float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)) != 1.0:
        return "a RoPE attention factor"
    n_rot = int(meta.get(f"{arch}.rope.dimension_count", info.head_dim))
    if n_rot != info.head_dim:
        return f"partial rotary dimensions ({n_rot} of {info.head_dim})"
    if arch == "phi3" and longrope(info.path) is not None:
        return "LongRoPE factors"
    return None


def rope_of(info) -> Rope:
    """The RoPE of the model `info` (kvcli.models.ModelInfo) describes; KvcliError when `refusal` says why not."""
    from kvcli.models import header_values, read_f32_tensor  # noqa: PLC0415
    why = refusal(info)
    if why:
        raise KvcliError(f"expected attention cannot undo this model's RoPE: {why}")
    meta = header_values(info.path)
    arch = info.architecture
    factor = float(meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear") or 0.0) or 1.0
    factors = None
    if arch == "llama":   # llama.cpp divides each frequency by the file's rope_freqs (Llama 3.1+)
        factors = read_f32_tensor(info.path, "rope_freqs.weight")
        factors = None if factors is None else np.asarray(factors, np.float32)
    return Rope(neox=arch in NEOX_ARCHS, n_rot=int(info.head_dim), freq_base=float(info.rope_theta),
                freq_scale=1.0 / factor, factors=factors)
