"""Issue #31's corpus sweep: `kvcli check` (kvcli.drivers.check.run_check, every policy both engines implement) on
text nobody in this project wrote, the licence and metadata files that installed packages ship in the venv.

Usage (one heavy process; the machine is shared, so run it niced):
  OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/check_corpus.py \
      [--models default,qwen2.5-coder-0.5b,gemma-3-270m] [--lengths 1000,2000] [--budgets 64,128] \
      [--texts psf-licence,diskcache-metadata] [--threads 1] [--tokens 16]
  .venv/bin/python benchmarks/check_corpus.py --table      # the pass-count table of what the files hold

Runs go in the order model, length, text, budget (so the default model's 1k runs come first). After every run the
model's file benchmarks/results/check-corpus-<model>.json is rewritten (a partial sweep is kept); a run already
in the file (same text, length, budget, threads) is skipped, so an interrupted sweep resumes where it stopped.

The texts (why these: docs/results/engine-agreement.md, "Corpus sweep"):
  psf-licence         typing_extensions' LICENSE: the PSF licence with Python's history, plain-text legal prose
  diskcache-metadata  diskcache's METADATA: e-mail style package headers, then a reStructuredText README
  rich-metadata       rich's METADATA: headers, then a Markdown README (badges, links, code, a table)
Each is cut to its first LENGTH tokens (the model's own tokenizer) before the instruction is added, as
`kvcli check --doc-tokens LENGTH` does.

Pass counts per run: L1 and L3 arithmetic and plan agreement over the checked policies, L2 once per run (one
observation per prompt). Engine verdicts: L1, L2, L3 arithmetic; plan agreement is the policy's sensitivity."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".venv" / "lib" / "python3.11" / "site-packages"
OUT = ROOT / "benchmarks" / "results"

TEXTS = {
    "psf-licence": ("typing_extensions", "typing_extensions-4.16.0.dist-info/licenses/LICENSE"),
    "diskcache-metadata": ("diskcache", "diskcache-5.6.3.dist-info/METADATA"),
    "rich-metadata": ("rich", "rich-15.0.0.dist-info/METADATA"),
}
MODELS = {"default": None, "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b", "gemma-3-270m": "gemma-3-270m"}


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return ""


def text_info(key: str) -> dict:
    package, rel = TEXTS[key]
    path = SITE / rel
    data = path.read_bytes()
    return {"package": package, "file": str(path.relative_to(ROOT)), "chars": len(data.decode("utf-8")),
            "sha256": hashlib.sha256(data).hexdigest()}


def model_file(name: str) -> Path:
    return OUT / f"check-corpus-{name}.json"


def load(name: str) -> dict:
    f = model_file(name)
    return json.loads(f.read_text()) if f.exists() else {"model": name, "texts": {}, "runs": []}


def save(name: str, data: dict) -> None:
    f = model_file(name)
    tmp = f.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=float))
    os.replace(tmp, f)


def counts(report: dict) -> dict:
    """Pass counts of one run: policies checked, L1, L3 arithmetic and plan agreement passes; L2; what failed."""
    checked = [e for e in report["policies"] if "skipped" not in e]
    c = {"tokens": report["prompt_tokens"], "policies": len(checked),
         "skipped": [e["policy"] for e in report["policies"] if "skipped" in e],
         "errors": {e["policy"]: e["error"] for e in checked if "error" in e},
         "l2": (report.get("l2") or {}).get("pass"),
         "l1": sum(bool((e.get("l1") or {}).get("pass")) for e in checked),
         "l3": sum(bool((e.get("l3") or {}).get("pass")) for e in checked),
         "plans": sum(bool((e.get("plans") or {}).get("pass")) for e in checked),
         "l1_fail": [e["policy"] for e in checked if e.get("l1") is not None and not e["l1"]["pass"]],
         "l3_fail": {e["policy"]: {k: e["l3"].get(k) for k in ("kl", "logits_max_abs", "greedy_agree", "native_plan")}
                     for e in checked if e.get("l3") is not None and not e["l3"]["pass"]},
         "plan_miss": {e["policy"]: e["plans"].get("sensitivity") for e in checked
                       if e.get("plans") is not None and not e["plans"]["pass"]},
         # passes that needed an allowance (commit 32c62b2): L2 K/V rows explained by a named source, L3
         # arithmetic beyond the f16 limits passed as a precision-sensitive plan
         "l2_allowed": l2_allowed(report),
         # (runs before 6f060a7 hold the precision verdict alone, as l3.precision)
         "l3_precision": {e["policy"]: e["l3"].get("allowance") or e["l3"]["precision"] for e in checked
                          if e.get("l3") is not None and (e["l3"].get("allowance") or e["l3"].get("precision"))}}
    kls = [(e["l3"]["kl"], e["policy"]) for e in checked if e.get("l3") is not None]
    c["kl_max"] = max(kls) if kls else (float("nan"), "-")
    return c


def l2_allowed(report: dict) -> list[dict]:
    """K/V rows beyond `l2_kv_rtol` (each with the distances measured and the source that explained it, or None)."""
    l2 = report.get("l2") or {}
    return [dict(row, array=k) for k in ("keys", "values") if isinstance(l2.get(k), dict)
            for row in l2[k].get("rows_over_detail") or []]


def row_line(row: dict, report: dict) -> str:
    scale = ((report.get("l2") or {}).get(row["array"]) or {}).get("scale")
    rtol = (report.get("thresholds") or {}).get("l2_kv_rtol")
    lim = f", threshold {rtol * scale:.3g}" if scale and rtol else ""
    dists = ", ".join(f"{k} {row[k]:.3g}" + (f" (to the reference {row[k + '_to_reference']:.3g})"
                                             if k + "_to_reference" in row else "")
                      for k in ("native_precision", "native_ubatch", "reference_llamacpp_arithmetic") if k in row)
    return (f"{row['array'][0].upper()} row layer {row.get('model_layer', row['layer'])} head {row['kv_head']} slot "
            f"{row['slot']}: engines {row['engines']:.3g}{lim}; {dists}; allowed by {row['explained_by'] or 'none'}")


def precision_line(a: dict) -> str:
    """An L3 arithmetic allowance (commit 6f060a7: l3.allowance, llama.cpp's arithmetic first, then precision)."""
    em, v = a.get("llamacpp_arithmetic") or {}, (a if "reference_rounding" in a else a.get("precision") or {})
    s = f"{'passed' if a.get('pass') else 'not passed'}" + (f" by {a['by']}" if a.get("by") else "")
    if em:
        s += (f"; reference with llama.cpp's activation arithmetic: KL {em['kl']:.4g}, logits "
              f"{em['logits_max_abs']:.3g}")
    rr, eq = v.get("reference_rounding") or {}, v.get("equal_precision") or {}
    if rr:
        s += f"; reference f32 vs its cache rounded to f16: KL {rr['kl']:.4g}, logits {rr['logits_max_abs']:.3g}"
    if eq:
        s += (f"; native f32/no flash vs reference: KL {eq['kl']:.4g}, logits {eq['logits_max_abs']:.3g}, greedy "
              f"{eq['greedy_agree'] * 100:.1f}%")
    return s + (f" ({v['why']})" if v.get("why") else "")


def l2_detail(report: dict) -> str:
    l2 = report.get("l2") or {}
    if l2.get("pass", True):
        return ""
    if "error" in l2:
        return l2["error"]
    bits = []
    for k, v in l2.items():
        if isinstance(v, dict) and not v.get("pass", True):
            s = f"{k} max abs {v['max_abs']:.3g} rel {v['rel']:.3g}"
            if v.get("rows_over"):
                s += f", {v['rows_over']} of {v['rows']} rows over"
                det = v.get("rows_over_detail") or []
                if det:
                    w = max(det, key=lambda x: x["engines"])
                    s += (f" (worst layer {w.get('model_layer', w['layer'])} slot {w['slot']}: engines "
                          f"{w['engines']:.3g}, native twin {w.get('native_precision', float('nan')):.3g})")
            bits.append(s)
    return "; ".join(bits)


def run_l3(run: dict, policy: str) -> dict:
    return next(e["l3"] for e in run["report"]["policies"] if e["policy"] == policy)


def table(names) -> str:
    rows = ["| model | text | length (prompt tokens) | budget | threads | L1 | L2 (K/V rows allowed) | "
            "L3 arithmetic (of which precision-sensitive) | plan agreement | "
            "same-plan KL max (policy) | skipped | s | load before |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    tot = {"l1": [0, 0], "l2": [0, 0], "l3": [0, 0], "plans": [0, 0]}

    def total_row(label: str, t: dict) -> str:
        return (f"| **{label}** | | | | | {t['l1'][0]}/{t['l1'][1]} | {t['l2'][0]}/{t['l2'][1]} | "
                f"{t['l3'][0]}/{t['l3'][1]} | {t['plans'][0]}/{t['plans'][1]} | | | | |")

    for name in names:
        data = load(name)
        tot_m = {k: [0, 0] for k in tot}
        for run in data["runs"]:
            c = counts(run["report"])
            n = c["policies"]
            for t in (tot, tot_m):
                for k in ("l1", "l3", "plans"):
                    t[k][0] += c[k]
                    t[k][1] += n
                t["l2"][0] += bool(c["l2"])
                t["l2"][1] += 1
            load_b = run.get("uptime_before", "").split("load average:")[-1].strip()
            n_allowed = sum(bool(row["explained_by"]) for row in c["l2_allowed"])
            allowed = f" ({n_allowed})" if n_allowed else ""
            if run.get("l2_redone"):   # --redo-l2 after a change of L2's rule
                allowed += f" [L2 again at {run['l2_redone']['commit']}]"
            n_prec = sum(bool(v.get("pass")) for v in c["l3_precision"].values())
            prec = f" ({n_prec})" if n_prec else ""
            rows.append(f"| {name} | {run['text']} | {run['length']} ({c['tokens']}) | {run['budget']} | "
                        f"{run['threads']} | {c['l1']}/{n} | {'pass' if c['l2'] else 'FAIL'}{allowed} | "
                        f"{c['l3']}/{n}{prec} | "
                        f"{c['plans']}/{n} | {c['kl_max'][0]:.4f} ({c['kl_max'][1]}) | "
                        f"{','.join(c['skipped']) or '-'} | {run['report']['seconds']:.0f} | "
                        f"{load_b} |")
            tag = f"{name} {run['text']} {run['length']} b{run['budget']}"
            if not c["l2"]:
                notes.append(f"{tag}: L2 FAIL: {l2_detail(run['report'])}")
            for row in c["l2_allowed"]:   # every row beyond the threshold, allowed or not
                notes.append(f"{tag}: L2 {'allowance' if row['explained_by'] else 'row not explained'}: "
                             f"{row_line(row, run['report'])}")
            for p, v in c["l3_precision"].items():
                if v.get("pass"):
                    notes.append(f"{tag}: L3 arithmetic {p}: KL {run_l3(run, p)['kl']:.4g}, logits "
                                 f"{run_l3(run, p)['logits_max_abs']:.3g} beyond the f16 limits, "
                                 f"{precision_line(v)}")
            for p in c["l1_fail"]:
                notes.append(f"{tag}: L1 FAIL {p}")
            for p, v in c["errors"].items():
                notes.append(f"{tag}: ERROR {p}: {v}")
            for p, v in c["l3_fail"].items():
                notes.append(f"{tag}: L3 arithmetic FAIL {p}: KL {v['kl']:.4g}, logits {v['logits_max_abs']:.3g}, "
                             f"greedy {v['greedy_agree'] * 100:.1f}%, plan {v.get('native_plan')}"
                             + (f"; {precision_line(c['l3_precision'][p])}" if p in c["l3_precision"] else ""))
            for p, v in c["plan_miss"].items():
                notes.append(f"{tag}: plan agreement miss {p}: {v}")
        if len(names) > 1 and data["runs"]:
            rows.append(total_row(f"{name} total", tot_m))
    rows.append(total_row("total", tot))
    return "\n".join(rows + [""] + [f"- {x}" for x in notes])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--lengths", default="1000,2000")
    ap.add_argument("--budgets", default="64,128")
    ap.add_argument("--texts", default="psf-licence,diskcache-metadata")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens of L3")
    ap.add_argument("--policies", default=None, help="default: every policy (kvcli check's default)")
    ap.add_argument("--table", action="store_true", help="print the table of the result files and exit")
    ap.add_argument("--redo", action="store_true",
                    help="run again the runs already in the files (after a change of the check's rules); the old run "
                         "moves to the file's superseded_runs")
    ap.add_argument("--redo-l2", action="store_true",
                    help="re-take L2 (levels 2 only, one observation per model, length and text) for the runs in the "
                         "files whose L2 failed, after a change of L2's rule: the new L2 replaces the old (kept as "
                         "l2_superseded) and the run's verdict is recomputed; L1 and L3 are left as they were")
    a = ap.parse_args()
    names = [m for m in a.models.split(",") if m]
    for m in names:
        if m not in MODELS:
            ap.error(f"unknown model {m} (one of {', '.join(MODELS)})")
    if a.table:
        print(table(names))
        return 0

    from kvcli.drivers.check import CheckSettings, Thresholds, run_check  # noqa: PLC0415
    if a.redo_l2:
        return redo_l2(names, [t for t in a.texts.split(",") if t], [int(x) for x in a.lengths.split(",") if x])
    from kvcli.models import resolve_model  # noqa: PLC0415

    texts = [t for t in a.texts.split(",") if t]
    commit = _sh(["git", "rev-parse", "--short", "HEAD"])
    for name in names:
        path = resolve_model(MODELS[name])
        data = load(name)
        data["model_path"] = str(path)
        for length in [int(x) for x in a.lengths.split(",") if x]:
            for key in texts:
                data["texts"][key] = text_info(key)
                doc = (SITE / TEXTS[key][1]).read_text(encoding="utf-8")
                for budget in [int(x) for x in a.budgets.split(",") if x]:
                    done = [r for r in data["runs"] if (r["text"], r["length"], r["budget"], r["threads"])
                            == (key, length, budget, a.threads)]
                    if done and not a.redo:
                        print(f"[corpus] {name} {key} {length} b{budget}: in the file, skipped", flush=True)
                        continue
                    settings = CheckSettings(budget=budget, n_tokens=a.tokens, doc_tokens=length,
                                             threads=a.threads)
                    before = _sh(["uptime"])
                    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                    print(f"[corpus] {started} {name} {key} {length} b{budget} threads {a.threads} ({before})",
                          flush=True)
                    report = run_check(path, doc, a.policies.split(",") if a.policies else None, settings,
                                       Thresholds(), log=lambda m: print(f"[check] {m}", flush=True))
                    run = {"text": key, "length": length, "budget": budget, "threads": a.threads,
                           "started": started, "uptime_before": before, "uptime_after": _sh(["uptime"]),
                           "commit": commit, "report": report}
                    # re-read the file before adding this run: another process may have written it meanwhile
                    fresh = load(name)
                    fresh["model_path"], fresh["texts"] = data["model_path"], {**fresh["texts"], **data["texts"]}
                    same = [r for r in fresh["runs"] if (r["text"], r["length"], r["budget"], r["threads"])
                            == (key, length, budget, a.threads)]
                    fresh["superseded_runs"] = fresh.get("superseded_runs", []) + same
                    fresh["runs"] = [r for r in fresh["runs"] if not any(r is x for x in same)] + [run]
                    data = fresh
                    save(name, data)
                    c = counts(report)
                    print(f"[corpus] done in {report['seconds']} s: {c['tokens']} tokens, L1 {c['l1']}/"
                          f"{c['policies']}, L2 {'pass' if c['l2'] else 'FAIL'}, L3 arithmetic {c['l3']}/"
                          f"{c['policies']}, plans {c['plans']}/{c['policies']}", flush=True)
        print(table([name]), flush=True)
    print(table(names))
    return 0


def redo_l2(names: list[str], texts: list[str], lengths: list[int]) -> int:
    """`--redo-l2`: L2 does not depend on the budget or the policies (one observation of the prompt), so one
    levels-2 check per (model, length, text) serves every run of it whose L2 failed."""
    from kvcli.drivers.check import CheckSettings, Thresholds, passed, run_check  # noqa: PLC0415
    from kvcli.models import resolve_model  # noqa: PLC0415
    commit = _sh(["git", "rev-parse", "--short", "HEAD"])
    for name in names:
        path = resolve_model(MODELS[name])
        for length in lengths:
            for key in texts:
                runs = [r for r in load(name)["runs"] if (r["text"], r["length"]) == (key, length)
                        and not (r["report"].get("l2") or {}).get("pass", True)]
                if not runs:
                    continue
                doc = (SITE / TEXTS[key][1]).read_text(encoding="utf-8")
                before, started = _sh(["uptime"]), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                print(f"[corpus] {started} {name} {key} {length}: L2 again for {len(runs)} run(s) ({before})",
                      flush=True)
                settings = CheckSettings(budget=runs[0]["budget"], n_tokens=runs[0]["report"]["settings"]["n_tokens"],
                                         doc_tokens=length, threads=runs[0]["threads"], levels=(2,))
                new = run_check(path, doc, ["snapkv"], settings, Thresholds(),
                                log=lambda m: print(f"[check] {m}", flush=True))
                # the thresholds L2 was taken under again (the run's own `thresholds` stay those of its L1 and L3)
                redone = {"started": started, "commit": commit, "uptime_before": before,
                          "uptime_after": _sh(["uptime"]), "seconds": new["seconds"],
                          "l2_thresholds": {k: v for k, v in new["thresholds"].items() if k.startswith("l2_")}}
                fresh = load(name)   # re-read: another process may have written the file meanwhile
                for r in fresh["runs"]:
                    if any(r["started"] == x["started"] for x in runs):
                        if new["prompt_tokens"] != r["report"]["prompt_tokens"]:
                            raise SystemExit(f"{name} {key} {length}: the prompt is {new['prompt_tokens']} tokens "
                                             f"now, {r['report']['prompt_tokens']} in the run")
                        r["report"]["l2_superseded"] = r["report"]["l2"]
                        r["report"]["l2"], r["l2_redone"] = new["l2"], redone
                        r["report"]["passed"] = passed(r["report"])
                save(name, fresh)
                print(f"[corpus] L2 {'pass' if new['l2']['pass'] else 'FAIL'} in {new['seconds']} s", flush=True)
    print(table(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
