"""Issue #5 must-show: `kvcli run --policy P --budget 128 --doc <station log> --json` on the default model,
for h2o, pyramidkv, windowkv and dynamickv, leaves each layer holding what the policy's schedule says.

The cache's cells are shared by all layers, so the stats carry two per-layer figures: `per_layer_cells`
(cells live in at least one KV head of the layer) and `per_head_entries` (live entries per layer and KV
head). After `run`, both also hold the tokens decoded since the compression (one cell each, every head).
Schedules: h2o keeps the budget in every layer; pyramidkv and windowkv follow the registry's closed forms
(KVCache-Factory's line; the group budgets in whole review windows); dynamickv's budgets depend on the
prompt's attention, so they are checked against the torch planner's plan on the same observation.
The document is the first ~1.5k tokens of examples/station-log.txt (the whole log is 5.8k tokens: four
prefills of it take minutes on the 2 CI cores; docs/results.md records a run on the whole file).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import EXAMPLES

BUDGET = 128
GEN = 3
QUESTION = "What radio code did the north ridge station use?"
POLICIES = ("h2o", "pyramidkv", "windowkv", "dynamickv")


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    text = (EXAMPLES / "station-log.txt").read_text(encoding="utf-8")
    cut = text.rfind("\n", 0, 6000)
    p = tmp_path_factory.mktemp("runsched") / "station-log-head.txt"
    p.write_text(text[:cut + 1], encoding="utf-8")
    return p


def torch_plan(model, doc, policy) -> tuple[int, np.ndarray]:
    """(prompt tokens, n_kept) of the torch planner on a native observation of the prompt `run` builds."""
    from kvcli.planning.planner import make_plan, resolve_for_model
    from kvcli.native.session import NativeSession
    from kvcli.templating import build_prompt
    s = NativeSession(model, n_ctx=0)
    try:
        tokens = s.tokenize(build_prompt(s, doc.read_text(encoding="utf-8"), QUESTION))
        s.create_context(len(tokens) + 16)
        spec, params = resolve_for_model(model, policy, {}, BUDGET, QUESTION)
        kinds, w = spec.observe(params)   # the very observation run makes for it
        obs = s.prefill(tokens, observe=kinds, window=w)
        return len(tokens), make_plan(spec, params, BUDGET, obs, "reference").n_kept
    finally:
        s.close()


def test_run_json_stats_follow_each_policys_schedule(cli_runner, default_model, doc):
    from kvcli.cli import cli
    from kvcli.policies import pyramidkv, windowkv
    n, dyn_kept = torch_plan(default_model, doc, "dynamickv")
    assert n > 8 * BUDGET
    n_layer = 30
    for policy in POLICIES:
        r = cli_runner.invoke(cli, ["run", "--model", str(default_model), "--policy", policy, "--budget", str(BUDGET),
                                    "--doc", str(doc), "-n", str(GEN), "--json", "--chunk", "0",
                                    QUESTION])   # one prefill: its schedule
        assert r.exit_code == 0, (policy, r.output)
        res = json.loads(r.stdout)
        st = res["stats"]
        assert res["policy"] == policy and st["prompt_tokens"] == n, policy
        gen = st["generated_tokens"]
        assert gen >= 1, policy
        cells = np.asarray(st["per_layer_cells"]) - gen            # what the compression left, per layer
        heads = np.asarray(st["per_head_entries"]) - gen           # [layer, KV head]
        # these policies keep the same number of entries in every KV head of a layer
        assert all((heads[l] == cells[l]).all() for l in range(n_layer)), policy
        assert st["kv_cells"] == cells.max() + gen, policy
        per_layer = cells.tolist()
        if policy == "h2o":
            assert per_layer == [BUDGET] * n_layer
        elif policy == "pyramidkv":
            w = 8
            assert per_layer == [w + b for b in pyramidkv.layer_budgets(n_layer, n, BUDGET, w, beta=20)]
            assert per_layer[0] > per_layer[-1]
        elif policy == "windowkv":
            alpha, omega = 16, 16                                  # task=localization: window 16; review_window
            gamma = windowkv.group_size(n_layer, 0)
            groups = windowkv.group_budgets(n_layer, gamma, BUDGET - alpha, 14)
            for l in range(n_layer):
                assert per_layer[l] == per_layer[(l // gamma) * gamma]     # one index set per group
                assert abs(per_layer[l] - alpha - groups[l // gamma]) < omega, (l, per_layer[l])
        else:  # dynamickv: data-dependent per-layer budgets, never more than budget x layers in all
            assert np.array_equal(heads, dyn_kept)                 # what the torch planner plans, head by head
            assert len(set(per_layer)) > 1 and sum(per_layer) <= BUDGET * n_layer
