"""The error-aware layer profile (CompressKV §3.4, Eq. 6-12): how much each layer suffers when squeezed.

For each calibration text the model prefills the prompt and greedily generates `gen_tokens` tokens
on the FULL cache (so errors never propagate from layer to layer). At prefill, every layer builds
a shadow index set with the compresskv selection itself at a tiny budget (32 = 24 slots chosen by
the layer's semantic retrieval heads + the 8-token window, through the reference compresskv
planner, so calibration squeezes exactly as the policy will). At each decoding step t, the new
token joins the shadow set and, per layer l,

    e_l += || W_O attn(q_t, K_shadow, V_shadow) - W_O attn(q_t, K, V) ||_F / (|| W_O attn(q_t, K, V) ||_F + eps)

Per text the errors are L1-normalised over layers; the profile is the mean over texts,
L1-normalised again (the paper normalises per dataset, then averages datasets).
"""
from __future__ import annotations

import numpy as np
import torch

from kvcli.calibration.runner import LM, Runner, attention_probs
from kvcli.planning.formats import Observation
from kvcli.policies.compresskv import SPEC

EPS = 1e-6   # the paper's epsilon (the authors' code uses 1e-5)


def shadow_sets(lm: LM, window_sums: list[torch.Tensor], srh: list[int], srh_k: int, budget: int, window: int,
                kernel: int) -> list[torch.Tensor]:
    """Per layer, the slots a compresskv cache of `budget` entries per layer would keep (uniform
    budgets), chosen by the policy's own reference planner from the window attention."""
    from kvcli.reference.policies.compresskv import plan as compresskv_plan  # noqa: PLC0415

    n = int(window_sums[0].shape[-1])
    obs = Observation(n_layer=lm.n_layer, n_head=lm.n_head, n_head_kv=lm.n_head_kv, head_dim=lm.head_dim, n=n,
                      window_sums=torch.stack(window_sums).to(torch.float32).numpy()[None], windows=(window,),
                      positions=np.arange(n, dtype=np.int32))
    params = SPEC.validate({"window": window, "kernel": kernel, "srh_k": srh_k, "srh": tuple(srh)})
    SPEC.check_budget(budget, params)   # the planners do not repeat the registry's checks
    plan = compresskv_plan(obs, params, budget)
    return [torch.from_numpy(plan.kept(l, 0).astype(np.int64)) for l in range(lm.n_layer)]


def text_errors(lm: LM, tokens: list[int], srh: list[int], srh_k: int, gen_tokens: int, budget: int = 32,
                window: int = 8, kernel: int = 5) -> tuple[np.ndarray, int]:
    """Summed relative attention-output error per layer over the decoding steps of one text."""
    n_prompt = len(tokens)
    win: list[torch.Tensor | None] = [None] * lm.n_layer
    err = np.zeros(lm.n_layer, dtype=np.float64)
    state = {"shadow": None}

    def on_layer(layer, q, K, V, module):
        if state["shadow"] is None:                 # prefill: the window rows summed (float64), as an engine observes
            win[layer] = attention_probs(lm, q, K, module.scaling).to(torch.float64).sum(dim=1)
            return
        idx = torch.cat([state["shadow"][layer], torch.arange(n_prompt, K.shape[1])])
        full = _attn_out(lm, q, K, V, module)
        comp = _attn_out(lm, q, K[:, idx], V[:, idx], module)
        err[layer] += float(torch.linalg.norm(comp - full) / (torch.linalg.norm(full) + EPS))

    runner = Runner(lm, on_layer)
    tok = runner.start(tokens, rows=window)
    state["shadow"] = shadow_sets(lm, win, srh, srh_k, budget, window, kernel)
    steps = 0
    for _ in range(gen_tokens):
        if tok in lm.eog_ids:
            break
        tok = runner.step(tok)
        steps += 1
    return err, steps


def _attn_out(lm: LM, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, module) -> torch.Tensor:
    """o_proj(softmax(q K^T * scale) V) for the last query: [hidden] float32."""
    p = attention_probs(lm, q[:, -1:], K, module.scaling)                # [n_head, 1, n]
    o = torch.matmul(p, V.repeat_interleave(lm.group, dim=0).float())    # [n_head, 1, d]
    return module.o_proj(o.reshape(1, -1).to(module.o_proj.weight.dtype))[0].float()


def layer_profile(per_text: list[np.ndarray]) -> np.ndarray:
    """L1-normalise each text's errors, average over texts, L1-normalise again."""
    rows = []
    for e in per_text:
        s = float(np.sum(e))
        if s > 0 and np.all(np.isfinite(e)):
            rows.append(np.asarray(e, dtype=np.float64) / s)
    if not rows:
        raise ValueError("no calibration text gave a usable error (did every text stop at once?)")
    mean = np.mean(np.stack(rows), axis=0)
    return mean / mean.sum()
