"""kvcli calibrate compresskv: probes, head scores, layer profile, the GGUF side-car and how the policy finds it.

Tiny random GGUF models (kvcli.testing.tiny_gguf) make the pipeline fast; the default model checks
that the probes are real (SmolLM2 answers a short one) and that the shipped calibration is found.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kvcli.calibration import store
from kvcli.calibration.compresskv import Settings, calibrate
from kvcli.calibration.lookup import policy_args
from kvcli.errors import KvcliError
from kvcli.testing.tiny_gguf import write_tiny_llama

SMALL = dict(lengths=(160,), depths=2, needles=1, samples=1, gen_tokens=4, max_new_tokens=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("cal") / "tiny.gguf", n_layer=3, n_head=4, n_head_kv=2,
                            head_dim=16, seed=1)


@pytest.fixture(scope="module")
def tiny_other_shape(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("cal2") / "other.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=16, seed=2)


@pytest.fixture(scope="module")
def tiny_same_shape(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("cal3") / "twin.gguf", n_layer=3, n_head=4, n_head_kv=2,
                            head_dim=16, seed=3)


@pytest.fixture()
def no_env(monkeypatch, tmp_path):
    monkeypatch.delenv("KVCLI_CALIBRATION", raising=False)
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))


def fake_calibration(model, **over) -> store.Calibration:
    from kvcli.models import model_hash, read_model_info
    i = read_model_info(model)
    d = dict(model_hash=model_hash(model), model_name=i.name, n_layer=i.n_layer, n_head=i.n_head,
             n_head_kv=i.n_head_kv, head_scores=np.arange(i.n_layer * i.n_head, dtype=np.float64)
             .reshape(i.n_layer, i.n_head) % 5, layer_scores=np.full(i.n_layer, 1.0 / i.n_layer), probes=4,
             probes_ok=3, settings={"lengths": [160]}, kvcli_version="0.1.0", created="2025-01-01T00:00:00Z",
             seconds=1.5)
    d.update(over)
    return store.Calibration(**d)


# ------------------------------------------------------------------------------- the real calibration
@pytest.fixture(scope="module")
def calibrated(tiny, tmp_path_factory):
    """The whole calibration on the tiny model, through the CLI, into an explicit side-car."""
    from click.testing import CliRunner

    from kvcli.cli import cli
    out = tmp_path_factory.mktemp("calout") / "tiny.kvcal.gguf"
    r = CliRunner().invoke(cli, ["calibrate", "compresskv", "--model", str(tiny), "-o", str(out), "--lengths", "160",
                                 "--depths", "2", "--needles", "1", "--samples", "1", "--gen-tokens", "4",
                                 "--max-new-tokens", "4", "--quiet"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(out)
    return out


def test_calibrate_tiny_model_writes_a_valid_sidecar(calibrated, tiny):
    cal = store.read(calibrated)
    assert (cal.n_layer, cal.n_head, cal.n_head_kv) == (3, 4, 2)
    assert cal.probes == 2 and 0 <= cal.probes_ok <= 2
    assert cal.layer_scores.shape == (3,) and abs(cal.layer_scores.sum() - 1) < 1e-9
    assert np.all(cal.layer_scores > 0)       # squeezing a random model to 32 entries hurts every layer
    assert cal.settings["lengths"] == [160] and cal.settings["samples"] == 1
    assert cal.kvcli_version and cal.method_version == store.METHOD_VERSION and cal.seconds > 0
    assert not list(calibrated.parent.glob("*.partial.json")) and not list(calibrated.parent.glob(".*tmp*"))


def test_calibration_round_trips_through_kvcli_info(calibrated, tiny, no_env, monkeypatch, cli_runner):
    from kvcli.cli import cli
    side = store.sidecar_path(tiny)
    shutil.copy(calibrated, side)
    try:
        r = cli_runner.invoke(cli, ["info", str(tiny), "--json"])
        assert r.exit_code == 0, r.output
        c = json.loads(r.stdout)["calibration"]
        want = store.read(calibrated)
        assert c["method"] == "compresskv" and c["kvcli_version"] == want.kvcli_version
        assert c["source"] == str(side)
        assert np.allclose(c["layer_scores"], want.layer_scores, rtol=0, atol=0)
        r = cli_runner.invoke(cli, ["info", str(tiny)])
        line = [x for x in r.stdout.splitlines() if x.startswith("calibration")][0]
        assert "compresskv" in line and f"kvcli {want.kvcli_version}" in line
    finally:
        side.unlink()
    r = cli_runner.invoke(cli, ["info", str(tiny)])
    assert "none (compresskv falls back" in r.stdout


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma3"])
def test_probe_attention_equals_the_reference_engine_observation(tiny, arch, tmp_path):
    """The hook's recomputed post-RoPE queries give the attention the reference engine observes
    (qwen2: Q bias; qwen3: Q norm; phi3: fused QKV; gemma3: Q norm, Q scale, the global layers' RoPE, and
    only its global layers hooked)."""
    import torch

    from kvcli.testing.tiny_gguf import write_tiny
    if arch != "llama":
        tiny = write_tiny(tmp_path / f"{arch}.gguf", arch)

    from kvcli.calibration.runner import Runner, attention_probs, load_lm, sdpa
    from kvcli.reference.session import ReferenceSession
    lm = load_lm(tiny)
    tokens = lm.tokenizer(lm.template("A short text about gardens and rivers. Which river?"),
                          add_special_tokens=False)["input_ids"]
    got = {}
    with sdpa(lm.model):
        Runner(lm, lambda l, q, K, V, m: got.__setitem__(l, attention_probs(lm, q, K, m.scaling))).start(tokens, 3)
    sess = ReferenceSession(tiny, n_ctx=0)
    obs = sess.prefill(tokens, observe=("window",), window=3)
    assert sorted(got) == list(range(lm.n_layer)) and lm.n_layer == sess.info.n_layer
    mine = torch.stack([got[l].double().sum(dim=1) for l in range(lm.n_layer)]).float().numpy()[None]  # window sums
    assert mine.shape == obs.window_sums.shape and obs.windows == (3,)
    assert np.max(np.abs(mine - obs.window_sums)) < 3 * 1e-5      # 3 rows of probabilities within 1e-5 each


def test_error_profile_is_zero_when_nothing_is_squeezed(tiny):
    from kvcli.calibration.layers import text_errors
    from kvcli.calibration.runner import load_lm, sdpa
    lm = load_lm(tiny)
    tokens = lm.tokenizer(lm.template("One two three four five six seven eight nine ten."),
                          add_special_tokens=False)["input_ids"]
    with sdpa(lm.model):
        whole, steps = text_errors(lm, tokens, [], 4, gen_tokens=3, budget=len(tokens) + 1, window=8)
        squeezed, _ = text_errors(lm, tokens, [0, 1, 2, 3] * 3, 4, gen_tokens=3, budget=12, window=8)
    assert steps == 3
    assert np.all(whole < 1e-5)                  # budget >= prompt: the shadow cache is the full cache
    assert np.all(squeezed > 1e-3)


def test_interrupted_calibration_resumes_and_leaves_no_broken_file(tiny, tmp_path, monkeypatch):
    import kvcli.calibration.compresskv as ck
    out = tmp_path / "t.kvcal.gguf"
    real = ck.run_probe
    calls = []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(ck, "run_probe", flaky)
    with pytest.raises(KeyboardInterrupt):
        calibrate(tiny, out, Settings(**SMALL), progress=False, warn=lambda m: None)
    assert not out.exists()
    partial = json.loads((tmp_path / "t.kvcal.gguf.partial.json").read_text())
    assert len(partial["probes"]) == 1
    msgs = []
    cal = calibrate(tiny, out, Settings(**SMALL), progress=False, warn=msgs.append)
    assert len(calls) == 3                       # the first probe was not run again
    assert any("resuming" in m for m in msgs)
    assert store.read(out).probes == 2 and cal.probes == 2
    assert not (tmp_path / "t.kvcal.gguf.partial.json").exists()


# ------------------------------------------------------------------------------- finding and refusing
def test_policy_args_use_the_sidecar_and_warn_without_one(tiny, no_env):
    msgs = []
    assert policy_args(tiny, {}, warn=msgs.append) == {}
    assert len(msgs) == 1 and "no compresskv calibration" in msgs[0] and "uniform" in msgs[0]
    side = store.write(fake_calibration(tiny), store.sidecar_path(tiny))
    try:
        msgs.clear()
        args = policy_args(tiny, {"srh_k": "2"}, warn=msgs.append)
        assert not msgs
        # fake head_scores row l = (4l + h) % 5: layer 0 ranks 3,2,1,0; layer 1 ranks 0,3,2,1 (4,0,1,2 -> 0 first)
        assert args["srh"].split(",")[:2] == ["3", "2"]
        assert len(args["srh"].split(",")) == 3 * 2
        assert len(args["layer_scores"].split(",")) == 3
        from kvcli.policies.compresskv import SPEC
        p = SPEC.validate(args)                  # the registry accepts what we produce
        assert len(p["srh"]) == 6 and abs(sum(p["layer_scores"]) - 1) < 1e-9
        assert policy_args(tiny, {"srh": "0,1,2"}, warn=msgs.append) == {"srh": "0,1,2"}   # explicit wins
        with pytest.raises(KvcliError, match="srh_k=5 is more than"):
            policy_args(tiny, {"srh_k": "5"}, warn=msgs.append)
    finally:
        side.unlink()


def test_calibration_without_answered_probes_warns_and_keeps_layer_budgets(tiny, no_env):
    side = store.write(fake_calibration(tiny, probes_ok=0, head_scores=np.zeros((3, 4))), store.sidecar_path(tiny))
    try:
        msgs = []
        args = policy_args(tiny, {}, warn=msgs.append)
        assert "srh" not in args and "layer_scores" in args
        assert len(msgs) == 1 and "no semantic retrieval heads" in msgs[0]
    finally:
        side.unlink()


def test_calibration_of_another_model_is_refused(tiny, tiny_other_shape, tiny_same_shape, no_env, tmp_path,
                                                 monkeypatch):
    other = store.write(fake_calibration(tiny_other_shape), tmp_path / "other.kvcal.gguf")
    twin = store.write(fake_calibration(tiny_same_shape), tmp_path / "twin.kvcal.gguf")
    monkeypatch.setenv("KVCLI_CALIBRATION", str(other))
    with pytest.raises(KvcliError, match=r"made for a model with 2 layers, 4 heads, 2 KV heads.*has 3, 4, 2"):
        policy_args(tiny, {})
    monkeypatch.setenv("KVCLI_CALIBRATION", str(twin))
    with pytest.raises(KvcliError, match="belongs to another model file"):
        policy_args(tiny, {})
    monkeypatch.delenv("KVCLI_CALIBRATION")
    side = store.sidecar_path(tiny)
    shutil.copy(twin, side)                      # found automatically: refused too, never skipped silently
    try:
        with pytest.raises(KvcliError, match="re-run kvcli calibrate compresskv"):
            store.find(tiny)
    finally:
        side.unlink()


def test_calibration_found_by_hash_in_the_user_cache(tiny, no_env):
    from kvcli.models import model_hash
    folder = store.user_dir()
    folder.mkdir(parents=True)
    store.write(fake_calibration(tiny), folder / f"tiny.{model_hash(tiny)}{store.SUFFIX}")
    store.write(fake_calibration(tiny, model_hash="0" * 16), folder / f"x.{'0' * 16}{store.SUFFIX}")
    cal = store.find(tiny)
    assert cal is not None and cal.source.startswith(str(folder)) and cal.model_hash == model_hash(tiny)


def test_bench_eval_and_check_plan_compresskv_with_the_models_calibration(calibrated, tiny, no_env, monkeypatch,
                                                                          cli_runner, tmp_path):
    """Every command that makes a plan resolves compresskv for the model in one place
    (kvcli.planning.planner.resolve_for_model): without a calibration each warns (once per run) and plans with
    the fallback; with the one `kvcli calibrate` wrote, each plans with its heads and layer budgets."""
    from kvcli.planning.planner import make_plan
    from kvcli.cli import cli
    from kvcli.policies.compresskv import allocate
    seen = []
    real = make_plan

    def spy(spec, params, budget, obs, planner):
        if spec.name == "compresskv":
            seen.append((tuple(params["srh"]), tuple(params["layer_scores"])))
        return real(spec, params, budget, obs, planner)

    # every driver that plans imports make_plan by name: spy on each
    for module in ("kvcli.drivers.compress", "kvcli.drivers.chunked", "kvcli.drivers.check.levels",
                   "kvcli.drivers.check.verdicts", "kvcli.drivers.reselect", "kvcli.drivers.reselect_bounded",
                   "kvcli.evaluation.chat"):
        monkeypatch.setattr(f"{module}.make_plan", spy)
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"line {i}: the ridge station logged wind and snow." for i in range(40)) + "\n")
    budget = 48
    commands = {
        "bench": ["bench", "--docs", str(doc), "--model", str(tiny), "--policies", "compresskv", "--budgets",
                  str(budget), "--gen", "2", "--repeat", "1", "--json", "--quiet"],
        "eval": ["eval", "niah", "--model", str(tiny), "--policies", "compresskv", "--budgets", str(budget),
                 "--lengths", "400", "--depths", "0.5", "--json", "--quiet"],
        "check": ["check", "--model", str(tiny), "--policy", "compresskv", "--budget", str(budget), "--doc", str(doc),
                  "--levels", "1", "--tokens", "2", "--json"],
    }

    from kvcli.calibration import lookup

    def run_all():
        out = {}
        for name, args in commands.items():
            seen.clear()
            monkeypatch.setattr(lookup, "_WARNED", set())  # each command as a fresh process: it warns once
            r = cli_runner.invoke(cli, args)
            assert r.exit_code == 0, (name, r.output)
            out[name] = (set(seen), r.stderr, json.loads(r.stdout))
        return out

    fallback = run_all()
    for name, (plans, err, _) in fallback.items():
        assert plans == {((), ())}, name                              # every head scores, uniform budgets
        assert err.count("no compresskv calibration for tiny.gguf") == 1, (name, err)
    row = [x for x in fallback["bench"][2]["rows"] if x["policy"] == "compresskv"][0]
    assert row["status"] == "ok" and row["per_layer_cells"] == [budget] * 3   # measured before decoding

    cal = store.read(calibrated)
    want = (tuple(cal.srh(4)) if cal.probes_ok else (), tuple(float(x) for x in cal.layer_scores))
    layers = allocate(list(cal.layer_scores), budget)
    assert layers != [budget] * 3 and sum(layers) == 3 * budget   # the calibration moves budget between layers
    side = store.sidecar_path(tiny)
    shutil.copy(calibrated, side)
    try:
        calibrated_runs = run_all()
    finally:
        side.unlink()
    for name, (plans, err, _) in calibrated_runs.items():
        assert plans == {want}, name
        assert "no compresskv calibration" not in err, (name, err)
    row = [x for x in calibrated_runs["bench"][2]["rows"] if x["policy"] == "compresskv"][0]
    assert row["per_layer_cells"] == layers          # the layer budgets reach the cache
    assert calibrated_runs["check"][2]["policies"][0]["l1"]["pass"]


def _write_raw(path, fields: dict):
    """A side-car written by hand, to plant bad values."""
    import gguf
    T = gguf.GGUFValueType
    w = gguf.GGUFWriter(str(path), store.ARCH)
    for k, v in fields.items():
        if isinstance(v, list):
            w.add_key_value(k, v, T.ARRAY, T.FLOAT64)
        elif isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float64(k, v)
        else:
            w.add_uint32(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def good_fields(cal: store.Calibration) -> dict:
    K, C = store.K, store.C
    return {K + "format": store.FORMAT, K + "method": "compresskv", K + "method_version": 1,
            K + "kvcli_version": "0.1.0", K + "created": "x", K + "seconds": 1.0, K + "model.hash": cal.model_hash,
            K + "model.name": "tiny", K + "model.n_layer": cal.n_layer, K + "model.n_head": cal.n_head,
            K + "model.n_head_kv": cal.n_head_kv, C + "head_scores": [float(x) for x in cal.head_scores.reshape(-1)],
            C + "layer_scores": [float(x) for x in cal.layer_scores], C + "probes": 4, C + "probes_ok": 3,
            C + "settings": "{}"}


@pytest.mark.parametrize("change, message", [
    ({"kvcli.compresskv.layer_scores": [0.5, 0.5]}, "layer_scores has 2 values, expected 3"),
    ({"kvcli.compresskv.layer_scores": [0.5, float("nan"), 0.5]}, "must be finite"),
    ({"kvcli.compresskv.layer_scores": [0.7, 0.7, 0.7]}, "sum to 1"),
    ({"kvcli.compresskv.head_scores": [1.0] * 11}, "head_scores has 11 values"),
    ({"kvcli.compresskv.head_scores": [-1.0] * 12}, "must be finite and >= 0"),
    ({"kvcli.compresskv.probes_ok": 9}, "9 successful probes out of 4"),
    ({"kvcli.compresskv.settings": "{not json"}, "not valid JSON"),
    ({"kvcli.calibration.model.n_head": "four"}, "holds str, expected int"),
    ({"kvcli.calibration.format": 7}, "format 7"),
    ({"kvcli.compresskv.layer_scores": None}, "layer_scores is missing"),
])
def test_corrupted_values_give_a_clear_error(tiny, tmp_path, change, message):
    f = good_fields(fake_calibration(tiny))
    for k, v in change.items():
        if v is None:
            del f[k]
        else:
            f[k] = v
    p = _write_raw(tmp_path / "bad.kvcal.gguf", f)
    with pytest.raises(KvcliError, match=message):
        store.read(p)


def test_damaged_sidecar_files_give_a_clear_error(tiny, tmp_path, no_env):
    good = store.write(fake_calibration(tiny), tmp_path / "good.kvcal.gguf")
    data = good.read_bytes()
    (tmp_path / "trunc.kvcal.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(KvcliError, match="calibration"):
        store.read(tmp_path / "trunc.kvcal.gguf")
    (tmp_path / "junk.kvcal.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(KvcliError, match="not a readable GGUF"):
        store.read(tmp_path / "junk.kvcal.gguf")
    with pytest.raises(KvcliError, match="not found"):
        store.read(tmp_path / "missing.kvcal.gguf")


def test_bad_settings_are_refused(tiny, tmp_path, cli_runner):
    from kvcli.cli import cli
    for args, msg in ([["--lengths", "16"], "too short"], [["--lengths", "9000"], "exceed the model's context"],
                      [["--lengths", "1x"], "comma-separated token counts"]):
        r = cli_runner.invoke(cli, ["calibrate", "compresskv", "--model", str(tiny), "-o", str(tmp_path / "o.gguf"),
                                    *args])
        assert r.exit_code == 2 and msg in r.output, r.output


def test_sliding_window_model_calibrates_its_global_layers(tmp_path, cli_runner, no_env):
    """gemma3: plans cover the global layers, so the heads and the layer profile are theirs (2 of 4 here), and
    compresskv then plans with that calibration; gemma2 (soft-capped scores) is refused in one line. The model
    has no chat template: the probes use the plain-completion prompt `kvcli run` gives it."""
    from kvcli.cli import cli
    from kvcli.models import read_model_info
    from kvcli.testing.tiny_gguf import write_tiny
    # without a chat template, as gemma-3-270m: the probes get kvcli's plain-completion prompt
    path = write_tiny(tmp_path / "gemma3.gguf", "gemma3", n_layer=4, chat_template="")
    info = read_model_info(path)
    assert info.n_layer == 2 and info.n_layer_model == 4
    out = store.sidecar_path(path)
    r = cli_runner.invoke(cli, ["calibrate", "compresskv", "--model", str(path), "--lengths", "160", "--depths", "2",
                                "--needles", "1", "--samples", "1", "--gen-tokens", "4", "--max-new-tokens", "4",
                                "--quiet"])
    assert r.exit_code == 0, r.output
    cal = store.find(path)
    assert cal.source == str(out) and (cal.n_layer, cal.n_head) == (2, info.n_head)
    assert cal.head_scores.shape == (2, info.n_head) and abs(cal.layer_scores.sum() - 1) < 1e-9
    args = policy_args(path, {}, warn=lambda m: None)   # a random model answers no probe: every head scores
    assert len(args["layer_scores"].split(",")) == 2
    g2 = write_tiny(tmp_path / "gemma2.gguf", "gemma2", n_layer=4)
    r = cli_runner.invoke(cli, ["calibrate", "compresskv", "--model", str(g2), "-o", str(tmp_path / "g2.gguf")])
    assert r.exit_code == 2 and "does not support gemma2 yet" in r.output, r.output


# ------------------------------------------------------------------------------- the default model
def test_rouge1_recall():
    from kvcli.calibration.probes import rouge1_recall
    assert rouge1_recall("eat warm oatcakes", "You should eat warm oatcakes!") == 1.0
    assert rouge1_recall("velvet copper falcon", "copper") == pytest.approx(1 / 3)
    assert rouge1_recall("a a b", "a b") == pytest.approx(2 / 3)


def test_default_model_answers_a_probe_and_scores_heads(default_model):
    """SmolLM2 copies a short needle: the probe succeeds and its heads get span attention."""
    from kvcli.calibration.heads import run_probe
    from kvcli.calibration.probes import build_probe
    from kvcli.calibration.runner import load_lm, sdpa
    lm = load_lm(default_model)
    probe = build_probe(lm.n_tokens, lm.template, 256, 0.5, 0, seed=0)
    with sdpa(lm.model):
        r = run_probe(lm, probe, 16, 0.5)
    assert r.ok, (probe.needle.answer, r.response)
    assert r.steps >= 2 and r.scores.shape == (30, 9)
    assert r.scores.max() > 0.5 * r.steps / 2   # some head puts a large share of its attention on the span


def test_shipped_calibration_is_found_for_the_default_model(default_model, no_env):
    cal = store.find(default_model)
    assert cal is not None, "kvcli/data/ should ship the default model's calibration"
    assert cal.source.startswith(str(store.DATA_DIR))
    assert cal.probes_ok > 0 and (cal.n_layer, cal.n_head) == (30, 9)
    args = policy_args(default_model, {}, warn=lambda m: pytest.fail(m))
    assert len(args["srh"].split(",")) == 30 * 4


def test_every_shipped_calibration_reads_and_is_named_by_its_model_hash():
    """kvcli/data/ ships the default model's and qwen2.5-coder-0.5b's: each must pass the reader's checks and
    carry the model hash it is found by (`<stem>.<hash>.kvcal.gguf`), or compresskv would never find it."""
    shipped = sorted(store.DATA_DIR.glob("*" + store.SUFFIX))
    assert len(shipped) >= 2
    for p in shipped:
        cal = store.read(p)
        assert p.name.endswith(f".{cal.model_hash}{store.SUFFIX}"), p.name
        assert 0 < cal.probes_ok <= cal.probes and cal.layer_scores.shape == (cal.n_layer,)
