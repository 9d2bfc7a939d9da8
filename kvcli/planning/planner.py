"""Between the policy registry and the drivers: a policy resolved for a model, one engine's planner run
on an observation, and the report of a compressed prefill.

Layers (each imports only the ones before it; tests/test_architecture.py checks it), one package each:
kvcli/policies (registry) -> kvcli/planning (this module; formats: Observation, Plan) -> kvcli/drivers
(compress, chunked, reselect, lockstep, bench, check; kvcli/evaluation's runners) -> kvcli/apps (pipeline, chat,
batch) -> kvcli/commands.
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field

import numpy as np

from kvcli import engines, policies
from kvcli.errors import KvcliError
from kvcli.models import read_model_info
from kvcli.planning.formats import Observation, Plan
from kvcli.planning.rope import refusal as rope_refusal
from kvcli.policies.base import PolicySpec
from kvcli.session import Session


@dataclass
class CompressReport:
    policy: str
    budget: int | None
    n_tokens: int
    prefill_s: float
    compress_s: float = 0.0      # planning + applying, after the prefill (and the policy's second pass)
    plan: Plan | None = None
    note: str = ""
    params: dict | None = None   # the resolved policy parameters (e.g. those resolved from the instruction)
    chunk: int | None = None     # chunked prefill (kvcli/drivers/chunked.py): tokens per chunk
    cap: int | None = None       # chunked: the most cells the sequence may hold while it is read
    steps: list = field(default_factory=list)   # chunked: one ChunkStep per chunk
    peak_cells: int | None = None                # most cells the sequence held while the prompt was read
    scoring: str | None = None   # chunked: which queries scored the chunks ("question" or "chunk")
    reconstruct_s: float | None = None   # the policy's second pass's seconds (part of compress_s)

    def as_stats(self) -> dict:
        """The figures of the prefill that go into `--json` stats."""
        out = {} if self.peak_cells is None else {"peak_kv_cells": self.peak_cells}
        if self.reconstruct_s is not None:
            out["reconstruct_s"] = round(self.reconstruct_s, 4)
        if self.chunk is not None:
            out.update({"chunk": self.chunk, "chunks": len(self.steps), "cache_cap": self.cap,
                        "chunk_scoring": self.scoring})
        return out


@dataclass(frozen=True)
class Compression:
    """One configuration (policy at a budget) resolved for a model: what the driver (kvcli/drivers/compress.py)
    prefills, plans and applies. `full` is one too: it observes nothing and never compresses.

    The compression value of a command: built once where the command reads its options (`resolve`, through
    kvcli.commands.options.Request.compression: the policy, its budget and arguments checked, completed for the
    model) and passed down; the apps and drivers take it as it is. `for_instruction` resolves it again only for a
    policy whose parameters depend on the question (PolicySpec.resolve_instruction)."""
    policy: str
    budget: int | None
    spec: PolicySpec
    params: dict = field(hash=False, compare=False)
    args: dict = field(default_factory=dict, hash=False, compare=False)   # the --policy-arg items as given
    model_path: object = field(default=None, hash=False, compare=False)  # the model it was resolved for
    instruction: str | None = field(default=None, hash=False, compare=False)   # ... and the instruction

    @property
    def observe(self) -> tuple[tuple[str, ...], int]:
        """(kinds, window) its prefill observes."""
        return self.spec.observe(self.params)

    def compresses(self, n: int) -> bool:
        return self.spec.compresses(n, self.budget)

    def fit_note(self, n: int) -> str:
        """Why a prompt of n tokens is not compressed ("" when it is, and for `full`, which never is)."""
        if self.compresses(n) or self.policy == "full":
            return ""
        return f"no compression: the prompt ({n} tokens) fits the budget ({self.budget})"

    def for_instruction(self, instruction: str | None) -> "Compression":
        """This compression for another instruction: itself, unless the policy resolves parameters from the
        question (then resolved again, from the arguments as given)."""
        if self.spec.resolve_instruction is None or instruction == self.instruction or self.model_path is None:
            return self
        return resolve(self.model_path, self.policy, self.budget, self.args, instruction)

    def asked(self, policy: str, budget: int | None, policy_args) -> bool:
        """Whether it is the compression of this policy, budget and arguments (a chat's /policy changes them)."""
        return (policy, budget, dict(policy_args or {})) == (self.policy, self.budget, self.args)


def resolve(model_path, policy: str, budget: int | None, policy_args: dict | None = None,
            instruction: str | None = None) -> Compression:
    """The Compression of `policy` at `budget` for the model at `model_path` (see `resolve_for_model`); `full`
    takes no argument and keeps every entry whatever the budget."""
    args = dict(policy_args or {})
    if (policy or "").strip().lower() == "full":   # no parameter, no budget: nothing to resolve for the model
        spec, params = policies.choose(policy, budget, args)
    else:
        spec, params = resolve_for_model(model_path, policy, args, budget, instruction)
    return Compression(policy, budget, spec, params, args, model_path, instruction)


_RESOLVED: dict = {}   # resolve_once's Compressions, oldest first
_RESOLVED_LOCK = threading.Lock()   # a server's request threads and its engine thread resolve alike
RESOLVED_KEPT = 64     # distinct compressions a long-lived process keeps resolved


def resolve_once(model_path, policy: str, budget: int | None, policy_args: dict | None = None) -> Compression:
    """`resolve`, once per (model, policy, budget, arguments) in this process: a server resolves the compression a
    request asks for when it parses it, and the answer takes the same Compression instead of resolving it again.
    A mistake is not kept: each ask raises resolve's one message again."""
    args = dict(policy_args or {})
    key = (str(model_path), policy, budget, repr(sorted(args.items())))
    c = _RESOLVED.get(key)
    if c is None:
        c = resolve(model_path, policy, budget, args)
        with _RESOLVED_LOCK:
            while len(_RESOLVED) >= RESOLVED_KEPT:
                _RESOLVED.pop(next(iter(_RESOLVED)))
            _RESOLVED[key] = c
    return c


def resolve_for_model(model_path, policy: str, policy_args: dict, budget: int, instruction: str | None = None):
    """(spec, params) of a compressing policy for the model at `model_path`: its arguments completed for the model
    by the policy's `model_args` hook (a calibration found for it, or a warning says why not), checked once
    (kvcli.policies.choose: parameters resolved from the instruction by `resolve_instruction`), the parameters that
    depend on the model's shape checked against its header (`model_check`) and the model refused where it cannot
    run the policy: before the model loads, not after the prefill. The one place a plan's policy is resolved: run,
    chat, compress, batch, bench, eval and check (through `resolve`)."""
    spec = policies.get(policy)  # an unknown name is the first thing to report
    if budget is None:
        raise KvcliError(policies.budget_needed(policy))
    if spec.model_args is not None:
        policy_args = _hook(spec.model_args)(model_path, policy_args)
    spec, params = policies.choose(policy, budget, policy_args, instruction)
    if spec.model_check is not None:
        spec.model_check(params, read_model_info(model_path))
    why = model_refusal(spec, model_path)
    if why:
        raise KvcliError(why)
    return spec, params


def _hook(path: str):
    """The function a "module:function" hook of a PolicySpec names (imported on first use)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def model_refusal(spec: PolicySpec, model_path) -> str | None:
    """Why the model at `model_path` cannot run the policy (None when it can): a policy observing queries un-rotates
    them (RoPE variants it knows); a second pass may refuse the model (`SecondPass.refusal`)."""
    if "query" in spec.needs:
        why = rope_refusal(read_model_info(model_path))
        if why:
            return f"policy '{spec.name}' does not support this model: {why} (it un-rotates the observed queries)"
    if spec.second_pass is not None:
        why = spec.second_pass.refusal(read_model_info(model_path))
        if why:
            return f"policy '{spec.name}' {why}"
    return None


def session_cells(session: Session, seq: int) -> int:
    """Cells the sequence occupies, measured from the engine's cache."""
    return int(session.stats(seq)["kv_cells"])


def shape_observation(info, n: int) -> Observation:
    """What a policy that observes nothing (streamingllm) plans from: the shapes and n slots' positions."""
    return Observation(info.n_layer, info.n_head, info.n_head_kv, info.head_dim, n=n,
                       positions=np.arange(n, dtype=np.int32))


def make_plan(spec, params: dict, budget: int, obs, planner: str) -> Plan:
    """Run the planner of one engine (kvcli.engines.planner): "native" (C++) or "reference" (torch, imported on
    first use), or a callable `planner(spec, params, budget, obs) -> Plan` (kvcli check's arithmetic verdict
    replays the native engine's plans in the reference engine's chunked reading)."""
    if callable(planner):
        plan = planner(spec, params, budget, obs)
    else:
        plan = engines.planner(planner)(spec.name, params, budget, obs)
    plan.validate(obs.n, obs.head_dim)
    return plan
