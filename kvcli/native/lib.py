"""ctypes bindings of native/include/kvcli.h, with numpy conversions to kvcli.planning.formats formats.

Functions are bound lazily: a library built without one of them gives a clear error when
that function is used, not at import.
"""
from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, c_char, c_char_p, c_double, c_float, c_int32, c_int64, c_void_p

import numpy as np

from kvcli import policies
from kvcli.errors import KvcliError
from kvcli.native import load_llama_cpp, signals_deferred
from kvcli.planning.formats import Observation, Plan

F32P = POINTER(c_float)
I32P = POINTER(c_int32)


class PlanView(ctypes.Structure):
    _fields_ = [
        ("n_layer", c_int32), ("n_head_kv", c_int32), ("head_dim", c_int32),
        ("n_kept", I32P), ("slots", I32P), ("log_mult", F32P),
        ("n_replace", c_int32), ("replace_entry", I32P), ("replace_k", F32P), ("replace_v", F32P),
    ]


KV_READER = ctypes.CFUNCTYPE(c_int32, c_void_p, c_int32, F32P, F32P)   # kvcli_kv_reader
ROPE_NONE, ROPE_NORM, ROPE_NEOX = -1, 0, 2                              # kvcli_rope_type


class RopeView(ctypes.Structure):
    _fields_ = [("type", c_int32), ("n_rot", c_int32), ("freq_base", c_double), ("freq_scale", c_double),
                ("freq_factors", F32P)]


class ObsView(ctypes.Structure):
    _fields_ = [
        ("n_layer", c_int32), ("n_head", c_int32), ("n_head_kv", c_int32), ("head_dim", c_int32),
        ("n_slots", c_int32), ("n_windows", c_int32), ("windows", I32P),
        ("window_sums", F32P), ("colsum", F32P), ("keys", F32P), ("values", F32P),
        ("read_kv", KV_READER), ("read_kv_user", c_void_p), ("colmax", F32P),
        ("n_query_rows", c_int32), ("queries", F32P), ("query_positions", I32P), ("positions", I32P),
        ("rope", RopeView),
    ]


class StateHeader(ctypes.Structure):
    _fields_ = [("policy", c_char * 32), ("budget", c_int32), ("original_tokens", c_int32),
                ("kvcli_version", c_char * 16)]


class Stats(ctypes.Structure):
    _fields_ = [("n_cells", c_int32), ("k_bytes", c_int64), ("v_bytes", c_int64),
                ("bias_bytes", c_int64), ("live_entries", c_int64)]


class Memory(ctypes.Structure):
    _fields_ = [("kv_size", c_int32), ("kv_bytes", c_int64), ("bias_bytes", c_int64)]


