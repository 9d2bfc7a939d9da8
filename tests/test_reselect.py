"""Re-selection per question (kvcli/drivers/reselect.py, the re-selected mode of kvcli/apps/chat.py) on tiny random
models.

What it must show: a re-selection observes what `run`'s one prefill of the same prompt observes (L2 thresholds of
kvcli check) and plans from it as the other engine's planner does (L1), in both engines, also for the later questions
of a conversation, which restore its turns from the stored cache (StoredDocument.extension) and prefill only what is
new; the conversation's earlier turns survive re-selection; Ctrl-C, a corrupt, foreign or deleted stored file leave
the conversation usable.
"""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from kvcli.drivers.check import Thresholds, compare_observations, compare_plans
from kvcli.errors import KvcliError
from kvcli.planning.planner import resolve

DOC = " ".join(f"Entry {i}: the {w} station logged code {1000 + 37 * i}." for i, w in
               enumerate(["north", "south", "river", "stone", "light", "delta", "gamma", "alpha"] * 6))


@pytest.fixture(scope="module")
def tiny(tiny_2k):
    return tiny_2k


# every test stores its documents in a cache folder of its own (conftest.py)
pytestmark = pytest.mark.usefixtures("cache_dir")


def native(model):
    from kvcli.native.session import NativeSession
    return NativeSession(model, n_ctx=0)


def conversation(model, policy="snapkv", budget=48, **kw):
    from kvcli.apps.chat import Conversation
    conv = Conversation(native(model), DOC, compression=resolve(model, policy, budget), reselect=True, **kw)
    conv.compress()
    return conv


def _rows(obs):
    """The observation with its K/V rows read out now (they are read lazily, and the sequence moves on)."""
    return obs.with_kv_arrays() if obs.has_kv else obs


def run_observation(session, tokens, cfg):
    """What `run` observes: one prefill of the whole prompt into a fresh sequence."""
    session.clear(1) if 1 in session.seqs else None
    obs = session.prefill(tokens, seq=1, observe=cfg.observe[0], window=cfg.observe[1])
    return obs


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "pyramidkv", "d2o", "expected_attention"])
def test_native_reselection_observes_what_run_observes(tiny, policy):
    from kvcli.planning.planner import make_plan, resolve
    from kvcli.apps.chat import Conversation
    from kvcli.native.session import NativeSession
    session = NativeSession(tiny, n_ctx=0, n_seq=2)
    conv = Conversation(session, DOC, compression=resolve(session.model_path, policy, 48), reselect=True)
    conv.compress()
    q = "Which code did the river station log?"
    prompt = session.tokenize(conv.conversation_text(q))
    cfg = resolve(tiny, policy, 48, {}, q)
    seen = {}
    r = conv.store.reselect(session, prompt, cfg, seq=0, on_step=lambda obs, plan: seen.update(
        obs=obs.with_kv_arrays() if obs.has_kv else obs, plan=plan))
    kinds, window = cfg.observe
    prefills_window = "window" in kinds or "query" in kinds   # expected_attention's Q rows: its last window
    assert r.restored == (min(conv.store.split, len(prompt) - window) if prefills_window else conv.store.split)
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


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "expected_attention"])
def test_reference_reselection_observes_what_run_observes(tiny, policy):
    from kvcli.planning.planner import make_plan, resolve
    from kvcli.apps.chat import TurnFormat, user_content
    from kvcli.reference.session import ReferenceSession
    from kvcli.drivers.reselect import StoredDocument
    ref = ReferenceSession(tiny, n_ctx=2048, n_seq=2)
    fmt = TurnFormat.probe(ref, None)
    q = "Which code did the stone station log?"
    head = ref.tokenize(fmt.head + DOC.strip())
    prompt = ref.tokenize(fmt.head + user_content(DOC, q) + fmt.after_user)
    # expected_attention with a window shorter than a turn, so that the second question restores the first's prompt
    cfg = resolve(tiny, policy, 48, {"window": 16} if policy == "expected_attention" else {}, q)
    store = StoredDocument.read(ref, head, colsum="colsum" in cfg.observe[0])
    assert store.path is None and store.snapshot is not None   # the reference engine keeps it in memory
    seen = {}
    store.reselect(ref, prompt, cfg, on_step=lambda obs, plan: seen.update(obs=_rows(obs), plan=plan))
    ran = run_observation(ref, prompt, cfg)
    l2 = compare_observations(ran, seen["obs"], Thresholds.tight())
    assert l2["pass"], l2
    nat_plan = make_plan(cfg.spec, cfg.params, 48, seen["obs"], "native")
    assert compare_plans(nat_plan, seen["plan"], Thresholds().l1_merge_atol)["pass"]
    # a second question after the first's turn: restored from the kept prompt, observed as one prefill observes
    ext_prompt = ref.tokenize(fmt.head + user_content(DOC, q) + fmt.after_user + "Code 1111." + fmt.assistant_to_user
                              + "And the river station?" + fmt.after_user)
    store.reselect(ref, prompt, cfg, extend=True)
    assert store.extension is not None and store.extension.tokens == prompt
    r2 = store.reselect(ref, ext_prompt, cfg, on_step=lambda obs, plan: seen.update(obs2=obs, plan2=plan))
    assert r2.source == "conversation" and r2.restored > len(head)
    ran2 = run_observation(ref, ext_prompt, cfg)
    l2 = compare_observations(ran2, seen["obs2"], Thresholds.tight())
    assert l2["pass"], l2
    assert compare_plans(make_plan(cfg.spec, cfg.params, 48, seen["obs2"], "native"), seen["plan2"],
                         Thresholds().l1_merge_atol)["pass"]
    # the engines agree with each other on the re-selection's observation (L2)
    s = native(tiny)
    s.create_context(1024)
    n_store = StoredDocument.read(s, head, colsum="colsum" in cfg.observe[0])
    seen_n = {}
    n_store.reselect(s, prompt, cfg, on_step=lambda obs, plan: seen_n.update(obs=_rows(obs)))
    assert compare_observations(seen_n["obs"], seen["obs"], Thresholds())["pass"]
    n_store.close()
    s.close()


