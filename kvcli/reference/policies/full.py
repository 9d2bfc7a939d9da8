"""full: keep every entry."""
from kvcli.planning.formats import Observation, Plan
from kvcli.reference.policies._common import keep_all


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    return keep_all(obs)
