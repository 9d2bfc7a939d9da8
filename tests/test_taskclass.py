"""WindowKV's task=auto classifier (kvcli/taskclass): data, shipped weights, held-out accuracy, policy wiring.

No model is loaded; the last test uses the native library's planner (built by ./setup.sh).
"""
from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pytest

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation, sum_window_rows
from kvcli.taskclass import (INSTRUCTIONS_PATH, MIN_KNOWN_FEATURES, TASKS, WEIGHTS_PATH, TaskClassifier, classifier,
                             classify, resolve_task)
from kvcli.taskclass import train as T
from kvcli.taskclass.features import featurize, normalize


@pytest.fixture(scope="module")
def rows():
    return T.load_rows(INSTRUCTIONS_PATH)


@pytest.fixture(scope="module")
def blob():
    return json.loads(WEIGHTS_PATH.read_text(encoding="utf-8"))


def test_labelled_data_is_a_clean_split(rows):
    train = [r for r in rows if r["split"] == "train"]
    test = [r for r in rows if r["split"] == "test"]
    assert len(train) >= 300 and len(test) >= 100
    for part in (train, test):
        counts = {t: sum(r["label"] == t for r in part) for t in TASKS}
        assert min(counts.values()) >= 0.4 * len(part), counts   # both classes, roughly balanced
    # nothing held out is also trained on, not even up to case and spacing
    seen = {" ".join(normalize(r["text"]).split()) for r in train}
    assert not [r["text"] for r in test if " ".join(normalize(r["text"]).split()) in seen]
    # every kind of task is represented on both sides
    assert {r["kind"] for r in test} == {r["kind"] for r in train}


def test_shipped_weights_come_from_this_data(blob, rows):
    assert blob["trained"]["data_sha256"] == hashlib.sha256(INSTRUCTIONS_PATH.read_bytes()).hexdigest(), \
        "task_instructions.jsonl changed: retrain with python -m kvcli.taskclass.train"
    # refitting with the recorded setting reproduces the shipped weights (the fit is exact and deterministic)
    train = [r for r in rows if r["split"] == "train"]
    feats = [featurize(r["text"], blob["feature_set"]) for r in train]
    vocab, w, b = T.ngram_fit(feats, T.labels(train), blob["trained"]["min_df"], blob["trained"]["lambda"])
    assert vocab == list(blob["weights"])
    np.testing.assert_allclose(np.array([blob["weights"][f] for f in vocab]), w, atol=1e-7)
    assert abs(blob["bias"] - b) < 1e-7


def test_held_out_accuracy_is_what_the_docs_report(blob, rows):
    test = [r for r in rows if r["split"] == "test"]
    preds = [classify(r["text"]).task for r in test]
    m = np.zeros((2, 2), dtype=int)
    for r, p in zip(test, preds):
        m[TASKS.index(r["label"]), TASKS.index(p)] += 1
    acc = np.trace(m) / len(test)
    assert m.tolist() == blob["trained"]["test_confusion"]
    assert acc == pytest.approx(blob["trained"]["test_accuracy"], abs=1e-6)
    assert acc >= 0.9
    # the documented numbers are these numbers
    doc = (INSTRUCTIONS_PATH.parents[2] / "docs" / "windowkv-task-classifier.md").read_text(encoding="utf-8")
    assert f"{int(np.trace(m))}/{len(test)}" in doc
    # and so is what task=auto answers once it refuses texts it knows too little of
    answered = [(r, p) for r, p in zip(test, preds) if classify(r["text"]).known_features >= MIN_KNOWN_FEATURES]
    ok = sum(r["label"] == p for r, p in answered)
    assert f"answers {len(answered)} of the {len(test)} held-out" in doc and f"{ok}/{len(answered)}" in doc


@pytest.mark.parametrize("text,task", [
    ("Summarise this document.", "aggregation"),
    ("Please complete the code given below.", "aggregation"),
    ("How many unique paragraphs are there after removing the duplicates?", "aggregation"),
    ("Following the examples, classify the last question. Type:", "aggregation"),
    ("Who founded the company described in the article?", "localization"),
    ("What is the special magic number hidden in the text?", "localization"),
    ("Answer the question based on the given passages. Question: where was the treaty signed?", "localization"),
])
def test_clear_cases(text, task):
    pred = classify(text)
    assert pred.task == task and pred.confidence > 0.9, pred


