"""Re-selection per question (kvcli/drivers/reselect.py, the re-selected mode of kvcli/apps/chat.py) on tiny random models.

What it must show: a re-selection observes what `run`'s one prefill of the same prompt observes (L2 thresholds of
kvcli check) and plans from it as the other engine's planner does (L1), in both engines; the conversation's earlier
turns survive re-selection; Ctrl-C, a corrupt, foreign or deleted stored file leave the conversation usable.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from kvcli.drivers.check import Thresholds, compare_observations, compare_plans
from kvcli.errors import KvcliError

DOC = " ".join(f"Entry {i}: the {w} station logged code {1000 + 37 * i}." for i, w in
               enumerate(["north", "south", "river", "stone", "light", "delta", "gamma", "alpha"] * 6))


@pytest.fixture(scope="module")
def tiny(tiny_2k):
    return tiny_2k


@pytest.fixture(scope="module")
def other_tiny(other_tiny_2k):
    return other_tiny_2k


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "kvcache"))
    return tmp_path / "kvcache"


def native(model):
    from kvcli.native.session import NativeSession
    return NativeSession(model, n_ctx=0)


def conversation(model, policy="snapkv", budget=48, **kw):
    from kvcli.apps.chat import Conversation
    conv = Conversation(native(model), DOC, policy=policy, budget=budget, reselect=True, **kw)
    conv.compress()
    return conv


def run_observation(session, tokens, cfg):
    """What `run` observes: one prefill of the whole prompt into a fresh sequence."""
    session.clear(1) if 1 in session.seqs else None
    obs = session.prefill(tokens, seq=1, observe=cfg.observe[0], window=cfg.observe[1])
    return obs


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "pyramidkv", "d2o"])
def test_native_reselection_observes_what_run_observes(tiny, policy):
    from kvcli.planning.planner import make_plan, resolve
    from kvcli.apps.chat import Conversation
    from kvcli.native.session import NativeSession
    session = NativeSession(tiny, n_ctx=0, n_seq=2)
    conv = Conversation(session, DOC, policy=policy, budget=48, reselect=True)
    conv.compress()
    q = "Which code did the river station log?"
    prompt = session.tokenize(conv.conversation_text(q))
    cfg = resolve(tiny, policy, 48, {}, q)
    seen = {}
    r = conv.store.reselect(session, prompt, cfg, seq=0, on_step=lambda obs, plan: seen.update(
        obs=obs.with_kv_arrays() if obs.has_kv else obs, plan=plan))
    kinds, window = cfg.observe
    assert r.restored == (min(conv.store.split, len(prompt) - window) if "window" in kinds else conv.store.split)
    assert r.prefilled == len(prompt) - r.restored
    ran = run_observation(session, prompt, cfg)
    ran = ran.with_kv_arrays() if ran.has_kv else ran
    l2 = compare_observations(ran, seen["obs"], Thresholds())
    assert l2["pass"], l2
    if "colsum" in cfg.observe[0]:   # stored sums + the prefilled rest's: the whole prompt's
        assert l2["colsum"]["rel"] < 1e-3, l2["colsum"]
    # L1: the other engine's planner makes the same plan from the re-selection's observation
    ref_plan = make_plan(cfg.spec, cfg.params, 48, seen["obs"], "reference")
    l1 = compare_plans(seen["plan"], ref_plan, Thresholds().l1_merge_atol)
    assert l1["pass"], l1
    # and the plan run would make keeps the same entries
    run_plan = make_plan(cfg.spec, cfg.params, 48, ran, "native")
    same = sum(np.array_equal(run_plan.kept(l, h), seen["plan"].kept(l, h))
               for l in range(run_plan.n_layer) for h in range(run_plan.n_head_kv))
    assert same == run_plan.n_layer * run_plan.n_head_kv
    session.close()


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_reference_reselection_observes_what_run_observes(tiny, policy):
    from kvcli.planning import planner
    from kvcli.apps.chat import TurnFormat, user_content
    from kvcli.reference.session import ReferenceSession
    from kvcli.drivers.reselect import StoredDocument
    ref = ReferenceSession(tiny, n_ctx=2048, n_seq=2)
    fmt = TurnFormat.probe(ref, None)
    q = "Which code did the stone station log?"
    head = ref.tokenize(fmt.head + DOC.strip())
    prompt = ref.tokenize(fmt.head + user_content(DOC, q) + fmt.after_user)
    cfg = resolve(tiny, policy, 48, {}, q)
    store = StoredDocument.read(ref, head, colsum="colsum" in cfg.observe[0])
    assert store.path is None and store.snapshot is not None   # the reference engine keeps it in memory
    seen = {}
    store.reselect(ref, prompt, cfg, on_step=lambda obs, plan: seen.update(obs=obs, plan=plan))
    ran = run_observation(ref, prompt, cfg)
    l2 = compare_observations(ran, seen["obs"], Thresholds.tight())
    assert l2["pass"], l2
    nat_plan = make_plan(cfg.spec, cfg.params, 48, seen["obs"], "native")
    assert compare_plans(nat_plan, seen["plan"], Thresholds().l1_merge_atol)["pass"]
    # the engines agree with each other on the re-selection's observation (L2)
    s = native(tiny)
    s.create_context(1024)
    n_store = StoredDocument.read(s, head, colsum="colsum" in cfg.observe[0])
    seen_n = {}
    n_store.reselect(s, prompt, cfg, on_step=lambda obs, plan: seen_n.update(obs=obs))
    assert compare_observations(seen_n["obs"], seen["obs"], Thresholds())["pass"]
    n_store.close()
    s.close()


def test_first_answer_is_runs_answer_and_turns_survive(tiny):
    """The first re-selected answer is what `run` answers (same prompt, same plan); a follow-up is asked after the
    earlier turn, which stays in the prompt; /reset forgets it; each re-selection restores the stored document."""
    from kvcli.apps.pipeline import run_document
    conv = conversation(tiny)
    q1, q2 = "Which code did the river station log?", "And the stone station?"
    g1 = conv.ask(q1, 8)
    ran = run_document(native(tiny), DOC, q1, policy="snapkv", budget=48, max_tokens=8)
    assert g1.text == ran.answer
    assert conv.stats()["kv_cells"] <= 48 + 8
    conv.ask(q2, 8)
    text = conv.conversation_text("Third?")
    assert q1 in text and q2 in text and g1.text in text and text.index(q1) < text.index(q2)
    assert conv.last_reselection.prefilled > len(conv.session.tokenize(q1))   # the first turn is re-read
    assert [t.question for t in conv.turns] == [q1, q2]
    conv.reset()
    assert conv.turns == [] and q1 not in conv.conversation_text("x")
    assert conv.ask(q1, 8).text == g1.text   # from the stored document again: the same answer
    conv.close()


def test_ctrl_c_during_reselection_keeps_the_conversation(tiny, monkeypatch):
    from kvcli.drivers import reselect
    conv = conversation(tiny)
    a = conv.ask("Which code did the river station log?", 6)
    real = reselect.StoredDocument.reselect

    def interrupted(self, *args, **kw):
        real(self, *args, **kw)
        raise KeyboardInterrupt

    monkeypatch.setattr(reselect.StoredDocument, "reselect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        conv.ask("And the stone station?", 6)
    monkeypatch.setattr(reselect.StoredDocument, "reselect", real)
    assert len(conv.turns) == 1 and conv.turns[0].answer == a.text
    b = conv.ask("And the stone station?", 6)   # usable: the next question restores the stored document
    assert len(conv.turns) == 2 and b.stopped in ("eog", "length")
    conv.close()


def test_deleted_store_is_read_again_and_said(tiny):
    conv = conversation(tiny)
    said = []
    conv.notify = said.append
    first = conv.ask("Which code did the river station log?", 6).text
    path = conv.store.path
    assert path.exists() and path.parent.name == "documents"
    path.unlink()
    conv.reset()
    assert conv.ask("Which code did the river station log?", 6).text == first
    assert said and "gone" in said[0] and conv.store.path.exists()
    stored = conv.store.path
    conv.close()
    assert not stored.exists()   # a temporary store goes at exit


def test_policy_switch_reselects_without_reading_and_reads_for_colsum(tiny):
    from kvcli.apps.chat import Repl
    conv = conversation(tiny)
    read_s = conv.store.read_s
    path = conv.store.path
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(conv, max_tokens=4, interactive=False, out=out, err=err, jsonl=True)
    repl.handle("/budget 40")
    assert conv.budget == 40 and conv.store.path == path and conv.store.read_s == read_s   # nothing read
    repl.handle("Which code did the river station log?")
    row = json.loads(out.getvalue().splitlines()[-1])
    assert row["mode"] == "re-selected" and row["store_bytes"] > 0 and row["reselect_s"] > 0
    assert row["kv_cells"] <= 40 + 4
    repl.handle("/policy h2o 40")   # scores by column sums: the store is read again with them
    assert conv.store.colsum is not None and "column sums" in err.getvalue()
    repl.handle("And the stone station?")
    assert len(conv.turns) == 2
    assert "re-selected" in conv.stats_table()
    conv.close()


def test_store_file_round_trip_and_refusals(tiny, other_tiny, tmp_path):
    from kvcli.apps.chat import Conversation
    keep = tmp_path / "doc.kvc"
    conv = conversation(tiny, store_path=keep)
    a = conv.ask("Which code did the river station log?", 6).text
    conv.close()
    assert keep.exists()   # named: kept
    again = Conversation.from_store(keep, policy="snapkv", budget=48, model=str(tiny))
    assert again.mode == "re-selected" and again.store.split == conv.store.split
    assert again.ask("Which code did the river station log?", 6).text == a
    again.close()
    assert keep.exists()
    # a column-sum policy on a store read without them: one line
    with pytest.raises(KvcliError, match="no column sums"):
        Conversation.from_store(keep, policy="h2o", budget=48, model=str(tiny))
    # foreign, truncated, corrupt
    with pytest.raises(KvcliError, match="was compressed for model"):
        Conversation.from_store(keep, policy="snapkv", budget=48, model=str(other_tiny))
    raw = keep.read_bytes()
    cut = tmp_path / "cut.kvc"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(KvcliError, match="truncated"):
        Conversation.from_store(cut, policy="snapkv", budget=48, model=str(tiny))
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(raw[:-100] + bytes(b ^ 0xFF for b in raw[-100:-50]) + raw[-50:])
    with pytest.raises(KvcliError, match="corrupted"):
        Conversation.from_store(bad, policy="snapkv", budget=48, model=str(tiny))


def test_compressed_file_is_not_a_store(tiny, tmp_path):
    from kvcli.apps.chat import Conversation
    once = Conversation(native(tiny), DOC, policy="snapkv", budget=48)
    once.compress()
    path = tmp_path / "once.kvc"
    once.save(path)
    with pytest.raises(KvcliError, match="compressed cache"):
        Conversation.from_store(path, policy="snapkv", budget=48, model=str(tiny))


def test_a_full_kvc_file_reselects_too(tiny, tmp_path):
    """A plain `compress --policy full` file (the document + the generic instruction) re-selects: the entries of the
    instruction are cut off at every question."""
    from kvcli.apps.chat import Conversation
    full = Conversation(native(tiny), DOC)
    full.compress()
    path = tmp_path / "full.kvc"
    full.save(path)
    conv = Conversation.from_store(path, policy="snapkv", budget=48, model=str(tiny))
    fresh = conversation(tiny)
    q = "Which code did the river station log?"
    assert conv.ask(q, 6).text == fresh.ask(q, 6).text
    assert conv.last_reselection.restored < conv.store.split
    fresh.close()


def test_document_too_long_for_reselection_is_refused(tiny):
    from kvcli.apps.chat import Conversation
    with pytest.raises(KvcliError, match="compress-once"):
        Conversation(native(tiny), DOC * 8, policy="snapkv", budget=48, reselect=True).compress()


# ------------------------------------------------------------------------------ the command line
def test_chat_command_reselects_by_default_and_stores(run_kvcli, tiny, tmp_path, cache_dir):
    doc = tmp_path / "d.txt"
    doc.write_text(DOC, encoding="utf-8")
    env = {"KVCLI_CACHE": str(cache_dir), "XDG_STATE_HOME": str(tmp_path / "state"),
           "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    questions = "Which code did the river station log?\nAnd the stone station?\n/stats\n"
    r = run_kvcli("chat", "--doc", doc, "--model", tiny, "--policy", "snapkv", "--budget", "48", "-n", "4", "--json",
                  input=questions, env=env)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["mode"] for x in rows] == ["re-selected"] * 2
    assert all(x["store_bytes"] > 0 and x["reselect_s"] > 0 and x["kv_cells"] <= 48 + 4 for x in rows)
    assert rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]   # the first turn is in the second prompt
    assert "re-selected per question" in r.stderr and "mode: re-selected" in r.stderr
    assert not any((cache_dir / "documents").iterdir())   # the temporary store is gone at exit
    once = run_kvcli("chat", "--doc", doc, "--model", tiny, "--policy", "snapkv", "--budget", "48", "-n", "4",
                     "--json", "--compress-once", input=questions, env=env)
    assert once.returncode == 0 and {json.loads(x)["mode"] for x in once.stdout.splitlines()} == {"question-agnostic"}
    # --store keeps it; --cache FILE --policy P --budget N re-selects from it without reading the document
    keep = tmp_path / "doc.kvc"
    k = run_kvcli("chat", "--doc", doc, "--model", tiny, "--policy", "snapkv", "--budget", "48", "-n", "4",
                  "--json", "--store", keep, input=questions, env=env)
    assert k.returncode == 0 and keep.exists(), k.stderr
    c = run_kvcli("chat", "--cache", keep, "--policy", "snapkv", "--budget", "48", "-n", "4", "--json",
                  input=questions, env=env)
    assert c.returncode == 0, c.stderr
    assert [json.loads(x)["answer"] for x in c.stdout.splitlines()] == [x["answer"] for x in rows]
    assert "loaded in" in c.stderr and "tokens read in" not in c.stderr
    # one-line refusals
    for args, msg in ((["--cache", keep, "--policy", "snapkv"], "needs a compressing --policy and --budget"),
                      (["--cache", keep, "--policy", "snapkv", "--budget", "48", "--doc", doc], "drop --doc"),
                      (["--doc", doc, "--store", keep], "--store keeps the full cache")):
        bad = run_kvcli("chat", "--model", tiny, *args, input="", env=env)
        lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
        assert bad.returncode == 2 and len(lines) == 1 and msg in lines[0], bad.stderr


def test_unwritable_store_is_said_and_kept_in_memory(tiny, monkeypatch, tmp_path):
    """A disk that is full when the cache is stored (at the start, or when a deleted store is read again): one
    line, the full cache kept in memory, the chat goes on and answers as it would from the file."""
    from kvcli import kvc
    from kvcli.apps.chat import Conversation
    conv = conversation(tiny)
    q = "Which code did the river station log?"
    first = conv.ask(q, 6).text
    said = []
    conv.notify = said.append
    real = kvc.write

    def full_disk(path, *a, **k):
        raise KvcliError(f"cannot write {path}: No space left on device")

    monkeypatch.setattr(kvc, "write", full_disk)
    conv.store.path.unlink()   # deleted while chatting, and the disk is full when it is read again
    conv.reset()
    assert conv.ask(q, 6).text == first
    assert any("gone" in x for x in said) and any("No space left" in x and "memory" in x for x in said)
    assert conv.store.path is None and conv.store.snapshot is not None
    monkeypatch.setattr(kvc, "write", real)
    out = tmp_path / "saved.kvc"
    conv.save(out)   # /save writes it from memory
    again = Conversation.from_store(out, policy="snapkv", budget=48, model=str(tiny))
    assert len(again.turns) == 1
    again.reset()
    assert again.ask(q, 6).text == first
    conv.close()
