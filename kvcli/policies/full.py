"""full: no compression (the reference every other policy is measured against)."""
from kvcli.policies.base import PolicySpec

SPEC = PolicySpec(
    name="full",
    summary="no compression: keep every prompt entry (baseline)",
    keeps="every entry of every layer and KV head; the budget is ignored",
    paper=None,
    budget_note="ignored: the whole prompt is kept",
)
