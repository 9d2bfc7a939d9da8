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


def last_json(out: str) -> dict:
    """The last line of a command's output, read as JSON (the --json report after any other line)."""
    return json.loads(out.strip().splitlines()[-1])
