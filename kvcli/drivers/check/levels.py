"""`kvcli check`'s run (`run_check`): the levels of `CheckSettings.levels` for every policy, on one prefill of the
prompt (`--chunk N`: kvcli/drivers/check/chunked_check.py). The levels: kvcli/drivers/check/__init__.py."""
from __future__ import annotations

import time
from dataclasses import asdict

from kvcli import policies
from kvcli.drivers import compress
from kvcli.planning.planner import make_plan, model_refusal
from kvcli.drivers.chunked import check_chunk
from kvcli.drivers.check.allowances import arithmetic_allowance, l2_allowances, note_allowances
from kvcli.drivers.check.chunked_check import run_chunked
from kvcli.drivers.check.comparators import compare_observations, jaccard_per_head, selection_margins
from kvcli.drivers.check.thresholds import Thresholds
from kvcli.drivers.check.verdicts import (CheckSettings, announce_read, arithmetic_verdict, build_tokens, l1_verdict,
                                          observed_windows, passed, plan_summary, plans_verdict, policies_to_check,
                                          with_skipped)
from kvcli.errors import KvcliError
from kvcli.engines import open_native


def resolve_policies(model_path, names, budget: int) -> tuple[dict, dict]:
    """({name: Compression} resolved for the model, {name: why} of those it cannot run): checking several policies,
    one the model cannot run (planner.model_refusal) is skipped, said why; every bad parameter or budget is an error,
    before any model is loaded (with the arguments a policy's model_args hook completes for the model, as
    run/bench/eval plan it). kvcli check resolves them once where it reads its options and hands them to run_check.
    A budget under 1 is refused here first, in one message whichever policies are checked (resolve names the policy
    in its own, and lets full pass)."""
    if budget < 1:
        raise KvcliError(f"budget must be >= 1 (got {budget})")
    unfit = {name: model_refusal(policies.get(name), model_path) for name in names} if len(names) > 1 else {}
    unfit = {k: v for k, v in unfit.items() if v}
    return {name: compress.resolve(model_path, name, budget) for name in names if name not in unfit}, unfit


def run_check(model_path, document: str, policy_names=None, settings: CheckSettings | None = None,
              thresholds: Thresholds | None = None, log=None, resolved: tuple[dict, dict] | None = None) -> dict:
    """Run the levels of `settings.levels` for each policy; returns the JSON-ready report. `resolved`: what
    `resolve_policies` gave the command for these policies (resolved here without it)."""
    from kvcli.reference.session import ReferenceSession  # noqa: PLC0415

    settings = settings or CheckSettings()
    th = thresholds or Thresholds()
    log = log or (lambda msg: None)
    names = policies_to_check(policy_names)
    levels = set(settings.levels)
    if not levels or not levels <= {1, 2, 3}:
        raise KvcliError("levels must be a subset of 1,2,3")
    if settings.n_tokens < 1:
        raise KvcliError("the number of greedy tokens must be >= 1")
    if not document or not document.strip():
        raise KvcliError("the document is empty")
    if settings.chunk is not None:
        check_chunk(settings.chunk)
    specs, unfit = resolved or resolve_policies(model_path, names, settings.budget)
    names = [name for name in names if name in specs]

    t0 = time.perf_counter()
    if settings.threads is not None and settings.threads < 1:
        raise KvcliError(f"--threads must be >= 1 (got {settings.threads})")
    native = open_native(model_path, n_ctx=0, cache_type=settings.cache_type, flash_attn=settings.flash_attn,
                         n_threads=settings.threads)
    tokens = build_tokens(native, document, settings)
    n = len(tokens)
    if settings.chunk is not None:
        try:
            report = run_chunked(native, model_path, tokens, names, specs, settings, th, log, t0)
            return with_skipped(report, unfit)
        finally:
            native.close()
    if n >= native.n_ctx_train:
        raise KvcliError(f"the prompt is {n} tokens, the model's context is {native.n_ctx_train}: use --doc-tokens")
    window = observed_windows(specs, names, settings.l2_window, n)
    # a policy's second pass (PolicySpec.second_pass) needs room after the prompt, one pass serving all that need
    # it; both engines get the same context, so they feed the same passes
    second: dict = {}
    for c in specs.values():
        if c.spec.second_pass is not None:
            second.setdefault(c.spec.second_pass, []).append(c.params)
    passes = [(p, p.shared(params)) for p, params in second.items()]
    queried = ("query",) if any("query" in c.spec.needs for c in specs.values()) else ()   # observed queries
    room = max([settings.n_tokens + 8] + [p.room(n, params) for p, params in passes])
    n_ctx = -(-(n + room) // 256) * 256
    native.create_context(min(n_ctx, native.n_ctx_train))
    announce_read(native, tokens, None)
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
                                 observe=("window", "colsum", "kv") + queried, window=window, planner="reference",
                                 passes=passes)
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
            for p, params in passes:   # the second passes' scores, as the reference's Shared prefill made them
                setattr(nat_obs, p.kind, p.run(native, tokens, 0, params).scores)
            allow = l2_allowances(model_path, tokens, settings, native.n_ctx, reference)
            report["l2"] = compare_observations(nat_obs, base_obs, th, allow)
            note_allowances(report["l2"], allow, native.info)
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
                    l1_steps.append(l1_verdict(cfg, obs, plan_n, th))
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
    with_skipped(report, unfit)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    report["passed"] = passed(report)
    native.close()
    return report


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
        arith = arithmetic_verdict(native, ref, settings, th)
        plans = plans_verdict(native, ref, jaccard_per_head(native.kept_positions(0), ref.kept_positions(0)),
                              settings, th, own=arith, margins=None)
        return arith, plans
    state_n = native.save_seq(0)
    arith = arithmetic_verdict(native, ref, settings, th, native_plan=plan_summary(plan_n))
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
    plans = plans_verdict(native, ref, jac, settings, th, margins=margins, budgets=(plan_n, applied.plan))
    return arith, plans
