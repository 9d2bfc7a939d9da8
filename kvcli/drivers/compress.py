"""Prefill -> observe -> plan -> apply: the one compression driver of every command.

The session (native or reference) prefills and captures what the policy needs to observe;
the planner of the same engine (C++ for native, torch for reference) turns the Observation
into a Plan; the session applies it. Budget semantics: docs/internals.md.

Two forms, one sequence of steps:
- `prefill_and_compress` (`compress_as` for a configuration resolved already): one configuration, read in
  one prefill or, with `chunk`, in chunks compressed after each (kvcli/drivers/chunked.py: `read_in_chunks`).
  run, chat, compress, batch, pipeline, bench (a configuration measured alone, or read in chunks), eval
  (documents read in chunks) and check (the native engine, both engines when chunked) call it.
- `Shared`: one prefill serving several configurations. It observes what they all need; each one
  (`Shared.apply`) puts the prefilled sequence back, plans from its part of the observation and applies
  its plan, for the caller to decode or measure before the next. bench (configurations that observe
  alike), eval (every configuration of a sample) and check (the reference engine) call it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from kvcli import policies
from kvcli.drivers.chunked import read_in_chunks
from kvcli.errors import KvcliError
from kvcli.planning.formats import Plan
from kvcli.planning.planner import CompressReport, Compression, make_plan, resolve, session_cells, shape_observation  # noqa: F401 - resolve: re-exported
from kvcli.session import Session


def prefill_and_compress(session: Session, tokens: list[int], cfg: Compression, *, seq: int = 0, progress=None,
                         planner: str | None = None, instruction: str | None = None, chunk: int | None = None,
                         cap: int | None = None, on_cache=None, scoring: str = "question",
                         on_step=None) -> CompressReport:
    """Prefill `tokens` into `seq` and compress them with `cfg`, the Compression the command resolved
    (kvcli.planning.planner.resolve: policy, budget per layer and KV head, arguments), taken as it is, for
    `instruction` (Compression.for_instruction).

    `instruction` is the user's question/instruction text: policies that adapt to the task
    (`PolicySpec.resolve_instruction`) classify it before planning. With `chunk`, a prompt longer than one chunk is
    read chunk by chunk, compressed after each (kvcli/drivers/chunked.py; `cap`: most cells while reading; `scoring`:
    which queries score each chunk). The prefill time counts from this call (the policy's resolution for the
    instruction in it)."""
    t0 = time.perf_counter()
    return compress_as(session, tokens, cfg.for_instruction(instruction), seq=seq, progress=progress,
                       planner=planner, chunk=chunk, cap=cap, on_cache=on_cache, scoring=scoring, on_step=on_step,
                       since=t0)


def compress_as(session: Session, tokens: list[int], cfg: Compression, *, seq: int = 0, progress=None,
                planner: str | None = None, chunk: int | None = None, cap: int | None = None, on_cache=None,
                scoring: str = "question", on_step=None, plan_always: bool = False,
                since: float | None = None) -> CompressReport:
    """`prefill_and_compress` of a configuration resolved already. `on_step(step, obs, plan)` is called with
    each plan before it is applied (kvcli check runs the other planner there); `plan_always`: plan a
    prompt that fits the budget too (nothing is applied: both planners must then keep everything)."""
    t0 = time.perf_counter() if since is None else since
    n = len(tokens)
    if chunk and n > chunk and cfg.policy != "full":
        return read_in_chunks(session, tokens, cfg, chunk, cap=cap, seq=seq, progress=progress, planner=planner,
                              on_step=on_step, on_cache=on_cache, scoring=scoring)
    compresses = cfg.compresses(n)
    if not (compresses or plan_always):   # full, or a prompt within the budget: nothing to observe or plan
        session.prefill(tokens, seq=seq, progress=progress)
        return CompressReport(cfg.policy, cfg.budget, n, time.perf_counter() - t0, note=cfg.fit_note(n),
                              peak_cells=session_cells(session, seq))
    _, window = cfg.observe
    obs = session.prefill(tokens, seq=seq, observe=cfg.spec.prefill_kinds(cfg.params), window=window,
                          progress=progress)
    prefill_s = time.perf_counter() - t0
    peak = session_cells(session, seq)
    if obs is None:  # a policy that observes nothing (streamingllm) plans from the shapes alone
        obs = shape_observation(session.info, n)
    t1 = time.perf_counter()
    recon_s = None
    extra = cfg.spec.second_pass
    if extra is not None:   # the policy's second pass (PolicySpec.second_pass), timed on its own
        r = extra.run(session, tokens, seq, cfg.params)
        setattr(obs, extra.kind, r.scores)
        recon_s = r.seconds
        peak += r.longest   # a pass's cells are held after the prompt's
    plan = make_plan(cfg.spec, cfg.params, cfg.budget, obs, planner or session.engine)
    if on_step is not None:
        on_step(0, obs, plan)
    del obs  # its sums (K/V rows are read per layer by the planner): freed before the compaction (peak memory)
    if compresses:
        session.apply_plan(plan, seq=seq)
    return CompressReport(cfg.policy, cfg.budget, n, prefill_s, time.perf_counter() - t1, plan, params=cfg.params,
                          note=cfg.fit_note(n), peak_cells=peak, reconstruct_s=recon_s)


def _prefill_kinds(kinds) -> tuple:
    """What the prefill itself observes: the kinds a policy's second pass fills come from that pass after it."""
    filled = {spec.second_pass.kind for spec in policies.REGISTRY.values() if spec.second_pass is not None}
    return tuple(k for k in kinds if k not in filled)


