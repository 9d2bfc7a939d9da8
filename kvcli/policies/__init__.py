"""The ONE policy registry both engines read (see docs/internals.md, "Policies").

    kvcli.policies.get("snapkv")       -> PolicySpec (clear error listing the policies if unknown)
    kvcli.policies.available()         -> names, in display order
    kvcli.policies.list_text()         -> `kvcli policies`, one line each
    kvcli.policies.explain_text(name)  -> `kvcli policies --explain NAME`

Each policy is one module here (its PolicySpec: parameters with their defaults and ranges, the only
ones; paper; deviations; closed-form schedules), one C++ file in native/src/policies/ (which declares no
parameter) and one torch file in kvcli/reference/policies/.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvcli.errors import KvcliError
from kvcli.policies import compresskv, d2o, dynamickv, expected_attention, full, h2o, keydiff, kvzip, pyramidkv, \
    snapkv, spindlekv, streamingllm, tova, windowkv
from kvcli.policies.base import Param, PolicySpec, parse_policy_args, parse_scoped_args
from kvcli.policies.notes import chunked_note

_ORDER = (full, streamingllm, snapkv, h2o, pyramidkv, windowkv, dynamickv, compresskv, d2o, spindlekv, kvzip,
          expected_attention, keydiff, tova)
REGISTRY: dict[str, PolicySpec] = {m.SPEC.name: m.SPEC for m in _ORDER}

__all__ = ["REGISTRY", "Param", "PolicySpec", "available", "budget_needed", "choose", "explain_text", "get",
           "list_text", "parse_policy_args", "parse_scoped_args", "prepare"]


def available() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> PolicySpec:
    key = (name or "").strip().lower()
    if key not in REGISTRY:
        raise KvcliError(f"unknown policy '{name}'; available: {', '.join(REGISTRY)}")
    return REGISTRY[key]


def list_text() -> str:
    return "\n".join(spec.line() for spec in REGISTRY.values())


def explain_text(name: str) -> str:
    spec = get(name)
    layout = layout_note(spec.name)
    return f"{spec.explain()}\n\n{chunked_note(spec)}" + (f"\n\n{layout}" if layout else "")


LAYOUT_RECORD = Path(__file__).resolve().parents[1] / "data" / "layout.json"


def layout_note(name: str) -> str:
    """For a policy whose layers keep different counts: the bytes the native cache holds for it (each layer as
    wide as its own widest KV head: the ragged layout, native/src/README.md) next to its live entries', the
    budget's and what llama.cpp's shared cells held before, as benchmarks/layout.py measured them from its plans
    (kvcli/data/layout.json). Empty for the policies that keep the budget in every layer."""
    rec = json.loads(LAYOUT_RECORD.read_text(encoding="utf-8"))
    rows = [r for r in rec["rows"] if r["policy"] == name]
    if not rows:
        return ""
    per = "; ".join(f"budget {r['budget']}: {r['layer_ragged_bytes'] / 1e6:.2f} MB held for live entries of "
                    f"{r['live_bytes'] / 1e6:.2f} MB (the budget's {r['budget_bytes'] / 1e6:.2f} MB; shared cells: "
                    f"{r['cells']} cells, {r['cells_bytes'] / 1e6:.2f} MB)" for r in rows)
    return (f"Memory: the layers keep different counts; the native cache stores each layer as wide as its own widest "
            f"KV head (KVCLI_LAYOUT=ragged, the default; =cells gives every layer the widest layer's cells). "
            f"Measured from this policy's plans (benchmarks/layout.py, {rec['model']}, {rec['doc']} of "
            f"{rec['prompt_tokens']} tokens, f16 cache): {per}. `kvcli bench` and the --json stats report `kv_bytes` "
            "(held) next to `kv_bytes_live` for your own documents.")


def budget_needed(policy: str) -> str:
    """The one message for a compressing policy given without a budget."""
    return f"policy '{policy}' needs --budget N (entries kept per layer and KV head)"


def choose(policy: str, budget: int | None, policy_args=None,
           instruction: str | None = None) -> tuple[PolicySpec, dict]:
    """The one check of a compression as a command asked for it, before any model is read: the policy's name, its
    budget, its --policy-arg items (parsed, in range, the budget-dependent checks), each mistake one message.
    `full` takes no argument and no budget. (spec, typed params); kvcli.planning.planner.resolve runs it first and
    then completes the choice for the model."""
    spec = get(policy)   # an unknown name is the first thing to report
    if spec.name == "full":
        if policy_args:
            raise KvcliError("policy 'full' takes no --policy-arg")
        return spec, spec.validate({})
    if budget is None:
        raise KvcliError(budget_needed(policy))
    spec, params, _ = prepare(spec.name, policy_args, budget, instruction=instruction)
    return spec, params


def prepare(name: str, policy_args=None, budget: int | None = None,
            instruction: str | None = None) -> tuple[PolicySpec, dict, str]:
    """Validate a policy choice from the command line: (spec, typed params, the params as key=value text).
    The native planner gets `spec.native_params(...)` at plan time (kvcli.native.lib.native_plan).

    `policy_args` is the list of --policy-arg "key=value" strings (or a dict). With `budget`, the
    budget-dependent checks run too (e.g. budget must exceed the window). `instruction` (the user's
    question/instruction, without the document) resolves parameters that depend on it: windowkv's
    task=auto runs kvcli's task classifier on it (kvcli/taskclass); without it task=auto is an error.
    """
    spec = get(name)
    params = spec.validate(policy_args, instruction=instruction)
    if budget is not None:
        spec.check_budget(budget, params)
    return spec, params, spec.render(params)
