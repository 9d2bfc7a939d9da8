"""benchmarks/time_to_answer.py: the parts that decide what is compared (no timing here)."""
from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def tta():
    spec = importlib.util.spec_from_file_location("time_to_answer", ROOT / "benchmarks" / "time_to_answer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kvpress_ratio_keeps_exactly_the_budget(tta):
    """kvpress keeps int(n * (1 - ratio)) entries: the ratio must give exactly kvcli's budget at every length."""
    for n in range(300, 9000, 7):
        for kept in (64, 128, 256, 512):
            if kept < n:
                assert int(n * (1 - tta.compression_ratio(n, kept))) == kept


def test_summary_ratios(tta):
    runs = [{"tool": t, "answer_s": s, "prefill_s": p, "compress_s": c, "decode_s": s - p - c, "process_wall_s": s + 1}
            for t, s, p, c in (("kvcli-snapkv", 10.0, 8.0, 0.2), ("kvcli-snapkv", 12.0, 9.0, 0.2),
                               ("stock-full", 9.0, 8.0, 0.0), ("kvpress-snapkv", 33.0, 20.0, 1.0),
                               ("kvcli-full", 11.0, 8.5, 0.0), ("stock-full-fa", 10.0, 8.4, 0.0))]
    tools = ["kvcli-snapkv", "stock-full", "kvpress-snapkv", "kvcli-full", "stock-full-fa"]
    out = tta.summarise(runs, tools)
    assert out["median"]["kvcli-snapkv"]["answer_s"] == 11.0
    assert out["kvpress_over_kvcli_answer"] == 3.0
    assert out["kvcli_snapkv_over_stock_answer"] == round(11.0 / 9.0, 3)
    assert out["kvcli_snapkv_prefill_compress_over_stock_prefill"] == round(8.7 / 8.0, 3)
    assert out["kvcli_full_over_stock_full_fa_answer"] == 1.1