QS3 = ["Which code did the river station log?", "And the stone station?", "Which station logged code 1259?"]


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "pyramidkv", "d2o"])
def test_conversation_turns_kept_in_the_store_observe_what_run_observes(tiny, policy, monkeypatch):
    """Questions 2 and 3 of a chat restore the earlier turns from the stored cache (the prompt's full cache kept before
    the compaction) and prefill only what is new; their observation is still `run`'s one prefill of the whole prompt
    (L2; column sums: the kept queries' sums + the new ones') and plans identically (L1, and the same entries as
    `run`'s plan); the answers are those of a chat that prefills every turn again."""
    from kvcli.apps.chat import Conversation
    from kvcli.drivers.reselect import StoredDocument, common_prefix
    from kvcli.native.session import NativeSession
    from kvcli.planning.planner import make_plan, resolve
    seen, real = [], StoredDocument.reselect

    def spy(self, *a, **kw):
        kw["on_step"] = lambda obs, plan: seen.append((obs.with_kv_arrays() if obs.has_kv else obs, plan))
        return real(self, *a, **kw)

    monkeypatch.setattr(StoredDocument, "reselect", spy)
    session = NativeSession(tiny, n_ctx=0, n_seq=2)
    conv = Conversation(session, DOC, compression=resolve(session.model_path, policy, 48), reselect=True)
    conv.compress()
    again = conversation(tiny, policy=policy, store_turns=False)   # every turn prefilled again at every question
    prev: list[int] = []   # the previous turn's prompt
    for i, q in enumerate(QS3):
        prompt = session.tokenize(conv.conversation_text(q))
        answer = conv.ask(q, 8).text
        r = conv.last_reselection
        assert r.n_tokens == len(prompt) and r.restored + r.prefilled == len(prompt)
        cfg = resolve(tiny, policy, 48, {}, q)
        if i:   # restored from the conversation: only the answer and the new question (or the window) prefilled
            new = len(prompt) - common_prefix(prev, prompt)
            assert r.source == "conversation" and len(prev) - common_prefix(prev, prompt) <= 1, r
            assert r.prefilled == max(new, cfg.observe[1] if "window" in cfg.observe[0] else 0), (r, new)
            assert new < len(prompt) - conv.store.split - 20   # the earlier turns are not prefilled again
        ext = conv.store.extension
        assert ext is not None and ext.tokens == prompt and ext.split == len(prompt)
        if "colsum" in cfg.observe[0]:
            assert ext.colsum.shape[2] == len(prompt)
        obs, plan = seen[-1]
        ran = run_observation(session, prompt, cfg)
        ran = ran.with_kv_arrays() if ran.has_kv else ran
        session.clear(1)
        l2 = compare_observations(ran, obs, Thresholds())
        assert l2["pass"], (i, l2)
        if "colsum" in cfg.observe[0]:
            assert l2["colsum"]["rel"] < 1e-3, (i, l2["colsum"])
        assert compare_plans(plan, make_plan(cfg.spec, cfg.params, 48, obs, "reference"),
                             Thresholds().l1_merge_atol)["pass"]
        # the entries `run`'s plan keeps: the same, but for column sums, whose float sums over a different split of
        # the queries (rel. 3e-4 here) may swap one near-tied entry, as a re-selection from the document alone does
        run_plan = make_plan(cfg.spec, cfg.params, 48, ran, "native")
        swapped = [len(np.setxor1d(run_plan.kept(l, h), plan.kept(l, h))) // 2
                   for l in range(run_plan.n_layer) for h in range(run_plan.n_head_kv)]
        assert max(swapped) <= (1 if "colsum" in cfg.observe[0] else 0), (i, swapped)
        assert answer == again.ask(q, 8).text, i
        assert again.last_reselection.source == "document" and again.store.extension is None
        prev = prompt
    s = conv.stats()
    assert s["stored_turn_tokens"] == len(conv.store.extension.tokens) - conv.store.split > 0
    # the turns are kept in the context beside the resident document, sharing its cells: their own cells alone
    assert 0 < s["stored_turns_bytes"] < s["store_bytes"]
    conv.reset()   # /reset drops the kept turns: back to the document-only store
    assert conv.store.extension is None and conv.stats()["stored_turn_tokens"] == 0
    conv.ask(QS3[1], 8)
    assert conv.last_reselection.source == "document"
    conv.close()
    again.close()
    session.close()


