"""Ctrl-C while llama.cpp calls back into Python (its log while a model loads or a context is made): the
KeyboardInterrupt is delivered once the C call returns (kvcli.native.sigint_deferred), not printed by ctypes as
"Exception ignored ... Traceback" and lost, which let `kvcli run` carry on after a Ctrl-C during its model load."""
from __future__ import annotations

import ctypes
import signal

import pytest

import kvcli.native as native
from kvcli.native.session import NativeSession

pytestmark = pytest.mark.usefixtures("sigint_raises")


@pytest.fixture()
def interrupting_log():
    """install(): llama.cpp's log sink replaced by one that raises SIGINT at the first line it gets, as a Ctrl-C
    would land (Python runs the handler inside the callback); returns the lines seen. kvcli's sink is put back."""
    L = native.load_llama_cpp()
    seen: list[bytes] = []

    def sink(level, text, user_data):
        seen.append(text)
        if len(seen) == 1:
            signal.raise_signal(signal.SIGINT)
    cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(sink)

    def install():
        L.llama_log_set(cb, None)
        return seen
    yield install
    L.llama_log_set(native._LOG_CALLBACK, None)


def test_ctrl_c_while_a_model_loads_interrupts_after_the_load(tiny_model, interrupting_log):
    seen = interrupting_log()
    with pytest.raises(KeyboardInterrupt):
        NativeSession(tiny_model, n_ctx=0)
    assert len(seen) > 1                                  # the load went on to its end, then the interrupt came
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_while_a_context_is_made_interrupts_after_it(tiny_model, interrupting_log):
    s = NativeSession(tiny_model, n_ctx=0)
    try:
        seen = interrupting_log()
        with pytest.raises(KeyboardInterrupt):
            s.create_context(256)
        assert len(seen) > 1 and s.ctx                    # the context was made, then the interrupt came
    finally:
        s.close()
