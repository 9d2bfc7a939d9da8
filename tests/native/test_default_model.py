"""End to end on the real default model (SmolLM2-135M Q4_1): a ~2k-token prompt compressed to
budget 128 with the native snapkv planner, measured from the live cache."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvcli.drivers.compress import prefill_and_compress, resolve
from kvcli.native import cache

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_2k_prompt_compressed_to_128_holds_128_cells_and_stays_fluent(session_factory, default_model):
    s = session_factory(default_model, n_ctx=3072, flash_attn=True, cache_type="f16", n_threads=None)
    doc = (ROOT / "examples" / "station-log.txt").read_text()
    prompt = s.apply_chat_template([{"role": "user", "content": doc[:7600] + "\n\nSummarise the log above."}])
    toks = s.tokenize(prompt)
    assert 1800 <= len(toks) <= 2600, len(toks)
    rep = prefill_and_compress(s, toks, resolve(s.model_path, "snapkv", 128, {}))
    plan = rep.plan
    assert plan is not None and plan.max_kept == 128

    info = s.info
    st = cache.stats(s.ctx, 0, info.n_layer, info.n_head_kv)
    assert st["n_cells"] == 128
    # bytes held: 128 cells x every layer's K and V rows (f16), i.e. the kept entries (snapkv keeps
    # 128 per (layer, head), so cells == entries per head); the slot bias adds 4 bytes per entry
    kept_bytes = plan.entries() * info.head_dim * 2 * 2
    assert abs(st["k_bytes"] + st["v_bytes"] - kept_bytes) <= 0.01 * kept_bytes
    assert st["live_entries"] == plan.entries()

    out = []
    for _ in range(24):
        t = int(np.argmax(s.logits()))
        if s.is_eog(t):
            break
        out.append(t)
        s.step({0: t})
    st2 = cache.stats(s.ctx, 0, info.n_layer, info.n_head_kv)
    assert st2["n_cells"] == 128 + len(out)
    text = s.detokenize(out)
    words = re.findall(r"[A-Za-z]+", text)
    # fluent: real words, not one token repeated
    assert len(words) >= 8, text
    assert len(set(words)) >= 5, text
    assert len(set(out)) >= len(out) // 3, text
