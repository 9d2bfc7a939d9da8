"""kvcli check: native engine vs reference engine, levels L1 (planners), L2 (observation), L3 (end to end)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvcli.drivers.check import CheckSettings, Thresholds, policies_to_check, resolve_policies, run_check
from kvcli.drivers.chunked import check_chunk
from kvcli.commands.options import Request, json_option, model_option, request_options
from kvcli.documents import read_document
from kvcli.errors import KvcliError
from kvcli.models import resolve_model

EXAMPLE_DOC = Path(__file__).resolve().parents[2] / "examples" / "solar-garden.txt"


def _epilog() -> str:
    d = Thresholds()
    lines = ["Thresholds (--threshold KEY=VALUE; defaults suit the default model in product settings; each one's "
             "reason, the figures measured where the engines are right, and what each level proves: "
             "docs/internals.md, \"kvcli check\"):"]
    for key, doc in Thresholds.DOCS.items():
        lines.append(f"  {key} = {getattr(d, key)}: {doc}")
    lines.append("What the levels prove: L1, L2 and L3 arithmetic are engine verdicts (the C++ planner is the torch "
                 "one, the observation is computed alike, a given compressed cache decodes alike); plan agreement "
                 "measures the policy (how far its plan and output move under observation differences within L2's "
                 "limits), not the engines. L2's K/V allowance (a few rows beyond l2_kv_rtol) passes a row that "
                 "llama.cpp's own settings (f32 cache without flash attention, or a batch size of 64) move at least "
                 "as far as the engines differ or bring within the threshold of the reference (the same engine "
                 "agreeing with the reference at that setting), or where the reference given llama.cpp's activation "
                 "arithmetic "
                 "(8-bit matmul inputs, f16 GELU table) comes within the threshold (docs/models.md: gemma-3-270m). "
                 "L3 arithmetic beyond its limits passes only for a measured reason: the reference given llama.cpp's "
                 "activation arithmetic comes within them, or (f16) a precision-sensitive plan: the reference's own "
                 "cache rounded to f16 moves its output beyond the limits, and the native engine at f32 without "
                 "flash attention agrees with the reference within the f32 limits.")
    lines.append("Exit code: 0 when the engines agree (L1, L2 and L3's arithmetic verdict pass), 1 when one of "
                 "them fails (or errors), 2 on bad input. Plan agreement (each engine its own plan) is the policy's "
                 "sensitivity: a miss is printed as PLAN SENSITIVITY and listed in --json's \"plan_sensitive\"; "
                 "it fails the check only with --strict-plans.")
    return "\n\n".join(["\b\n" + "\n".join(lines)])


def _levels(text: str) -> tuple:
    try:
        levels = tuple(sorted({int(x.strip().upper().lstrip("L")) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise KvcliError(f"--levels expects a list like 1,2,3 (got '{text}')") from None
    if not levels or not set(levels) <= {1, 2, 3}:
        raise KvcliError(f"--levels expects levels among 1,2,3 (got '{text}')")
    return levels


_ALLOWANCE_WORDS = {"native_precision": "the native engine at its other precision",
                    "native_ubatch": "the native engine at another batch size",
                    "reference_llamacpp_arithmetic": "the reference with llama.cpp's activation arithmetic"}


def _rows_over(v: dict, l2: dict) -> str:
    """For K/V rows beyond the threshold: how many, and what each allowance source measured at the worst one."""
    if not v.get("rows_over"):
        return ""
    text = f" ({v['rows_over']} of {v['rows']} rows beyond the threshold"
    detail = v.get("rows_over_detail")
    if detail:
        worst = max(detail, key=lambda x: x["engines"])
        text += (f"; worst: layer {worst.get('model_layer', worst['layer'])} slot {worst['slot']}, engines differ by "
                 f"{worst['engines']:.3g}")
        settings = l2.get("allowances", {})
        for label, words in _ALLOWANCE_WORDS.items():
            if label in worst:
                text += f", {words} ({settings.get(label, '')}) by {worst[label]:.3g}"
                if f"{label}_to_reference" in worst:
                    text += f" (to {worst[label + '_to_reference']:.3g} of the reference)"
        if any(x["explained_by"] for x in detail):
            text += "; allowed: " + ", ".join(f"slot {x['slot']} by {x['explained_by']}" for x in detail
                                              if x["explained_by"])
    return text + ")"


def _allowance_note(l3: dict) -> str:
    """L3 arithmetic's allowance (kvcli.drivers.check.arithmetic_allowance), in one line."""
    a = l3.get("allowance")
    if not a:
        return ""
    ct = a["cache_type"]
    em = a["llamacpp_arithmetic"]
    text = (f"L3 arithmetic beyond the {ct} limits; the reference given llama.cpp's activation arithmetic: KL "
            f"{em['kl']:.3g}, logits {em['logits_max_abs']:.3g}, greedy {em['greedy_agree'] * 100:.1f}% "
            f"({'within' if em['pass'] else 'beyond'} the limits)")
    p = a.get("precision")
    if p and "reference_rounding" in p:
        rr, eq = p["reference_rounding"], p["equal_precision"]
        text += (f"; the reference's own cache rounded to {ct} moves its next token by KL {rr['kl']:.3g} (logits "
                 f"{rr['logits_max_abs']:.3g}); native f32 without flash attention vs reference: KL {eq['kl']:.3g}, "
                 f"logits {eq['logits_max_abs']:.3g}, greedy {eq['greedy_agree'] * 100:.1f}% "
                 f"({'within' if eq['pass'] else 'beyond'} the f32 limits)")
    elif p:
        text += f"; {p.get('why', '')}"
    verdict = {"llamacpp_arithmetic": "allowed: llama.cpp's activation arithmetic",
               "precision": "allowed: a precision-sensitive plan, the engines agree at equal precision",
               None: "not explained"}[a["by"]]
    return f"{text}: {verdict}"


