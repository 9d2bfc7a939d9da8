"""kvcli check: the comparison functions of each level and the command's input errors (no model needed
for most of them)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvcli.drivers.check import (Thresholds, compare_kv_rows, compare_observations, compare_plans, jaccard_per_head,
                         jaccard_per_layer, logits_distance, plan_sensitivity, selection_margins)
from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation, Plan


def _plan(kept, log_mult=None):
    return Plan.from_lists([[np.asarray(h, np.int32) for h in layer] for layer in kept], log_mult=log_mult)


def test_l1_identical_plans_pass():
    p = _plan([[[0, 3, 5], [1, 2, 5]], [[0, 1, 5], [4, 5]]])
    r = compare_plans(p, _plan([[[0, 3, 5], [1, 2, 5]], [[0, 1, 5], [4, 5]]]), 1e-5)
    assert r["pass"] and r["identical_budgets"] and r["heads_differing"] == 0


def test_l1_one_different_slot_fails_and_says_where():
    a = _plan([[[0, 3, 5], [1, 2, 5]]])
    b = _plan([[[0, 3, 5], [1, 4, 5]]])
    r = compare_plans(a, b, 1e-5)
    assert not r["pass"] and r["heads_differing"] == 1
    assert "layer 0 head 1" in r["first_difference"] and "[2]" in r["first_difference"]


def test_l1_budgets_must_match():
    r = compare_plans(_plan([[[0, 3, 5]]]), _plan([[[0, 3]]]), 1e-5)
    assert not r["pass"] and not r["identical_budgets"]


def test_l1_merged_rows_within_atol():
    def merged(delta):
        p = _plan([[[0, 2, 4]]], log_mult=[[np.array([0, math.log(2), 0], np.float32)]])
        p.replace_entry = np.array([1], np.int32)
        p.replace_k = np.full((1, 4), 0.5 + delta, np.float32)
        p.replace_v = np.full((1, 4), -0.5, np.float32)
        return p
    assert compare_plans(merged(0.0), merged(5e-6), 1e-5)["pass"]
    r = compare_plans(merged(0.0), merged(1e-3), 1e-5)
    assert not r["pass"] and r["merge_max_abs"] == pytest.approx(1e-3, rel=1e-3)
    # a merge on one side only is a difference even if the kept sets agree
    plain = _plan([[[0, 2, 4]]], log_mult=[[np.array([0, math.log(2), 0], np.float32)]])
    assert not compare_plans(merged(0.0), plain, 1e-5)["pass"]


def test_l1_missing_log_mult_equals_zeros():
    a = _plan([[[0, 1]]])
    b = _plan([[[0, 1]]], log_mult=[[np.zeros(2, np.float32)]])
    assert compare_plans(a, b, 1e-5)["pass"]
    c = _plan([[[0, 1]]], log_mult=[[np.array([0, 0.1], np.float32)]])
    assert not compare_plans(a, c, 1e-5)["pass"]


def _obs(seed=0, n=12, windows=(1, 3)):
    rng = np.random.default_rng(seed)
    sums = (rng.random((len(windows), 2, 4, n)) * np.array(windows)[:, None, None, None]).astype(np.float32)
    return Observation(n_layer=2, n_head=4, n_head_kv=2, head_dim=8, n=n, window_sums=sums, windows=windows,
                       colsum=rng.random((2, 4, n)).astype(np.float32),
                       keys=rng.standard_normal((2, 2, n, 8)).astype(np.float32),
                       values=rng.standard_normal((2, 2, n, 8)).astype(np.float32),
                       positions=np.arange(n, dtype=np.int32))


def test_l2_reports_errors_and_thresholds():
    a, b = _obs(), _obs()
    r = compare_observations(a, b, Thresholds.tight())
    assert r["pass"] and r["window"]["max_abs"] == 0 and r["positions_equal"]
    b.window_sums = b.window_sums.copy()
    b.window_sums[1, 1, 2, 5] += 3 * 0.01       # window 3: 0.01 more attention per window query
    r = compare_observations(a, b, Thresholds.tight())
    assert not r["pass"] and not r["window"]["pass"] and r["colsum"]["pass"]
    assert r["window"]["max_abs"] == pytest.approx(0.01, rel=1e-3)
    assert compare_observations(a, b, Thresholds())["pass"]  # within the default (realistic) tolerance
    c = _obs(n=11)
    with pytest.raises(KvcliError, match="slots"):
        compare_observations(a, c, Thresholds())


def test_restrict_takes_one_window_without_copying():
    o = _obs(windows=(2, 5))
    r = o.restrict(("window",), 2)
    assert r.windows == (2,) and r.window_sums.shape == (1, 2, 4, 12)
    assert np.array_equal(r.window_sums[0], o.window_sums[0]) and np.shares_memory(r.window_sums, o.window_sums)
    assert r.colsum is None and r.keys is None
    r = o.restrict(("colsum", "kv"), 0)
    assert r.window_sums is None and r.windows == () and r.colsum is o.colsum and r.keys is o.keys
    with pytest.raises(KvcliError, match="window 6 was not observed"):
        o.restrict(("window",), 6)


def test_l3_metrics():
    a = [[np.array([0, 1, 2, 3]), np.array([0, 5])]]
    b = [[np.array([0, 1, 2, 4]), np.array([0, 5])]]
    assert jaccard_per_layer(a, b) == [pytest.approx((3 / 5 + 1.0) / 2)]
    x = np.array([1.0, 2.0, 3.0], np.float32)
    err, kl = logits_distance(x, x + 7.0)          # a constant shift is the same distribution
    assert err == pytest.approx(7.0) and kl == pytest.approx(0.0, abs=1e-12)
    p = np.array([0.0, 0.0]), np.array([0.0, math.log(3.0)])
    _, kl = logits_distance(*p)                    # KL([.5,.5] || [.25,.75])
    assert kl == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))


def test_threshold_overrides():
    t = Thresholds().with_overrides(["l3_kl_max_f16=0.5", "l1_merge_atol=1e-6"])
    assert t.l3_kl_max_f16 == 0.5 and t.l1_merge_atol == 1e-6 and Thresholds().l3_kl_max_f16 != 0.5
    assert t.arithmetic("f16")["kl_max"] == 0.5 and t.arithmetic("f32")["kl_max"] == Thresholds().l3_kl_max_f32
    # the names of earlier releases: one value for every cache type, and the Jaccard that became plan agreement's
    t = Thresholds().with_overrides(["l3_kl_max=0.2", "l3_jaccard_min=0.5"])
    assert all(t.arithmetic(c)["kl_max"] == 0.2 for c in Thresholds.CACHE_TYPES) and t.plan_jaccard_min == 0.5
    with pytest.raises(KvcliError, match="cache type"):
        t.arithmetic("q4_0")
    for bad, msg in (["nope=1"], "unknown threshold"), (["l3_kl_max=x"], "number"), (["l3_kl_max"], "key=value"), \
            (["l3_kl_max=-1"], ">= 0"):
        with pytest.raises(KvcliError, match=msg):
            Thresholds().with_overrides(bad)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("check") / "m.gguf", n_layer=1)


@pytest.mark.parametrize("args, msg", [
    (["--threshold", "bogus=1"], "unknown threshold"),
    (["--levels", "4"], "--levels"),
    (["--policy", "nosuch"], "unknown policy"),
    # a budget under 1: the same words whichever policy is checked (snapkv's was "policy 'snapkv': budget ...")
    (["--budget", "0", "--policy", "snapkv"], "error: budget must be >= 1 (got 0)"),
    (["--budget", "0", "--policy", "full"], "error: budget must be >= 1 (got 0)"),
    (["--doc", "/nonexistent/doc.txt"], "document not found"),
    (["--chunk", "16", "--policy", "snapkv"], "--chunk must be at least"),
])
def test_check_command_bad_input_is_one_line(cli_runner, args, msg, tiny_model):
    from kvcli.cli import cli
    r = cli_runner.invoke(cli, ["check", "--model", str(tiny_model), *args])
    assert r.exit_code == 2, r.output
    err = r.stderr if hasattr(r, "stderr") else r.output
    assert msg in err and len(err.strip().splitlines()) == 1


def test_a_chunk_under_the_least_is_one_message_wherever_it_is_caught(cli_runner, tiny_model):
    """--chunk 16 (under MIN_CHUNK) is refused in the same words by kvcli check, run_check, plan_chunking and kvcli
    eval's runner (chunked.check_chunk), where each wrote its own copy and eval its own wording ('--chunk must be at
    least 64')."""
    from helpers import compression

    from kvcli.cli import cli
    from kvcli.drivers.check import CheckSettings, run_check
    from kvcli.drivers.chunked import MIN_CHUNK, plan_chunking
    from kvcli.evaluation.runner import run_generation_eval
    want = f"--chunk must be at least {MIN_CHUNK} tokens (got 16)"
    r = cli_runner.invoke(cli, ["check", "--model", str(tiny_model), "--policy", "snapkv", "--chunk", "16"])
    err = r.stderr if hasattr(r, "stderr") else r.output
    assert r.exit_code == 2 and want in err and len(err.strip().splitlines()) == 1, r.output
    caught = []
    doc = "The lighthouse keeper logged the tide at dawn and the ferry at noon. " * 12
    for refuse in (lambda: run_check(tiny_model, doc, ["snapkv"], CheckSettings(budget=48, chunk=16)),
                   lambda: plan_chunking(3000, 256, 8192, compression("snapkv", 256), chunk=16, cell_bytes=1024),
                   lambda: run_generation_eval(tiny_model, "niah", ["niah"], ["snapkv"], [48], [256], [0.5], 1,
                                               chunk=16)):
        with pytest.raises(KvcliError) as e:
            refuse()
        caught.append(str(e.value))
    assert caught == [want] * 3