def test_deterministic_fast_and_bounded():
    c = classifier()
    text = "Give me a short summary of the meeting."
    first = c.predict(text)
    assert all(c.predict(text) == first for _ in range(5))
    assert TaskClassifier.from_file(WEIGHTS_PATH).predict(text) == first   # a fresh load gives the same bits
    t0 = time.perf_counter()
    for _ in range(20):
        c.predict(text)
    assert (time.perf_counter() - t0) / 20 < 0.02   # well under a millisecond on an idle core
    # a pasted whole prompt is read as head + tail only: cost does not grow with the document
    long = "filler words about nothing in particular. " * 5000 + "Summarize the report above."
    t0 = time.perf_counter()
    assert c.predict(long).task == "aggregation"
    assert time.perf_counter() - t0 < 0.5


def test_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(KvcliError, match="non-empty instruction"):
        classify("   ")
    # Korean: no n-gram of it was in the training data
    with pytest.raises(KvcliError, match=r"cannot tell what kind of task .* pass task=localization"):
        resolve_task("이 문서를 요약해 주세요")
    assert classify("이 문서를 요약해 주세요").known_features < MIN_KNOWN_FEATURES
    bad = tmp_path / "w.json"
    bad.write_text('{"format": "something-else"}')
    with pytest.raises(KvcliError, match="not a kvcli task classifier"):
        TaskClassifier.from_file(bad)


def test_windowkv_task_auto_resolves_before_planning():
    _, p, text = P.prepare("windowkv", ["task=auto"], 128, instruction="Summarize the whole report in a paragraph.")
    assert (p["task"], p["window"], p["score"]) == ("aggregation", 32, "topp")
    assert "task=aggregation;" in text and "auto" not in text.split(";")[0]
    _, p, _ = P.prepare("windowkv", ["task=auto"], 128, instruction="Which river flows through the capital?")
    assert (p["task"], p["window"], p["score"]) == ("localization", 16, "mean")
    # an explicit choice wins over the instruction, and other policies ignore the instruction
    _, p, _ = P.prepare("windowkv", ["task=localization"], 128, instruction="Summarize the report.")
    assert p["task"] == "localization"
    assert P.prepare("snapkv", [], 128, instruction="Summarize.")[1] == P.prepare("snapkv", [], 128)[1]
    # the resolved params validate again without the instruction (the torch planner does that)
    assert P.get("windowkv").validate(p) == p
    with pytest.raises(KvcliError, match="task=auto classifies the instruction, but none reached the policy"):
        P.prepare("windowkv", ["task=auto"], 128)
    with pytest.raises(KvcliError, match="task=auto classifies the instruction, but none"):
        P.prepare("windowkv", ["task=auto"], 128, instruction="  ")
    with pytest.raises(KvcliError, match="policy 'windowkv': task=auto: the task classifier cannot tell"):
        P.prepare("windowkv", ["task=auto"], 128, instruction="이 문서를 요약해 주세요")


def test_both_engines_plan_with_the_resolved_task():
    """task=auto reaches the C++ and torch planners as the same concrete task: identical plans, equal to
    the plan of that task given explicitly (and different from the other task's plan here)."""
    from kvcli.native.lib import native_plan
    from kvcli.reference.policies import reference_plan

    rng = np.random.default_rng(7)
    n_layer, n_head, n_kv, n, w = 4, 6, 2, 260, 32
    x = np.exp(rng.normal(0, 2.0, size=(n_layer, n_head, w, n)))
    q = np.arange(n - w, n)
    x = np.where(np.arange(n)[None, :] <= q[:, None], x, 0.0)
    windows = (16, 32)   # windowkv's window by task: localization 16, aggregation 32
    obs = Observation(n_layer=n_layer, n_head=n_head, n_head_kv=n_kv, head_dim=8, n=n, windows=windows,
                      window_sums=sum_window_rows((x / x.sum(-1, keepdims=True)).astype(np.float32), windows),
                      positions=np.arange(n, dtype=np.int32))
    plans = {}
    for instruction, task in (("Write a summary of all the reviews.", "aggregation"),
                              ("When did the museum reopen?", "localization")):
        _, params, _ = P.prepare("windowkv", ["task=auto"], 96, instruction=instruction)
        assert params["task"] == task
        nat, ref = native_plan("windowkv", params, 96, obs), reference_plan("windowkv", params, 96, obs)
        explicit = native_plan("windowkv", P.prepare("windowkv", [f"task={task}"], 96)[1], 96, obs)
        for other in (ref, explicit):
            assert np.array_equal(nat.n_kept, other.n_kept) and np.array_equal(nat.slots, other.slots)
        plans[task] = nat
    assert not np.array_equal(plans["aggregation"].slots, plans["localization"].slots)
