"""The native engine: our patched llama.cpp, loaded through llama-cpp-python's ctypes bindings.

`load_llama_cpp()` must run before anything imports `llama_cpp`: it points
LLAMA_CPP_LIB_PATH at our build (kvcli/native/lib/default, or $KVCLI_LIB_DIR) so that the
bindings load the patched library, never a stock one. The bindings are the ones the build copied out of the pinned
llama-cpp-python sdist into kvcli/native/_vendor/ (kvcli/native/build.py), else an installed llama-cpp-python.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
from pathlib import Path

from kvcli.errors import KvcliError

LIB_ROOT = Path(__file__).resolve().parent / "lib"
VENDOR = Path(__file__).resolve().parent / "_vendor"   # llama_cpp/ (llama-cpp-python's ctypes bindings)


def lib_dir() -> Path:
    env = os.environ.get("KVCLI_LIB_DIR")
    return Path(env) if env else LIB_ROOT / "default"


def build_info() -> dict:
    p = lib_dir() / "build_info.json"
    return json.loads(p.read_text()) if p.exists() else {}


DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred():
    """Ctrl-C, SIGTERM and SIGHUP during a C call that calls back into Python are delivered once the call has
    returned. Python runs a signal's handler at the next bytecode, and while C code runs that is the entry of a
    ctypes callback (llama.cpp's log sink while a model loads, a planner's K/V reader), before any `try` of its own:
    the exception (KeyboardInterrupt, or kvcli's Terminated for SIGTERM/SIGHUP) cannot cross the C frames, ctypes
    prints it as "Exception ignored ... Traceback" and the signal is lost (Ctrl-C while `kvcli run` loaded its
    model: that message, then the whole run; SIGTERM while a model loaded: a process that went on until killed).
    Each signal that arrived is re-sent to the process after the call, under the handler that was in place. A
    signal ignored (`nohup`) stays ignored. Only the main thread receives signals; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit: list[int] = []
    prev = {}
    for sig in DEFERRED_SIGNALS:
        handler = signal.getsignal(sig)
        if handler is not signal.SIG_IGN:
            prev[sig] = signal.signal(sig, lambda signum, _frame: hit.append(signum))
    try:
        yield
    finally:
        for sig, handler in prev.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(hit):   # once each, in the order they came
            signal.raise_signal(sig)


def _log_sink(level, text, user_data):
    # llama.cpp's own log goes nowhere unless KVCLI_DEBUG is set: stderr is for kvcli's messages
    if os.environ.get("KVCLI_DEBUG"):
        sys.stderr.write(text.decode("utf-8", "replace"))


_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_log_sink)
_llama_cpp = None


def load_llama_cpp():
    """Import llama_cpp bound to our patched library; a clear error if it is not built."""
    global _llama_cpp
    if _llama_cpp is not None:
        return _llama_cpp
    d = lib_dir()
    if not (d / "libllama.so").exists():
        raise KvcliError(f"the kvcli native library is not built ({d / 'libllama.so'} is missing): "
                         "run ./setup.sh, or python -m kvcli.native.build")
    if "llama_cpp" in sys.modules and os.environ.get("LLAMA_CPP_LIB_PATH") != str(d):
        raise KvcliError("llama_cpp was imported before kvcli could point it at the patched library")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(d)
    if (VENDOR / "llama_cpp" / "__init__.py").is_file() and str(VENDOR) not in sys.path:
        sys.path.insert(0, str(VENDOR))   # the bindings of the llama.cpp we built, before any installed ones
    try:
        import llama_cpp  # noqa: PLC0415 (must come after the environment variable)
    except ImportError as e:
        raise KvcliError(f"the llama_cpp bindings are missing ({e}): reinstall kvcli (pip install .), or run "
                         "python -m kvcli.native.build") from e
    llama_cpp.llama_log_set(_LOG_CALLBACK, None)
    llama_cpp.llama_backend_init()
    _llama_cpp = llama_cpp
    return llama_cpp
