"""The registry: names, text for `kvcli policies`, parameter validation and rendering (no model, no library)."""
from __future__ import annotations

import pytest

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.policies.base import parse_policy_args

PART1 = ["full", "streamingllm", "snapkv", "h2o", "pyramidkv", "windowkv", "dynamickv", "compresskv"]


def test_available_and_get():
    assert P.available()[:len(PART1)] == PART1
    assert P.get("SnapKV").name == "snapkv"
    with pytest.raises(KvcliError, match=r"unknown policy 'nope'; available: full, streamingllm, snapkv"):
        P.get("nope")


def test_list_text_one_line_each():
    lines = P.list_text().splitlines()
    assert len(lines) == len(P.available())
    for name, line in zip(P.available(), lines):
        assert line.split()[0] == name and len(line.split()) > 3


@pytest.mark.parametrize("name", PART1)
def test_explain_lists_every_parameter_and_deviation(name):
    spec = P.get(name)
    text = P.explain_text(name)
    assert text.startswith(f"{name}: {spec.summary}")
    for p in spec.params:
        assert f"  {p.name} = {p.shown_default()}" in text
        assert p.doc in text
    for d in spec.deviations:
        assert d in text
    if spec.paper is not None:
        assert spec.paper.title in text
    assert "Keeps:" in text and "Budget:" in text


def test_explain_windowkv_describes_auto():
    t = P.explain_text("windowkv")
    assert "task=auto is kvcli's own classifier" in t and "windowkv-task-classifier.md" in t


def test_defaults_and_render():
    spec, params, text = P.prepare("snapkv", [], 128)
    assert params == {"window": 32, "kernel": 7, "pool": "max", "gqa": "mean"}
    assert text == "window=32;kernel=7;pool=max;gqa=mean"
    _, params, text = P.prepare("snapkv", ["window=64", "kernel=5", "pool=AVG"], 128)
    assert params == {"window": 64, "kernel": 5, "pool": "avg", "gqa": "mean"}
    assert text == "window=64;kernel=5;pool=avg;gqa=mean"
    _, params, text = P.prepare("dynamickv", {"r_max": "5"}, 128)
    assert params["r_max"] == 5.0 and "r_max=5.0" in text
    assert P.prepare("full", [], None)[2] == ""


def test_windowkv_resolves_by_task():
    _, p, _ = P.prepare("windowkv", ["task=aggregation"], 128)
    assert (p["window"], p["score"], p["top_p"]) == (32, "topp", 8)
    _, p, _ = P.prepare("windowkv", [], 128)
    assert (p["window"], p["score"], p["top_p"]) == (16, "mean", 8)
    _, p, _ = P.prepare("windowkv", ["task=aggregation", "score=mean", "window=4", "review_window=8"], 128)
    assert (p["window"], p["score"], p["top_p"]) == (4, "mean", 4)


def test_observe():
    assert P.get("snapkv").observe(P.get("snapkv").defaults()) == (("window",), 32)
    assert P.get("h2o").observe(P.get("h2o").defaults()) == (("colsum",), 0)
    assert P.get("streamingllm").observe(P.get("streamingllm").defaults()) == ((), 0)
    spec = P.get("windowkv")
    assert spec.observe(spec.validate(["task=aggregation"])) == (("window",), 32)
    assert spec.compresses(200, 128) and not spec.compresses(128, 128)
    assert not P.get("full").compresses(10_000, 128)


