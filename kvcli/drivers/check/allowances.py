"""`kvcli check`'s allowances: where a difference beyond a threshold is llama.cpp's own arithmetic, not kvcli's.

L2 (K/V rows): `Allowance` sources consulted in order (`l2_allowances`): the native engine at another precision or
batch size (`NativeTwin`), the reference with llama.cpp's activation arithmetic (`emulated_reference`).
L3 arithmetic: `arithmetic_allowance` (the emulated reference, then `precision_sensitivity`)."""
from __future__ import annotations

import numpy as np

from kvcli.drivers.check.comparators import greedy_compare, logits_distance
from kvcli.errors import KvcliError
from kvcli.engines import open_native
from kvcli.planning.formats import Observation


# --------------------------------------------------------------------------------- L2: K/V rows


class Allowance:
    """One source L2's K/V allowance consults: `observe()` gives an Observation of the check's tokens, taken at most
    once. kind "native": the native engine at another of llama.cpp's settings; a row passes where that setting moves
    the native row at least as far as the engines differ, or puts it within `l2_kv_rtol` of the reference row (the
    same engine and patch agree with the reference at that setting). kind "reference": the reference engine with
    llama.cpp's
    activation arithmetic emulated; a row passes where it lies within `l2_kv_rtol` of the native row."""

    def __init__(self, label: str, kind: str, observe, setting: str = ""):
        self.label, self.kind, self.setting, self._observe, self._obs = label, kind, setting, observe, None
        self.used = False

    def rows(self, name: str):
        """(label, kind, callable giving this source's `name` rows, or None) for compare_kv_rows."""
        def get():
            if self._obs is None:
                self.used = True
                obs = self._observe()
                self._obs = obs.with_kv_arrays() if obs is not None else False
            return getattr(self._obs, name) if self._obs is not False else None
        return self.label, self.kind, get


def note_allowances(l2: dict, allowances: list, info) -> None:
    """Name the settings L2's allowance consulted and give each row beyond the threshold its model layer."""
    used = [a for a in allowances if a.used]
    if not used:
        return
    l2["allowances"] = {a.label: a.setting for a in used}
    if used[0].label == "native_precision":
        l2["precision_twin"] = used[0].setting
    for name in ("keys", "values"):
        for row in l2.get(name, {}).get("rows_over_detail", []):
            row["model_layer"] = info.kv_layers[row["layer"]] if info.kv_layers else row["layer"]


ALLOWANCE_UBATCH = 64   # the native twin's batch size: ggml-cpu's matmuls then block (and round) differently


class NativeTwin:
    """The native engine's K/V observation of `tokens` at another of llama.cpp's settings, in a fresh context:
    "precision": an f32 cache without flash attention for a check run with anything else (an f16 cache with flash
    attention for one run with that); "ubatch": the check's cache and attention at a batch size of
    ALLOWANCE_UBATCH tokens."""

    def __init__(self, model_path, tokens, settings, n_ctx, what: str = "precision"):
        self.cache_type, self.flash_attn, self.n_batch = settings.cache_type, settings.flash_attn, 512
        if what == "precision":
            plain = settings.cache_type == "f32" and not settings.flash_attn
            self.cache_type, self.flash_attn = ("f16", True) if plain else ("f32", False)
            self.setting = f"{self.cache_type} cache, flash attention {'on' if self.flash_attn else 'off'}"
        else:
            self.n_batch = ALLOWANCE_UBATCH
            self.setting = f"batch size {ALLOWANCE_UBATCH} instead of 512"
        self.model_path, self.tokens, self.threads, self.n_ctx = model_path, tokens, settings.threads, n_ctx

    def __call__(self) -> Observation:
        session = open_native(self.model_path, n_ctx=0, cache_type=self.cache_type, flash_attn=self.flash_attn,
                              n_batch=self.n_batch, n_threads=self.threads)
        try:
            session.create_context(self.n_ctx)
            return session.prefill(self.tokens, seq=0, observe=("kv",)).with_kv_arrays()
        finally:
            session.close()


def emulated_reference(reference, tokens):
    """The reference engine's K/V observation of `tokens` with llama.cpp's activation arithmetic emulated
    (kvcli/reference/llamacpp_arithmetic.py), its sequence 0 put back afterwards."""
    def observe() -> Observation:
        from kvcli.reference.llamacpp_arithmetic import llamacpp_activations  # noqa: PLC0415
        saved = reference.save_seq(0) if 0 in reference.seqs else None
        reference.clear(0)
        try:
            with llamacpp_activations(reference.model, reference.model_path):
                return reference.prefill(tokens, seq=0, observe=("kv",)).with_kv_arrays()
        finally:
            reference.clear(0)
            if saved is not None:
                reference.restore_seq(saved, 0)
    return observe


def l2_allowances(model_path, tokens, settings, n_ctx, reference) -> list:
    """L2's K/V allowance sources, in the order they are consulted (docs/internals.md "kvcli check")."""
    precision = NativeTwin(model_path, tokens, settings, n_ctx, "precision")
    ubatch = NativeTwin(model_path, tokens, settings, n_ctx, "ubatch")
    return [Allowance("native_precision", "native", precision, precision.setting),
            Allowance("native_ubatch", "native", ubatch, ubatch.setting),
            Allowance("reference_llamacpp_arithmetic", "reference", emulated_reference(reference, tokens),
                      "reference with llama.cpp's 8-bit matmul inputs and f16 GELU table")]


# --------------------------------------------------------------------------------- L3: arithmetic


