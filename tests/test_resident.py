"""A resident document (kvcli/drivers/reselect.py, `StoredDocument.make_resident`; native/src/README.md, "A resident
document"): the document's full cache is held once in a sequence of the context, every question shares its cells
(seq_cp) and gathers its selection into a sequence of its own (kvcli_gather_plan), the document's cells untouched.

What it must show: the same plan and the same logits as today's path (the stored cache restored into the answer's
sequence, then compacted in place), for policies that keep per-head counts, replacement rows, column sums and
kvzip's reconstruction; the document's cells byte for byte the same after any number of questions; the question's
cells freed; the cell accounting counting shared cells once.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvcli.errors import KvcliError

DOC = " ".join(f"Entry {i}: the {w} station logged code {1000 + 37 * i}." for i, w in
               enumerate(["north", "south", "river", "stone", "light", "delta", "gamma", "alpha"] * 6))
QUESTIONS = ("Which code did the river station log?", "What did the gamma station log last?")
BUDGET = 48
RESIDENT, WORK, OUT = 1, 2, 3

pytestmark = pytest.mark.usefixtures("cache_dir")


def _session(model):
    from kvcli.native.session import NativeSession
    return NativeSession(model, n_ctx=2048, n_seq=4)


def _prompts(session, question):
    doc = session.tokenize(session.apply_chat_template([{"role": "user", "content": DOC + "\n\n"}],
                                                       add_assistant=False))
    full = session.tokenize(session.apply_chat_template([{"role": "user", "content": DOC + "\n\n" + question}]))
    return doc, full


def _store(session, policy, doc_tokens):
    from kvcli.drivers.reselect import StoredDocument
    from kvcli.planning.planner import resolve
    cfg = resolve(session.model_path, policy, BUDGET, {})
    colsum = "colsum" in cfg.observe[0]
    return StoredDocument.read(session, doc_tokens, seq=0, colsum=colsum)


def _decode(session, seq, steps=(11, 7, 300)):
    out = [session.logits(seq)]
    for t in steps:
        session.step({seq: t})
        out.append(session.logits(seq))
    return np.array(out)


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv", "h2o", "d2o", "kvzip", "expected_attention", "streamingllm"])
def test_resident_gather_gives_the_restored_compactions_plan_and_logits(tiny_2k, policy):
    from kvcli.planning.planner import resolve
    s = _session(tiny_2k)
    doc, _ = _prompts(s, "")
    store = _store(s, policy, doc)
    for q in QUESTIONS:
        _, prompt = _prompts(s, q)
        cfg = resolve(s.model_path, policy, BUDGET, {}, q)
        # today's path: the stored cache restored into sequence 0, the question prefilled, compacted in place
        old = store.reselect(s, prompt, cfg, seq=0)
        old_logits = _decode(s, 0)
        s.clear(0)
        # resident: the document's cells held in RESIDENT, shared into WORK, the selection gathered into OUT
        store.make_resident(s, RESIDENT)
        before = s.save_seq(RESIDENT).state
        new = store.reselect(s, prompt, cfg, seq=WORK, into=OUT)
        assert new.seq == OUT and new.resident and new.source == "document"
        assert np.array_equal(new.plan.n_kept, old.plan.n_kept)
        assert np.array_equal(new.plan.slots, old.plan.slots)
        new_logits = _decode(s, OUT)
        if new.restored == store.split:   # the same cells in the same order: the same sums, bit for bit
            assert np.array_equal(new_logits, old_logits)
        else:   # cut back (a window reaching into the document): the document's cells it does not share lie between
            # the shared ones and the question's, masked; the attention's sums (flash attention's tiles, the few-rows
            # path's matrix products over every cell) are then grouped otherwise: measured up to 1.7e-3
            np.testing.assert_allclose(new_logits, old_logits, rtol=0, atol=3e-3)
        s.clear(WORK)                                             # the question's own cells
        assert s.save_seq(RESIDENT).state == before               # the document's cells never move nor change
        s.clear(OUT)
        store.evict(s)
    store.close()
    s.close()


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv"])
def test_question_window_scores_by_the_question_alone(tiny_2k, policy):
    """window_from="question" (kvcli serve, kvcli chat): the window is the prompt's tokens after the stored
    document, nothing stored is prefilled again, and the resident path still gives the restored path's plan and
    logits bit for bit; a column-sum policy and expected_attention's query rows keep their own windows."""
    from kvcli.planning.planner import resolve
    s = _session(tiny_2k)
    doc, prompt = _prompts(s, QUESTIONS[0])
    store = _store(s, policy, doc)
    cfg = resolve(s.model_path, policy, BUDGET, {}, QUESTIONS[0])
    window = cfg.observe[1]
    old = store.reselect(s, prompt, cfg, seq=0, window_from="question")
    # snapkv's window (32) is longer than the question, pyramidkv's (8) shorter: kept
    assert old.restored == store.split and old.prefilled == len(prompt) - store.split
    assert old.window == min(window, old.prefilled) and (old.window < window) == (policy == "snapkv")
    old_logits = _decode(s, 0)
    s.clear(0)
    store.make_resident(s, RESIDENT)
    new = store.reselect(s, prompt, cfg, seq=WORK, into=OUT, window_from="question")
    assert new.window == old.window and np.array_equal(new.plan.slots, old.plan.slots)
    assert np.array_equal(_decode(s, OUT), old_logits)
    for other in ("h2o", "expected_attention"):
        c = resolve(s.model_path, other, BUDGET, {})
        assert store.question_window(prompt, c) is c
    store.evict(s)
    store.close()
    s.close()


