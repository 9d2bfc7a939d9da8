"""Torch reference planners: one readable file per policy, each `plan(obs, params, budget) -> Plan`.

`params` is the validated dict from the registry (`kvcli.policies.get(name).validate(...)`). The C++
planners in native/src/policies/ must give identical plans on the same observation (kvcli check, L1).
"""
from __future__ import annotations

import importlib

from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation, Plan
from kvcli.policies import get


def planner(name: str):
    """The `plan` function of a policy's reference implementation."""
    spec = get(name)
    if not spec.reference:
        raise KvcliError(f"policy '{spec.name}' has no reference (torch) implementation yet")
    return importlib.import_module(f"kvcli.reference.policies.{spec.name}").plan


def reference_plan(name: str, params: dict | list | None, budget: int, obs: Observation) -> Plan:
    """Validate params with the registry, then run the torch planner (the argument order of
    kvcli.planning.planner.make_plan: name, parameters, budget, observation)."""
    spec = get(name)
    typed = spec.validate(params if params is not None else {})
    spec.check_budget(budget, typed)
    obs.validate()
    return planner(name)(obs, typed, int(budget))
