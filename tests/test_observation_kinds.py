"""The observation kinds are one set (kvcli.planning.formats.KINDS): every policy's needs are among them, both
engines refuse another with the same message, and the kinds the attention graph captures are the C API's
KVCLI_OBS_* bits (native/include/kvcli.h's enum kvcli_obs_kind), read from the header here, not the library."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcli import policies
from kvcli.errors import KvcliError
from kvcli.planning import formats

HEADER = Path(__file__).resolve().parent.parent / "native" / "include" / "kvcli.h"


def test_the_graph_kinds_are_the_c_apis_bits():
    enum = re.search(r"enum kvcli_obs_kind \{(.*?)\};", HEADER.read_text(), re.S).group(1)
    c_bits = {name.lower(): int(value) for name, value in re.findall(r"KVCLI_OBS_(\w+)\s*=\s*(\d+)", enum)}
    assert c_bits == formats.OBS_BITS
    assert formats.CAPTURED == set(c_bits) and formats.KINDS == formats.CAPTURED | {"kv"}


def test_every_policy_needs_known_kinds():
    for name in policies.available():
        spec = policies.get(name)
        assert set(spec.needs) <= formats.KINDS, name
        if spec.second_pass is not None:
            assert spec.second_pass.kind in spec.needs, name


def test_an_unknown_kind_is_one_message():
    with pytest.raises(KvcliError, match="unknown observation kind 'colmin' \\(choose from window, colsum, colmax, "
                                         "query, kv\\)"):
        formats.check_kinds(("window", "colmin"))
    assert formats.kind_bits(("kv",)) == 0 and formats.kind_bits(("window", "query")) == 9
