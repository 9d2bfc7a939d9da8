"""Prefill -> observe -> plan -> apply: the one compression driver both engines share.

The session (native or reference) prefills and captures what the policy needs to observe;
the planner of the same engine (C++ for native, torch for reference) turns the Observation
into a Plan; the session applies it. Budget semantics: docs/internals.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    chunk: int | None = None     # chunked prefill (kvcli/chunked.py): tokens per chunk
    cap: int | None = None       # chunked: the most cells the sequence may hold while it is read
    steps: list = field(default_factory=list)   # chunked: one ChunkStep per chunk
    peak_cells: int | None = None                # most cells the sequence held while the prompt was read
    scoring: str | None = None   # chunked: which queries scored the chunks ("question" or "chunk")

    def as_stats(self) -> dict:
        """The figures of the prefill that go into `--json` stats."""
        out = {} if self.peak_cells is None else {"peak_kv_cells": self.peak_cells}
        if self.chunk is not None:
            out.update({"chunk": self.chunk, "chunks": len(self.steps), "cache_cap": self.cap,
                        "chunk_scoring": self.scoring})
        return out


def resolve_policy(session, policy: str, policy_args: dict, budget: int, instruction: str | None = None):
    """(spec, params) of a compressing policy for the session's model (see `resolve_for_model`)."""
    return resolve_for_model(session.model_path, policy, policy_args, budget, instruction)


def resolve_for_model(model_path, policy: str, policy_args: dict, budget: int, instruction: str | None = None):
    """(spec, params) of a compressing policy for the model at `model_path`: its arguments validated,
    compresskv's offline calibration found for the model (or a warning says why not), windowkv's task=auto
    classified, the parameters that depend on the model's shape checked against its header (d2o's full_layers):
    before the model loads, not after the prefill. The one place a plan's policy is resolved: run, chat,
    compress, batch, bench, eval and check."""
    from kvcli import policies  # noqa: PLC0415

    policies.get(policy)  # an unknown name is the first thing to report
    if budget is None:
        raise KvcliError(f"policy '{policy}' needs --budget N (entries kept per layer and KV head)")
    if policy == "compresskv":  # its offline calibration is found for the model, or a warning says why not
        from kvcli.calibration.compresskv import policy_args as calibrated_args  # noqa: PLC0415
        policy_args = calibrated_args(model_path, policy_args)
    spec, params, _ = policies.prepare(policy, policy_args, budget, instruction=instruction)
    if params.get("full_layers"):
        from kvcli.models import read_model_info  # noqa: PLC0415
        from kvcli.policies.d2o import full_layer_set  # noqa: PLC0415
        full_layer_set(params["full_layers"], read_model_info(model_path).n_layer)
    return spec, params


def prefill_and_compress(session, tokens: list[int], policy: str, budget: int | None, policy_args: dict,
                         seq: int = 0, progress=None, planner: str | None = None,
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
        return CompressReport(policy, budget, len(tokens), time.perf_counter() - t0, peak_cells=_cells(session, seq))
    if chunk and len(tokens) > chunk:
        from kvcli.chunked import prefill_chunked  # noqa: PLC0415
        return prefill_chunked(session, tokens, policy, budget, policy_args, chunk, cap=cap, seq=seq,
                               progress=progress, planner=planner, instruction=instruction, on_cache=on_cache,
                               scoring=scoring)
    spec, params = resolve_policy(session, policy, policy_args, budget, instruction)
    if not spec.compresses(len(tokens), budget):
        session.prefill(tokens, seq=seq, progress=progress)
        return CompressReport(policy, budget, len(tokens), time.perf_counter() - t0,
                              note=f"no compression: the prompt ({len(tokens)} tokens) fits the budget ({budget})",
                              peak_cells=_cells(session, seq))
    observe, window = spec.observe(params)
    obs = session.prefill(tokens, seq=seq, observe=observe, window=window, progress=progress)
    prefill_s = time.perf_counter() - t0
    peak = _cells(session, seq)
    if obs is None:  # a policy that observes nothing (streamingllm) plans from the shapes alone
        i = session.info
        obs = Observation(i.n_layer, i.n_head, i.n_head_kv, i.head_dim, n=len(tokens),
                          positions=np.arange(len(tokens), dtype=np.int32))
    t1 = time.perf_counter()
    plan = make_plan(spec, params, budget, obs, planner or session.engine)
    del obs  # K/V rows of a merging policy: freed before the compaction reads the cache (peak memory)
    session.apply_plan(plan, seq=seq)
    return CompressReport(policy, budget, len(tokens), prefill_s, time.perf_counter() - t1, plan, params=params,
                          peak_cells=peak)


def _cells(session, seq: int) -> int:
    """Cells the sequence occupies, measured from the engine's cache."""
    return int(session.stats(seq)["kv_cells"])


def make_plan(spec, params: dict, budget: int, obs, planner: str) -> Plan:
    """Run the planner of one engine: "native" (C++) or "reference" (torch)."""
    if planner == "native":
        from kvcli.native.lib import native_plan  # noqa: PLC0415
        plan = native_plan(spec.name, params, budget, obs)
    elif planner == "reference":
        from kvcli.reference.policies import reference_plan  # noqa: PLC0415
        plan = reference_plan(spec.name, params, budget, obs)
    else:
        raise KvcliError(f"unknown planner '{planner}'")
    plan.validate(obs.n, obs.head_dim)
    return plan
