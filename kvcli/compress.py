"""Prefill -> observe -> plan -> apply: the one compression driver both engines share.

The session (native or reference) prefills and captures what the policy needs to observe;
the planner of the same engine (C++ for native, torch for reference) turns the Observation
into a Plan; the session applies it. Budget semantics: docs/internals.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvcli.errors import KvcliError
from kvcli.plan import Observation, Plan


@dataclass
class CompressReport:
    policy: str
    budget: int | None
    n_tokens: int
    prefill_s: float
    compress_s: float = 0.0      # planning + applying, after the prefill
    plan: Plan | None = None
    note: str = ""
    params: dict | None = None   # the resolved policy parameters (e.g. the task windowkv's auto picked)


def prefill_and_compress(session, tokens: list[int], policy: str, budget: int | None, policy_args: dict,
                         seq: int = 0, progress=None, planner: str | None = None,
                         instruction: str | None = None) -> CompressReport:
    """Prefill `tokens` into `seq` and compress them with `policy` to `budget` entries per layer and KV head.

    `instruction` is the user's question/instruction text: policies that adapt to the task
    (windowkv task=auto) classify it before planning."""
    t0 = time.perf_counter()
    if policy == "full":  # no compression: nothing to observe or plan
        if policy_args:
            raise KvcliError("policy 'full' takes no --policy-arg")
        session.prefill(tokens, seq=seq, progress=progress)
        return CompressReport(policy, budget, len(tokens), time.perf_counter() - t0)
    from kvcli import policies  # noqa: PLC0415

    policies.get(policy)  # an unknown name is the first thing to report
    if budget is None:
        raise KvcliError(f"policy '{policy}' needs --budget N (entries kept per layer and KV head)")
    if policy == "compresskv":  # its offline calibration is found for the model, or a warning says why not
        from kvcli.calibration.compresskv import policy_args as calibrated_args  # noqa: PLC0415
        policy_args = calibrated_args(session.model_path, policy_args)
    spec, params, _ = policies.prepare(policy, policy_args, budget, instruction=instruction)
    if not spec.compresses(len(tokens), budget):
        session.prefill(tokens, seq=seq, progress=progress)
        return CompressReport(policy, budget, len(tokens), time.perf_counter() - t0,
                              note=f"no compression: the prompt ({len(tokens)} tokens) fits the budget ({budget})")
    observe, window = spec.observe(params)
    obs = session.prefill(tokens, seq=seq, observe=observe, window=window, progress=progress)
    prefill_s = time.perf_counter() - t0
    if obs is None:  # a policy that observes nothing (streamingllm) plans from the shapes alone
        i = session.info
        obs = Observation(i.n_layer, i.n_head, i.n_head_kv, i.head_dim, n=len(tokens),
                          positions=np.arange(len(tokens), dtype=np.int32))
    t1 = time.perf_counter()
    plan = make_plan(spec, params, budget, obs, planner or session.engine)
    session.apply_plan(plan, seq=seq)
    return CompressReport(policy, budget, len(tokens), prefill_s, time.perf_counter() - t1, plan, params=params)


def make_plan(spec, params: dict, budget: int, obs, planner: str) -> Plan:
    """Run the planner of one engine: "native" (C++) or "reference" (torch)."""
    if planner == "native":
        from kvcli.native.lib import native_plan  # noqa: PLC0415
        plan = native_plan(spec.name, spec.render(params), budget, obs)
    elif planner == "reference":
        from kvcli.reference.policies import reference_plan  # noqa: PLC0415
        plan = reference_plan(spec.name, params, budget, obs)
    else:
        raise KvcliError(f"unknown planner '{planner}'")
    plan.validate(obs.n, obs.head_dim)
    return plan
