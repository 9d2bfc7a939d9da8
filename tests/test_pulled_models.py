"""The models `kvcli models pull` installs, end to end (slow; each skips when its model is not pulled).

What they depend on is pinned here: the thread count of both engines (THREADS: llama.cpp's CPU kernels round
differently with another thread count, and torch's reductions too), the documents and their cut, the budgets
and `kvcli check`'s default thresholds (kvcli/drivers/check/thresholds.py; not loosened here).

`./setup.sh` pulls qwen2.5-coder-0.5b, so the CI runs the tests of that model, its `kvcli check` of every policy
included (measured 2026-11-26 on the 2 cores here, load about 1 as other jobs started: 166 s, 12 policies, before
the L3 allowance); gemma-3-270m's run only where it is pulled (its check: 126 s at load about 4, beside other jobs).
KVCLI_PULLED_TESTS=0 skips the two checks (a quick
local run); nothing else does.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvcli import catalogue, policies

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "examples" / "solar-garden.txt"
LONG_DOC = ROOT / "examples" / "station-log.txt"
THREADS = 2          # CI's cores; the qwen figures below were measured with it
# policies whose two engines' own plans differ on this text although the engines agree (L3 arithmetic, the same
# plan in both, passes): the plan flips on near-ties of the policy's score, within L2's observation limits
# (issue 31). Measured at f61c4d4, 2 threads: d2o's same-plan KL 5.8e-4; its own plans: 33 of 48 selections differ,
# 8 took a different budget from the observation, 4 layers' budgets differ by 1, KL 0.0667 (plan_kl_max 0.05),
# greedy 75%.
PLAN_SENSITIVE_QWEN = {"d2o": "variance-based layer budgets move with the observation (issue 31)",
                       # since the few-rows attention path (a7035cc): the engines' own plans overlap 0.954 (worst
                       # layer), flipped entries within 0.51x the cut score of the cut; L1-L3 pass (2026-12-02)
                       "expected_attention": "query statistics over near-tied scores (kvcli check reports it)"}
# policies whose plan on this text is ill-conditioned at f16, so that L3 arithmetic passes only as a precision-
# sensitive plan (kvcli.drivers.check.arithmetic_allowance): measured 2026-11-26, 2 threads: spindlekv's plan decoded
# by the native engine with an f16 and an f32 cache differs by KL 1.85; the reference's own cache rounded to f16
# moves it by KL 0.62; native f32 (no flash attention) vs reference KL 0.024 (docs/internals.md).
PRECISION_SENSITIVE_QWEN = {"spindlekv": "merged entries of multiplicity up to 68 in heads keeping one entry"}


heavy = pytest.mark.skipif(os.environ.get("KVCLI_PULLED_TESTS") == "0",
                           reason="kvcli check on a pulled model: minutes on 2 cores; KVCLI_PULLED_TESTS=0 skips it")


def pulled(name: str) -> Path:
    path = catalogue.pulled_path(name)
    if not path.is_file():
        pytest.skip(f"{name} is not pulled (kvcli models pull {name})")
    return path


@pytest.mark.slow
def test_qwen_run_snapkv_keeps_the_budget(run_kvcli):
    pulled("qwen2.5-coder-0.5b")
    r = run_kvcli("run", "--model", "qwen2.5-coder-0.5b", "--doc", DOC, "--policy", "snapkv", "--budget", "128",
                  "--threads", THREADS, "--json", "-n", "48", "How much did the project cost?", timeout=1800)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    s = out["stats"]
    assert out["answer"].strip() and s["prompt_tokens"] > 1000
    assert s["kv_cells"] <= 128 + s["generated_tokens"]


@pytest.mark.slow
@heavy
def test_qwen_check_passes_l1_l3_for_every_policy():
    """Every policy both engines implement: identical plans (L1) and the engines' arithmetic (L3, the same plan in
    both) within the default thresholds; each engine's own plan agrees too (plan agreement), except for the
    policies of PLAN_SENSITIVE_QWEN, which must then be reported as plan-sensitive, not as an engine failure."""
    pulled("qwen2.5-coder-0.5b")
    from kvcli.drivers.check import CheckSettings, Thresholds, run_check
    from kvcli.commands.check import format_report
    both = [n for n, s in policies.REGISTRY.items() if s.native and s.reference]
    r = run_check(catalogue.pulled_path("qwen2.5-coder-0.5b"), DOC.read_text(), both,
                  CheckSettings(budget=64, n_tokens=8, doc_tokens=1000, threads=THREADS), Thresholds())
    table = format_report(r)
    print(table)
    assert r["engines_agree"] and r["passed"], table
    for e in r["policies"]:
        assert "error" not in e and e["l1"]["pass"] and e["l3"]["pass"], table
        if e["policy"] not in PRECISION_SENSITIVE_QWEN:   # within the f16 limits, no allowance needed
            assert "allowance" not in e["l3"], table
        if e["policy"] in PLAN_SENSITIVE_QWEN:   # reported as the policy's sensitivity, with its figures
            assert e["plans"]["pass"] or e["plans"].get("sensitivity"), table
        else:
            assert e["plans"]["pass"], table


@pytest.mark.slow
def test_gemma_run_compresses_the_global_layers(run_kvcli, tmp_path):
    """gemma-3-270m: 15 of its 18 layers slide over 512 tokens (llama.cpp's window cache, left whole); snapkv at
    128 compresses the 3 global layers of a 2k-token document."""
    pulled("gemma-3-270m")
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(LONG_DOC.read_text().split()[:1500]))
    r = run_kvcli("run", "--model", "gemma-3-270m", "--doc", doc, "--policy", "snapkv", "--budget", "128",
                  "--threads", THREADS, "--json", "-n", "16", "What happened on the station?", timeout=1800)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["stats"]
    assert s["prompt_tokens"] > 1800 and s["kv_cells"] <= 128 + s["generated_tokens"]
    assert s["sliding_layers"] == [il for il in range(18) if il % 6 != 5] and s["sliding_window"] == 512
    for il in (5, 11, 17):
        assert s["per_layer_cells"][il] <= 128 + s["generated_tokens"]
    assert all(512 <= s["per_layer_cells"][il] < s["prompt_tokens"] for il in s["sliding_layers"])


@pytest.mark.slow
@heavy
def test_gemma_check_passes():
    """kvcli check on gemma-3-270m and a 2k-token document, every level, snapkv and pyramidkv: identical plans (L1),
    the engines' observations close (L2: one K and one V row of 6,042 are beyond the threshold, allowed as
    llama.cpp's arithmetic: the K row moves further with llama.cpp's batch size 64, the V row comes within the
    threshold in the reference given llama.cpp's 8-bit matmul inputs and f16 GELU; docs/models.md), both decode
    alike after compressing the 3 global layers (L3). About 2 min on 1 thread, most of it the reference engine."""
    pulled("gemma-3-270m")
    from kvcli.drivers.check import CheckSettings, Thresholds, run_check
    from kvcli.commands.check import format_report
    path = catalogue.pulled_path("gemma-3-270m")
    r = run_check(path, LONG_DOC.read_text(), ["snapkv", "pyramidkv"],
                  CheckSettings(budget=128, doc_tokens=2000, threads=1), Thresholds())
    table = format_report(r)
    assert r["passed"] and r["l2"]["pass"], table
    for e in r["policies"]:
        assert "error" not in e and e["l1"]["pass"] and e["l1"]["identical_budgets"], table
        assert e["l3"]["pass"] and len(e["plans"]["jaccard_per_layer"]) == 3, table
