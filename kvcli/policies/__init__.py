"""The ONE policy registry both engines read (see docs/internals.md, "Policies").

    kvcli.policies.get("snapkv")       -> PolicySpec (clear error listing the policies if unknown)
    kvcli.policies.available()         -> names, in display order
    kvcli.policies.list_text()         -> `kvcli policies`, one line each
    kvcli.policies.explain_text(name)  -> `kvcli policies --explain NAME`

Each policy is one module here (its PolicySpec: parameters, paper, deviations), one C++ file in
native/src/policies/ and one torch file in kvcli/reference/policies/.
"""
from __future__ import annotations

from kvcli.errors import KvcliError
from kvcli.policies import compresskv, d2o, dynamickv, full, h2o, pyramidkv, snapkv, spindlekv, streamingllm, \
    windowkv
from kvcli.policies.base import Param, PolicySpec, parse_policy_args

_ORDER = (full, streamingllm, snapkv, h2o, pyramidkv, windowkv, dynamickv, compresskv, d2o, spindlekv)
REGISTRY: dict[str, PolicySpec] = {m.SPEC.name: m.SPEC for m in _ORDER}

__all__ = ["REGISTRY", "Param", "PolicySpec", "available", "explain_text", "get", "list_text",
           "parse_policy_args", "prepare"]


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
    from kvcli.chunked import chunked_note  # noqa: PLC0415
    spec = get(name)
    return f"{spec.explain()}\n\n{chunked_note(spec)}"


def prepare(name: str, policy_args=None, budget: int | None = None,
            instruction: str | None = None) -> tuple[PolicySpec, dict, str]:
    """Validate a policy choice from the command line: (spec, typed params, C params string).

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