def test_kept_turns_fall_back_to_the_document_when_the_prompt_differs(tiny):
    """A prompt that does not start with the kept conversation (an edited history) restores from the stored
    document (column sums: they cover the kept queries only) or from what the two share (window sums), exactly."""
    from kvcli.apps.chat import Turn
    for policy in ("h2o", "snapkv"):
        conv = conversation(tiny, policy=policy)
        conv.ask(QS3[0], 8)
        conv.ask(QS3[1], 8)
        conv.turns[0] = Turn(QS3[0], "Another answer entirely.", "eog", 0, 5)   # the history rendered otherwise
        conv.ask(QS3[2], 8)
        r = conv.last_reselection
        if policy == "h2o":
            assert r.source == "document" and r.restored == conv.store.split
        else:   # the first question and the start of its answer are shared with the kept conversation
            assert r.source == "conversation" and conv.store.split < r.restored < len(conv.store.extension.tokens)
        conv.close()


def test_kept_turns_that_cannot_be_restored_fall_back_to_the_document(tiny, monkeypatch):
    from kvcli.drivers import reselect
    conv, ref = conversation(tiny), conversation(tiny, store_turns=False)
    assert conv.ask(QS3[0], 6).text == ref.ask(QS3[0], 6).text
    real = reselect.StoredDocument.restore

    def refuse_kept(self, session, seq, upto, extension=None):
        if extension is not None:
            raise KvcliError("cannot go back to that position")
        return real(self, session, seq, upto)

    monkeypatch.setattr(reselect.StoredDocument, "restore", refuse_kept)
    assert conv.ask(QS3[1], 6).text == ref.ask(QS3[1], 6).text
    assert conv.last_reselection.source == "document"   # and the question's prompt kept for the next one
    assert conv.store.extension is not None and conv.store.extension.split == conv.prompt_len
    conv.close()
    ref.close()


def test_fresh_and_run_keep_no_turns(tiny, cli_runner, tmp_path):
    """--fresh answers each question from the document alone and `kvcli run`'s several questions are each asked
    alone: neither keeps the conversation in the stored cache."""
    from kvcli.apps.chat_repl import Repl
    from kvcli.cli import cli
    conv = conversation(tiny)
    out = io.StringIO()
    repl = Repl(conv, max_tokens=4, interactive=False, out=out, err=io.StringIO(), jsonl=True, fresh=True)
    for q in QS3:
        repl.handle(q)
    rows = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["reselect_from"] for x in rows] == ["document"] * 3 and all(x["reselect_keep_s"] == 0 for x in rows)
    assert conv.store.extension is None
    conv.close()
    doc = tmp_path / "d.txt"
    doc.write_text(DOC, encoding="utf-8")
    r = cli_runner.invoke(cli, ["run", "--model", str(tiny), "--doc", str(doc), "-p", "snapkv", "-b", "48", "-n", "4",
                                "--json", *sum((["--question", q] for q in QS3), [])])
    assert r.exit_code == 0, r.output
    answers = json.loads(r.stdout)["answers"]
    assert [a["stats"]["reselect_from"] for a in answers] == ["document"] * 3
    assert all(a["stats"]["reselect_keep_s"] == 0 for a in answers)


