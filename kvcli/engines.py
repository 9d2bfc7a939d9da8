"""The engines as the layers above them reach them: opening a session of either engine, running one engine's
planner, and the native engine's capabilities beyond the Session protocol (kvcli/session.py), each by name
and taking a session, never its llama.cpp context.

Only the engine layer imports kvcli.native (tests/test_architecture.py, NATIVE_IMPORTERS): the planning
layer, the drivers, kvcli.evaluation, the apps and the commands import this module instead, so what they need
of the native engine is the list below and nothing else.
"""
from __future__ import annotations

import ctypes

import numpy as np

from kvcli.errors import ContextFull, KvcliError
from kvcli.native import build_info, lib_dir
from kvcli.native import cache as _cache
from kvcli.native.lib import attn_path, identity, native_plan
from kvcli.native.session import CACHE_TYPES, NativeSession, SeqSnapshot, default_threads
from kvcli.native.state import F16, Q8_0, cells_from, chunk_keys, convert_chunk
from kvcli.native.state import Reader as StateReader

__all__ = [
    # opening an engine, running its planner
    "open_native", "open_reference", "open_session", "planner",
    # what both engines raise (kvcli/errors.py's, here too for the callers that catch it beside an engine call) and
    # what the native engine saves
    "ContextFull", "SeqSnapshot",
    # the native library and its build
    "CACHE_TYPES", "attn_path", "build_info", "default_threads", "identity", "lib_dir",
    # the native cache state's format (kvcli/native/state.py): chunk files and .kvc files are made of it
    "F16", "Q8_0", "StateReader", "cells_from", "chunk_keys", "convert_chunk",
    # a native sequence's cache, read and labelled
    "cache_state", "is_compressed", "kv_reader", "live_stats", "read_kv_layer", "seq_positions", "set_header",
    # what an engine can do beyond the Session protocol, asked by name instead of by its name or attributes
    "cites", "saves_state", "shares_cells", "saved_state",
    # what a citation reads of the native engine (kvcli/citations.py)
    "control_tokens", "slot_origins", "token_pieces",
]


def open_native(model_path, **kw) -> NativeSession:
    """A session of the llama.cpp engine (NativeSession's arguments)."""
    return NativeSession(model_path, **kw)


def open_reference(model_path, **kw):
    """A session of the torch engine (ReferenceSession's arguments); imported here, on first use: it loads torch."""
    from kvcli.reference.session import ReferenceSession  # noqa: PLC0415  (loads torch)
    return ReferenceSession(model_path, **kw)


def open_session(engine: str, model_path, **kw):
    """A session of the engine named "native" or "reference" (the latter takes n_ctx and n_threads only)."""
    if engine == "native":
        return open_native(model_path, **kw)
    if engine == "reference":
        return open_reference(model_path, **{k: v for k, v in kw.items() if k in ("n_ctx", "n_threads")})
    raise KvcliError(f"unknown engine '{engine}'")


def planner(engine: str):
    """The planner of one engine, `plan(policy_name, params, budget, obs) -> Plan`: "native" (C++) or "reference"
    (torch; imported on first use)."""
    if engine == "native":
        return native_plan
    if engine == "reference":
        from kvcli.reference.policies import reference_plan  # noqa: PLC0415  (loads torch)
        return reference_plan
    raise KvcliError(f"unknown planner '{engine}'")


def _native(session) -> NativeSession:
    if not isinstance(session, NativeSession):
        raise KvcliError(f"this needs the native engine's cache, not the {session.engine} engine's")
    return session


def seq_positions(session, seq: int) -> np.ndarray:
    """The position each cell of `seq` holds, in cell order."""
    return _cache.seq_positions(_native(session).ctx, seq)


def read_kv_layer(session, seq: int, il: int, keys: np.ndarray, values: np.ndarray) -> None:
    """One layer's K/V rows of `seq`'s cells into keys/values ([n_head_kv, cells, head_dim] float32 each)."""
    _cache.read_kv_layer(_native(session).ctx, seq, session.info, il, keys, values)


def kv_reader(session, seq: int, positions: np.ndarray):
    """Observation.kv_reader of `seq` as observed at `positions`: one layer's K/V rows read when the planner asks."""
    return _cache.KvReader(_native(session).ctx, seq, session.info, positions)


def live_stats(session, seq: int) -> dict:
    """The live cache's own figures of `seq` (kvcli_stats_get): n_cells, live_entries, k/v/bias bytes."""
    info = _native(session).info
    return _cache.stats(session.ctx, seq, info.n_layer_model, info.n_head_kv)


def cache_state(session, seq: int) -> bytearray:
    """`seq`'s cache state (what .kvc files and restore_seq hold)."""
    return _cache.get_state(_native(session).ctx, seq)


def is_compressed(session, seq: int) -> bool:
    return bool(_cache.is_compressed(_native(session).ctx, seq))


def set_header(session, seq: int, policy: str, budget: int, original_tokens: int) -> None:
    """Label `seq`'s cache with the compression it was made with (saved with its state)."""
    _cache.set_header(_native(session).ctx, seq, policy, budget, original_tokens)


# ------------------------------------------------------------------ capabilities, asked by name
# The drivers, apps and commands ask these instead of `session.engine == "native"` or an attribute's presence: what
# differs between the engines is named once, here (tests/test_architecture.py checks no probe comes back).

def shares_cells(session) -> bool:
    """Whether the engine hands one sequence's cells to another without copying them (share, gather, free_seq,
    move_seq: a resident document's questions, bounded re-selection's chunks): the native engine's cell pool."""
    return isinstance(session, NativeSession)


def saves_state(session) -> bool:
    """Whether save_seq gives the cache's state as bytes, which a .kvc file holds (`saved_state`): the native
    engine; the reference engine's snapshot is a copy of its torch cache, kept in memory only."""
    return isinstance(session, NativeSession)


def saved_state(snap) -> bytes | None:
    """The cache state a save_seq snapshot holds (what .kvc files hold); None for the reference engine's."""
    return snap.state if isinstance(snap, SeqSnapshot) else None


def cites(session) -> bool:
    """Whether an answer can be cited (kvcli/citations.py): the engine maps each slot to the position it holds
    (`slot_origins`) and reads its tokenizer's pieces with special tokens as text (`token_pieces`)."""
    return isinstance(session, NativeSession)


def slot_origins(session, seq: int) -> list[list[np.ndarray]]:
    """Per (layer, KV head), the original position of the entry each slot (cell order) of `seq` holds; -1: a dead
    slot."""
    return _native(session)._slot_origins(seq)


def token_pieces(session, tokens: list[int]) -> list[bytes]:
    """Each token's bytes as the tokenizer wrote it, special tokens as their text (llama_token_to_piece with
    special=True)."""
    s = _native(session)
    out = []
    buf = ctypes.create_string_buffer(128)
    for t in tokens:
        n = s.L.llama_token_to_piece(s.vocab, int(t), buf, 128, 0, True)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = s.L.llama_token_to_piece(s.vocab, int(t), big, -n, 0, True)
            out.append(big.raw[:n])
        else:
            out.append(buf.raw[:n])
    return out


def control_tokens(session, tokens: list[int]) -> list[bool]:
    """Whether each token is a control token (a chat template's message markers: llama_vocab_is_control)."""
    s = _native(session)
    return [bool(s.L.llama_vocab_is_control(s.vocab, int(t))) for t in tokens]