def test_check_threads_reach_both_engines(cli_runner, tiny_model, tmp_path, monkeypatch):
    """--threads N goes to the native context and to torch (the report's settings say so)."""
    import json

    import torch

    from kvcli.cli import cli
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper logged the tide at dawn and the ferry at noon. " * 12)
    before = torch.get_num_threads()
    try:
        r = cli_runner.invoke(cli, ["check", "--model", str(tiny_model), "--policy", "streamingllm", "--budget", "32",
                                    "--doc", str(doc), "--tokens", "2", "--threads", "1", "--json"])
        assert r.exit_code in (0, 1), r.output
        report = json.loads(r.stdout if hasattr(r, "stdout") else r.output)
        assert report["settings"]["threads"] == 1 and torch.get_num_threads() == 1
        assert report["policies"][0]["l1"]["pass"]
    finally:
        torch.set_num_threads(before)
    bad = cli_runner.invoke(cli, ["check", "--model", str(tiny_model), "--threads", "0"])
    assert bad.exit_code == 2



def test_check_says_a_long_reads_tokens_and_time_before_it_starts(cli_runner, tiny_model, tmp_path, monkeypatch,
                                                                   cache_dir):
    """kvcli check's --doc read is announced as kvcli run's is (doc_formats.announce_read; KVCLI_READ_NOTICE_S=0 makes
    any read long enough): one line on stderr, with the prompt's token count, before the report; read in chunks too."""
    import json

    from kvcli.cli import cli
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper logged the tide at dawn and the ferry at noon. " * 12)
    monkeypatch.setenv("KVCLI_READ_NOTICE_S", "0")
    monkeypatch.setenv("KVCLI_READ_TOK_S", "50")
    for extra, how in (([], "in one prefill"), (["--chunk", "64"], "in chunks of 64")):
        r = cli_runner.invoke(cli, ["check", "--model", str(tiny_model), "--policy", "streamingllm", "--budget", "32",
                                    "--doc", str(doc), "--tokens", "2", "--levels", "1", "--threads", "1", "--json",
                                    *extra])
        assert r.exit_code in (0, 1), r.output
        n = json.loads(r.stdout)["prompt_tokens"]
        notice = [ln for ln in r.stderr.splitlines() if ln.startswith("[this document is ")]
        assert notice == [f"[this document is {n:,} tokens: reading it {how} in the native engine (at least once per "
                          f"policy) will take about {round(n / 50)} s (estimated at 50 tokens/s: KVCLI_READ_TOK_S)]"], \
            r.stderr
        assert r.output.index(notice[0]) < r.output.index('"prompt_tokens"')   # said before the report


