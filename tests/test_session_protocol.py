"""The session API both engines implement (kvcli.session.Session): each engine's session is one, and
`truncate` (what a conversation's /reset and a failed turn use) removes the positions past a point the same
way in both: the next tokens then give the logits they give without the removed ones."""
from __future__ import annotations

import numpy as np
import pytest

from kvcli.errors import KvcliError
from kvcli.native.session import NativeSession
from kvcli.session import Session
from tests.conftest import EXAMPLES, tiny_session

DOC = (EXAMPLES / "solar-garden.txt").read_text()


@pytest.fixture(scope="module")
def tiny(tiny_1k):
    return tiny_1k


def test_both_engines_are_sessions(tiny):
    deferred = NativeSession(tiny, n_ctx=0)     # the context is made later: n_ctx is 0 until then
    assert isinstance(deferred, Session) and deferred.n_ctx == 0
    for engine in ("native", "reference"):
        assert isinstance(tiny_session(tiny, engine), Session)


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_truncate_removes_the_positions_past_a_point(tiny, engine):
    """Prefill A, then X, truncate back to A's end, prefill B: the logits of A then B. `prompt_tokens` still
    counts X (as /reset always left it); rollback lowers it."""
    a, b = tiny_session(tiny, engine), tiny_session(tiny, engine)
    toks = a.tokenize(DOC)
    first, extra, then = toks[:150], toks[300:340], toks[150:200]
    a.prefill(first)
    b.prefill(first)
    b.prefill(extra)
    b.truncate(0, 150)
    st = b.seq(0)
    assert st.next_pos == 150 and st.cells == 150 and b.stats(0)["kv_cells"] == 150
    assert st.tokens_read == 150 and st.prompt_tokens == 190
    with pytest.raises(KvcliError, match="no logits yet"):
        b.logits(0)                          # they belonged to a removed token
    with pytest.raises(KvcliError, match="cannot truncate sequence 0 at position 151"):
        b.truncate(0, 151)
    a.prefill(then)
    b.prefill(then)
    np.testing.assert_allclose(b.logits(0), a.logits(0), atol=1e-5, rtol=0)
    assert b.stats(0)["kv_cells"] == a.stats(0)["kv_cells"] == 200
    b.rollback(0, 50)
    assert b.seq(0).next_pos == 150 and b.seq(0).prompt_tokens == 150