def format_report(r: dict) -> str:
    """A readable table of the report of kvcli.drivers.check.run_check."""
    ok = lambda b: "pass" if b else "FAIL"  # noqa: E731
    out = [f"model {r['model']}  |  {r['prompt_tokens']} prompt tokens  |  budget {r['budget']}  |  "
           f"native cache {r['settings']['cache_type']}, flash attention "
           f"{'on' if r['settings']['flash_attn'] else 'off'}"
           + (f"  |  chunked prefill, chunks of {r['chunk']}" if r.get("chunk") else "") + f"  |  {r['seconds']} s"]
    if "l2" in r:
        l2 = r["l2"]
        if "error" in l2:
            out.append(f"L2 observation: FAIL ({l2['error']})")
        else:
            parts = [f"{k} max abs {v['max_abs']:.2e} rel {v['rel']:.2e} {ok(v['pass'])}" + _rows_over(v, l2)
                     for k, v in l2.items() if isinstance(v, dict) and "max_abs" in v]
            what = f" (first chunk, {l2['tokens']} tokens)" if "tokens" in l2 else ""
            out.append(f"L2 observation{what}: {ok(l2['pass'])}")
            out += [f"  {p}" for p in parts]
    ar = lambda x: (f"{x['logits_max_abs']:<7.3g} {x['kl']:<9.2e} {x['greedy_agree'] * 100:>5.1f}% "  # noqa: E731
                    f"({x['greedy_prefix']:>2})")
    head = (f"{'policy':<13} {'L1 plans':<22} {'L3 arithmetic: logits KL greedy':<36} "
            f"{'plans: jaccard  logits KL greedy':<50}")
    out += ["", head, "-" * len(head)]
    notes = []
    for e in r["policies"]:
        name = e["policy"]
        if "skipped" in e:
            out.append(f"{name:<13} skipped: {e['skipped']}")
            continue
        if "error" in e:
            out.append(f"{name:<13} ERROR: {e['error']}")
            continue
        l1 = e.get("l1")
        l1s = "-" if l1 is None else (f"identical {ok(True)}" if l1["pass"] else
                                      f"{l1['heads_differing']} heads differ FAIL")
        if l1 is not None and l1["pass"] and l1.get("merged_rows"):
            l1s = f"same, merge {l1['merge_max_abs']:.0e} pass"
        if l1 is not None and "steps" in l1:   # chunked: one verdict over every planning step
            l1s = (f"{l1['steps']} steps identical" if l1["pass"] else
                   f"{l1['steps_differing']}/{l1['steps']} steps differ FAIL")
        l3, pl = e.get("l3"), e.get("plans")
        if l3 is None:
            out.append(f"{name:<13} {l1s:<22}")
        else:
            pls = "" if pl is None else (f"{pl['jaccard_min']:.3f}/{pl['jaccard_mean']:.3f}  {ar(pl)} "
                                         f"{'agree' if pl['pass'] else 'SENSITIVE'}")
            out.append(f"{name:<13} {l1s:<22} {ar(l3)} {ok(l3['pass']):<4}  {pls}")
        if l3 is not None and l3.get("allowance"):
            out.append(f"{'':<13} {_allowance_note(l3)}")
        if l1 is not None and not l1["pass"] and l1.get("first_difference"):
            out.append(f"{'':<13} L1: {l1['first_difference']}")
        if pl is not None and pl.get("sensitivity"):
            out.append(f"{'':<13} plans {pl['sensitivity']}")
            notes.append(name)
        if e.get("note"):
            out.append(f"{'':<13} {e['note']}")
        if e.get("chunks"):
            peak = f"; peak cells native/reference {l3['peak_cells'][0]}/{l3['peak_cells'][1]}" if l3 else ""
            out.append(f"{'':<13} {e['chunks']} chunks, cells after each: "
                       f"{' '.join(str(a) for _, a in e['steps'])}{peak}")
    strict = r["settings"].get("strict_plans")
    out += ["", "L3 arithmetic: both engines decode the native plan (limits for the native "
            f"{r['settings']['cache_type']} cache); plans: each engine its own plan, jaccard min/mean over layers; "
            "logits: max abs; greedy: teacher-forced agreement (tokens before the first difference)",
            f"ENGINES: {'pass' if r.get('engines_agree', r['passed']) else 'FAIL'} (L1, L2, L3 arithmetic)"]
    if notes:
        out.append(f"PLAN SENSITIVITY: {len(notes)} {'policy' if len(notes) == 1 else 'policies'} whose engines' "
                   f"plans differ beyond the plan-agreement thresholds: {', '.join(notes)} "
                   + ("(--strict-plans: this fails the check)" if strict else
                      "(the policy's sensitivity to observation differences within L2's limits, not an engine "
                      "defect; --strict-plans makes it fail the check)"))
    else:
        out.append("PLAN SENSITIVITY: none (every checked policy's plans agree)")
    out.append(f"RESULT: {'pass' if r['passed'] else 'FAIL'}")
    return "\n".join(out)


