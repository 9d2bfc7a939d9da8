"""kvcli eval on tiny settings: metrics and aggregation by hand, the three evaluations end to end on a
tiny random model (structure, full cache = 1.0 of itself), and one real needle on the default model."""
from __future__ import annotations

import json
import math

import pytest
from helpers import native_missing

from kvcli.cli import cli
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import parse_size
from kvcli.evaluation.runner import aggregate
from kvcli.evaluation.tasks import string_match_all
from kvcli.testing.tiny_gguf import write_tiny_llama


def need_compaction():
    missing = native_missing("kvcli_apply_plan", "kvcli_observe_begin")
    if missing:
        pytest.fail(f"the native library lacks {', '.join(missing)}: rebuild it (python -m kvcli.native.build)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("eval") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=32, n_ctx_train=2048)


def test_string_match_all_is_rulers():
    assert string_match_all("The number is 1234567.", ["1234567"]) == 1.0
    assert string_match_all("abc XY", ["xy", "zz"]) == 0.5   # case-insensitive, share of references
    assert string_match_all("", ["1"]) == 0.0


def test_parse_size():
    assert parse_size("4k", "x") == 4096 and parse_size("1.5k", "x") == 1536 and parse_size("700", "x") == 700
    for bad in ("k", "0", "1.1", "-3", "4g"):
        with pytest.raises(KvcliError):
            parse_size(bad, "--lengths")


def test_aggregate_fraction_of_full_on_same_samples():
    recs = []
    for s, (full, pol) in enumerate([(100, 100), (100, 0), (0, 100)]):
        base = {"task": "niah", "length": 512, "depth": 0.5, "sample": s}
        recs.append({**base, "policy": "full", "budget": None, "score": full, "status": "ok"})
        recs.append({**base, "policy": "snapkv", "budget": 64, "score": pol, "status": "ok"})
    recs.append({"task": "niah", "length": 512, "depth": 0.5, "sample": 0, "policy": "x", "budget": 64,
                 "score": None, "status": "not available: x"})
    out = {(r["policy"], r["budget"]): r for r in aggregate(recs, ("task", "policy", "budget", "length"))}
    assert out[("full", None)]["frac_of_full"] == 1.0
    assert out[("snapkv", 64)]["score"] == pytest.approx(200 / 3)
    assert out[("snapkv", 64)]["frac_of_full"] == pytest.approx((200 / 3) / (200 / 3))
    assert out[("x", 64)]["score"] is None and out[("x", 64)]["status"].startswith("not available")


def _run(cli_runner, *args):
    r = cli_runner.invoke(cli, ["eval", *args, "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_eval_niah_structure_tiny(cli_runner, tiny, tmp_path):
    res = _run(cli_runner, "niah", "--model", str(tiny), "--policies", "full,nosuch", "--budgets", "64",
               "--lengths", "300,400", "--depths", "0.2,0.8", "--plot", str(tmp_path / "n.png"))
    assert res["task"] == "niah" and len(res["records"]) == 2 * 2 * 2
    full = [r for r in res["records"] if r["policy"] == "full"]
    assert all(r["status"] == "ok" and r["score"] in (0.0, 100.0) and r["tokens"] <= r["length"] for r in full)
    assert all(r["status"].startswith("not available") for r in res["records"] if r["policy"] == "nosuch")
    assert {(c["length"], c["depth"]) for c in res["cells"] if c["policy"] == "full"} == \
        {(300, 0.2), (300, 0.8), (400, 0.2), (400, 0.8)}
    assert (tmp_path / "n.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_ruler_tasks_tiny(cli_runner, tiny):
    res = _run(cli_runner, "ruler", "--model", str(tiny), "--policies", "full", "--lengths", "600",
               "--samples", "1", "--depths", "0.5")
    tasks = {r["task"] for r in res["records"]}
    assert tasks == {"niah_single", "niah_multikey", "vt", "cwe"}
    for r in res["records"]:
        assert r["status"] == "ok" and 0 <= r["score"] <= 100 and 500 <= r["tokens"] <= 600
    vt = [r for r in res["records"] if r["task"] == "vt"][0]
    assert len(vt["answers"]) == 5
    cwe = [r for r in res["records"] if r["task"] == "cwe"][0]
    assert len(set(cwe["answers"])) == 10


def test_eval_states_held_bytes_of_shared_prefill(cli_runner, tiny):
    # one shared prefill for every configuration: each still reports what its own compressed cache holds
    res = _run(cli_runner, "ruler", "--model", str(tiny), "--policies", "full,snapkv,pyramidkv", "--budgets", "48,96",
               "--lengths", "600", "--samples", "1", "--depths", "0.5", "--tasks", "niah_single")
    comp = [r for r in res["records"] if r["policy"] != "full"]
    assert len(comp) == 4 and all(r["status"] == "ok" for r in comp)
    for r in comp:
        assert 0 < r["kv_bytes_live"] <= r["kv_bytes"] and r["kv_cells"] >= r["budget"]
    held = {(r["policy"], r["budget"]): r["kv_bytes"] for r in comp}
    assert held[("snapkv", 48)] < held[("snapkv", 96)]
    assert all(c["kv_bytes"] > 0 for c in res["cells"] if c["policy"] != "full")


def test_eval_truncate_baseline_in_one_go(cli_runner, tiny):
    """A prompt that fits the context: `truncate` runs once per budget (its own prefill of the first 32 and the
    last budget - 32 tokens) beside the shared-prefill policies, never as a context's worth (that is full)."""
    res = _run(cli_runner, "niah", "--model", str(tiny), "--policies", "full,snapkv,truncate", "--budgets", "64,128",
               "--lengths", "300", "--depths", "0.5")
    got = [(r["policy"], r["budget"]) for r in res["records"]]
    assert sorted(got, key=str) == sorted([("full", None), ("snapkv", 64), ("snapkv", 128), ("truncate", 64),
                                           ("truncate", 128)], key=str)
    assert all(r["status"] == "ok" and r["score"] in (0.0, 100.0) for r in res["records"])
    assert {c["budget"] for c in res["summary"] if c["policy"] == "truncate"} == {64, 128}


def test_eval_interrupted_keeps_what_it_scored(cli_runner, tiny, tmp_path, monkeypatch):
    """Ctrl-C during a long evaluation: the samples scored so far are written (--json-out) and the exit is 130."""
    from kvcli.evaluation import runner
    real, calls = runner._greedy, []

    def greedy_then_interrupt(*a, **k):
        calls.append(1)
        if len(calls) == 3:       # the second sample's first configuration
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(runner, "_greedy", greedy_then_interrupt)
    out = tmp_path / "part.json"
    r = cli_runner.invoke(cli, ["eval", "niah", "--model", str(tiny), "--policies", "full,snapkv", "--budgets", "64",
                                "--lengths", "300", "--depths", "0.2,0.8", "--json-out", str(out)])
    assert r.exit_code == 130
    res = json.loads(out.read_text())
    assert res["interrupted"] is True
    # the configuration being decoded when the interrupt came is not a result
    assert [(x["depth"], x["policy"]) for x in res["records"]] == [(0.2, "full"), (0.2, "snapkv")]
    assert all(x["status"] == "ok" and x["score"] in (0.0, 100.0) for x in res["records"])


def test_eval_fidelity_tiny(cli_runner, tiny, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text(" ".join(f"line {i} of the report says the pump ran for {i % 7} hours." for i in range(60)))
    pols = "full,streamingllm" if not native_missing("kvcli_apply_plan") else "full"
    res = _run(cli_runner, "fidelity", "--model", str(tiny), "--docs", str(doc), "--policies", pols,
               "--budgets", "64", "--lengths", "256", "--cont", "16")
    recs = {r["policy"]: r for r in res["records"]}
    full = recs["full"]
    assert full["status"] == "ok" and math.isfinite(full["ppl"]) and full["ppl"] > 1
    assert full["kl_mean"] == pytest.approx(0.0, abs=1e-9)
    s = [x for x in res["summary"] if x["policy"] == "full"][0]
    assert s["ratio_to_full"] == 1.0
    if "streamingllm" in recs:
        assert recs["streamingllm"]["status"] == "ok" and recs["streamingllm"]["kl_mean"] >= 0
    short = _run(cli_runner, "fidelity", "--model", str(tiny), "--docs", str(doc), "--policies", "full",
                 "--lengths", "2000", "--cont", "16")
    assert short["records"][0]["status"].startswith("document too short")


@pytest.mark.parametrize("args, message", [
    (["niah", "--lengths", "4x"], "not a token count"),
    (["niah", "--depths", "1.5"], "must lie in"),
    (["niah", "--lengths", "100k", "--chunk", "8000"], "do not fit"),
    (["ruler", "--tasks", "qa"], "unknown task"),
    (["niah", "--plot", "a.svg"], ".png"),
    (["niah", "--policies", "snapkv", "--budgets", ""], "--budgets"),
])
def test_eval_bad_input_one_line(cli_runner, tiny, args, message):
    r = cli_runner.invoke(cli, ["eval", *args, "--model", str(tiny)])
    assert r.exit_code == 2, r.output
    assert message in r.output and r.output.count("\n") == 1


@pytest.mark.slow
def test_niah_default_model_full_and_compressed(cli_runner, default_model):
    """The calibrated case: at ~512 tokens the 135M model's full cache finds the needle."""
    need_compaction()
    res = _run(cli_runner, "niah", "--model", str(default_model), "--policies", "full,snapkv", "--budgets", "128",
               "--lengths", "512", "--depths", "0.5")
    by = {r["policy"]: r for r in res["records"]}
    assert by["full"]["score"] == 100.0, by["full"]["prediction"]
    assert by["snapkv"]["status"] == "ok"
    summ = {(s["policy"], s["budget"]): s for s in res["summary"]}
    assert summ[("full", None)]["frac_of_full"] == 1.0
    assert summ[("snapkv", 128)]["frac_of_full"] == by["snapkv"]["score"] / 100.0