def _kv(seed=0, shape=(2, 2, 500, 8)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_l2_kv_rows_beyond_the_threshold_pass_only_where_native_precision_moves_them_as_far():
    """One row past l2_kv_rtol passes when the native engine's other precision setting moves it at least as far
    (a precision-sensitive token), and fails when it does not (an engine disagreement)."""
    ref = _kv()
    nat = ref.copy()
    nat[1, 0, 17] += 0.5 * np.abs(ref).max()          # one row of 2,000 off by half the scale
    twin_far, twin_near = nat.copy(), nat.copy()
    twin_far[1, 0, 17] -= 0.9 * np.abs(ref).max()     # the native engine itself moves it further
    twin_near[1, 0, 17] -= 0.1 * np.abs(ref).max()
    th = Thresholds()
    r = compare_kv_rows(nat, ref, th, lambda: twin_far)
    assert r["pass"] and r["rows_over"] == 1 and r["rows"] == 2000 and r["rel"] == pytest.approx(0.5, rel=1e-5)
    assert r["rows_over_detail"][0]["slot"] == 17 and r["rows_over_detail"][0]["layer"] == 1
    assert not compare_kv_rows(nat, ref, th, lambda: twin_near)["pass"]
    assert not compare_kv_rows(nat, ref, th, lambda: None)["pass"]      # no twin: no allowance


def test_l2_kv_row_passes_where_the_native_engine_at_another_setting_agrees_with_the_reference():
    """A row the twin moves less far than the engines differ, but into the reference's neighbourhood: the same
    engine and patch agree with the reference at that setting, so the distance is llama.cpp's arithmetic at the
    check's setting (gemma-3-270m's layer-11 K row at slot 398: engines 18.5, twin move 16.2, twin to reference
    2.3, threshold 10.3). A twin that stays as far from the reference does not explain it."""
    ref = _kv()
    scale = np.abs(ref).max()
    nat = ref.copy()
    nat[1, 0, 17] += 0.18 * scale                      # beyond the threshold (0.1 x scale)
    twin = nat.copy()
    twin[1, 0, 17] -= 0.16 * scale                     # moved less than 0.18, to 0.02 x scale of the reference
    r = compare_kv_rows(nat, ref, Thresholds(), [("native_precision", "native", lambda: twin)])
    row = r["rows_over_detail"][0]
    assert r["pass"] and row["explained_by"] == "native_precision"
    assert row["native_precision"] == pytest.approx(0.16 * scale, rel=1e-5)
    assert row["native_precision_to_reference"] == pytest.approx(0.02 * scale, rel=1e-4)
    astray = nat.copy()
    astray[1, 0, 17] += 0.16 * scale                   # moved as far, the other way: 0.34 x scale from the reference
    assert not compare_kv_rows(nat, ref, Thresholds(), [("native_precision", "native", lambda: astray)])["pass"]


def test_l2_kv_rows_systematic_error_fails_without_asking_the_twin():
    """A wrong mapping or position moves most rows: beyond the allowed fraction the twin is never consulted, and
    the tight thresholds allow no row at all."""
    ref = _kv()
    wrong = ref[:, ::-1].copy()                        # KV heads swapped

    def twin():
        raise AssertionError("the twin must not be taken")
    r = compare_kv_rows(wrong, ref, Thresholds(), twin)
    assert not r["pass"] and r["rows_over"] > 100
    nat = ref.copy()
    nat[0, 1, 3] += 1e-2
    assert not compare_kv_rows(nat, ref, Thresholds.tight(), twin)["pass"]
    # and the allowance is one in a hundred rows by default: 21 rows of 2,000 are already too many, the report
    # still naming them (the first 20, as many as would have been allowed)
    nat = ref.copy()
    nat[0, 0, 1:22] += np.abs(ref).max()
    r = compare_kv_rows(nat, ref, Thresholds(), twin)
    assert not r["pass"] and r["rows_over"] == 21 and r["rows_allowed"] == 20
    assert [x["slot"] for x in r["rows_over_detail"]] == list(range(1, 21))
    assert compare_kv_rows(nat, ref, Thresholds(l2_kv_sensitive_rows=0.011), lambda: ref * 3)["pass"]


def test_selection_margins_measure_flips_from_the_cut():
    """Plan agreement's sensitivity figure: two observations whose scores swap a near-tie at the cut give one
    differing selection with two flipped entries, each a small gap from the cut in the policy's score and rank 1;
    a budget taken from the observation is told apart; identical scores give nothing."""
    s = np.array([[9.0, 5.0, 4.0, 3.99, 1.0, 0.5]])          # one row, k = 3 keeps slots 0, 1, 2
    r = selection_margins([(s, 3)], [(s.copy(), 3)])
    assert r["rows"] == 1 and r["rows_differing"] == 0 and r["flipped"] == 0 and r["first"] is None
    t = s.copy()
    t[0, 3] = 4.01                                              # the reference engine's scores swap 2 and 3
    r = selection_margins([(s, 3)], [(t, 3)])
    assert r["rows_differing"] == 1 and r["flipped"] == 2 and r["rank_max"] == 1
    cut = (4.0 + 3.99) / 2
    assert r["gap_max"] == pytest.approx(0.01 / cut) and r["delta_max"] == pytest.approx(0.02 / cut)
    assert r["beyond_near_tie"] == 0 and r["rows_budget_differs"] == 0 and r["first"]["budget"] == [3, 3]
    # a budget of 4 in the reference engine: the row differs because its k does
    r = selection_margins([(s, 3)], [(s.copy(), 4)])
    assert r["rows_differing"] == 1 and r["rows_budget_differs"] == 1 and r["flipped"] == 1
    # a flip far from the cut (what a broken observation gives) shows as a large gap and rank, and a score
    # difference as large
    u = s.copy()
    u[0, 0], u[0, 5] = 0.4, 9.0                                # slots 0 and 5 exchanged
    r = selection_margins([(s, 3)], [(u, 3)])
    assert r["flipped"] == 2 and r["rank_max"] == 3 and r["gap_max"] > 1 and r["delta_max"] > 2
    # leading dimensions are rows of their own (a layer's KV heads), k per call; mismatched calls are reported
    two = np.stack([s[0], s[0]])
    r = selection_margins([(two, 3)], [(np.stack([s[0], t[0]]), 3)])
    assert r["rows"] == 2 and r["rows_differing"] == 1 and r["first"]["row"] == 1
    assert not selection_margins([(s, 3)], [])["comparable"]
    assert not selection_margins([(s, 3)], [(two, 3)])["comparable"]


def test_plan_sensitivity_line():
    base = {"pass": False, "jaccard_min": 0.9, "kl": 0.2, "greedy_agree": 0.875}
    m = selection_margins([(np.array([[9.0, 5.0, 4.0, 3.99, 1.0]]), 3)], [(np.array([[9.0, 5.0, 3.99, 4.0, 1.0]]), 3)])
    line = plan_sensitivity({**base, "margins": m})
    assert line.startswith("sensitive (near-ties)") and "1 of 1 selections differ" in line and "KL 0.2" in line
    assert plan_sensitivity({**base, "margins": None, "layers_budget_differs": 2, "budget_max_diff": 3}) \
        .startswith("sensitive (budget allocation)")
    assert plan_sensitivity({**base, "pass": True}) == ""


def test_jaccard_per_head():
    a = [[np.array([0, 1, 2, 3]), np.array([0, 5])]]
    b = [[np.array([0, 1, 2, 4]), np.array([0, 5])]]
    assert jaccard_per_head(a, b) == [[pytest.approx(3 / 5), 1.0]]


def test_l2_kv_rows_allowances_are_tried_in_order_and_each_row_says_which_allowed_it():
    """Two rows beyond the threshold: one llama.cpp's own batch size moves as far as the engines differ (a "native"
    source), the other the reference given llama.cpp's arithmetic brings within the threshold (a "reference"
    source). Both pass, each naming its source; without the reference source the second fails; a source not needed
    is never taken."""
    ref = _kv(shape=(2, 2, 1000, 8))
    scale = np.abs(ref).max()
    nat = ref.copy()
    nat[0, 1, 5] += 0.5 * scale
    nat[1, 0, 9] += 0.5 * scale
    precision = nat.copy()                         # moves neither row
    ubatch = nat.copy()
    ubatch[0, 1, 5] += 0.8 * scale                 # moves the first row further than the engines differ
    emulated = ref.copy()
    emulated[1, 0, 9] = nat[1, 0, 9] - 0.05 * scale  # the emulated reference lands near the native second row
    th = Thresholds(l2_kv_sensitive_rows=0.01)
    src = [("native_precision", "native", lambda: precision), ("native_ubatch", "native", lambda: ubatch),
           ("reference_llamacpp_arithmetic", "reference", lambda: emulated)]
    r = compare_kv_rows(nat, ref, th, src)
    assert r["pass"] and r["rows_over"] == 2
    by = {x["slot"]: x["explained_by"] for x in r["rows_over_detail"]}
    assert by == {5: "native_ubatch", 9: "reference_llamacpp_arithmetic"}
    assert not compare_kv_rows(nat, ref, th, src[:2])["pass"]

    def never():
        raise AssertionError("not needed, not taken")
    assert compare_kv_rows(nat, ref, th, [("native_ubatch", "native", lambda: ubatch + np.where(
        np.arange(1000)[None, None, :, None] == 9, 0.8 * scale, 0)), ("x", "reference", never)])["pass"]
