"""`kvcli check`'s comparisons of the two engines' outputs, level by level: plans (L1), observation arrays and K/V
rows (L2), kept sets, selection margins, logits and greedy decoding (L3). Each returns a JSON-ready dict with its
`pass`; which differences are allowed anyway is kvcli/drivers/check/allowances.py."""
from __future__ import annotations

import numpy as np

from kvcli.drivers.check.thresholds import Thresholds
from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation, Plan


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
    if native.queries is not None and reference.queries is not None:   # observed Q rows (the query kind), like K rows
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
    took its budget from the observation (policies whose layer budgets follow the scores: counted in
    `rows_budget_differs`; a row whose candidates differ in number as well is counted there without a gap)."""
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
        if sn.shape != sr.shape:   # a policy whose candidates follow its budget (a prefix of n - recent)
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