def test_first_answer_is_runs_answer_and_turns_survive(tiny):
    """The first re-selected answer is what `run` answers (same prompt, same plan); a follow-up is asked after the
    earlier turn, which stays in the prompt; /reset forgets it; each re-selection restores the stored document."""
    from kvcli.apps.run_document import run_document
    from kvcli.planning.planner import resolve
    conv = conversation(tiny)
    q1, q2 = "Which code did the river station log?", "And the stone station?"
    g1 = conv.ask(q1, 8)
    ran = run_document(native(tiny), DOC, q1, compression=resolve(tiny, "snapkv", 48), max_tokens=8)
    assert g1.text == ran.answer
    assert conv.stats()["kv_cells"] <= 48 + 8
    conv.ask(q2, 8)
    text = conv.conversation_text("Third?")
    assert q1 in text and q2 in text and g1.text in text and text.index(q1) < text.index(q2)
    r = conv.last_reselection   # the first turn restored from the conversation's stored cache, not prefilled again
    assert r.source == "conversation" and r.restored > conv.store.split + len(conv.session.tokenize(q1))
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
    assert path.exists() and path.parent.parent.name == "documents"   # an entry of the document store
    path.unlink()
    conv.reset()
    assert conv.ask("Which code did the river station log?", 6).text == first
    assert said and "gone" in said[0] and conv.store.path.exists()
    stored = conv.store.path
    conv.close()
    assert not stored.exists()   # a temporary store goes at exit


def test_deleted_store_mid_conversation_reads_again_and_answers_the_same(tiny):
    """The stored file deleted between two questions (the kept turns in memory): one line, the document read again,
    the kept turns dropped with the old store, and the answer is the one the chat would have given."""
    conv, ref = conversation(tiny), conversation(tiny, store_turns=False)
    said = []
    conv.notify = said.append
    assert conv.ask(QS3[0], 6).text == ref.ask(QS3[0], 6).text
    conv.store.path.unlink()
    assert conv.ask(QS3[1], 6).text == ref.ask(QS3[1], 6).text
    assert len(said) == 1 and "gone" in said[0] and conv.last_reselection.source == "document"
    assert conv.ask(QS3[2], 6).text == ref.ask(QS3[2], 6).text
    assert conv.last_reselection.source == "conversation"
    conv.close()
    ref.close()


def test_policy_switch_reselects_without_reading_and_reads_for_colsum(tiny):
    from kvcli.apps.chat_repl import Repl
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
    again = Conversation.from_store(keep, compression=resolve(tiny, "snapkv", 48))
    assert again.mode == "re-selected" and again.store.split == conv.store.split
    assert again.ask("Which code did the river station log?", 6).text == a
    again.close()
    assert keep.exists()
    # a column-sum policy on a store read without them: one line
    with pytest.raises(KvcliError, match="no column sums"):
        Conversation.from_store(keep, compression=resolve(tiny, "h2o", 48))
    # foreign, truncated, corrupt
    with pytest.raises(KvcliError, match="was compressed for model"):
        Conversation.from_store(keep, compression=resolve(other_tiny, "snapkv", 48))
    raw = keep.read_bytes()
    cut = tmp_path / "cut.kvc"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(KvcliError, match="truncated"):
        Conversation.from_store(cut, compression=resolve(tiny, "snapkv", 48))
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(raw[:-100] + bytes(b ^ 0xFF for b in raw[-100:-50]) + raw[-50:])
    with pytest.raises(KvcliError, match="corrupted"):
        Conversation.from_store(bad, compression=resolve(tiny, "snapkv", 48))


