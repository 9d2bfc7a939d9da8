"""One source of policy parameters: the registry (kvcli/policies/) declares, defaults and validates them;
the C++ planner (native/src/policies/) declares none and is handed every one, schedules included.

The source checks read native/src/policies/*.cpp; the others need the native library (no model is loaded).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from policy_obs import random_obs

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.native.lib import native_plan

SRC = Path(__file__).resolve().parents[2] / "native" / "src"
# the policies planned in C++ (native/src/policies/NAME.cpp): every one
CPP = P.available()
GETTER = re.compile(r"params\.get_(\w+)\(([^;]*?)\)\s*(?:==|;|\))", re.S)
# the helpers of plan/scores.cpp that read a shared parameter: read_gqa -> gqa, read_max_pool -> pool
HELPERS = {"read_gqa": "gqa", "read_max_pool": "pool"}


def cpp_reads(name: str) -> list[tuple[str, str, str]]:
    """(getter, key, the rest of the arguments) of every parameter read in native/src/policies/NAME.cpp."""
    text = (SRC / "policies" / f"{name}.cpp").read_text(encoding="utf-8")
    out = []
    for kind, args in GETTER.findall(text):
        m = re.fullmatch(r'\s*"(\w+)"\s*(?:,(.*))?', args, re.S)
        assert m, f"{name}.cpp: params.get_{kind}({args}) does not name its key as a string literal"
        out.append((kind, m.group(1), (m.group(2) or "").strip()))
    out += [("helper", key, "") for helper, key in HELPERS.items() if f"kvcli::{helper}(params)" in text]
    return out


@pytest.mark.parametrize("name", CPP)
def test_no_numeric_default_or_range_in_the_native_policies(name):
    reads = cpp_reads(name)
    for kind, key, rest in reads:
        if kind == "choice":   # the only extra argument: the policy's vocabulary, strings only
            assert re.fullmatch(r'\{\s*"\w+"(\s*,\s*"\w+")*\s*\}', rest), f"{name}.cpp get_choice({key}): {rest}"
        else:
            assert rest == "", f"{name}.cpp get_{kind}({key}, {rest}): a default or a range in the native planner"
    text = (SRC / "policies" / f"{name}.cpp").read_text(encoding="utf-8")
    assert "params.get_" not in GETTER.sub("", text), f"{name}.cpp reads a parameter in a form this test cannot check"
    # and the getters themselves take none (plan/plan.h)
    header = (SRC / "plan" / "plan.h").read_text(encoding="utf-8")
    for decl in re.findall(r"\bget_\w+\(([^)]*)\);", header):
        assert not re.search(r"\b(def|lo|hi|odd)\b", decl), decl


@pytest.mark.parametrize("name", CPP)
def test_the_registry_hands_over_exactly_what_the_native_planner_reads(name):
    spec = P.get(name)
    rendered = spec.native_params(spec.defaults(), 64, 4, 240)
    given = [item.split("=", 1)[0] for item in rendered.split(";") if item]
    assert sorted(given) == sorted(key for _, key, _ in cpp_reads(name))


@pytest.mark.parametrize("name", [n for n in CPP if P.get(n).params])
def test_a_missing_parameter_is_a_clean_error(name):
    """Each key the registry renders, left out of a direct C API call: a one-line error naming it."""
    obs = random_obs(2, 4, 6, 2, 240, w=32, kv=True)
    spec = P.get(name)
    items = spec.native_params(spec.defaults(), 64, obs.n_layer, obs.n).split(";")
    for i, item in enumerate(items):
        key = item.split("=", 1)[0]
        with pytest.raises(KvcliError, match=rf"^native planner '{name}' failed: policy '{name}': parameter {key} is "
                                             r"missing \(the native planner declares no defaults"):
            native_plan(name, ";".join(items[:i] + items[i + 1:]), 64, obs)


@pytest.mark.parametrize("name,text,match", [
    # what a direct C API call can get wrong that would index outside the observation or divide by zero:
    # the checks that stay in the native planner (each says why in a comment)
    ("h2o", "recent=500;gqa=mean", r"scores of -260 slots asked for, the observation has 240"),
    ("windowkv", "window=16;review_window=0;top_p=1;shared_layers=1;score=mean;group_budgets=8,8,8,8",
     r"review_window and shared_layers must be >= 1"),
    ("windowkv", "window=16;review_window=4;top_p=1;shared_layers=2;score=mean;group_budgets=8",
     r"group_budgets has 1 values, 4 layers in groups of 2 need 2"),
    ("pyramidkv", "window=8;kernel=7;pool=max;gqa=mean;layer_budgets=1,2", r"layer_budgets has 2 values, the "
                                                                           r"observation has 4 layers"),
    ("compresskv", "window=8;kernel=5;pool=avg;srh_k=1;srh=0,1,-1,2;layer_budgets=64,64,64,64",
     r"srh names query head -1"),
    ("dynamickv", "window=8;kernel=7;pool=avg;r_max=10.0;interval=0;gqa=mean", r"interval must be >= 1"),
    ("d2o", "allocation=uniform;heavy=0;recent=0;sinks=4;merge=paper;tau=head;min_frac=0.01;full_layers=;gqa=mean",
     r"heavy \+ recent must be >= 1"),
])
def test_memory_safety_checks_stay_native(name, text, match):
    obs = random_obs(2, 4, 6, 2, 240, w=32, kv=True)
    with pytest.raises(KvcliError, match=match):
        native_plan(name, text, 64, obs)


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "dynamickv", "streamingllm"])
def test_a_budget_at_the_window_is_no_native_crash(name):
    """The registry refuses budget <= window (the one check); the C API, called around it, still returns a
    well-formed plan or a clean error."""
    obs = random_obs(2, 4, 6, 2, 240, w=32)
    spec = P.get(name)
    params = spec.defaults()
    budget = int(params[spec.budget_above]) if spec.budget_above else 1
    with pytest.raises(KvcliError, match="must be larger than"):
        spec.check_budget(budget, params)
    plan = native_plan(name, spec.native_params(params, budget, obs.n_layer, obs.n), budget, obs)
    plan.validate(obs.n, obs.head_dim)
