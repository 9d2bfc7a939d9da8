"""Prefill -> observe -> plan -> apply: the one compression driver both engines share.

The session (native or reference) prefills and captures what the policy needs to observe;
the planner of the same engine (C++ for native, torch for reference) turns the Observation
into a Plan; the session applies it. Budget semantics: docs/internals.md.
"""
from __future__ import annotations

import time

from kvcli import planning
from kvcli.chunked import prefill_chunked
from kvcli.errors import KvcliError
from kvcli.planning import CompressReport, resolve_policy, session_cells, shape_observation
from kvcli.session import Session


def prefill_and_compress(session: Session, tokens: list[int], policy: str, budget: int | None,
                         policy_args: dict, seq: int = 0, progress=None, planner: str | None = None,
                         instruction: str | None = None, chunk: int | None = None, cap: int | None = None,
                         on_cache=None, scoring: str = "question") -> CompressReport:
    """Prefill `tokens` into `seq` and compress them with `policy` to `budget` entries per layer and KV head.

    `instruction` is the user's question/instruction text: policies that adapt to the task
    (windowkv task=auto) classify it before planning. With `chunk`, a prompt longer than one chunk is
    read chunk by chunk, compressed after each (kvcli/chunked.py; `cap`: most cells while reading; `scoring`:
    which queries score each chunk)."""
    t0 = time.perf_counter()
    if policy == "full":  # no compression: nothing to observe or plan
        if policy_args:
            raise KvcliError("policy 'full' takes no --policy-arg")
        session.prefill(tokens, seq=seq, progress=progress)
        return CompressReport(policy, budget, len(tokens), time.perf_counter() - t0,
                              peak_cells=session_cells(session, seq))
    if chunk and len(tokens) > chunk:
        return prefill_chunked(session, tokens, policy, budget, policy_args, chunk, cap=cap, seq=seq,
                               progress=progress, planner=planner, instruction=instruction, on_cache=on_cache,
                               scoring=scoring)
    spec, params = resolve_policy(session, policy, policy_args, budget, instruction)
    if not spec.compresses(len(tokens), budget):
        session.prefill(tokens, seq=seq, progress=progress)
        return CompressReport(policy, budget, len(tokens), time.perf_counter() - t0,
                              note=f"no compression: the prompt ({len(tokens)} tokens) fits the budget ({budget})",
                              peak_cells=session_cells(session, seq))
    observe, window = spec.observe(params)
    obs = session.prefill(tokens, seq=seq, observe=observe, window=window, progress=progress)
    prefill_s = time.perf_counter() - t0
    peak = session_cells(session, seq)
    if obs is None:  # a policy that observes nothing (streamingllm) plans from the shapes alone
        obs = shape_observation(session.info, len(tokens))
    t1 = time.perf_counter()
    plan = planning.make_plan(spec, params, budget, obs, planner or session.engine)
    del obs  # K/V rows of a merging policy: freed before the compaction reads the cache (peak memory)
    session.apply_plan(plan, seq=seq)
    return CompressReport(policy, budget, len(tokens), prefill_s, time.perf_counter() - t1, plan, params=params,
                          peak_cells=peak)