# name -> (restype, argtypes)
_SIGNATURES = {
    "kvcli_version": (c_char_p, []),
    "kvcli_llama_commit": (c_char_p, []),
    "kvcli_build_flags": (c_char_p, []),
    "kvcli_state_format": (c_int32, []),
    "kvcli_last_error": (c_char_p, []),
    "kvcli_observe_begin": (c_int32, [c_void_p, c_int32, c_int32, c_int32, I32P]),
    "kvcli_observe_end": (c_int32, [c_void_p]),
    "kvcli_observe_n_slots": (c_int32, [c_void_p]),
    "kvcli_observe_n_window": (c_int32, [c_void_p, c_int32]),
    "kvcli_observe_read_window_sum": (c_int32, [c_void_p, c_int32, c_int32, F32P]),
    "kvcli_observe_read_colsum": (c_int32, [c_void_p, c_int32, F32P]),
    "kvcli_observe_read_colmax": (c_int32, [c_void_p, c_int32, F32P]),
    "kvcli_observe_n_queries": (c_int32, [c_void_p, I32P]),
    "kvcli_observe_read_queries": (c_int32, [c_void_p, c_int32, F32P]),
    "kvcli_observe_release": (c_int32, [c_void_p, c_int32]),
    "kvcli_seq_n_slots": (c_int32, [c_void_p, c_int32]),
    "kvcli_seq_read_kv": (c_int32, [c_void_p, c_int32, c_int32, c_int32, F32P]),
    "kvcli_seq_positions": (c_int32, [c_void_p, c_int32, I32P]),
    "kvcli_apply_plan": (c_int32, [c_void_p, c_int32, POINTER(PlanView)]),
    "kvcli_apply_plan_reindexed": (c_int32, [c_void_p, c_int32, POINTER(PlanView), c_int32]),
    "kvcli_gather_plan": (c_int32, [c_void_p, c_int32, c_int32, POINTER(PlanView)]),
    "kvcli_compact_rows": (c_int32, [POINTER(PlanView), c_int32, c_int32, c_int32, c_int32, c_int32, I32P, I32P,
                                     c_int32, c_void_p, c_int64, c_void_p, c_int64]),
    "kvcli_seq_is_compressed": (c_int32, [c_void_p, c_int32]),
    "kvcli_seq_is_reindexable": (c_int32, [c_void_p, c_int32]),
    "kvcli_seq_set_header": (c_int32, [c_void_p, c_int32, POINTER(StateHeader)]),
    "kvcli_seq_get_header": (c_int32, [c_void_p, c_int32, POINTER(StateHeader)]),
    "kvcli_stats_get": (c_int32, [c_void_p, c_int32, POINTER(Stats), I32P, I32P]),
    "kvcli_memory_get": (c_int32, [c_void_p, POINTER(Memory)]),
    "kvcli_release_compute": (c_int32, [c_void_p, POINTER(c_int64)]),
    "kvcli_last_graph_count": (c_int32, [c_void_p, c_char_p]),
    "kvcli_model_kv_layers": (c_int32, [c_void_p, I32P]),
    "kvcli_cells_with_bias": (c_int32, [c_void_p]),
    "kvcli_attn_path_choose": (c_int32, [c_int32, c_int32, c_char_p, c_int32]),
    "kvcli_attn_path_taken": (c_int32, [c_void_p, c_int32]),
    "kvcli_compact_path_taken": (c_int32, [c_void_p]),
    "kvcli_layout_trim": (c_int32, [c_void_p]),
    "kvcli_layout_fronts": (c_int32, [c_void_p, I32P]),
    "kvcli_view_starts": (c_int32, [c_void_p, I32P]),
    "kvcli_layout_pack": (c_int32, [c_void_p]),
    "kvcli_plan_make": (c_void_p, [c_char_p, c_char_p, c_int32, POINTER(ObsView)]),
    "kvcli_plan_free": (None, [c_void_p]),
    "kvcli_plan_get": (c_int32, [c_void_p, POINTER(PlanView)]),
}


class _Lib:
    def __init__(self):
        self._cdll = load_llama_cpp().llama_cpp._lib
        self._bound: dict = {}

    def __getattr__(self, name):
        if name not in _SIGNATURES:
            raise AttributeError(name)
        fn = self._bound.get(name)
        if fn is None:
            try:
                fn = getattr(self._cdll, name)
            except AttributeError:
                raise KvcliError(f"the native library has no {name}(): rebuild it (python -m kvcli.native.build)") \
                    from None
            fn.restype, fn.argtypes = _SIGNATURES[name]
            self._bound[name] = fn
        return fn

    def last_error(self) -> str:
        return (self.kvcli_last_error() or b"").decode("utf-8", "replace")

    def check(self, rc: int, what: str) -> int:
        if rc is None or rc < 0:
            raise KvcliError(f"{what} failed: {self.last_error() or 'unknown native error'}")
        return rc


_LIB: _Lib | None = None


def lib() -> _Lib:
    global _LIB
    if _LIB is None:
        _LIB = _Lib()
    return _LIB


def identity() -> dict:
    L = lib()
    return {"version": L.kvcli_version().decode(), "llama_commit": L.kvcli_llama_commit().decode(),
            "build_flags": L.kvcli_build_flags().decode(), "state_format": int(L.kvcli_state_format())}


ATTN_PATHS = {1: "mask", 2: "split", 3: "rows"}  # kvcli_attn_path_kind
MOVES_PATHS = {1: "host", 2: "device"}  # kvcli_moves_path_kind: how a compaction moved the K/V rows