def test_shared_cells_are_counted_once_and_freed_with_the_question(tiny_2k):
    from kvcli.planning.planner import resolve
    s = _session(tiny_2k)
    doc, prompt = _prompts(s, QUESTIONS[0])
    store = _store(s, "snapkv", doc)
    store.make_resident(s, RESIDENT)
    assert store.snapshot is None and store.path is not None     # held once: in the context, its file on disk
    held = s.cells_used()
    assert held == store.split == s.measured_cells(RESIDENT)
    s.share(RESIDENT, WORK, store.split)
    assert s.cells_used() == held                                # shared, not copied
    s.clear(WORK)
    r = store.reselect(s, prompt, resolve(s.model_path, "snapkv", BUDGET, {}), seq=WORK, into=OUT)
    assert s.cells_used() == held + r.prefilled + r.plan.max_kept
    s.clear(WORK)
    assert s.cells_used() == held + r.plan.max_kept
    s.clear(OUT)
    assert s.cells_used() == held == s.measured_cells(RESIDENT)
    store.evict(s)
    assert s.cells_used() == 0 and store.resident is None
    store.close()
    s.close()


def test_an_answer_beside_a_resident_document_attends_from_its_own_cells(tiny_2k):
    """Decoding a gathered answer views the cache from the first cell the answer holds, not from cell 0 (every
    document cell is masked for it); the question's sequence, which sees the document, views it from cell 0. A graph
    is reused only with the same views: two answers gathered at different cells, decoded in turns (the later one
    first, whose graph would drop the earlier answer's cells), give each the logits it gives decoded alone."""
    from kvcli.native import cache
    from kvcli.planning.planner import resolve
    s = _session(tiny_2k)
    doc, _ = _prompts(s, "")
    store = _store(s, "snapkv", doc)
    store.make_resident(s, RESIDENT)
    n_layers = len(cache.layout_fronts(s.ctx))
    first, second = 0, OUT

    def answers():
        for seq in (first, second, WORK):
            s.clear(seq)
        got = []
        for q, into in zip(QUESTIONS, (first, second)):
            r = store.reselect(s, _prompts(s, q)[1], resolve(s.model_path, "snapkv", BUDGET, {}), seq=WORK, into=into)
            got.append(r)
            if into == first:
                s.step({WORK: 5})   # the question's sequence sees the document from cell 0
                assert cache.view_starts(s.ctx) == [0] * n_layers
                s.clear(WORK)
        return got

    r1, _ = answers()
    alone = {first: _decode(s, first)}
    # the first answer's block, after the document and the question's cells
    assert cache.view_starts(s.ctx) == [store.split + r1.prefilled] * n_layers
    alone[second] = _decode(s, second)
    assert cache.view_starts(s.ctx)[0] >= store.split + r1.prefilled + r1.plan.max_kept
    answers()
    turns = {second: [s.logits(second)], first: [s.logits(first)]}
    for t in (11, 7, 300):
        for seq in (second, first):
            s.step({seq: t})
            turns[seq].append(s.logits(seq))
    for seq in (first, second):   # the same visible cells in the same order; masked cells between them
        np.testing.assert_allclose(np.array(turns[seq]), alone[seq], rtol=0, atol=1e-5)
    s.close()


def test_a_gather_refuses_a_busy_destination_and_a_full_context(tiny_2k):
    from kvcli.planning.planner import resolve
    s = _session(tiny_2k)
    doc, prompt = _prompts(s, QUESTIONS[0])
    store = _store(s, "snapkv", doc)
    store.make_resident(s, RESIDENT)
    with pytest.raises(KvcliError, match="not an empty sequence"):
        s.share(RESIDENT, RESIDENT, 10)
    s.prefill([5, 6], seq=OUT)
    with pytest.raises(KvcliError, match="not an empty sequence to gather"):
        store.reselect(s, prompt, resolve(s.model_path, "snapkv", BUDGET, {}), seq=WORK, into=OUT)
    s.clear(OUT)
    s.clear(WORK)
    assert s.save_seq(RESIDENT).next_pos == store.split          # the document survived the refusal
    store.evict(s)
    store.close()
    s.close()