@click.command("check", epilog=_epilog())
@click.option("--policy", "-p", "policy_names", multiple=True, metavar="NAME[,NAME]",
              help="Policy to check (repeatable, or comma-separated). Default: every policy.")
@click.option("--budget", "-b", type=int, default=256, show_default=True,
              help="Entries kept per layer and KV head, observation window included.")
@click.option("--doc", "doc", default=None, metavar="FILE",
              help="Document to compress ('-' for stdin). Default: examples/solar-garden.txt.")
@click.option("--doc-tokens", type=click.IntRange(16, None), default=None, metavar="N",
              help="Cut the document to its first N tokens.")
@model_option
@click.option("--tokens", "-n", "n_tokens", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Greedy tokens compared in L3.")
@click.option("--levels", default="1,2,3", show_default=True, help="Levels to run.")
@click.option("--flash-attn/--no-flash-attn", default=True, show_default=True, help="Native flash attention.")
@request_options("cache_type", "chunk", "threads", cache_types=("f16", "f32", "q8_0"),
                 cache_type_help="Native KV cache type (f32 with --no-flash-attn gives the tightest agreement).",
                 chunk_help="Read the prompt in chunks of N tokens in both engines (chunked "
                 "prefill with re-indexed positions); L1 is then checked at every planning step.",
                 threads_help="CPU threads of both engines (default: all cores natively, torch's default).")
@click.option("--threshold", "thresholds", multiple=True, metavar="KEY=VALUE", help="Override a threshold.")
@click.option("--tight", is_flag=True, help="Thresholds for float32 GGUFs checked with --cache-type f32 "
                                              "--no-flash-attn (engines agree to ~1e-5).")
@click.option("--strict-plans", is_flag=True, help="A plan-agreement miss (the engines' own plans differ beyond "
                                                     "the plan_* thresholds) fails the check too (exit code 1).")
@json_option
def check_cmd(req: Request, policy_names, budget, doc, doc_tokens, model, n_tokens, levels, flash_attn,
              thresholds, tight, strict_plans, as_json):
    """Check the native engine against the PyTorch reference engine on one document.

    L1 feeds the same observation to the C++ and torch planners (identical plans required); L2
    compares the observations both engines compute; L3 has two verdicts. L3 arithmetic (the engine
    verdict): both engines decode with the same plan, the native one, and their next-token logits, KL
    and greedy tokens must agree within the limits of the native cache type. Plan agreement (the
    policy's sensitivity): each engine plans from its own observation; kept positions (Jaccard per layer
    and KV head), how far from the budget's cut the differing decisions lie in the policy's score, and
    what each engine's own plan decodes. Plans that flip on near-ties are reported as PLAN SENSITIVITY,
    not as an engine failure. With --chunk N both engines read the document in chunks, compressing and
    re-indexing after each one. Thresholds and what each level proves: docs/internals.md."""
    from kvcli.reference import require as require_reference  # noqa: PLC0415 (torch: pip install 'kvcli[reference]')
    require_reference()   # without the extra: one line and exit 2, before anything else
    # every input error is reported before a model is loaded
    th = (Thresholds.tight() if tight else Thresholds()).with_overrides(thresholds)
    level_set = _levels(levels)
    names = policies_to_check(policy_names)
    chunk = req.chunk
    if chunk is not None:
        check_chunk(chunk)
        if not policy_names:   # every policy but full: chunked prefill compresses after every chunk
            names = [n for n in names if n != "full"]
    if doc is None:
        if not EXAMPLE_DOC.exists():
            raise KvcliError("no --doc given and the example document is not installed: pass --doc FILE")
        doc = str(EXAMPLE_DOC)
    document = read_document(doc)
    path = resolve_model(model)
    resolved = resolve_policies(path, names, budget)   # every policy checked once, before a model loads
    settings = CheckSettings(budget=budget, n_tokens=n_tokens, cache_type=req.cache_type, flash_attn=flash_attn,
                             levels=level_set, doc_tokens=doc_tokens, chunk=chunk, chunk_scoring=req.chunk_scoring,
                             threads=req.threads, strict_plans=strict_plans)
    log = (lambda msg: click.echo(f"[check] {msg}", err=True)) if sys.stderr.isatty() else None
    report = run_check(path, document, names, settings, th, log=log, resolved=resolved)
    if as_json:
        click.echo(json.dumps(report, default=float))
    else:
        click.echo(format_report(report))
    if not report["passed"]:
        click.get_current_context().exit(1)


COMMANDS = [check_cmd]