# Prompt tokens per ubatch on the CPU (NativeSession's default n_batch there; llama.cpp's 512 with a GPU). The compute
# buffer's largest tensors grow with the ubatch (the FFN's activations, the n_kv x ubatch mask): a document read in
# ubatches of 256 held 21 MiB less at 5.6k tokens and 25 MiB less at 16k than at 512 on qwen2.5-coder-0.5b, and read
# the 5.6k faster (69.2 against 74.7 s, 2 threads, idle 2-core AMD EPYC; native/src/README.md).
CPU_UBATCH = 256


def attn_path(flash_attn: bool, cache_on_cpu: bool) -> tuple[str, str]:
    """The attention path of a compacted cache's layers (native/src/README.md, "CUDA") and why, from
    $KVCLI_ATTN_PATH, the flash-attention setting and where the cache lives; a bad $KVCLI_ATTN_PATH is a
    KvcliError."""
    L = lib()
    why = ctypes.create_string_buffer(256)
    rc = L.kvcli_attn_path_choose(int(flash_attn), int(cache_on_cpu), why, len(why))
    if rc < 0:
        raise KvcliError(f"{L.last_error()} (got KVCLI_ATTN_PATH={os.environ.get('KVCLI_ATTN_PATH')!r})")
    return ATTN_PATHS[rc], why.value.decode()


def _f32(a: np.ndarray | None):
    return None if a is None else a.ctypes.data_as(F32P)


def _i32(a: np.ndarray | None):
    return None if a is None else a.ctypes.data_as(I32P)


def plan_view(plan: Plan, head_dim: int) -> tuple[PlanView, list]:
    """A PlanView over the plan's arrays; the returned list keeps them alive."""
    keep = [np.ascontiguousarray(plan.n_kept, np.int32), np.ascontiguousarray(plan.slots, np.int32)]
    lm = None if plan.log_mult is None else np.ascontiguousarray(plan.log_mult, np.float32)
    re = np.ascontiguousarray(plan.replace_entry, np.int32)
    rk = None if plan.replace_k is None else np.ascontiguousarray(plan.replace_k, np.float32)
    rv = None if plan.replace_v is None else np.ascontiguousarray(plan.replace_v, np.float32)
    keep += [lm, re, rk, rv]
    v = PlanView(plan.n_layer, plan.n_head_kv, head_dim, _i32(keep[0]), _i32(keep[1]), _f32(lm),
                 int(re.size), _i32(re), _f32(rk), _f32(rv))
    return v, keep


class _NativePlan:
    """Owns a kvcli_plan: freed when the last array viewing its rows goes (see `plan_from_view`)."""

    def __init__(self, handle):
        self.handle, self.free = handle, lib().kvcli_plan_free

    def __del__(self):
        self.free(self.handle)


def _rows(ptr, r: int, head_dim: int, owner: _NativePlan) -> np.ndarray:
    """[r, head_dim] float32 over the native plan's rows, no copy; the array keeps `owner` alive."""
    buf = (c_float * (r * head_dim)).from_address(ctypes.addressof(ptr.contents))
    buf.owner = owner
    return np.frombuffer(buf, np.float32).reshape(r, head_dim)


def plan_from_view(v: PlanView, owner: _NativePlan | None = None) -> Plan:
    """The Plan of a view: small arrays copied; with `owner` (the native plan the view is of), the replacement
    rows (merging policies: up to 2 x entries x head_dim floats) are views of its memory, not a second copy."""
    n_kept = np.ctypeslib.as_array(v.n_kept, (v.n_layer * v.n_head_kv,)).reshape(v.n_layer, v.n_head_kv).copy()
    total = int(n_kept.sum())
    slots = np.ctypeslib.as_array(v.slots, (total,)).copy() if total else np.zeros(0, np.int32)
    log_mult = np.ctypeslib.as_array(v.log_mult, (total,)).copy() if (v.log_mult and total) else None
    r = int(v.n_replace)
    if r:
        rep = np.ctypeslib.as_array(v.replace_entry, (r,)).copy()
        if owner is not None:
            rk, rv = _rows(v.replace_k, r, v.head_dim, owner), _rows(v.replace_v, r, v.head_dim, owner)
        else:
            rk = np.ctypeslib.as_array(v.replace_k, (r * v.head_dim,)).reshape(r, v.head_dim).copy()
            rv = np.ctypeslib.as_array(v.replace_v, (r * v.head_dim,)).reshape(r, v.head_dim).copy()
    else:
        rep, rk, rv = np.zeros(0, np.int32), None, None
    return Plan(n_kept=n_kept.astype(np.int32), slots=slots.astype(np.int32), log_mult=log_mult,
                replace_entry=rep.astype(np.int32), replace_k=rk, replace_v=rv)


