"""The models `kvcli models pull` installs, end to end (slow; each skips when its model is not pulled)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcli import catalogue, policies

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "examples" / "solar-garden.txt"


def pulled(name: str) -> Path:
    path = catalogue.pulled_path(name)
    if not path.is_file():
        pytest.skip(f"{name} is not pulled (kvcli models pull {name})")
    return path


@pytest.mark.slow
def test_qwen_run_snapkv_keeps_the_budget(run_kvcli):
    pulled("qwen2.5-coder-0.5b")
    r = run_kvcli("run", "--model", "qwen2.5-coder-0.5b", "--doc", DOC, "--policy", "snapkv", "--budget", "128",
                  "--json", "-n", "48", "How much did the project cost?", timeout=1800)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    s = out["stats"]
    assert out["answer"].strip() and s["prompt_tokens"] > 1000
    assert s["kv_cells"] <= 128 + s["generated_tokens"]


@pytest.mark.slow
def test_qwen_check_passes_l1_l3_for_every_policy():
    pulled("qwen2.5-coder-0.5b")
    from kvcli.check import CheckSettings, Thresholds, run_check
    from kvcli.commands.check import format_report
    both = [n for n, s in policies.REGISTRY.items() if s.native and s.reference]
    r = run_check(catalogue.pulled_path("qwen2.5-coder-0.5b"), DOC.read_text(), both,
                  CheckSettings(budget=64, n_tokens=8, doc_tokens=1000), Thresholds())
    table = format_report(r)
    for e in r["policies"]:
        assert "error" not in e and e["l1"]["pass"] and e["l3"]["pass"], table


@pytest.mark.slow
def test_gemma_is_refused_in_one_line(run_kvcli):
    pulled("gemma-3-270m")
    r = run_kvcli("info", "gemma-3-270m")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "unsupported architecture 'gemma3'" in r.stderr and "iSWA" in r.stderr