@pytest.mark.parametrize("name,args,match", [
    ("snapkv", ["windw=3"], r"policy 'snapkv' has no parameter 'windw'; valid keys: window, kernel, pool, gqa"),
    ("full", ["x=1"], r"policy 'full' has no parameter 'x'; valid keys: none"),
    ("snapkv", ["window=abc"], r"parameter window must be an integer \(got 'abc'\)"),
    ("snapkv", ["window=0"], r"parameter window must be >= 1"),
    ("snapkv", ["kernel=4"], r"parameter kernel must be odd"),
    ("snapkv", ["pool=median"], r"parameter pool must be one of max, avg"),
    ("dynamickv", ["r_max=nan"], r"parameter r_max must be finite"),
    ("dynamickv", ["r_max=0.5"], r"parameter r_max must be >= 1"),
    ("windowkv", ["task=auto"], r"task=auto classifies the instruction, but none reached the policy"),
    ("snapkv", ["window"], r"--policy-arg expects key=value or policy.key=value \(got 'window'\)"),
    ("snapkv", ["=3"], r"--policy-arg expects key=value"),
    ("snapkv", ["window=3", "window=4"], r"--policy-arg window given twice"),
    ("snapkv", ["window=3;kernel=5"], r"may not contain ';'"),
    ("compresskv", ["srh=1,x"], r"parameter srh must be a comma-separated list of integers \(bad item 'x'\)"),
    ("compresskv", ["layer_scores=0.5,inf"], r"comma-separated list of finite numbers"),
    ("compresskv", ["layer_scores=0.5,0.2"], r"layer_scores must sum to 1"),
])
def test_param_errors(name, args, match):
    with pytest.raises(KvcliError, match=match):
        P.prepare(name, args, 128)


@pytest.mark.parametrize("name,budget,match", [
    ("snapkv", 32, r"budget 32 must be larger than window=32"),
    ("pyramidkv", 8, r"budget 8 must be larger than window=8"),
    ("dynamickv", 4, r"budget 4 must be larger than window=8"),
    ("h2o", 20, r"budget 20 must be larger than recent=32"),
    ("streamingllm", 4, r"budget 4 must be larger than sinks=4"),
    ("windowkv", 16, r"budget 16 must be larger than window=16"),
    ("snapkv", 0, r"budget must be >= 1"),
])
def test_budget_errors(name, budget, match):
    with pytest.raises(KvcliError, match=match):
        P.prepare(name, [], budget)


def test_list_params_round_trip():
    _, p, text = P.prepare("compresskv", ["srh=3, 1,2", "layer_scores=0.25,0.75"], 64)
    assert p["srh"] == (3, 1, 2) and p["layer_scores"] == (0.25, 0.75)
    assert "srh=3,1,2;layer_scores=0.25,0.75" in text
    _, p2, _ = P.prepare("compresskv", {"srh": p["srh"], "layer_scores": p["layer_scores"]}, 64)
    assert p2 == p


def test_parse_policy_args():
    assert parse_policy_args(["a=1", " b = x=y "]) == {"a": "1", "b": "x=y"}
    assert parse_policy_args(None) == {}


def test_a_policy_lives_in_one_place_per_engine_with_its_test():
    """Issue #65: each registry entry is its spec (kvcli/policies/NAME.py), its torch planner
    (kvcli/reference/policies/NAME.py), its C++ planner (native/src/policies/NAME.cpp, registered under NAME) and its
    test (tests/policies/test_NAME.py), and docs/usage.md's table of the policies has its row; no planner file is
    left without a registry entry."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    usage = (root / "docs" / "usage.md").read_text(encoding="utf-8")
    missing = []
    for name in P.available():
        spec = P.get(name)
        wants = [(root / "kvcli" / "policies" / f"{name}.py", None), (root / "tests" / "policies" / f"test_{name}.py",
                                                                     None)]
        if spec.reference:
            wants.append((root / "kvcli" / "reference" / "policies" / f"{name}.py", None))
        if spec.native:
            wants.append((root / "native" / "src" / "policies" / f"{name}.cpp", f'KVCLI_REGISTER_POLICY("{name}"'))
        for path, text in wants:
            if not path.is_file() or (text is not None and text not in path.read_text(encoding="utf-8")):
                missing.append(str(path.relative_to(root)) + (f" ({text})" if text else ""))
        if not re.search(rf"^\| `{name}` \|", usage, re.M):
            missing.append(f"docs/usage.md: the policies table's row for {name}")
    assert not missing, "\n".join(missing)
    planners = {p.stem for p in (root / "native" / "src" / "policies").glob("*.cpp")} | \
        {p.stem for p in (root / "kvcli" / "reference" / "policies").glob("*.py") if not p.stem.startswith("_")}
    assert planners <= set(P.available()), f"planners with no registry entry: {sorted(planners - set(P.available()))}"
