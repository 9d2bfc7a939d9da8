"""NativeSession.rollback / save_seq / restore_seq: what bench, eval and .kvc loading use to repeat a decode and to
put a saved sequence back, on the real native library and a tiny random model."""
from __future__ import annotations

import numpy as np
import pytest

from kvcli.drivers.compress import prefill_and_compress, resolve
from kvcli.errors import KvcliError
from kvcli.native.session import ContextFull, NativeSession, SeqSnapshot
from kvcli.testing.tiny_gguf import write_tiny_llama

N = 96


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("sess") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=32, n_ctx_train=1024)


def prompt(seed: int, n: int = N) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 200, n)]


def greedy(s: NativeSession, n: int, seq: int = 0) -> tuple[list[int], list[np.ndarray]]:
    toks, logits = [], []
    for _ in range(n):
        t = int(np.argmax(s.logits(seq)))
        s.step({seq: t})
        toks.append(t)
        logits.append(s.logits(seq))
    return toks, logits


def test_rollback_repeats_a_decode_exactly_after_compression(tiny):
    with NativeSession(tiny, n_ctx=256, cache_type="f32", flash_attn=False) as s:
        prefill_and_compress(s, prompt(1), resolve(s.model_path, "snapkv", 32, {"window": 8}))
        cells = s.measured_cells(0)
        assert cells == s.seq(0).cells == 32
        first = s.logits(0)
        toks1, log1 = greedy(s, 5)
        assert s.seq(0).next_pos == N + 5 and s.measured_cells(0) == cells + 5
        s.rollback(0, 5)
        st = s.seq(0)
        assert (st.next_pos, st.cells, s.measured_cells(0)) == (N, cells, cells)
        assert st.prompt_tokens == N and st.kept_positions is not None  # the compressed prefix is untouched
        with pytest.raises(KvcliError, match="no logits"):  # they belonged to a removed token
            s.logits(0)
        s.step({0: int(np.argmax(first))})  # the first generated token again
        toks2 = [toks1[0]] + greedy(s, 4)[0]
        assert toks2 == toks1
        np.testing.assert_allclose(s.logits(0), log1[-1], atol=1e-5)


def test_rollback_refuses_more_than_the_sequence_holds(tiny):
    with NativeSession(tiny, n_ctx=256, cache_type="f32", flash_attn=False) as s:
        s.prefill(prompt(2, 10))
        with pytest.raises(KvcliError, match="cannot roll back 11 tokens"):
            s.rollback(0, 11)
        with pytest.raises(KvcliError, match="cannot roll back -1 tokens"):
            s.rollback(0, -1)
        s.rollback(0, 0)
        assert s.seq(0).next_pos == 10 and s.measured_cells(0) == 10


def test_save_and_restore_into_another_sequence_and_session(tiny):
    with NativeSession(tiny, n_ctx=256, cache_type="f32", flash_attn=False) as s:
        prefill_and_compress(s, prompt(3), resolve(s.model_path, "snapkv", 40, {"window": 8}))
        snap = s.save_seq(0)
        assert (snap.next_pos, snap.cells, snap.prompt_tokens) == (N, 40, N)
        want, want_logits = greedy(s, 4)
        # the same session, same sequence: decoding went on, then the snapshot puts it back
        assert s.restore_seq(snap, 0) == 40
        assert s.seq(0).next_pos == N and s.seq(0).kept_positions is snap.kept_positions
        assert greedy(s, 4)[0] == want
    with NativeSession(tiny, n_ctx=256, n_seq=2, cache_type="f32", flash_attn=False) as s2:
        s2.prefill(prompt(4, 20), seq=0)  # another sequence is already there
        assert s2.restore_seq(snap, 1) == 40
        assert s2.cells_used() == 60 and s2.measured_cells(0) == 20
        got, got_logits = greedy(s2, 4, seq=1)
        assert got == want
        np.testing.assert_allclose(got_logits[-1], want_logits[-1], atol=1e-5)


def test_restore_checks_what_it_loads(tiny):
    with NativeSession(tiny, n_ctx=256, cache_type="f32", flash_attn=False) as s:
        s.prefill(prompt(5, 50))
        snap = s.save_seq(0)
        with pytest.raises(KvcliError, match="did not load as saved"):
            s.restore_seq(SeqSnapshot(state=snap.state, next_pos=snap.next_pos + 3, cells=50), 0)
        assert s.measured_cells(0) == 0 and s.seq(0).cells == 0  # nothing half-loaded is left behind
        with pytest.raises(KvcliError, match="did not load as saved"):
            s.restore_seq(SeqSnapshot(state=snap.state, next_pos=snap.next_pos, cells=49), 0)
        assert s.restore_seq(SeqSnapshot(state=snap.state, next_pos=50), 0) == 50  # cells unknown: not checked
    with NativeSession(tiny, n_ctx=256, n_seq=2, cache_type="f32", flash_attn=False) as s:
        s.prefill(prompt(6, 230), seq=0)
        with pytest.raises(ContextFull, match="does not fit"):
            s.restore_seq(snap, 1)
        with pytest.raises(KvcliError, match="out of range"):
            s.restore_seq(snap, 2)
    with NativeSession(tiny, n_ctx=256, cache_type="f16", flash_attn=True) as s:  # another cache type
        with pytest.raises(KvcliError, match="cannot load the cache state"):
            s.restore_seq(snap, 0)
