"""Torch helpers the reference policies share: plain torch, float64, fixed order of summation.

The C++ planners (native/src/plan/scores.cpp) add the same numbers in the same order, so both
engines compute bit-identical scores and, with ties broken by the lower index, identical plans.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation, Plan


def keep_all(obs: Observation) -> Plan:
    return Plan.keep_all(obs.n_layer, obs.n_head_kv, obs.n)


def plan_from_kept(kept: list[list[torch.Tensor]]) -> Plan:
    """kept[l][h]: 1-D int tensor of ascending slots."""
    return Plan.from_lists([[k.to(torch.int64).numpy().astype(np.int32) for k in layer] for layer in kept])


def require_window(obs: Observation, policy: str, w: int) -> torch.Tensor:
    """The window sums of window length w, [n_layer, n_head, n] float32 (a view of the observation)."""
    if obs.window_sums is None:
        raise KvcliError(f"policy '{policy}' needs the window observation (observe \"window\")")
    sums = obs.window_sum(w)
    if sums is None:
        raise KvcliError(f"policy '{policy}' needs the window sums of window {w}, the observation has window(s) "
                         f"{', '.join(map(str, obs.windows))}")
    return torch.from_numpy(np.asarray(sums, dtype=np.float32))


def require_colsum(obs: Observation, policy: str) -> torch.Tensor:
    if obs.colsum is None:
        raise KvcliError(f"policy '{policy}' needs the colsum observation (observe \"colsum\")")
    return torch.from_numpy(np.ascontiguousarray(obs.colsum, dtype=np.float32))


def window_sum(sums: torch.Tensor, length: int) -> torch.Tensor:
    """Attention each of the first `length` slots receives from the window queries (already summed by the
    engine: Observation.window_sums): [..., n] float32 -> [..., length] float64, as the C++ side reads it."""
    acc = sums[..., :length].to(torch.float64)
    check_nan(acc)  # before pooling, as the C++ side
    return acc


def check_nan(s: torch.Tensor) -> None:
    if torch.isnan(s).any():
        raise KvcliError("the observation contains NaN")


def pool1d(s: torch.Tensor, kernel: int, pool: str) -> torch.Tensor:
    """Centred 1-D pooling along the last axis, stride 1 (as F.max_pool1d / F.avg_pool1d with
    padding=kernel//2 and count_include_pad), written as a sum of shifted slices so that the
    order of the additions is fixed."""
    if kernel <= 1:
        return s
    h = kernel // 2
    n = s.shape[-1]
    if pool == "max":
        padded = F.pad(s, (h, h), value=float("-inf"))
        out = padded[..., 0:n]
        for i in range(1, kernel):
            out = torch.maximum(out, padded[..., i:i + n])
        return out
    padded = F.pad(s, (h, h), value=0.0)
    acc = torch.zeros_like(s)
    for i in range(kernel):
        acc = acc + padded[..., i:i + n]
    return acc / kernel


def gqa_combine(per_q: torch.Tensor, n_head_kv: int, mode: str) -> torch.Tensor:
    """[n_head, ...] scores per query head -> [n_head_kv, ...] per KV head.

    Query head q belongs to KV head q // G. mean: heads of a group added in order, then / G.
    """
    G = per_q.shape[0] // n_head_kv
    grouped = per_q.reshape((n_head_kv, G) + tuple(per_q.shape[1:]))
    out = grouped[:, 0]
    for g in range(1, G):
        out = torch.maximum(out, grouped[:, g]) if mode == "max" else out + grouped[:, g]
    if mode == "mean" and G > 1:
        out = out / G
    return out


def snap_scores(sums_l: torch.Tensor, n_head_kv: int, length: int, kernel: int, pool: str,
                gqa: str) -> torch.Tensor:
    """SnapKV's score for one layer: window attention summed over the window queries, pooled per
    query head, combined per KV head. sums_l: [n_head, n] -> [n_head_kv, length] float64."""
    return gqa_combine(pool1d(window_sum(sums_l, length), kernel, pool), n_head_kv, gqa)


def check_finite(s: torch.Tensor, policy: str) -> None:
    if torch.isnan(s).any():
        raise KvcliError(f"policy '{policy}': the observation contains NaN")


def rank_desc(s: torch.Tensor, policy: str) -> torch.Tensor:
    """Indices by descending score along the last axis, ties to the lower index (stable sort)."""
    check_finite(s, policy)
    return torch.sort(-s, dim=-1, stable=True).indices


def topk_ascending(s: torch.Tensor, k: int, policy: str) -> torch.Tensor:
    """The k best indices along the last axis (ties: lower index), returned ascending."""
    k = max(0, min(int(k), s.shape[-1]))
    record_selection(s, k)
    return torch.sort(rank_desc(s, policy)[..., :k], dim=-1).values


# kvcli check's plan agreement (kvcli.drivers.check.selection_margins): while `recording()` is active, every top-k
# selection a torch planner makes is kept as (scores, k), in the order the planner makes them, so that the
# selections of one policy on two observations can be compared decision by decision.
_recorders: list[list] = []


def record_selection(s: torch.Tensor, k) -> None:
    """Note one selection: the best `k` (an int, or one per leading row) of `s` along its last axis."""
    if _recorders:
        _recorders[-1].append((s.detach().to(torch.float64).cpu().numpy().copy(), k))


class recording:
    """`with recording() as calls:` collects the (scores, k) of every selection made inside."""

    def __enter__(self) -> list:
        _recorders.append([])
        return _recorders[-1]

    def __exit__(self, *exc) -> None:
        _recorders.pop()


def require_kv(obs: Observation, policy: str) -> None:
    """A merging policy's observation holds K/V rows (arrays or a reader); `layer_kv` reads them a layer at a time."""
    if not obs.has_kv:
        raise KvcliError(f"policy '{policy}' needs the kv observation (observe \"kv\")")


def layer_kv(obs: Observation, layer: int, policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s K and V rows ([n_head_kv, n, head_dim] float32), NaN refused: the native planner's
    Obs::layer_kv, called for the same layers."""
    k, v = obs.layer_kv(layer)
    keys = torch.from_numpy(np.ascontiguousarray(k, dtype=np.float32))
    values = torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
    if torch.isnan(keys).any() or torch.isnan(values).any():
        raise KvcliError(f"policy '{policy}': the observation contains NaN (keys/values)")
    return keys, values
