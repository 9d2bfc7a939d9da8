"""Plain helpers several test files share (fixtures are in conftest.py): `from helpers import ...` (pytest puts
tests/ on sys.path, as tests/policies/ for policy_obs.py and tests/native/ for npref.py)."""
from __future__ import annotations

import json

from kvcli.errors import KvcliError


def native_missing(*names) -> list[str]:
    """The named entry points the native library lacks (an older build): the tests that need them skip."""
    from kvcli.native.lib import lib
    out = []
    for n in names:
        try:
            getattr(lib(), n)
        except KvcliError:
            out.append(n)
    return out


def compression(policy: str, budget: int | None):
    """The Compression of `policy` at `budget` with its default arguments, checked as a command checks them
    (kvcli.policies.choose) but completed for no model: what kvcli.drivers.chunked.plan_chunking takes, for the
    tests of its sizing, which read no model."""
    from kvcli import policies
    from kvcli.planning.planner import Compression
    return Compression(policy, budget, *policies.choose(policy, budget, {}))


def last_json(out: str) -> dict:
    """The last line of a command's output, read as JSON (the --json report after any other line)."""
    return json.loads(out.strip().splitlines()[-1])


def reselection_session(model, document: str, question: str, n_ctx: int = 1024):
    """A native session of `model` with two sequences and an `n_ctx`-cell context, the document's head tokens (as a
    re-selected chat stores them) and the prompt of `question` after it: the bounded re-selection tests' setup."""
    from kvcli.apps.chat import TurnFormat, user_content
    from kvcli.native.session import NativeSession
    s = NativeSession(model, n_ctx=0, n_seq=2)
    fmt = TurnFormat.probe(s, None)
    head = s.tokenize(fmt.head + document.strip())
    prompt = s.tokenize(fmt.head + user_content(document, question) + fmt.after_user)
    s.create_context(n_ctx)
    return s, head, prompt
