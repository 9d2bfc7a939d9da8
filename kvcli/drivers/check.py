"""`kvcli check`: prove the native engine right against the reference engine, at three levels.

L1 policy       the SAME observation arrays (taken from the native engine) go to the native (C++)
                planner and to the torch planner: kept sets and budgets must be identical (ties go
                to the lower slot in both), merged rows and log-multiplicities equal to `l1_merge_atol`.
L2 observation  each engine computes the observation from the same GGUF and tokens: window
                sums (of every window length the check needs, divided by that length: the mean
                attention of a window query), column sums, K and V rows. Reported: max abs and
                relative error (relative = max abs error / max abs value of the reference array).
                A K/V row beyond its threshold is allowed (at most `l2_kv_sensitive_rows` of them)
                only where llama.cpp's own settings move that row at least as far or bring it within
                the threshold of the reference (the native engine at its other precision setting, f32
                cache without flash attention or f16 with, or at a batch size of 64), or where the
                reference engine given llama.cpp's activation arithmetic (8-bit matmul inputs, f16
                GELU table) comes within the threshold: a token
                so sensitive to llama.cpp's own arithmetic says nothing about kvcli (report: the
                rows, every distance, which source allowed each).
L3 end to end   two verdicts, after each engine compressed its cache:
  arithmetic    (the engine verdict) the reference engine applies the NATIVE plan (same kept sets, same merged
                rows) to its own prefill, so both hold one and the same compressed cache: next-token logits
                (max abs error, KL(native || reference)) and greedy agreement over N tokens (teacher-forced:
                both engines are fed the native engine's greedy tokens, and each step counts when the
                reference's argmax is the same token), within limits stated per native cache type
                (`Thresholds.arithmetic`). Must hold for every policy: only the engines' arithmetic differs.
                Beyond the limits the same plan passes only for a measured reason (`arithmetic_allowance`):
                the reference given llama.cpp's activation arithmetic (8-bit matmul inputs, f16 GELU) comes
                within them, or (f16) the plan is precision-sensitive: the reference's own cache rounded to
                f16 moves its output beyond them too and the engines agree at equal precision (the native f32
                cache without flash attention, f32 limits): `precision_sensitivity`.
  plan agreement (the policy's sensitivity) each engine plans from its own observation with its own planner:
                Jaccard of the kept positions per layer and KV head, the layer budgets, how far from the
                budget's boundary (in the policy's own score) the decisions lie on which the plans differ
                (`selection_margins`), and the same logits/greedy comparison with each engine decoding its own
                plan. A policy whose plans flip on near-ties of its score (the engines' observations differ
                within L2's limits) misses here without any engine being wrong: reported, and failing the
                exit status only with `strict_plans` (`kvcli check --strict-plans`).
                The logits present right after prefill predate the compression: the "next-token" comparison
                is the one after the first decoded token, the first that reads the compressed caches.

Chunked prefill (`chunk`, `kvcli check --chunk N`): both engines read the prompt with the driver
(kvcli/drivers/compress.py; its chunked loop is in kvcli/drivers/chunked.py): prefill a chunk, observe it (a window
policy
through the question probe, prefilled and rolled back, unless `chunk_scoring` is "chunk"), plan over
everything held, compact with re-indexed positions (a model with sliding-window layers: keeping them). L1 is
checked at every planning step: the torch planner on the native observation of that step must make the native
plan. L2 compares the observations of the first chunk.
L3's arithmetic verdict has the reference engine read the prompt in the same chunks with the native engine's plan
at every step (a replaying planner); plan agreement compares the end results of each engine's own plans, its
Jaccard over the *original* prompt positions each (layer, KV head) still holds, followed through each engine's
own plans (after re-indexing, the engines' positions are B-k..B-1 and say nothing about which tokens were kept);
its selection margins are not computed for a chunked read.

L1 alone (`--levels 1`) loads no reference engine. Models with sliding-window layers (gemma2, gemma3) are checked
at every level, on the layers kvcli compresses (ModelInfo.kv_layers: observations, plans, kept positions); the
sliding layers take part through the logits only (L3), both engines masking them to their window.

Both engines get the very same token ids (tokenised once, by the native engine). Thresholds are
parameters (`Thresholds`, `kvcli check --threshold key=value`); their defaults are for the
default model (SmolLM2-135M Q4_1) with the native engine as users run it (f16 cache, flash
attention): the native engine then multiplies quantised weights by 8-bit-quantised activations
while the reference works in float32 on dequantised weights, so L2/L3 can only be close, never
equal. On float32 GGUFs with an f32 cache and flash attention off the engines agree to ~1e-5
and much tighter thresholds hold (the tests use them).
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, fields

import numpy as np

from kvcli import policies
from kvcli.drivers import chunked, compress
from kvcli.planning.planner import make_plan, model_refusal
from kvcli.drivers.chunked import MIN_CHUNK
from kvcli.drivers.reconstruct import reconstruct, repeat_room
from kvcli.errors import KvcliError
from kvcli.native.session import NativeSession
from kvcli.templating import build_prompt
from kvcli.planning.formats import Observation, Plan

# --------------------------------------------------------------------------------- thresholds


@dataclass
class Thresholds:
    """Pass/fail limits of each level; the defaults suit the default model in product settings."""

    # Defaults: measured on the default model, a 2021-token document (examples/station-log.txt cut
    # to 2000 tokens), budget 256, native f16 cache + flash attention, 8 policies: L1 identical;
    # L2 window 0.090, colsum rel 0.0073, K rel 0.023, V rel 0.065; L3 Jaccard >= 0.80, next-token
    # KL <= 0.010, logits max abs <= 1.71, greedy agreement >= 93.8%. A wrong head mapping, mask or
    # position gives errors of order one, far above these limits.
    l1_merge_atol: float = 1e-5     # L1: max abs difference of merged K/V rows and of log_mult
    l2_window_atol: float = 0.15    # L2: max abs difference of window sums / window length (measured as
    #                                 per-probability differences, 0.090, before observations were reduced)
    l2_colsum_rtol: float = 0.05    # L2: max abs difference of column sums / max column sum
    # L2: column maxima (kvzip's reconstruction scores: one query's probability each, so a query whose attention
    # sits on a knife edge moves one slot's maximum far; measured (issue 32, budget 256, f16 + flash attention):
    # default model 2,042 tokens max abs 0.148 mean 4.9e-4, qwen2.5-coder-0.5b 1,040 tokens max abs 0.089 mean
    # 8.0e-4. A wrong head mapping or mask moves most maxima: the mean catches it.
    l2_colmax_atol: float = 0.3     # ... max abs difference
    l2_colmax_mean_atol: float = 0.005   # ... mean abs difference
    l2_kv_rtol: float = 0.1         # L2: max abs difference of K (and of V) rows / max abs K (V) value
    # L2: the fraction of K (V) rows that may exceed l2_kv_rtol, each only where llama.cpp's own settings (f32
    # cache without flash attention vs f16 with it; a batch size of 64) move that row at least as far as the
    # engines differ there or bring it within l2_kv_rtol of the reference, or where the reference with llama.cpp's
    # activation arithmetic emulated comes within l2_kv_rtol: a token whose K llama.cpp's own choices move by more
    # than the threshold (measured: one K and one V row of 6,042 on gemma-3-270m, 2,014 tokens; one K row of 3,042,
    # 1,014 tokens; ten V rows of 3,042 on a Markdown README's URLs, 0.33%, gemma-3-270m at 1k) is not an engine
    # disagreement. The fraction only guards the per-row test: a wrong mapping, mask or position moves most rows,
    # in every setting alike (so no setting explains them either).
    l2_kv_sensitive_rows: float = 0.01
    # L3 arithmetic (the engine verdict): both engines decode the SAME plan (the native planner's), so the only
    # difference left is their arithmetic; per native cache type (the reference is float32 throughout). Measured
    # (docs/internals.md "kvcli check", docs/results.md, issue 31): the native engine's 8-bit activations and its
    # cache's rounding against float32 give next-token KL 0.0001-0.0195 at f16 (three models), 0.0012-0.0061 at
    # f32 without flash attention, 0.0008-0.0222 at q8_0 (which rounds K and V to 8 bits besides); logits max
    # abs at most 1.17. A wrong mask, position, head mapping or compaction gives KL of order one.
    l3_kl_max_f32: float = 0.05     # L3: KL(native || reference), nats, same plan, native f32 cache
    l3_kl_max_f16: float = 0.05     # ... native f16 cache (the product setting)
    l3_kl_max_q8_0: float = 0.1     # ... native q8_0 cache
    l3_logits_atol_f32: float = 3.0   # L3: next-token logits max abs, same plan, per cache type
    l3_logits_atol_f16: float = 3.0
    l3_logits_atol_q8_0: float = 4.0
    l3_greedy_min: float = 0.75     # L3: teacher-forced greedy agreement, same plan
    # Plan agreement (the policy's sensitivity, not an engine verdict): each engine plans from its own
    # observation; the plans and what they decode are compared. Reported; fails the exit code only with
    # --strict-plans (see run_check's doc).
    plan_jaccard_min: float = 0.7   # plans: lowest per-layer Jaccard of kept positions (mean over KV heads)
    plan_kl_max: float = 0.05       # plans: KL(native || reference) of the next token, each engine its own plan
    plan_greedy_min: float = 0.75   # plans: teacher-forced greedy agreement, each engine its own plan

    DOCS = {
        "l1_merge_atol": "L1: merged K/V rows and log_mult, native vs torch planner (max abs)",
        "l2_window_atol": "L2: window attention summed over the window queries / window length (max abs)",
        "l2_colsum_rtol": "L2: column sums (max abs / max column sum)",
        "l2_colmax_atol": "L2: column maxima of the reconstruction pass (kvzip; max abs)",
        "l2_colmax_mean_atol": "L2: column maxima of the reconstruction pass (kvzip; mean abs)",
        "l2_kv_rtol": "L2: K and V rows, and the Q rows expected_attention observes (max abs / max abs value)",
        "l2_kv_sensitive_rows": "L2: fraction of K/V rows allowed beyond l2_kv_rtol, each only where llama.cpp's "
                                "own settings (precision, batch size) move the row as far or where the reference "
                                "given llama.cpp's activation arithmetic comes within l2_kv_rtol (0: none)",
        "l3_kl_max_f32": "L3 arithmetic (same plan in both engines): next-token KL(native || reference), "
                         "native f32 cache (maximum; l3_kl_max=X sets every cache type)",
        "l3_kl_max_f16": "L3 arithmetic: the same, native f16 cache",
        "l3_kl_max_q8_0": "L3 arithmetic: the same, native q8_0 cache",
        "l3_logits_atol_f32": "L3 arithmetic: next-token logits max abs, native f32 cache (l3_logits_atol=X: "
                              "every cache type)",
        "l3_logits_atol_f16": "L3 arithmetic: the same, native f16 cache",
        "l3_logits_atol_q8_0": "L3 arithmetic: the same, native q8_0 cache",
        "l3_greedy_min": "L3 arithmetic: teacher-forced greedy agreement over N tokens (minimum fraction)",
        "plan_jaccard_min": "plan agreement (own plans): lowest per-layer Jaccard of kept positions (minimum)",
        "plan_kl_max": "plan agreement: next-token KL, each engine decoding its own plan (maximum)",
        "plan_greedy_min": "plan agreement: greedy agreement, each engine decoding its own plan (minimum)",
    }
    # names of earlier releases: one value for every cache type (l3_*) or the plan figure it became
    ALIASES = {"l3_kl_max": ("l3_kl_max_f32", "l3_kl_max_f16", "l3_kl_max_q8_0"),
               "l3_logits_atol": ("l3_logits_atol_f32", "l3_logits_atol_f16", "l3_logits_atol_q8_0"),
               "l3_jaccard_min": ("plan_jaccard_min",)}
    CACHE_TYPES = ("f32", "f16", "q8_0")

    @classmethod
    def tight(cls) -> "Thresholds":
        """For float32 GGUFs checked with an f32 cache and flash attention off (the tests' tiny models)."""
        return cls(l2_window_atol=1e-4, l2_colsum_rtol=1e-4, l2_colmax_atol=1e-4,
                   l2_colmax_mean_atol=1e-5, l2_kv_rtol=1e-4, l2_kv_sensitive_rows=0.0,
                   l3_kl_max_f32=1e-6, l3_kl_max_f16=1e-6, l3_kl_max_q8_0=1e-6, l3_logits_atol_f32=1e-3,
                   l3_logits_atol_f16=1e-3, l3_logits_atol_q8_0=1e-3, l3_greedy_min=1.0,
                   plan_jaccard_min=0.95, plan_kl_max=1e-6, plan_greedy_min=1.0)

    def arithmetic(self, cache_type: str) -> dict:
        """The L3 arithmetic limits for a native cache type."""
        if cache_type not in self.CACHE_TYPES:
            raise KvcliError(f"no L3 thresholds for cache type '{cache_type}' (known: {', '.join(self.CACHE_TYPES)})")
        return {"kl_max": getattr(self, f"l3_kl_max_{cache_type}"),
                "logits_atol": getattr(self, f"l3_logits_atol_{cache_type}"), "greedy_min": self.l3_greedy_min}

    def with_overrides(self, items) -> "Thresholds":
        """Apply "key=value" strings (or a dict); a clear error for an unknown key or a bad number."""
        pairs = items.items() if isinstance(items, dict) else [_split_kv(s) for s in items]
        names = {f.name for f in fields(self)}
        out = copy.copy(self)
        for key, value in pairs:
            if key in self.ALIASES:
                for k in self.ALIASES[key]:
                    out = out.with_overrides({k: value})
                continue
            if key not in names:
                raise KvcliError(f"unknown threshold '{key}'; valid: {', '.join(sorted(names))}")
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise KvcliError(f"threshold {key} must be a number (got '{value}')") from None
            if not math.isfinite(v) or v < 0:
                raise KvcliError(f"threshold {key} must be a finite number >= 0 (got '{value}')")
            setattr(out, key, v)
        return out

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _split_kv(item: str) -> tuple[str, str]:
    key, sep, value = str(item).partition("=")
    if not sep or not key.strip():
        raise KvcliError(f"--threshold expects key=value, got '{item}'")
    return key.strip(), value.strip()


# --------------------------------------------------------------------------------- L1: plans


def compare_plans(native: Plan, torch_plan: Plan, atol: float) -> dict:
    """L1: the two planners' answers on the same observation."""
    out = {"identical_budgets": False, "heads_differing": 0, "first_difference": None, "merge_max_abs": 0.0,
           "log_mult_max_abs": 0.0, "entries": native.entries()}
    if native.n_kept.shape != torch_plan.n_kept.shape:
        out["first_difference"] = f"plan shapes {native.n_kept.shape} vs {torch_plan.n_kept.shape}"
        out["pass"] = False
        return out
    out["identical_budgets"] = bool(np.array_equal(native.n_kept, torch_plan.n_kept))
    for l in range(native.n_layer):
        for h in range(native.n_head_kv):
            a, b = native.kept(l, h), torch_plan.kept(l, h)
            if not np.array_equal(a, b):
                out["heads_differing"] += 1
                if out["first_difference"] is None:
                    only_a = np.setdiff1d(a, b)[:5].tolist()
                    only_b = np.setdiff1d(b, a)[:5].tolist()
                    out["first_difference"] = (f"layer {l} head {h}: native keeps {len(a)} (only native: {only_a}), "
                                               f"torch keeps {len(b)} (only torch: {only_b})")
    same_sets = out["identical_budgets"] and out["heads_differing"] == 0
    merge_ok = True
    if same_sets:
        lm_a = native.log_mult if native.log_mult is not None else np.zeros(native.entries(), np.float32)
        lm_b = torch_plan.log_mult if torch_plan.log_mult is not None else np.zeros(native.entries(), np.float32)
        out["log_mult_max_abs"] = _max_abs(lm_a, lm_b)
        ra, rb = np.sort(native.replace_entry), np.sort(torch_plan.replace_entry)
        if not np.array_equal(ra, rb):
            merge_ok = False
            out["first_difference"] = (f"merged entries differ: native replaces {native.replace_entry.size} rows, "
                                       f"torch {torch_plan.replace_entry.size}")
        elif ra.size:
            ia, ib = np.argsort(native.replace_entry), np.argsort(torch_plan.replace_entry)
            out["merge_max_abs"] = max(_max_abs(native.replace_k[ia], torch_plan.replace_k[ib]),
                                       _max_abs(native.replace_v[ia], torch_plan.replace_v[ib]))
    out["merged_rows"] = int(native.replace_entry.size)
    out["pass"] = bool(same_sets and merge_ok and out["merge_max_abs"] <= atol and out["log_mult_max_abs"] <= atol)
    return out


def _max_abs(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0:
        return 0.0
    both_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    d = np.where(both_inf, 0.0, np.abs(a - b))
    return float(np.nan_to_num(d, nan=np.inf).max())


# --------------------------------------------------------------------------------- L2: observations


def compare_arrays(native: np.ndarray, reference: np.ndarray) -> dict:
    if native.shape != reference.shape:
        raise KvcliError(f"observation shapes differ: native {native.shape}, reference {reference.shape}")
    err = _max_abs(native, reference)
    scale = float(np.abs(reference).max()) if reference.size else 0.0
    mean = float(np.abs(native.astype(np.float64) - reference).mean()) if reference.size else 0.0
    return {"max_abs": err, "rel": err / scale if scale > 0 else err, "mean_abs": mean, "scale": scale}


def compare_observations(native: Observation, reference: Observation, th: Thresholds,
                         allowances=None) -> dict:
    """L2: every field both observations hold (K/V rows read whole: a planner reads one layer at a time).

    `allowances`: L2's K/V allowance (`l2_kv_sensitive_rows`), `Allowance`s tried in order on the rows beyond
    `l2_kv_rtol` that no earlier one explained, each taken only when needed."""
    native, reference = native.with_kv_arrays(), reference.with_kv_arrays()
    out: dict = {}
    if native.n != reference.n:
        raise KvcliError(f"the engines hold different numbers of slots: native {native.n}, reference {reference.n}")
    if native.window_sums is not None and reference.window_sums is not None:
        if native.windows != reference.windows:
            raise KvcliError(f"the engines observed different windows: native {native.windows}, "
                             f"reference {reference.windows}")
        per_query = np.asarray(native.windows, np.float32)[:, None, None, None]  # mean attention per window query
        r = compare_arrays(native.window_sums / per_query, reference.window_sums / per_query)
        r["pass"] = r["max_abs"] <= th.l2_window_atol
        out["window"] = r
    if native.colsum is not None and reference.colsum is not None:
        r = compare_arrays(native.colsum, reference.colsum)
        r["pass"] = r["rel"] <= th.l2_colsum_rtol
        out["colsum"] = r
    if native.colmax is not None and reference.colmax is not None:
        r = compare_arrays(native.colmax, reference.colmax)
        r["pass"] = r["max_abs"] <= th.l2_colmax_atol and r["mean_abs"] <= th.l2_colmax_mean_atol
        out["colmax"] = r
    if native.queries is not None and reference.queries is not None:   # expected_attention's Q rows, like K rows
        if not np.array_equal(native.query_positions, reference.query_positions):
            raise KvcliError("the engines observed the Q rows of different positions")
        r = compare_arrays(native.queries, reference.queries)
        r["pass"] = r["rel"] <= th.l2_kv_rtol
        out["queries"] = r
    for name in ("keys", "values"):
        a, b = getattr(native, name), getattr(reference, name)
        if a is not None and b is not None:
            out[name] = compare_kv_rows(a, b, th, [a_.rows(name) for a_ in allowances or []])
    if native.positions is not None and reference.positions is not None:
        out["positions_equal"] = bool(np.array_equal(native.positions, reference.positions))
    out["pass"] = bool(out.get("positions_equal", True)) and all(
        v["pass"] for k, v in out.items() if isinstance(v, dict))
    return out


class Allowance:
    """One source L2's K/V allowance consults: `observe()` gives an Observation of the check's tokens, taken at most
    once. kind "native": the native engine at another of llama.cpp's settings; a row passes where that setting moves
    the native row at least as far as the engines differ, or puts it within `l2_kv_rtol` of the reference row (the
    same engine and patch agree with the reference at that setting). kind "reference": the reference engine with
    llama.cpp's
    activation arithmetic emulated; a row passes where it lies within `l2_kv_rtol` of the native row."""

    def __init__(self, label: str, kind: str, observe, setting: str = ""):
        self.label, self.kind, self.setting, self._observe, self._obs = label, kind, setting, observe, None
        self.used = False

    def rows(self, name: str):
        """(label, kind, callable giving this source's `name` rows, or None) for compare_kv_rows."""
        def get():
            if self._obs is None:
                self.used = True
                obs = self._observe()
                self._obs = obs.with_kv_arrays() if obs is not None else False
            return getattr(self._obs, name) if self._obs is not False else None
        return self.label, self.kind, get


def compare_kv_rows(native: np.ndarray, reference: np.ndarray, th: Thresholds, allowances) -> dict:
    """L2 for K (or V) rows [layer, kv head, slot, dim]: passes when every row is within `l2_kv_rtol` x the
    largest reference value, or when the few rows beyond it (at most `l2_kv_sensitive_rows` of them) are each
    explained by one of `allowances` ((label, kind, rows()) tried in order, see `Allowance`; a bare callable is the
    native engine at its other precision setting): llama.cpp's own settings move the row at least as far as the
    engines differ, or bring it within the threshold of the reference row ("native"), or the reference given
    llama.cpp's activation arithmetic comes within the threshold of the native row ("reference")."""
    if callable(allowances):
        allowances = [("native_precision", "native", allowances)]
    r = compare_arrays(native, reference)
    err = np.abs(native.astype(np.float64) - reference).max(axis=-1) if native.size else np.zeros(0)
    limit = th.l2_kv_rtol * r["scale"]
    over = np.argwhere(err > limit)
    r["rows"], r["rows_over"] = int(err.size), int(len(over))
    r["pass"] = not len(over)
    if len(over):
        r["rows_allowed"] = allowed = int(th.l2_kv_sensitive_rows * err.size)
        # the report names the rows also beyond the fraction (no source is consulted then: the array fails)
        rows = [{"layer": int(il), "kv_head": int(h), "slot": int(p), "engines": float(err[il, h, p]),
                 "explained_by": None} for il, h, p in over[:max(allowed, 10)]]
        for label, kind, get in allowances if len(over) <= allowed else []:
            if all(x["explained_by"] for x in rows):
                break
            other = get()
            if other is None:
                continue
            dist = np.abs(native.astype(np.float64) - other).max(axis=-1)
            # a native setting also explains a row it brings within the threshold of the reference: the same
            # engine and patch agree with the reference there, and the rest is llama.cpp's arithmetic at the
            # check's setting (gemma-3-270m's layer-11 K row at slot 398: twin 2.30 from the reference, docs/models.md)
            to_ref = np.abs(other.astype(np.float64) - reference).max(axis=-1) if kind == "native" else None
            for x in rows:
                at = x["layer"], x["kv_head"], x["slot"]
                d = float(dist[at])
                x[label] = d
                if kind == "native":
                    x[f"{label}_to_reference"] = t = float(to_ref[at])
                    ok = d >= x["engines"] or t <= limit
                else:
                    ok = d <= limit
                if ok and not x["explained_by"]:
                    x["explained_by"] = label
        r["rows_over_detail"] = rows   # every row when within the fraction (a verdict names what it allowed)
        r["pass"] = len(over) <= allowed and all(x["explained_by"] for x in rows)
    return r


def _note_allowances(l2: dict, allowances: list, info) -> None:
    """Name the settings L2's allowance consulted and give each row beyond the threshold its model layer."""
    used = [a for a in allowances if a.used]
    if not used:
        return
    l2["allowances"] = {a.label: a.setting for a in used}
    if used[0].label == "native_precision":
        l2["precision_twin"] = used[0].setting
    for name in ("keys", "values"):
        for row in l2.get(name, {}).get("rows_over_detail", []):
            row["model_layer"] = info.kv_layers[row["layer"]] if info.kv_layers else row["layer"]


ALLOWANCE_UBATCH = 64   # the native twin's batch size: ggml-cpu's matmuls then block (and round) differently


class NativeTwin:
    """The native engine's K/V observation of `tokens` at another of llama.cpp's settings, in a fresh context:
    "precision": an f32 cache without flash attention for a check run with anything else (an f16 cache with flash
    attention for one run with that); "ubatch": the check's cache and attention at a batch size of
    ALLOWANCE_UBATCH tokens."""

    def __init__(self, model_path, tokens, settings, n_ctx, what: str = "precision"):
        self.cache_type, self.flash_attn, self.n_batch = settings.cache_type, settings.flash_attn, 512
        if what == "precision":
            plain = settings.cache_type == "f32" and not settings.flash_attn
            self.cache_type, self.flash_attn = ("f16", True) if plain else ("f32", False)
            self.setting = f"{self.cache_type} cache, flash attention {'on' if self.flash_attn else 'off'}"
        else:
            self.n_batch = ALLOWANCE_UBATCH
            self.setting = f"batch size {ALLOWANCE_UBATCH} instead of 512"
        self.model_path, self.tokens, self.threads, self.n_ctx = model_path, tokens, settings.threads, n_ctx

    def __call__(self) -> Observation:
        session = NativeSession(self.model_path, n_ctx=0, cache_type=self.cache_type, flash_attn=self.flash_attn,
                                n_batch=self.n_batch, n_threads=self.threads)
        try:
            session.create_context(self.n_ctx)
            return session.prefill(self.tokens, seq=0, observe=("kv",)).with_kv_arrays()
        finally:
            session.close()


def emulated_reference(reference, tokens):
    """The reference engine's K/V observation of `tokens` with llama.cpp's activation arithmetic emulated
    (kvcli/reference/llamacpp_arithmetic.py), its sequence 0 put back afterwards."""
    def observe() -> Observation:
        from kvcli.reference.llamacpp_arithmetic import llamacpp_activations  # noqa: PLC0415
        saved = reference.save_seq(0) if 0 in reference.seqs else None
        reference.clear(0)
        try:
            with llamacpp_activations(reference.model, reference.model_path):
                return reference.prefill(tokens, seq=0, observe=("kv",)).with_kv_arrays()
        finally:
            reference.clear(0)
            if saved is not None:
                reference.restore_seq(saved, 0)
    return observe


def l2_allowances(model_path, tokens, settings, n_ctx, reference) -> list:
    """L2's K/V allowance sources, in the order they are consulted (docs/internals.md "kvcli check")."""
    precision = NativeTwin(model_path, tokens, settings, n_ctx, "precision")
    ubatch = NativeTwin(model_path, tokens, settings, n_ctx, "ubatch")
    return [Allowance("native_precision", "native", precision, precision.setting),
            Allowance("native_ubatch", "native", ubatch, ubatch.setting),
            Allowance("reference_llamacpp_arithmetic", "reference", emulated_reference(reference, tokens),
                      "reference with llama.cpp's 8-bit matmul inputs and f16 GELU table")]


def observed_windows(specs: dict, names, l2_window: int, n: int) -> tuple[int, ...]:
    """The window lengths one observation must hold for L2 and every named policy's window (at most n)."""
    ws = {min(l2_window, n)}
    for p in names:
        kinds, w = specs[p].observe
        if "window" in kinds or "query" in kinds:   # query rows: the longest window's (expected_attention)
            ws.add(min(w, n))
    return tuple(sorted(ws))


# --------------------------------------------------------------------------------- L3: end to end


def jaccard_per_head(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> list[list[float]]:
    """Jaccard of the kept positions of every (layer, KV head)."""
    out = []
    for la, lb in zip(a, b):
        js = []
        for ha, hb in zip(la, lb):
            sa, sb = set(np.asarray(ha).tolist()), set(np.asarray(hb).tolist())
            union = len(sa | sb)
            js.append(len(sa & sb) / union if union else 1.0)
        out.append(js)
    return out


def jaccard_per_layer(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> list[float]:
    """Jaccard of the kept positions per layer (mean over KV heads)."""
    return [float(np.mean(js)) for js in jaccard_per_head(a, b)]


def selection_margins(native_calls: list, reference_calls: list) -> dict:
    """Plan agreement's sensitivity figure: how far from the budget's boundary, in the policy's own score, the
    decisions lie on which the engines' plans differ.

    `native_calls` / `reference_calls`: the (scores, k) of every top-k selection the torch planner made from the
    native engine's observation and from the reference engine's (kvcli.reference.policies._common.recording),
    in the planner's order: the i-th of each is the same decision (a layer, or a layer's KV head: a row of
    scores). The torch planner on the native observation makes the native plan (L1). For a row whose kept
    sets differ, each flipped entry (kept by one engine only) has
      gap   how far its native score must move to cross the native cut (down to the first evicted score for an
            entry the native plan keeps, up to the last kept one for an entry it evicts), relative to the cut
            score (the mean of those two);
      rank  how many places from the cut it ranks in the native order (1: next to it);
    and the row has `delta`, the engines' largest score difference on its flipped entries (same scale). With the
    same budget in both engines a flip is a near-tie: its gap is at most two flipped entries' score differences
    together (at most 2 x delta; `beyond_near_tie` counts the flips that are not); a row whose budget k differs
    took its budget from the observation (d2o, dynamickv: counted in `rows_budget_differs`; a d2o row whose
    candidates differ in number as well is counted there without a gap)."""
    out = {"selections": len(native_calls), "rows": 0, "rows_differing": 0, "rows_budget_differs": 0,
           "flipped": 0, "gap_max": 0.0, "rank_max": 0, "delta_max": 0.0, "beyond_near_tie": 0,
           "first": None, "comparable": True}
    if len(native_calls) != len(reference_calls):
        out.update(comparable=False, why=f"the planner made {len(native_calls)} selections on the native observation "
                                         f"and {len(reference_calls)} on the reference one")
        return out
    for i, ((sn, kn), (sr, kr)) in enumerate(zip(native_calls, reference_calls)):
        if sn.shape[:-1] != sr.shape[:-1]:
            out.update(comparable=False, why=f"selection {i}: scores of shape {sn.shape} vs {sr.shape}")
            return out
        if sn.shape != sr.shape:   # a policy whose candidates follow its budget (d2o's prefix n - recent)
            rows = int(np.prod(sn.shape[:-1]))
            out["rows"] += rows
            out["rows_differing"] += rows
            out["rows_budget_differs"] += rows
            continue
        a_rows, b_rows = sn.reshape(-1, sn.shape[-1]), sr.reshape(-1, sr.shape[-1])
        n = a_rows.shape[1]
        for r in range(a_rows.shape[0]):
            a, b = a_rows[r], b_rows[r]
            k1 = int(np.ravel(kn)[r] if np.ndim(kn) else kn)
            k2 = int(np.ravel(kr)[r] if np.ndim(kr) else kr)
            order_n, order_r = np.argsort(-a, kind="stable"), np.argsort(-b, kind="stable")
            set_n, set_r = set(order_n[:k1].tolist()), set(order_r[:k2].tolist())
            out["rows"] += 1
            if set_n == set_r:
                continue
            out["rows_differing"] += 1
            out["rows_budget_differs"] += k1 != k2
            rank = np.empty(n, np.int64)
            rank[order_n] = np.arange(n)
            last_kept = a[order_n[k1 - 1]] if k1 > 0 else np.inf
            first_out = a[order_n[k1]] if k1 < n else -np.inf
            cut = abs(float(np.mean([x for x in (last_kept, first_out) if np.isfinite(x)])))
            scale = max(cut, 1e-12 * float(np.abs(a).max()), 1e-300)
            flipped = sorted(set_n ^ set_r)
            delta = float(np.abs(a[flipped] - b[flipped]).max()) / scale
            gaps, ranks = [], []
            for j in flipped:
                if j in set_n:
                    gaps.append((a[j] - first_out) / scale)
                    ranks.append(int(k1 - rank[j]))
                else:
                    gaps.append((last_kept - a[j]) / scale)
                    ranks.append(int(rank[j] - k1 + 1))
            gaps = [float(g) if np.isfinite(g) else float("inf") for g in gaps]
            out["flipped"] += len(gaps)
            out["gap_max"] = max(out["gap_max"], max(gaps))
            out["rank_max"] = max(out["rank_max"], max(ranks))
            out["delta_max"] = max(out["delta_max"], delta)
            if k1 == k2:
                out["beyond_near_tie"] += sum(g > 2 * delta for g in gaps)
            if out["first"] is None:
                out["first"] = {"selection": i, "row": r, "budget": [k1, k2], "flipped": len(gaps),
                                "gap": max(gaps), "rank": max(ranks), "delta": delta}
    return out


def logits_distance(native: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(max abs difference, KL(native || reference) in nats) of two logit vectors."""
    a, b = native.astype(np.float64), reference.astype(np.float64)
    la = a - a.max() - np.log(np.exp(a - a.max()).sum())
    lb = b - b.max() - np.log(np.exp(b - b.max()).sum())
    kl = float(np.sum(np.exp(la) * (la - lb)))
    return float(np.abs(a - b).max()), max(kl, 0.0)


def greedy_compare(native, reference, n_tokens: int, seq_n: int = 0, seq_r: int = 0) -> dict:
    """Decode greedily in the native engine, feeding the same tokens to the reference (teacher forcing).

    The logits present right after prefill were computed before the compression, so the first
    comparison that sees the compressed caches is after the first decoded token: that is the
    "next-token" comparison (logits_max_abs, kl). Then n_tokens - 1 more steps; greedy_agree counts
    the steps (of n_tokens) where the reference's argmax is the native engine's token.
    """
    ln = native.logits(seq_n)
    prefill_err, _ = logits_distance(ln, reference.logits(seq_r))
    tok = int(np.argmax(ln))
    tokens, kls, errs = [tok], [], []
    agree, prefix, diverged = 0, 0, False
    for _ in range(n_tokens):
        native.step({seq_n: tok})
        reference.step({seq_r: tok})
        ln, lr = native.logits(seq_n), reference.logits(seq_r)
        err, kl = logits_distance(ln, lr)
        errs.append(err)
        kls.append(kl)
        tok = int(np.argmax(ln))
        same = int(np.argmax(lr)) == tok
        agree += same
        diverged = diverged or not same
        prefix += not diverged
        tokens.append(tok)
    return {"logits_max_abs": errs[0], "kl": kls[0], "kl_mean": float(np.mean(kls)), "kl_max": float(np.max(kls)),
            "prefill_logits_max_abs": prefill_err, "greedy_agree": agree / n_tokens, "greedy_prefix": prefix,
            "greedy_tokens": n_tokens, "native_tokens": tokens}


# --------------------------------------------------------------------------------- the check


@dataclass
class CheckSettings:
    budget: int = 256
    n_tokens: int = 16              # greedy tokens of L3
    cache_type: str = "f16"         # native KV cache type
    flash_attn: bool = True         # native flash attention
    l2_window: int = 32             # window queries of the L2 observation (besides every policy's own window)
    levels: tuple = (1, 2, 3)
    instruction: str = "Summarise the document above in three sentences."
    doc_tokens: int | None = None   # cut the document to this many tokens before templating
    chunk: int | None = None        # chunked prefill in chunks of this many tokens (None: one prefill)
    chunk_scoring: str = "question"   # chunked: which queries score each chunk (kvcli/drivers/chunked.py)
    threads: int | None = None      # CPU threads of both engines (None: the native default, torch's own)
    strict_plans: bool = False      # a plan-agreement miss fails the check too (default: reported only)


def policies_to_check(names) -> list[str]:
    if not names:
        return policies.available()
    out = []
    for n in names:
        for part in str(n).split(","):
            if part.strip():
                spec = policies.get(part.strip())
                if spec.name not in out:
                    out.append(spec.name)
    return out


def build_tokens(native, document: str, settings: CheckSettings) -> list[int]:
    """The prompt both engines get: the document (optionally cut) and the instruction, templated
    and tokenised once by the native engine."""
    if settings.doc_tokens is not None:
        doc_toks = native.tokenize(document)
        if len(doc_toks) > settings.doc_tokens:
            document = native.detokenize(doc_toks[: settings.doc_tokens])
    return native.tokenize(build_prompt(native, document, settings.instruction))


def run_check(model_path, document: str, policy_names=None, settings: CheckSettings | None = None,
              thresholds: Thresholds | None = None, log=None) -> dict:
    """Run the levels of `settings.levels` for each policy; returns the JSON-ready report."""
    from kvcli.reference.session import ReferenceSession  # noqa: PLC0415

    settings = settings or CheckSettings()
    th = thresholds or Thresholds()
    log = log or (lambda msg: None)
    names = policies_to_check(policy_names)
    levels = set(settings.levels)
    if not levels or not levels <= {1, 2, 3}:
        raise KvcliError("levels must be a subset of 1,2,3")
    if settings.budget < 1:
        raise KvcliError(f"budget must be >= 1 (got {settings.budget})")
    if settings.n_tokens < 1:
        raise KvcliError("the number of greedy tokens must be >= 1")
    if not document or not document.strip():
        raise KvcliError("the document is empty")
    if settings.chunk is not None:
        if settings.chunk < MIN_CHUNK:
            raise KvcliError(f"--chunk must be at least {MIN_CHUNK} tokens (got {settings.chunk})")
    # every bad policy parameter / budget is reported before any model is loaded (compresskv with the model's
    # calibration, as run/bench/eval plan it)
    # checking several policies, one the model cannot run (kvzip on a sliding-window model) is skipped, said why
    unfit = {name: model_refusal(policies.get(name), model_path) for name in names} if len(names) > 1 else {}
    unfit = {k: v for k, v in unfit.items() if v}
    names = [name for name in names if name not in unfit]
    specs = {name: compress.resolve(model_path, name, settings.budget) for name in names}

    t0 = time.perf_counter()
    if settings.threads is not None and settings.threads < 1:
        raise KvcliError(f"--threads must be >= 1 (got {settings.threads})")
    native = NativeSession(model_path, n_ctx=0, cache_type=settings.cache_type, flash_attn=settings.flash_attn,
                           n_threads=settings.threads)
    tokens = build_tokens(native, document, settings)
    n = len(tokens)
    if settings.chunk is not None:
        try:
            report = _run_chunked(native, model_path, tokens, names, specs, settings, th, log, t0)
            return _with_skipped(report, unfit)
        finally:
            native.close()
    if n >= native.n_ctx_train:
        raise KvcliError(f"the prompt is {n} tokens, the model's context is {native.n_ctx_train}: use --doc-tokens")
    window = observed_windows(specs, names, settings.l2_window, n)
    # kvzip's reconstruction pass needs room after the prompt (kvcli/drivers/reconstruct.py); both engines get the
    # same context, so they feed the same passes
    recon = [c.params["repeat_chunk"] for c in specs.values() if "colmax" in c.spec.needs]
    queried = ("query",) if any("query" in c.spec.needs for c in specs.values()) else ()   # expected_attention
    room = max([settings.n_tokens + 8] + [repeat_room(n, r) for r in recon])
    n_ctx = -(-(n + room) // 256) * 256
    native.create_context(min(n_ctx, native.n_ctx_train))
    # L1 compares the two planners on the native observation: it needs no reference engine
    reference = None
    if levels & {2, 3}:
        log(f"{n} prompt tokens; loading the reference engine")
        reference = ReferenceSession(model_path, n_ctx=native.n_ctx, n_threads=settings.threads)

    report = {"model": str(model_path), "prompt_tokens": n, "n_ctx": native.n_ctx, "budget": settings.budget,
              "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()},
              "thresholds": th.as_dict(), "policies": []}

    # the reference prefills once, observing everything; each policy's L3 gets that prefill back (compress.Shared)
    shared = base_obs = None
    if reference is not None:
        log("reference prefill")
        runnable = [c for c in specs.values() if c.spec.native and c.spec.reference]
        shared = compress.Shared(reference, tokens, runnable if 3 in levels else [],
                                 observe=("window", "colsum", "kv") + (("colmax",) if recon else ()) + queried,
                                 window=window, planner="reference", repeat_chunk=max(recon, default=None))
        if shared.error is not None or shared.obs_error is not None:
            raise shared.error or shared.obs_error
        base_obs = shared.obs
        if shared.state is None and 3 in levels:   # L3 puts the prefill back for each policy's second comparison
            shared.state = reference.save_seq(0)

    if 2 in levels:
        log("L2: native prefill with observation")
        try:
            native.clear(0)
            nat_obs = native.prefill(tokens, seq=0, observe=("window", "colsum", "kv") + queried, window=window)
            if recon:   # the reconstruction pass's column maxima (kvzip), as the reference's Shared prefill made them
                nat_obs.colmax, _ = reconstruct(native, tokens, 0, max(recon))
            allow = l2_allowances(model_path, tokens, settings, native.n_ctx, reference)
            report["l2"] = compare_observations(nat_obs, base_obs, th, allow)
            _note_allowances(report["l2"], allow, native.info)
        except KvcliError as e:
            report["l2"] = {"pass": False, "error": str(e)}

    for name in names:
        cfg = specs[name]
        entry = {"policy": name, "note": cfg.fit_note(n)}
        report["policies"].append(entry)
        if not (cfg.spec.native and cfg.spec.reference):
            missing = "native" if not cfg.spec.native else "reference"
            entry["skipped"] = f"no {missing} implementation"
            log(f"{name}: skipped ({entry['skipped']})")
            continue
        log(f"{name}: native prefill, L1 and L3")
        l1_steps, planned = [], {}

        def both_planners(step, obs, plan_n, cfg=cfg, l1_steps=l1_steps, planned=planned):
            # the torch planner on the native observation (L1), its selections recorded for plan agreement
            from kvcli.reference.policies._common import recording  # noqa: PLC0415
            planned["plan"] = plan_n
            with recording() as calls:
                if 1 in levels:
                    l1_steps.append(_l1(cfg, obs, plan_n, th))
                elif cfg.compresses(obs.n):
                    make_plan(cfg.spec, cfg.params, cfg.budget, obs, "reference")
            planned["calls"] = calls

        try:
            native.clear(0)
            # the native engine observes, plans and compresses its own cache; planned even when nothing is
            # compressed: both planners must then keep everything (L1 on the native plan's observation)
            compress.compress_as(native, tokens, cfg, planner="native", plan_always=True, on_step=both_planners)
            if l1_steps:
                entry["l1"] = l1_steps[0]
            if 3 in levels:
                entry["l3"], entry["plans"] = _level3(native, shared, cfg, settings, th, planned["plan"],
                                                      planned.get("calls"), tokens)
        except KvcliError as e:
            entry["error"] = str(e)
    _with_skipped(report, unfit)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    report["passed"] = _passed(report)
    native.close()
    return report


def _l1(cfg, obs, plan_n, th) -> dict:
    """L1 of one planning step: the torch planner on the observation the native plan was made from."""
    return compare_plans(plan_n, make_plan(cfg.spec, cfg.params, cfg.budget, obs, "reference"),
                         th.l1_merge_atol)


def _level3(native, shared, cfg, settings, th, plan_n, calls_n, tokens) -> tuple[dict, dict]:
    """L3 of one policy, after the native engine compressed sequence 0 with its own plan `plan_n` (made from the
    observation on which the torch planner's selections were `calls_n`; None: not recorded).

    Arithmetic: the reference engine's prefill (`shared`) gets the *native* plan, and both decode: the engines'
    arithmetic on one compressed cache. Plan agreement: the reference prefill is given back to this
    configuration, planned from its own observation by its own planner (`shared.apply`), and both decode again
    (the native engine from its compressed state, saved before)."""
    ref, n = shared.session, shared.n
    if shared.used:
        ref.restore_seq(shared.state, shared.seq)
    shared.used = True
    compresses = cfg.compresses(n)
    if compresses:
        ref.apply_plan(plan_n, seq=shared.seq)
    if not compresses:   # full, or a prompt within the budget: one comparison serves both verdicts
        arith = _arithmetic(native, ref, settings, th)
        plans = _plans(native, ref, jaccard_per_head(native.kept_positions(0), ref.kept_positions(0)), settings, th,
                       own=arith, margins=None)
        return arith, plans
    state_n = native.save_seq(0)
    arith = _arithmetic(native, ref, settings, th, native_plan=plan_summary(plan_n))
    if not arith["pass"]:
        arith["allowance"] = arithmetic_allowance(native, state_n, shared, tokens, plan_n, settings, th,
                                                  arith["native_tokens"][0])
        arith["pass"] = arith["allowance"]["pass"]
    native.restore_seq(state_n, 0)
    from kvcli.reference.policies._common import recording  # noqa: PLC0415
    with recording() as calls_r:
        applied = shared.apply(cfg)
    if applied.error is not None:
        raise applied.error
    jac = jaccard_per_head(native.kept_positions(0), ref.kept_positions(0))
    margins = selection_margins(calls_n, calls_r) if calls_n is not None else None
    plans = _plans(native, ref, jac, settings, th, margins=margins, budgets=(plan_n, applied.plan))
    return arith, plans


def arithmetic_allowance(native, state_n, shared, tokens, plan, settings, th, first: int) -> dict:
    """L3 arithmetic beyond the native cache type's limits: the same plan passes only for one of two measured reasons,
    tried in this order (each field of the result holds its figures):
    - `llamacpp_arithmetic`: the reference engine given llama.cpp's activation arithmetic (8-bit matmul inputs, f16
      GELU table: kvcli/reference/llamacpp_arithmetic.py) prefills, applies the plan and decodes again, teacher-forced
      on the native tokens, within the cache type's limits: the miss was llama.cpp's rounding of the activations at a
      sensitive step, not kvcli's cache (measured, issue 31: snapkv at budget 64 on qwen2.5-coder-0.5b and the
      diskcache METADATA, next-token KL 0.056 against the float32 reference, 0.011 against the emulating one);
    - `precision`: the plan is ill-conditioned at the cache's precision (`precision_sensitivity`, f16 only).
    Neither emulation changes which entries are held or how they are attended: a compaction, mask or position defect
    still fails."""
    out: dict = {"pass": False, "by": None, "cache_type": settings.cache_type}
    out["llamacpp_arithmetic"] = _emulated_arithmetic(native, state_n, shared, tokens, plan, settings, th)
    if out["llamacpp_arithmetic"]["pass"]:
        out.update({"pass": True, "by": "llamacpp_arithmetic"})
        return out
    out["precision"] = precision_sensitivity(native, shared, tokens, plan, settings, th, first)
    if out["precision"]["pass"]:
        out.update({"pass": True, "by": "precision"})
    return out


def _emulated_arithmetic(native, state_n, shared, tokens, plan, settings, th) -> dict:
    """The native engine's compacted sequence (`state_n`) against the reference with llama.cpp's activation
    arithmetic, the same plan, the cache type's limits."""
    from kvcli.reference.llamacpp_arithmetic import llamacpp_activations  # noqa: PLC0415

    ref, seq = shared.session, shared.seq
    native.restore_seq(state_n, 0)
    ref.clear(seq)
    with llamacpp_activations(ref.model, ref.model_path):
        ref.prefill(tokens, seq=seq)
        ref.apply_plan(plan, seq=seq)
        r = greedy_compare(native, ref, settings.n_tokens, 0, seq)
    limits = th.arithmetic(settings.cache_type)
    r["pass"] = bool(r["kl"] <= limits["kl_max"] and r["logits_max_abs"] <= limits["logits_atol"]
                     and r["greedy_agree"] >= limits["greedy_min"])
    return {k: r[k] for k in ("logits_max_abs", "kl", "greedy_agree", "pass")}


def _round_reference_cache(reference, seq: int, cache_type: str) -> None:
    """Store the reference's cache of `seq` as a native `cache_type` cache stores it (f16: K and V rounded)."""
    if cache_type != "f16":
        raise KvcliError(f"no rounding of the reference cache to {cache_type}")
    for layer in reference.seq(seq).cache.layers:
        layer.keys.copy_(layer.keys.half().float())
        layer.values.copy_(layer.values.half().float())


def precision_sensitivity(native, shared, tokens, plan, settings, th, first: int) -> dict:
    """L3 arithmetic when the native cache type's limits are missed: is the plan itself precision-sensitive?

    Two measurements, each a next-token comparison after the native engine's first decoded token:
    - `reference_rounding`: the reference engine decoding the same plan from its float32 cache and from that cache
      rounded to the native cache type (f16). No llama.cpp in it: how far storing this plan's cache at that precision
      moves the output by itself.
    - `equal_precision`: the native engine at f32 without flash attention (a fresh context: prefill, the same plan)
      against the reference, teacher-forced over the check's tokens, within the f32 limits.
    The verdict passes when the rounding alone moves the reference beyond the cache type's limits (the plan is
    ill-conditioned at that precision: measured, issue 31, spindlekv at budget 64 on qwen2.5-coder-0.5b, whose
    merged entries of multiplicity up to 68 in heads keeping one entry turn f16 rounding into KL 0.62) and the
    engines agree at equal precision. A compaction or mask defect of the f16 path moves a well-conditioned plan,
    whose rounding stays within the limits, so it still fails; q8_0 and f32 checks have no such allowance."""
    out: dict = {"pass": False, "cache_type": settings.cache_type}
    if settings.cache_type != "f16":
        out["why"] = f"no precision allowance for a {settings.cache_type} cache"
        return out
    ref, seq = shared.session, shared.seq

    def reference_logits(rounded: bool) -> np.ndarray:
        ref.restore_seq(shared.state, seq)
        ref.apply_plan(plan, seq=seq)
        if rounded:
            _round_reference_cache(ref, seq, settings.cache_type)
        ref.step({seq: first})
        return ref.logits(seq)

    limits = th.arithmetic(settings.cache_type)
    err, kl = logits_distance(reference_logits(True), reference_logits(False))
    out["reference_rounding"] = {"logits_max_abs": err, "kl": kl,
                                 "beyond_limits": bool(kl > limits["kl_max"] or err > limits["logits_atol"])}
    twin = NativeSession(native.model_path, n_ctx=0, cache_type="f32", flash_attn=False, n_threads=settings.threads)
    try:
        twin.create_context(native.n_ctx)
        twin.prefill(tokens, seq=0)
        twin.apply_plan(plan, seq=0)
        ref.restore_seq(shared.state, seq)
        ref.apply_plan(plan, seq=seq)
        eq = greedy_compare(twin, ref, settings.n_tokens, 0, seq)
    finally:
        twin.close()
    f32 = th.arithmetic("f32")
    eq["pass"] = bool(eq["kl"] <= f32["kl_max"] and eq["logits_max_abs"] <= f32["logits_atol"]
                      and eq["greedy_agree"] >= f32["greedy_min"])
    out["equal_precision"] = {k: eq[k] for k in ("logits_max_abs", "kl", "greedy_agree", "pass")}
    out["pass"] = out["reference_rounding"]["beyond_limits"] and eq["pass"]
    return out


def plan_summary(plan: Plan) -> dict:
    """What L3 arithmetic's report says of the plan both engines decoded (to find a plan a compaction mishandles)."""
    lm = plan.log_mult
    return {"entries": int(plan.entries()), "min_kept": int(plan.n_kept.min()) if plan.n_kept.size else 0,
            "merged_rows": int(plan.replace_entry.size),
            "log_mult_max": float(np.abs(lm).max()) if lm is not None and lm.size else 0.0}


def _arithmetic(native, reference, settings, th, **extra) -> dict:
    """L3 arithmetic: both engines hold the same plan's cache; decode and compare with the cache type's limits."""
    limits = th.arithmetic(settings.cache_type)
    out = {"plan": "native", "cache_type": settings.cache_type, "limits": limits, **extra}
    out.update(greedy_compare(native, reference, settings.n_tokens, 0, 0))
    out["pass"] = bool(out["kl"] <= limits["kl_max"] and out["logits_max_abs"] <= limits["logits_atol"]
                       and out["greedy_agree"] >= limits["greedy_min"])
    return out


def _plans(native, reference, jac_heads: list[list[float]], settings, th, own: dict | None = None,
           margins: dict | None = None, budgets=None, **extra) -> dict:
    """Plan agreement after each engine compressed sequence 0 with its own plan: the kept positions per layer and
    KV head, the layer budgets, the sensitivity figure (`selection_margins`), and both engines decoding their own
    plans (`own`: that comparison made already)."""
    jac = [float(np.mean(js)) for js in jac_heads]
    out = {"jaccard_min": min(jac), "jaccard_mean": float(np.mean(jac)), "jaccard_per_layer": jac,
           "jaccard_per_head": jac_heads, **extra}
    if budgets is not None and budgets[1] is not None:
        a, b = np.asarray(budgets[0].n_kept), np.asarray(budgets[1].n_kept)
        out["budgets_equal"] = bool(np.array_equal(a, b))
        out["layers_budget_differs"] = int((a != b).any(axis=1).sum())
        out["budget_max_diff"] = int(np.abs(a.astype(np.int64) - b).max()) if a.size else 0
    if margins is not None:
        out["margins"] = margins
    own = own if own is not None else greedy_compare(native, reference, settings.n_tokens, 0, 0)
    out.update({k: v for k, v in own.items() if k not in ("pass", "plan", "cache_type", "limits")})
    out["pass"] = bool(out["jaccard_min"] >= th.plan_jaccard_min and out["kl"] <= th.plan_kl_max
                       and out["greedy_agree"] >= th.plan_greedy_min)
    out["sensitivity"] = plan_sensitivity(out)
    return out


def plan_sensitivity(p: dict) -> str:
    """One line: what the plan-agreement figures say about the policy (empty when the plans agree)."""
    if p["pass"]:
        return ""
    parts = []
    if p["jaccard_min"] < 1.0:
        parts.append(f"kept sets overlap {p['jaccard_min']:.3f} (worst layer)")
    m = p.get("margins")
    if m and m.get("comparable") and m["rows_differing"]:
        text = (f"{m['rows_differing']} of {m['rows']} selections differ, {m['flipped']} entries flipped, "
                f"the farthest {m['gap_max']:.2g} x the cut score from the cut (rank {m['rank_max']}), the engines' "
                f"scores of flipped entries up to {m['delta_max']:.2g} x the cut score apart")
        if m["rows_budget_differs"]:
            text += f"; {m['rows_budget_differs']} took a different budget from the observation"
        if m["beyond_near_tie"]:
            text += f"; {m['beyond_near_tie']} flips beyond the engines' score difference"
        parts.append(text)
    elif m and not m.get("comparable"):
        parts.append(f"selections not comparable ({m.get('why')})")
    elif m and p["jaccard_min"] < 1.0 and not p.get("layers_budget_differs"):
        parts.append("the planners' selections agree on both observations, yet the caches keep different positions: "
                     "the engines apply a plan differently (see L3 arithmetic)")
    if p.get("layers_budget_differs"):
        parts.append(f"{p['layers_budget_differs']} layers' budgets differ (by up to {p['budget_max_diff']})")
    parts.append(f"own plans decode with KL {p['kl']:.3g}, greedy {p['greedy_agree'] * 100:.1f}%")
    if m and m.get("comparable") and m["rows_differing"] and not m["beyond_near_tie"] and not m["rows_budget_differs"]:
        kind = "near-ties"
    elif (m and m.get("rows_budget_differs")) or p.get("layers_budget_differs"):
        kind = "budget allocation"
    elif m and m.get("comparable") and not m["rows_differing"] and p["jaccard_min"] < 1.0:
        kind = "not the plans"
    else:
        kind = "plans"
    return f"sensitive ({kind}): " + "; ".join(parts)


# --------------------------------------------------------------------------------- chunked prefill


class Origins:
    """The original prompt index held by each (layer, KV head, slot) of a sequence read in chunks, followed
    through the plans of the chunked driver. Engine-independent: in both engines a compaction leaves
    B = plan.max_kept slots and the next tokens enter at slots B, B+1, ... in prompt order. A (l, h)
    keeping k entries holds them in slots 0..k-1 (a compaction without re-indexing) or B-k..B-1 (with:
    right-aligned); the other slots are dead padding, -1 here."""

    def __init__(self, n_layer: int, n_head_kv: int):
        self.ids = [[np.zeros(0, np.int64) for _ in range(n_head_kv)] for _ in range(n_layer)]
        self.width = 0        # slots held after the last compaction
        self.consumed = 0     # prompt tokens entered so far

    def _grow(self, n_slots: int) -> None:
        new = n_slots - self.width
        if new < 0:
            raise KvcliError(f"the sequence holds {n_slots} slots, fewer than the {self.width} its last plan left")
        fresh = np.arange(self.consumed, self.consumed + new, dtype=np.int64)
        self.ids = [[np.concatenate([h, fresh]) for h in layer] for layer in self.ids]
        self.consumed += new
        self.width = n_slots

    def on_plan(self, n_slots: int, plan: Plan, reindexed: bool = True) -> None:
        """A plan made over `n_slots` slots was applied (with re-indexing: right-aligned slots)."""
        self._grow(n_slots)
        width = plan.max_kept
        out = []
        for l, layer in enumerate(self.ids):
            row = []
            for h, ids in enumerate(layer):
                slots = np.full(width, -1, np.int64)   # a dead slot a plan picks stays dead (-1)
                start = plan.first_slot(l, h, reindexed)
                slots[start: start + plan.n_kept[l, h]] = ids[plan.kept(l, h)]
                row.append(slots)
            out.append(row)
        self.ids, self.width = out, width

    def kept(self, n_slots: int) -> list[list[np.ndarray]]:
        """Original positions live in each (layer, KV head) of a sequence of `n_slots` slots now."""
        self._grow(n_slots)
        return [[h[h >= 0] for h in layer] for layer in self.ids]


def _merge_l1(steps: list[dict]) -> dict:
    """One L1 verdict for all planning steps of a chunked prefill."""
    out = {"pass": all(s["pass"] for s in steps), "steps": len(steps),
           "steps_differing": sum(not s["pass"] for s in steps),
           "identical_budgets": all(s["identical_budgets"] for s in steps),
           "heads_differing": sum(s["heads_differing"] for s in steps),
           "merged_rows": sum(s.get("merged_rows", 0) for s in steps),
           "merge_max_abs": max((s["merge_max_abs"] for s in steps), default=0.0),
           "log_mult_max_abs": max((s["log_mult_max_abs"] for s in steps), default=0.0),
           "entries": [s["entries"] for s in steps], "first_difference": None}
    for i, s in enumerate(steps):
        if not s["pass"]:
            out["first_difference"] = f"step {i}: {s['first_difference']}"
            break
    return out


def _run_chunked(native, model_path, tokens, names, specs, settings, th, log, t0) -> dict:
    """kvcli check --chunk: both engines read `tokens` in chunks with the driver, kvcli.drivers.compress (see the module
    doc)."""
    from kvcli.reference.session import ReferenceSession  # noqa: PLC0415

    n, levels, chunk = len(tokens), set(settings.levels), settings.chunk
    reserve = settings.n_tokens + 8
    sizing = {}
    for name in names:   # sizes (and bad combinations) before the reference engine is loaded
        if name == "full":
            continue
        c = chunked.plan_chunking(n, reserve, native.n_ctx_train, name, settings.budget, chunk,
                                  cell_bytes=native.bytes_per_cell())
        if c.chunk is None:
            raise KvcliError(f"the prompt ({n} tokens) fits in one chunk of {chunk}: choose a smaller --chunk "
                             "(or drop it to check a single prefill)")
        sizing[name] = c
    if not sizing:
        raise KvcliError("chunked prefill compresses after every chunk: choose a compressing policy")
    n_ctx = max(c.n_ctx for c in sizing.values())
    native.create_context(n_ctx)
    log(f"{n} prompt tokens in chunks of {chunk}; loading the reference engine")
    reference = ReferenceSession(model_path, n_ctx=native.n_ctx, n_threads=settings.threads)
    info = native.info
    reindexed = not chunked.keeps_positions(info)   # sliding-window models keep positions
    report = {"model": str(model_path), "prompt_tokens": n, "n_ctx": native.n_ctx, "budget": settings.budget,
              "chunk": chunk,
              "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()},
              "thresholds": th.as_dict(), "policies": []}

    if 2 in levels:   # the first chunk's observation, the one both engines compute from the same tokens
        log("L2: observation of the first chunk in both engines")
        first = tokens[:chunk]
        window = observed_windows(specs, sizing, settings.l2_window, len(first))
        try:
            native.clear(0)
            reference.clear(0)
            kinds = ("window", "colsum", "kv")
            nat_obs = native.prefill(first, seq=0, observe=kinds, window=window)
            ref_obs = reference.prefill(first, seq=0, observe=kinds, window=window)
            allow = l2_allowances(model_path, first, settings, native.n_ctx, reference)
            report["l2"] = compare_observations(nat_obs, ref_obs, th, allow)
            report["l2"]["tokens"] = len(first)
            _note_allowances(report["l2"], allow, native.info)
        except KvcliError as e:
            report["l2"] = {"pass": False, "error": str(e)}

    for name in names:
        cfg = specs[name]
        entry = {"policy": name, "note": ""}
        report["policies"].append(entry)
        if name not in sizing:
            entry["skipped"] = "chunked prefill needs a compressing policy"
            continue
        if not (cfg.spec.native and cfg.spec.reference):
            entry["skipped"] = f"no {'native' if not cfg.spec.native else 'reference'} implementation"
            log(f"{name}: skipped ({entry['skipped']})")
            continue
        log(f"{name}: chunked prefill in both engines, L1 at every step, L3")
        reading = dict(instruction=settings.instruction, chunk=chunk, cap=sizing[name].cap,
                       scoring=settings.chunk_scoring)
        try:
            l1_steps, origins_n, plans_n = [], Origins(info.n_layer, info.n_head_kv), []

            def native_step(step, obs, plan_n, cfg=cfg, l1_steps=l1_steps, origins=origins_n, plans_n=plans_n):
                if 1 in levels:
                    l1_steps.append(_l1(cfg, obs, plan_n, th))
                origins.on_plan(obs.n, plan_n, reindexed)
                plans_n.append(plan_n)

            native.clear(0)
            rep_n = compress.prefill_and_compress(native, tokens, name, settings.budget, {}, planner="native",
                                                  on_step=native_step, **reading)
            entry["chunks"] = len(rep_n.steps)
            entry["steps"] = [[s.cells_before, s.cells_after] for s in rep_n.steps]
            if 1 in levels:
                entry["l1"] = _merge_l1(l1_steps)
            if 3 in levels:
                kept_n = origins_n.kept(native.stats(0)["kv_cells"])
                state_n = native.save_seq(0)
                # arithmetic: the reference engine reads the prompt in the same chunks with the native plans
                replay = iter(plans_n)

                def native_plans(spec, params, budget, obs, replay=replay):
                    plan = next(replay, None)
                    if plan is None:
                        raise KvcliError("the reference engine planned more steps than the native engine")
                    return plan

                reference.clear(0)
                rep_a = compress.prefill_and_compress(reference, tokens, name, settings.budget, {},
                                                      planner=native_plans, **reading)
                entry["l3"] = _arithmetic(native, reference, settings, th, peak_cells=[rep_n.peak_cells,
                                                                                      rep_a.peak_cells])
                native.restore_seq(state_n, 0)
                # plan agreement: the reference engine reads them with its own plans
                origins_r = Origins(info.n_layer, info.n_head_kv)
                reference.clear(0)
                rep_r = compress.prefill_and_compress(
                    reference, tokens, name, settings.budget, {}, planner="reference",
                    on_step=lambda step, obs, plan, o=origins_r: o.on_plan(obs.n, plan, reindexed), **reading)
                kept_r = origins_r.kept(reference.stats(0)["kv_cells"])
                entry["plans"] = _plans(native, reference, jaccard_per_head(kept_n, kept_r), settings, th,
                                        peak_cells=[rep_n.peak_cells, rep_r.peak_cells],
                                        reference_steps=[[s.cells_before, s.cells_after] for s in rep_r.steps])
                entry["l3"]["reference_steps"] = [[s.cells_before, s.cells_after] for s in rep_a.steps]
        except KvcliError as e:
            entry["error"] = str(e)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    report["passed"] = _passed(report)
    return report


def _with_skipped(report: dict, unfit: dict) -> dict:
    """The policies left out because the model or the reading cannot run them, each with why."""
    report["policies"] += [{"policy": name, "note": "", "skipped": why} for name, why in unfit.items()]
    return report


def _passed(report: dict) -> bool:
    """The exit status: the engine verdicts (L1, L2, L3 arithmetic) and no errors; a plan-agreement miss only with
    `strict_plans`. Also fills report["plans_agree"] and report["plan_sensitive"] (the policies that missed)."""
    ok = report.get("l2", {"pass": True})["pass"]
    report["plan_sensitive"] = [e["policy"] for e in report["policies"] if "plans" in e and not e["plans"]["pass"]]
    report["plans_agree"] = not report["plan_sensitive"]
    for e in report["policies"]:
        if "error" in e:
            ok = False
        for lvl in ("l1", "l3"):
            if lvl in e and not e[lvl]["pass"]:
                ok = False
    report["engines_agree"] = bool(ok)
    if report["settings"].get("strict_plans") and not report["plans_agree"]:
        ok = False
    return bool(ok)