def arithmetic_allowance(native, state_n, shared, tokens, plan, settings, th, first: int) -> dict:
    """L3 arithmetic beyond the native cache type's limits: the same plan passes only for one of two measured reasons,
    tried in this order (each field of the result holds its figures):
    - `llamacpp_arithmetic`: the reference engine given llama.cpp's activation arithmetic (8-bit matmul inputs, f16
      GELU table: kvcli/reference/llamacpp_arithmetic.py) prefills, applies the plan and decodes again, teacher-forced
      on the native tokens, within the cache type's limits: the miss was llama.cpp's rounding of the activations at a
      sensitive step, not kvcli's cache (measured, issue 31: snapkv at budget 64 on qwen2.5-coder-0.5b and the
      diskcache METADATA, next-token KL 0.056 against the float32 reference, 0.011 against the emulating one);
    - `precision`: the plan is ill-conditioned at the cache's precision (`precision_sensitivity`, f16 only).
    Neither emulation changes which entries are held or how they are attended: a compaction, mask or position defect
    still fails."""
    out: dict = {"pass": False, "by": None, "cache_type": settings.cache_type}
    out["llamacpp_arithmetic"] = _emulated_arithmetic(native, state_n, shared, tokens, plan, settings, th)
    if out["llamacpp_arithmetic"]["pass"]:
        out.update({"pass": True, "by": "llamacpp_arithmetic"})
        return out
    out["precision"] = precision_sensitivity(native, shared, tokens, plan, settings, th, first)
    if out["precision"]["pass"]:
        out.update({"pass": True, "by": "precision"})
    return out


def _emulated_arithmetic(native, state_n, shared, tokens, plan, settings, th) -> dict:
    """The native engine's compacted sequence (`state_n`) against the reference with llama.cpp's activation
    arithmetic, the same plan, the cache type's limits."""
    from kvcli.reference.llamacpp_arithmetic import llamacpp_activations  # noqa: PLC0415

    ref, seq = shared.session, shared.seq
    native.restore_seq(state_n, 0)
    ref.clear(seq)
    with llamacpp_activations(ref.model, ref.model_path):
        ref.prefill(tokens, seq=seq)
        ref.apply_plan(plan, seq=seq)
        r = greedy_compare(native, ref, settings.n_tokens, 0, seq)
    limits = th.arithmetic(settings.cache_type)
    r["pass"] = bool(r["kl"] <= limits["kl_max"] and r["logits_max_abs"] <= limits["logits_atol"]
                     and r["greedy_agree"] >= limits["greedy_min"])
    return {k: r[k] for k in ("logits_max_abs", "kl", "greedy_agree", "pass")}


def _round_reference_cache(reference, seq: int, cache_type: str) -> None:
    """Store the reference's cache of `seq` as a native `cache_type` cache stores it (f16: K and V rounded)."""
    if cache_type != "f16":
        raise KvcliError(f"no rounding of the reference cache to {cache_type}")
    for layer in reference.seq(seq).cache.layers:
        layer.keys.copy_(layer.keys.half().float())
        layer.values.copy_(layer.values.half().float())


def precision_sensitivity(native, shared, tokens, plan, settings, th, first: int) -> dict:
    """L3 arithmetic when the native cache type's limits are missed: is the plan itself precision-sensitive?

    Two measurements, each a next-token comparison after the native engine's first decoded token:
    - `reference_rounding`: the reference engine decoding the same plan from its float32 cache and from that cache
      rounded to the native cache type (f16). No llama.cpp in it: how far storing this plan's cache at that precision
      moves the output by itself.
    - `equal_precision`: the native engine at f32 without flash attention (a fresh context: prefill, the same plan)
      against the reference, teacher-forced over the check's tokens, within the f32 limits.
    The verdict passes when the rounding alone moves the reference beyond the cache type's limits (the plan is
    ill-conditioned at that precision: measured, issue 31, a merging policy at budget 64 on qwen2.5-coder-0.5b, whose
    merged entries of multiplicity up to 68 in heads keeping one entry turn f16 rounding into KL 0.62) and the
    engines agree at equal precision. A compaction or mask defect of the f16 path moves a well-conditioned plan,
    whose rounding stays within the limits, so it still fails; q8_0 and f32 checks have no such allowance."""
    out: dict = {"pass": False, "cache_type": settings.cache_type}
    if settings.cache_type != "f16":
        out["why"] = f"no precision allowance for a {settings.cache_type} cache"
        return out
    ref, seq = shared.session, shared.seq

    def reference_logits(rounded: bool) -> np.ndarray:
        ref.restore_seq(shared.state, seq)
        ref.apply_plan(plan, seq=seq)
        if rounded:
            _round_reference_cache(ref, seq, settings.cache_type)
        ref.step({seq: first})
        return ref.logits(seq)

    limits = th.arithmetic(settings.cache_type)
    err, kl = logits_distance(reference_logits(True), reference_logits(False))
    out["reference_rounding"] = {"logits_max_abs": err, "kl": kl,
                                 "beyond_limits": bool(kl > limits["kl_max"] or err > limits["logits_atol"])}
    twin = open_native(native.model_path, n_ctx=0, cache_type="f32", flash_attn=False, n_threads=settings.threads)
    try:
        twin.create_context(native.n_ctx)
        twin.prefill(tokens, seq=0)
        twin.apply_plan(plan, seq=0)
        ref.restore_seq(shared.state, seq)
        ref.apply_plan(plan, seq=seq)
        eq = greedy_compare(twin, ref, settings.n_tokens, 0, seq)
    finally:
        twin.close()
    f32 = th.arithmetic("f32")
    eq["pass"] = bool(eq["kl"] <= f32["kl_max"] and eq["logits_max_abs"] <= f32["logits_atol"]
                      and eq["greedy_agree"] >= f32["greedy_min"])
    out["equal_precision"] = {k: eq[k] for k in ("logits_max_abs", "kl", "greedy_agree", "pass")}
    out["pass"] = out["reference_rounding"]["beyond_limits"] and eq["pass"]
    return out