@dataclass
class Applied:
    """One configuration of a `Shared` prefill, applied (or why not: `error`, an exception to report)."""
    cfg: Compression
    plan: Plan | None = None
    compress_s: float = 0.0      # planning + applying (+ the second pass of a policy that has one)
    reconstruct_s: float | None = None   # the policy's second pass's seconds (shared by its configurations)
    note: str = ""
    error: Exception | None = None


class Shared:
    """One prefill of `tokens` into `seq` serving every configuration of `cfgs`.

    The prefill observes what the configurations that compress the prompt need together (one window sum per
    window length: a policy with window w plans from the sums over the last w queries), and `observe` /
    `window` besides (kvcli check's L2). `apply(cfg)`, once for each of `cfgs`, in any order, gives it the
    prefilled sequence (put back from a saved state for every one after the first), plans from the
    observation restricted to what its own prefill would have observed (`Observation.restrict`) and applies
    its plan. `first`: the logits after the prefill (a restored sequence's next token comes from them);
    `prefill_s`: the prefill's seconds.

    A configuration whose policy has a second pass (`PolicySpec.second_pass`) gets its kind from one such pass after
    the prefill, shared by every configuration that needs it (`SecondPass.shared` of their parameters, and of
    `passes` besides: (pass, params) pairs kvcli check runs whatever the configurations), `reconstruct_s` its
    seconds.

    A failing prefill is each configuration's error (`Applied.error`); when the observing prefill fails with
    a KvcliError, the prompt is prefilled again without observation for the configurations that need none.
    """

    def __init__(self, session: Session, tokens: list[int], cfgs: list[Compression], *, seq: int = 0,
                 observe=(), window=(), planner: str | None = None, passes=()):
        self.session, self.seq, self.n = session, seq, len(tokens)
        self.planner = planner or session.engine
        kinds, windows = set(observe), set((window,) if isinstance(window, int) else window)
        second: dict = {}   # pass -> the parameters of the configurations (and `passes`) that need it
        for p, params in passes:
            second.setdefault(p, []).append(params)
            kinds.add(p.kind)
        for c in cfgs:
            if c.compresses(self.n):
                k, w = c.observe
                kinds |= set(k)
                if c.spec.second_pass is not None:
                    second.setdefault(c.spec.second_pass, []).append(c.params)
                if "window" in k:
                    windows.add(w)
                elif "query" in k:   # query rows: the longest window's, every prompt query at most
                    windows.add(min(w, self.n))
        self.obs = self.first = self.state = self.error = self.obs_error = None
        self.prefill_s, self.used, self.reconstruct_s = 0.0, False, None
        try:
            t0 = time.perf_counter()
            try:
                self.obs = session.prefill(tokens, seq=seq, observe=_prefill_kinds(sorted(kinds)),
                                           window=tuple(sorted(windows)))
            except KvcliError as e:
                if not kinds or all(c.compresses(self.n) and c.observe[0] for c in cfgs):
                    raise
                self.obs_error = e   # reported for each configuration that needed the observation
                session.clear(seq)
                t0 = time.perf_counter()
                session.prefill(tokens, seq=seq)
            self.prefill_s = time.perf_counter() - t0
            if self.obs is None:  # nothing observed: positions are all a plan needs (streamingllm)
                self.obs = shape_observation(session.info, self.n)
            if self.obs_error is None:   # each second pass, once for all the configurations that need it
                for p, params in second.items():
                    r = p.run(session, tokens, seq, p.shared(params))
                    setattr(self.obs, p.kind, r.scores)
                    self.reconstruct_s = (self.reconstruct_s or 0.0) + r.seconds
            self.first = session.logits(seq)
            if len(cfgs) > 1:
                self.state = session.save_seq(seq)
        except Exception as e:  # noqa: BLE001 - each configuration reports it; the caller decides what stops
            self.error = e

    def apply(self, cfg: Compression) -> Applied:
        if self.error is not None:
            return Applied(cfg, error=self.error)
        try:
            if self.used:
                self.session.restore_seq(self.state, self.seq)
            self.used = True
            if not cfg.compresses(self.n):
                return Applied(cfg, note=cfg.fit_note(self.n))
            kinds, window = cfg.observe
            if self.obs_error is not None and kinds:
                return Applied(cfg, error=self.obs_error)
            t1 = time.perf_counter()
            plan = make_plan(cfg.spec, cfg.params, cfg.budget, self.obs.restrict(kinds, window), self.planner)
            self.session.apply_plan(plan, seq=self.seq)
            recon = self.reconstruct_s if cfg.spec.second_pass is not None else None   # each would have paid it
            return Applied(cfg, plan, time.perf_counter() - t1 + (recon or 0.0), reconstruct_s=recon)
        except Exception as e:  # noqa: BLE001 - reported on this configuration; the next one restores the prefill
            return Applied(cfg, error=e)
