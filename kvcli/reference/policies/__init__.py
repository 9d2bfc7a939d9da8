"""Torch reference planners: one readable file per policy, each `plan(obs, params, budget) -> Plan`.

`params` is the validated dict from the registry (`kvcli.policies.get(name).validate(...)`). The C++
planners in native/src/policies/ must give identical plans on the same observation (kvcli check, L1).
"""
from __future__ import annotations

import importlib

from kvcli.errors import KvcliError
from kvcli.plan import Observation, Plan


def planner(name: str):
    """The `plan` function of a policy's reference implementation."""
    from kvcli.policies import get  # noqa: PLC0415
    spec = get(name)
    if not spec.reference:
        raise KvcliError(f"policy '{spec.name}' has no reference (torch) implementation yet")
    return importlib.import_module(f"kvcli.reference.policies.{spec.name}").plan


def make_plan(name: str, obs: Observation, params: dict | list | None, budget: int) -> Plan:
    """Validate params with the registry, then run the torch planner."""
    from kvcli.policies import get  # noqa: PLC0415
    spec = get(name)
    typed = spec.validate(params if params is not None else {})
    spec.check_budget(budget, typed)
    obs.validate()
    return planner(name)(obs, typed, int(budget))


def reference_plan(name: str, params: dict, budget: int, obs: Observation) -> Plan:
    """The argument order kvcli/compress.py uses: (name, typed params, budget, observation)."""
    return make_plan(name, obs, params, budget)
