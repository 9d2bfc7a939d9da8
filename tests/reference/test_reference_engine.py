"""The reference engine on a tiny random GGUF: its attention, observation and compaction are right.

Each property is checked against an independent computation: transformers' own eager attention
for the observation, and exact identities of softmax attention for the compaction.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcli.errors import KvcliError
from kvcli.planning.formats import Plan
from kvcli.reference.session import ReferenceSession

PROMPT = ("<|im_start|>user\nThe lighthouse keeper counted ships every night and wrote their names in a "
          "book.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture()
def ref(tiny_gguf):
    return ReferenceSession(tiny_gguf)


def test_observation_equals_transformers_eager_attention(ref):
    toks = ref.tokenize(PROMPT)
    windows = (2, 5)
    obs = ref.prefill(toks, observe=("window", "colsum", "kv"), window=(5, 2))
    n = len(toks)
    assert obs.windows == windows and obs.window_sums.shape == (2, 3, 4, n) and obs.colsum.shape == (3, 4, n)
    assert obs.keys.shape == (3, 2, n, 16) and obs.values.shape == (3, 2, n, 16)
    assert (obs.positions == np.arange(n)).all()
    # the same model with transformers' stock eager attention, which returns the probabilities
    model = ref.model
    impl = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            out = model(torch.tensor([toks]), output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(impl)
    for l, att in enumerate(out.attentions):
        att = att[0].numpy()                                     # [n_head, n, n]
        for i, w in enumerate(windows):   # the last w rows summed
            np.testing.assert_allclose(obs.window_sums[i, l], att[:, n - w:, :].sum(axis=1), atol=1e-5)
        np.testing.assert_allclose(obs.colsum[l], att.sum(axis=1), atol=1e-5)
    # every query spends one unit of attention
    for i, w in enumerate(windows):
        assert np.allclose(obs.window_sums[i].sum(-1), w, rtol=1e-5)
    assert np.allclose(obs.colsum.sum(-1), n, rtol=1e-5)


def _keep_lists(n, n_layer=3, n_head_kv=2, seed=0, k=9):
    rng = np.random.default_rng(seed)
    return [[np.sort(rng.choice(n, size=k, replace=False)).astype(np.int32) for _ in range(n_head_kv)]
            for _ in range(n_layer)]


def _continue(session, tokens, steps=3):
    """Greedy steps; returns the logits seen before each step."""
    seen = []
    for _ in range(steps):
        seen.append(session.logits())
        session.step({0: int(np.argmax(seen[-1]))})
    seen.append(session.logits())
    return seen


def test_compaction_equals_masking_the_full_cache(tiny_gguf):
    """Gathering the kept entries (per layer, per head) == keeping all of them with bias -inf on the rest."""
    a, b = ReferenceSession(tiny_gguf), ReferenceSession(tiny_gguf)
    toks = a.tokenize(PROMPT)
    n = len(toks)
    a.prefill(toks)
    b.prefill(toks)
    kept = _keep_lists(n)
    kept[1][0] = kept[1][0][:4]                     # heads of one layer keep different counts
    a.apply_plan(Plan.from_lists(kept))
    mask = [[np.where(np.isin(np.arange(n), k), 0.0, -np.inf).astype(np.float32) for k in layer] for layer in kept]
    b.apply_plan(Plan.from_lists([[np.arange(n, dtype=np.int32)] * 2 for _ in range(3)], log_mult=mask))
    assert a.stats()["per_layer_cells"] == [9, 9, 9] and b.stats()["kv_cells"] == n
    # per-layer cells count the slots some head of the layer uses (as the native engine's stats do)
    assert b.stats()["per_layer_cells"] == [len(set(np.concatenate(layer).tolist())) for layer in kept]
    assert [[k.tolist() for k in layer] for layer in a.kept_positions()] == \
        [[k.tolist() for k in layer] for layer in kept]
    for la, lb in zip(_continue(a, toks), _continue(b, toks)):
        np.testing.assert_allclose(la, lb, atol=1e-4)
    # decoding went on at the original positions: each step's token is live at position n, n+1, ...
    assert a.kept_positions()[0][0][-3:].tolist() == [n, n + 1, n + 2]


def test_log_mult_stands_for_duplicated_entries(tiny_gguf):
    """An entry with bias log(2) weighs exactly as two copies of it: replace slot j by a copy of slot i
    and keep both, or keep i alone with log(2). Exercises replace_k/replace_v and log_mult."""
    a, b = ReferenceSession(tiny_gguf), ReferenceSession(tiny_gguf)
    toks = a.tokenize(PROMPT)
    n = len(toks)
    obs = a.prefill(toks, observe=("kv",))
    b.prefill(toks)
    i, j = 3, 7
    # a: all slots, j's rows replaced by i's rows (in every layer and head)
    all_slots = [[np.arange(n, dtype=np.int32)] * 2 for _ in range(3)]
    plan_a = Plan.from_lists(all_slots)
    entries = np.array([(l * 2 + h) * n + j for l in range(3) for h in range(2)], dtype=np.int32)
    plan_a.replace_entry = entries
    plan_a.replace_k = np.stack([obs.keys[l, h, i] for l in range(3) for h in range(2)])
    plan_a.replace_v = np.stack([obs.values[l, h, i] for l in range(3) for h in range(2)])
    a.apply_plan(plan_a)
    # b: j dropped, i counted twice
    without_j = np.delete(np.arange(n, dtype=np.int32), j)
    lm = np.where(without_j == i, math.log(2.0), 0.0).astype(np.float32)
    b.apply_plan(Plan.from_lists([[without_j] * 2 for _ in range(3)], log_mult=[[lm] * 2 for _ in range(3)]))
    for la, lb in zip(_continue(a, toks), _continue(b, toks)):
        np.testing.assert_allclose(la, lb, atol=1e-4)


def test_keep_all_plan_changes_nothing(tiny_gguf):
    a, b = ReferenceSession(tiny_gguf), ReferenceSession(tiny_gguf)
    toks = a.tokenize(PROMPT)
    a.prefill(toks)
    b.prefill(toks)
    a.apply_plan(Plan.keep_all(3, 2, len(toks)))
    for la, lb in zip(_continue(a, toks), _continue(b, toks)):
        np.testing.assert_array_equal(la, lb)


def test_chunked_prefill_equals_one_pass(tiny_gguf):
    a, b = ReferenceSession(tiny_gguf), ReferenceSession(tiny_gguf)
    toks = a.tokenize(PROMPT)
    a.prefill(toks)
    b.prefill(toks[:10])
    b.prefill(toks[10:])
    np.testing.assert_allclose(a.logits(), b.logits(), atol=1e-4)


def test_bad_inputs_are_clear_errors(ref):
    toks = ref.tokenize(PROMPT)
    with pytest.raises(KvcliError, match="no logits"):
        ref.logits()
    with pytest.raises(KvcliError, match="unknown observation kind"):
        ref.prefill(toks, observe=("attention",))
    with pytest.raises(KvcliError, match="window"):
        ref.prefill(toks, observe=("window",), window=len(toks) + 1)
    with pytest.raises(KvcliError, match="out of range"):
        ref.prefill([10 ** 9])
    ref.prefill(toks)
    with pytest.raises(KvcliError, match="outside"):
        ref.apply_plan(Plan.from_lists([[np.array([0, len(toks)], np.int32)] * 2] * 3))
    with pytest.raises(KvcliError, match="layers"):
        ref.apply_plan(Plan.keep_all(2, 2, len(toks)))
    ref.apply_plan(Plan.keep_all(3, 2, len(toks)))
    with pytest.raises(KvcliError, match="without re-indexing"):
        ref.apply_plan(Plan.keep_all(3, 2, len(toks)), reindex=True)
    with pytest.raises(KvcliError, match="sequence 3"):
        ref.prefill(toks, seq=3)


def test_text_side_matches_llama_cpp_conventions(ref):
    toks = ref.tokenize(PROMPT)
    assert toks[0] == 1  # <|im_start|> parsed as a special token
    assert ref.is_eog(2)  # <|im_end|>, the GGUF's eos
    assert ref.token_bytes(1) == b""  # control tokens render as nothing, as llama.cpp's special=false
    assert ref.detokenize(ref.tokenize("café ünïcode ✓")) == "café ünïcode ✓"


def test_kvcli_run_with_the_reference_engine(tiny_gguf, tmp_path, cli_runner):
    """`kvcli run --engine reference` compresses with the torch planner and reports the cache it holds."""
    import json

    from kvcli.cli import cli
    doc = tmp_path / "doc.txt"
    doc.write_text("The keeper of the lighthouse wrote down every ship. " * 12)
    r = cli_runner.invoke(cli, ["run", "--engine", "reference", "--model", str(tiny_gguf), "--doc", str(doc),
                                "--policy", "snapkv", "--budget", "48", "-n", "4", "--json", "Summarise."])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    s = out["stats"]
    assert out["policy"] == "snapkv" and s["prompt_tokens"] > 48 and 1 <= s["generated_tokens"] <= 4
    # 48 kept per layer and head, plus the tokens decoded after the compression
    assert s["per_layer_cells"] == [48 + s["generated_tokens"]] * 3 and s["kv_bytes"] < s["kv_bytes_full"]


@pytest.mark.parametrize("policy", ["pyramidkv", "dynamickv", "windowkv", "d2o", "spindlekv"])
def test_held_bytes_are_the_native_ragged_layouts(tiny_gguf, policy):
    """Issue #45: the reference engine states the bytes the native cache holds (each layer from its first live slot
    on), counted from its own slots and bias, for the layer-budget policies and spindlekv's merges alike; with an f32
    native cache the figures are equal, every layer's cells too."""
    from kvcli.drivers.compress import Shared, resolve
    from kvcli.native.session import NativeSession
    stats = []
    for session in (NativeSession(tiny_gguf, n_ctx=1024, cache_type="f32", n_threads=2),
                    ReferenceSession(tiny_gguf, n_ctx=1024)):
        tokens = [(7 * i) % 200 + 3 for i in range(400)]
        cfg = resolve(tiny_gguf, policy, 48)
        shared = Shared(session, tokens, [cfg], planner="native")
        assert shared.error is None and shared.apply(cfg).error is None
        stats.append({k: session.stats(0)[k] for k in ("kv_cells", "kv_bytes", "kv_bytes_live", "per_layer_cells")})
        tensors = session.bytes_allocated() if isinstance(session, ReferenceSession) else None
        session.close()
    native, reference = stats
    assert native == reference
    if len(set(reference["per_layer_cells"])) > 1:   # layers keeping fewer: held below the padded tensors
        assert reference["kv_bytes"] < tensors
