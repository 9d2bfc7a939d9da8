"""streamingllm: the first `sinks` tokens (attention sinks) and the most recent budget - sinks tokens."""
import torch

from kvcli.planning.formats import Observation, Plan
from kvcli.reference.policies._common import keep_all, plan_from_kept


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    sinks = params["sinks"]
    if obs.n <= budget:
        return keep_all(obs)
    kept = torch.cat([torch.arange(sinks), torch.arange(obs.n - (budget - sinks), obs.n)])
    return plan_from_kept([[kept] * obs.n_head_kv for _ in range(obs.n_layer)])
