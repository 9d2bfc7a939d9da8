"""`kvcli check`: prove the native engine right against the reference engine, at three levels.

L1 policy       the SAME observation arrays (taken from the native engine) go to the native (C++)
                planner and to the torch planner: kept sets and budgets must be identical (ties go
                to the lower slot in both), merged rows and log-multiplicities equal to `l1_merge_atol`.
L2 observation  each engine computes the observation from the same GGUF and tokens: window
                sums (of every window length the check needs, divided by that length: the mean
                attention of a window query), column sums, K and V rows. Reported: max abs and
                relative error (relative = max abs error / max abs value of the reference array).
                A K/V row beyond its threshold is allowed (at most `l2_kv_sensitive_rows` of them)
                only where llama.cpp's own settings move that row at least as far or bring it within
                the threshold of the reference (the native engine at its other precision setting, f32
                cache without flash attention or f16 with, or at a batch size of 64), or where the
                reference engine given llama.cpp's activation arithmetic (8-bit matmul inputs, f16
                GELU table) comes within the threshold: a token
                so sensitive to llama.cpp's own arithmetic says nothing about kvcli (report: the
                rows, every distance, which source allowed each).
L3 end to end   two verdicts, after each engine compressed its cache:
  arithmetic    (the engine verdict) the reference engine applies the NATIVE plan (same kept sets, same merged
                rows) to its own prefill, so both hold one and the same compressed cache: next-token logits
                (max abs error, KL(native || reference)) and greedy agreement over N tokens (teacher-forced:
                both engines are fed the native engine's greedy tokens, and each step counts when the
                reference's argmax is the same token), within limits stated per native cache type
                (`Thresholds.arithmetic`). Must hold for every policy: only the engines' arithmetic differs.
                Beyond the limits the same plan passes only for a measured reason (`arithmetic_allowance`):
                the reference given llama.cpp's activation arithmetic (8-bit matmul inputs, f16 GELU) comes
                within them, or (f16) the plan is precision-sensitive: the reference's own cache rounded to
                f16 moves its output beyond them too and the engines agree at equal precision (the native f32
                cache without flash attention, f32 limits): `precision_sensitivity`.
  plan agreement (the policy's sensitivity) each engine plans from its own observation with its own planner:
                Jaccard of the kept positions per layer and KV head, the layer budgets, how far from the
                budget's boundary (in the policy's own score) the decisions lie on which the plans differ
                (`selection_margins`), and the same logits/greedy comparison with each engine decoding its own
                plan. A policy whose plans flip on near-ties of its score (the engines' observations differ
                within L2's limits) misses here without any engine being wrong: reported, and failing the
                exit status only with `strict_plans` (`kvcli check --strict-plans`).
                The logits present right after prefill predate the compression: the "next-token" comparison
                is the one after the first decoded token, the first that reads the compressed caches.

Chunked prefill (`chunk`, `kvcli check --chunk N`): both engines read the prompt with the driver
(kvcli/drivers/compress.py; its chunked loop is in kvcli/drivers/chunked.py): prefill a chunk, observe it (a window
policy through the question probe, prefilled and rolled back, unless `chunk_scoring` is "chunk"), plan over
everything held, compact with re-indexed positions (a model with sliding-window layers: keeping them). L1 is
checked at every planning step: the torch planner on the native observation of that step must make the native
plan. L2 compares the observations of the first chunk.
L3's arithmetic verdict has the reference engine read the prompt in the same chunks with the native engine's plan
at every step (a replaying planner); plan agreement compares the end results of each engine's own plans, its
Jaccard over the *original* prompt positions each (layer, KV head) still holds, followed through each engine's
own plans (after re-indexing, the engines' positions are B-k..B-1 and say nothing about which tokens were kept);
its selection margins are not computed for a chunked read.

L1 alone (`--levels 1`) loads no reference engine. Models with sliding-window layers (gemma2, gemma3) are checked
at every level, on the layers kvcli compresses (ModelInfo.kv_layers: observations, plans, kept positions); the
sliding layers take part through the logits only (L3), both engines masking them to their window.

Both engines get the very same token ids (tokenised once, by the native engine). Thresholds are
parameters (`Thresholds`, `kvcli check --threshold key=value`); their defaults are for the
default model (SmolLM2-135M Q4_1) with the native engine as users run it (f16 cache, flash
attention): the native engine then multiplies quantised weights by 8-bit-quantised activations
while the reference works in float32 on dequantised weights, so L2/L3 can only be close, never
equal. On float32 GGUFs with an f32 cache and flash attention off the engines agree to ~1e-5
and much tighter thresholds hold (the tests use them).

Where each part lives (this package re-exports the names other modules use):
  thresholds.py     `Thresholds`: the limits of every level (`kvcli check --threshold key=value`)
  comparators.py    the comparisons: plans (L1), observation arrays and K/V rows (L2), kept sets, selection margins,
                    logits and greedy decoding (L3)
  allowances.py     where a difference beyond a threshold is llama.cpp's own arithmetic: L2's K/V row sources
                    (`Allowance`, `NativeTwin`, `emulated_reference`), L3's `arithmetic_allowance`
  verdicts.py       what every run shares: `CheckSettings`, the prompt, the policies checked, the verdicts built from
                    the comparisons, the exit status (`passed`)
  levels.py         the run, `run_check`: every level for every policy on one prefill
  chunked_check.py  the run with `--chunk N` (`Origins`: the prompt positions followed through every plan)
"""
from kvcli.drivers.check.thresholds import Thresholds
from kvcli.drivers.check.comparators import (compare_arrays, compare_kv_rows, compare_observations, compare_plans,
                                             greedy_compare, jaccard_per_head, jaccard_per_layer, logits_distance,
                                             selection_margins)
from kvcli.drivers.check.allowances import (ALLOWANCE_UBATCH, Allowance, NativeTwin, arithmetic_allowance,
                                            emulated_reference, l2_allowances, precision_sensitivity)
from kvcli.drivers.check.verdicts import (CheckSettings, build_tokens, observed_windows, passed, plan_sensitivity,
                                          plan_summary, policies_to_check)
from kvcli.drivers.check.chunked_check import Origins
from kvcli.drivers.check.levels import resolve_policies, run_check

__all__ = ["ALLOWANCE_UBATCH", "Allowance", "CheckSettings", "NativeTwin", "Origins", "Thresholds",
           "arithmetic_allowance", "build_tokens", "compare_arrays", "compare_kv_rows", "compare_observations",
           "compare_plans", "emulated_reference", "greedy_compare", "jaccard_per_head", "jaccard_per_layer",
           "l2_allowances", "logits_distance", "observed_windows", "passed", "plan_sensitivity", "plan_summary",
           "policies_to_check", "precision_sensitivity", "resolve_policies", "run_check", "selection_margins"]