def test_from_store_takes_the_commands_compression(tiny, tmp_path, monkeypatch):
    """kvcli chat/run --cache PATH --policy P --budget N: the command resolves its compression once, for the model
    the store is opened with (store_model: the one it records), and from_store sets it on the conversation as it
    is, resolving nothing again; the answer is the one of a conversation resolved from policy and budget."""
    from kvcli.apps import chat_base
    from kvcli.apps.chat import Conversation, store_model
    from kvcli.planning.planner import resolve
    keep = tmp_path / "doc.kvc"
    conv = conversation(tiny, store_path=keep)
    q = "Which code did the river station log?"
    a = conv.ask(q, 6).text
    conv.close()
    assert store_model(keep) == tiny and store_model(keep, model=str(tiny)) == tiny
    compression = resolve(store_model(keep), "snapkv", 48, {"window": 8})
    monkeypatch.setattr(chat_base, "resolve", lambda *a, **k: pytest.fail("resolved again"))
    again = Conversation.from_store(keep, compression=compression)
    assert again.compression is compression and str(again.session.model_path) == str(tiny)
    assert (again.policy, again.budget, again.policy_args) == ("snapkv", 48, {"window": 8})
    assert again.report.params == compression.params
    again.ask(q, 6)
    assert again.compression is compression   # the questions use it too (for_instruction: itself)
    again.close()
    monkeypatch.undo()
    plain = Conversation.from_store(keep, compression=resolve(tiny, "snapkv", 48))
    assert plain.ask(q, 6).text == a
    plain.close()


def test_compressed_file_is_not_a_store(tiny, tmp_path):
    from kvcli.apps.chat import Conversation
    once = Conversation(native(tiny), DOC, compression=resolve(tiny, "snapkv", 48))
    once.compress()
    path = tmp_path / "once.kvc"
    once.save(path)
    with pytest.raises(KvcliError, match="compressed cache"):
        Conversation.from_store(path, compression=resolve(tiny, "snapkv", 48))


def test_a_full_kvc_file_reselects_too(tiny, tmp_path):
    """A plain `compress --policy full` file (the document + the generic instruction) re-selects: the entries of the
    instruction are cut off at every question."""
    from kvcli.apps.chat import Conversation
    full = Conversation(native(tiny), DOC)
    full.compress()
    path = tmp_path / "full.kvc"
    full.save(path)
    conv = Conversation.from_store(path, compression=resolve(tiny, "snapkv", 48))
    fresh = conversation(tiny)
    q = "Which code did the river station log?"
    assert conv.ask(q, 6).text == fresh.ask(q, 6).text
    assert conv.last_reselection.restored < conv.store.split
    fresh.close()


def test_document_too_long_for_reselection_is_refused(tiny):
    """Longer than the context: a window policy is re-selected in bounded chunks (tests/test_reselect_bounded.py), a
    column-sum policy, which bounded re-selection cannot serve, is refused in one line."""
    from kvcli.apps.chat import Conversation
    with pytest.raises(KvcliError, match="compress-once"):
        Conversation(native(tiny), DOC * 8, compression=resolve(tiny, "h2o", 48), reselect=True).compress()


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
    for args, msg in ((["--cache", keep, "--policy", "snapkv"], "policy 'snapkv' needs --budget N"),
                      (["--cache", keep, "--policy", "full", "--budget", "48"], "needs a compressing --policy"),
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
    real, real_pieces = kvc.write, kvc.write_pieces

    def full_disk(path, *a, **k):
        raise KvcliError(f"cannot write {path}: No space left on device")

    monkeypatch.setattr(kvc, "write", full_disk)
    monkeypatch.setattr(kvc, "write_pieces", full_disk)   # a store is streamed from the context in pieces
    conv.store.path.unlink()   # deleted while chatting, and the disk is full when it is read again
    conv.reset()
    assert conv.ask(q, 6).text == first
    assert any("gone" in x for x in said) and any("No space left" in x and "memory" in x for x in said)
    # in memory: resident in the context (the native engine's exact form), else a snapshot
    assert conv.store.path is None and (conv.store.snapshot is not None or conv.store.resident is not None)
    n_said = len(said)
    conv.ask("And the stone station?", 6)   # the kept turns need no disk: restored, nothing more said
    assert conv.last_reselection.source == "conversation" and len(said) == n_said
    conv.ask(q, 6)   # the conversation changed the history: drop the turns for the test below
    conv.turns = conv.turns[:1]
    monkeypatch.setattr(kvc, "write", real)
    monkeypatch.setattr(kvc, "write_pieces", real_pieces)
    out = tmp_path / "saved.kvc"
    conv.save(out)   # /save writes it from memory
    again = Conversation.from_store(out, compression=resolve(tiny, "snapkv", 48))
    assert len(again.turns) == 1
    again.reset()
    assert again.ask(q, 6).text == first
    conv.close()