class _KvCallback:
    """Observation.kv_reader as a kvcli_kv_reader: the planner's buffers are filled in place. An exception
    cannot cross the C planner: it is kept in `error` (raised by native_plan) and the planner gets 1."""

    def __init__(self, obs: Observation):
        self.reader, self.error = obs.kv_reader, None
        self.shape = (obs.n_head_kv, obs.n, obs.head_dim)
        self.fn = KV_READER(self)

    def __call__(self, _user, il, keys, values) -> int:
        try:
            self.reader(int(il), np.ctypeslib.as_array(keys, self.shape), np.ctypeslib.as_array(values, self.shape))
            return 0
        except BaseException as e:   # noqa: BLE001  (re-raised by native_plan once the planner returns)
            self.error = e
            return 1


def obs_view(obs: Observation) -> tuple[ObsView, list]:
    """An ObsView over the observation's arrays (no copy when they are float32 C-order, as both engines
    return them), with its kv_reader as the planner's K/V reader when it holds no K/V arrays; the returned
    list keeps them alive (the last item: the reader's callback, None without one)."""
    arrs = [None if a is None else np.ascontiguousarray(a, np.float32)
            for a in (obs.window_sums, obs.colsum, obs.keys, obs.values, obs.colmax, obs.queries)]
    ints = [None if a is None else np.ascontiguousarray(a, np.int32) for a in (obs.query_positions, obs.positions)]
    windows = np.asarray(obs.windows, np.int32)
    cb = _KvCallback(obs) if obs.kv_reader is not None and (obs.keys is None or obs.values is None) else None
    rope, factors = RopeView(ROPE_NONE, 0, 0.0, 0.0, None), None
    if obs.rope is not None:
        factors = None if obs.rope.factors is None else np.ascontiguousarray(obs.rope.factors, np.float32)
        rope = RopeView(ROPE_NEOX if obs.rope.neox else ROPE_NORM, obs.rope.n_rot, obs.rope.freq_base,
                        obs.rope.freq_scale, _f32(factors))
    n_rows = 0 if obs.queries is None else obs.queries.shape[2]
    v = ObsView(obs.n_layer, obs.n_head, obs.n_head_kv, obs.head_dim, obs.n, len(obs.windows), _i32(windows),
                *[_f32(a) for a in arrs[:4]], cb.fn if cb else KV_READER(), None, _f32(arrs[4]),
                n_rows, _f32(arrs[5]), *[_i32(a) for a in ints], rope)
    return v, arrs + ints + [factors, windows, cb]


def native_plan(policy: str, params: dict | str, budget: int, obs: Observation) -> Plan:
    """Run the C++ planner of `policy` on `obs` (kvcli_plan_make).

    `params` is the registry's validated dict (`PolicySpec.validate`; the budget checked with
    `check_budget`): it is rendered here with the closed-form schedule of this observation
    (`PolicySpec.native_params`). A str is passed to the C API as it is (tests of its own errors)."""
    if isinstance(params, dict):
        params = policies.get(policy).native_params(params, budget, obs.n_layer, obs.n)
    L = lib()
    ov, keep = obs_view(obs)
    with signals_deferred():
        handle = L.kvcli_plan_make(policy.encode(), params.encode(), int(budget), ctypes.byref(ov))
    if not handle:
        if keep[-1] is not None and keep[-1].error is not None:   # the K/V reader failed: its own error
            raise keep[-1].error
        raise KvcliError(f"native planner '{policy}' failed: {L.last_error() or 'unknown error'}")
    owner = _NativePlan(handle)   # frees it once the plan's rows are gone
    pv = PlanView()
    L.check(L.kvcli_plan_get(handle, ctypes.byref(pv)), "kvcli_plan_get")
    return plan_from_view(pv, owner)
