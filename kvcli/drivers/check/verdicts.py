"""What every run of `kvcli check` shares, one prefill or chunked: its settings (`CheckSettings`), the prompt both
engines get, the policies checked, the windows observed, and the verdicts built from the comparisons: L1 per
planning step, L3 arithmetic and plan agreement per policy, the exit status (`passed`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcli import doc_formats, policies
from kvcli.planning.planner import make_plan
from kvcli.drivers.check.comparators import compare_plans, greedy_compare
from kvcli.templating import build_prompt
from kvcli.planning.formats import Plan


# --------------------------------------------------------------------------------- settings and prompt


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


def announce_read(native, tokens: list[int], chunk: int | None) -> None:
    """A long read of the document says its token count and estimated time before the first read starts
    (doc_formats.announce_read, one line on stderr, as kvcli run says it): the time of one read in the native engine,
    where check reads it at least once per policy (and in the reference engine too); `native` holds a context, its
    sequence 0 empty (a probe may be prefilled there)."""
    how = f"in chunks of {chunk}" if chunk else "in one prefill"
    doc_formats.announce_read(native, tokens, "chunked" if chunk else "prefill",
                              f"reading it {how} in the native engine (at least once per policy)", probe_seq=0)


def observed_windows(specs: dict, names, l2_window: int, n: int) -> tuple[int, ...]:
    """The window lengths one observation must hold for L2 and every named policy's window (at most n)."""
    ws = {min(l2_window, n)}
    for p in names:
        kinds, w = specs[p].observe
        if "window" in kinds or "query" in kinds:   # query rows: the longest window's (the query kind)
            ws.add(min(w, n))
    return tuple(sorted(ws))


# --------------------------------------------------------------------------------- verdicts


def l1_verdict(cfg, obs, plan_n, th) -> dict:
    """L1 of one planning step: the torch planner on the observation the native plan was made from."""
    return compare_plans(plan_n, make_plan(cfg.spec, cfg.params, cfg.budget, obs, "reference"),
                         th.l1_merge_atol)


def plan_summary(plan: Plan) -> dict:
    """What L3 arithmetic's report says of the plan both engines decoded (to find a plan a compaction mishandles)."""
    lm = plan.log_mult
    return {"entries": int(plan.entries()), "min_kept": int(plan.n_kept.min()) if plan.n_kept.size else 0,
            "merged_rows": int(plan.replace_entry.size),
            "log_mult_max": float(np.abs(lm).max()) if lm is not None and lm.size else 0.0}


def arithmetic_verdict(native, reference, settings, th, **extra) -> dict:
    """L3 arithmetic: both engines hold the same plan's cache; decode and compare with the cache type's limits."""
    limits = th.arithmetic(settings.cache_type)
    out = {"plan": "native", "cache_type": settings.cache_type, "limits": limits, **extra}
    out.update(greedy_compare(native, reference, settings.n_tokens, 0, 0))
    out["pass"] = bool(out["kl"] <= limits["kl_max"] and out["logits_max_abs"] <= limits["logits_atol"]
                       and out["greedy_agree"] >= limits["greedy_min"])
    return out


def plans_verdict(native, reference, jac_heads: list[list[float]], settings, th, own: dict | None = None,
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


def with_skipped(report: dict, unfit: dict) -> dict:
    """The policies left out because the model or the reading cannot run them, each with why."""
    report["policies"] += [{"policy": name, "note": "", "skipped": why} for name, why in unfit.items()]
    return report


def passed(report: dict) -> bool:
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
