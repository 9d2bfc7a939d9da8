"""Question-scored chunked reading (kvcli/drivers/chunked.py, scoring="question"): after every chunk but the last
the prompt's last tokens (chunked.probe_length) are prefilled as a probe, its last window observed, and rolled
back. The rollback must leave the
sequence exactly as it was, the probe's observation must cover exactly the held slots, the cache must
stay within budget + chunk, and both engines must make the same plans from it (tests/reference covers
that through kvcli check --chunk)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvcli.drivers.compress import prefill_and_compress, resolve
from kvcli.errors import KvcliError
from kvcli.native.session import NativeSession
from kvcli.reference.session import ReferenceSession
from tests.conftest import EXAMPLES

DOC = (EXAMPLES / "solar-garden.txt").read_text()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("scoring") / "tiny.gguf", n_ctx_train=1024)


def _native(model):
    return NativeSession(model, n_ctx=1024, cache_type="f32", flash_attn=False, n_threads=2)


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_rolled_back_probe_leaves_the_sequence_as_it_was(tiny, engine):
    """Prefill A, probe P, roll P back, prefill B: the same logits as A then B with no probe."""
    make = (lambda: _native(tiny)) if engine == "native" else (lambda: ReferenceSession(tiny, n_ctx=1024))
    a, b = make(), make()
    toks = a.tokenize(DOC)
    first, probe, then = toks[:150], toks[300:332], toks[150:200]
    a.prefill(first)
    b.prefill(first)
    obs = b.prefill(probe, observe=("window",), window=len(probe))
    assert obs.n == 150 + 32 and (obs.positions[-32:] == np.arange(150, 182)).all()
    b.rollback(0, len(probe))
    assert b.seq(0).next_pos == 150 and b.stats(0)["kv_cells"] == 150
    a.prefill(then)
    b.prefill(then)
    np.testing.assert_allclose(b.logits(0), a.logits(0), atol=1e-5, rtol=0)
    assert b.stats(0)["kv_cells"] == a.stats(0)["kv_cells"] == 200


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_probe_observation_is_the_question_window_over_the_held_slots(tiny, engine):
    """The planner sees the sums of the w probe queries' rows over exactly the slots held before the probe."""
    s = _native(tiny) if engine == "native" else ReferenceSession(tiny, n_ctx=1024)
    toks = s.tokenize(DOC)[:400]
    seen = []
    rep = prefill_and_compress(s, toks, resolve(s.model_path, "snapkv", 48, {"window": 16}), chunk=96, planner=engine,
                               on_step=lambda step, obs, plan: seen.append(obs))
    assert rep.scoring == "question" and len(rep.steps) >= 4
    for step, obs in zip(rep.steps[:-1], seen[:-1]):
        assert obs.windows == (16,) and obs.window_sums.shape[-1] == obs.n == step.cells_before
        assert obs.positions.max() < obs.n        # re-indexed: the held slots are 0..n-1, no probe slot among them
        rows = obs.window_sums[0].sum(axis=-1)    # the probe's own columns are dropped: 16 rows sum to < 16
        assert (rows > 0).all() and (rows < 16 * (1 + 1e-5)).all()
    # the cache never held more than budget + chunk, probe included
    assert rep.peak_cells <= 48 + 96
    assert max(st.cells_before for st in rep.steps) <= 48 + 96 - 16


def test_chunk_scoring_changes_what_is_kept(tiny):
    """The two scorings are different algorithms: on the same prompt they keep different entries."""
    kept = {}
    for scoring in ("question", "chunk"):
        s = _native(tiny)
        toks = s.tokenize(DOC)[:400]
        rep = prefill_and_compress(s, toks, resolve(s.model_path, "snapkv", 48, {"window": 16}), chunk=96,
                                   scoring=scoring)
        assert rep.scoring == scoring
        kept[scoring] = rep.plan.slots.copy()
    assert not np.array_equal(kept["question"], kept["chunk"])


def test_policies_without_a_window_are_not_probed(tiny):
    s = _native(tiny)
    toks = s.tokenize(DOC)[:400]
    for policy in ("h2o", "streamingllm"):
        s.clear()
        rep = prefill_and_compress(s, toks, resolve(s.model_path, policy, 48, {}), chunk=96)
        assert rep.scoring == "chunk" and rep.peak_cells <= 48 + 96


def test_unknown_scoring_is_refused(tiny):
    s = _native(tiny)
    with pytest.raises(KvcliError, match="unknown chunk scoring"):
        prefill_and_compress(s, s.tokenize(DOC)[:400], resolve(s.model_path, "snapkv", 48, {}), chunk=96,
                             scoring="both")


def test_cli_reports_the_scoring_and_refuses_a_bad_one(cli_runner, tiny, tmp_path):
    from kvcli.cli import cli
    doc = tmp_path / "d.txt"
    doc.write_text(DOC * 2, encoding="utf-8")
    for scoring in ("question", "chunk"):
        r = cli_runner.invoke(cli, ["run", "--model", str(tiny), "--doc", str(doc), "--policy", "snapkv", "--budget",
                                    "64", "--chunk", "128", "--chunk-scoring", scoring, "-n", "2", "--json", "What?"])
        assert r.exit_code == 0, r.output
        st = json.loads(r.stdout)["stats"]
        assert st["chunk_scoring"] == scoring and st["chunks"] >= 3 and st["peak_kv_cells"] <= 64 + 128
    r = cli_runner.invoke(cli, ["run", "--model", str(tiny), "--doc", str(doc), "--policy", "snapkv", "--budget", "64",
                                "--chunk-scoring", "both", "What?"])
    assert r.exit_code == 2 and "--chunk-scoring: 'both' is not one of" in r.output   # one line (issue #20.2b)


def test_a_short_window_is_probed_with_the_question_before_it(tiny):
    """A window of 8 (pyramidkv's, compresskv's) is the chat template's closing tokens: with chunks of 256 the probe
    is the prompt's last 32 tokens, of which the last 8 queries are observed (chunked.probe_length)."""
    from kvcli.drivers.chunked import probe_length
    assert probe_length(8, 256) == 32 and probe_length(8, 96) == 12 and probe_length(64, 1024) == 64
    s = _native(tiny)
    toks = s.tokenize(DOC)[:700]
    seen = []
    rep = prefill_and_compress(s, toks, resolve(s.model_path, "snapkv", 48, {"window": 8}), chunk=256,
                               on_step=lambda step, obs, plan: seen.append(obs))
    assert len(rep.steps) >= 3
    for step, obs in zip(rep.steps[:-1], seen[:-1]):
        assert obs.windows == (8,) and obs.window_sums.shape[-1] == obs.n == step.cells_before
        rows = obs.window_sums[0].sum(axis=-1)    # 8 observed queries' rows over the held slots
        assert (rows > 0).all() and (rows < 8 * (1 + 1e-5)).all()
    assert max(st.cells_before for st in rep.steps[:-1]) <= 48 + 256 - 32   # the chunks left the probe its room
