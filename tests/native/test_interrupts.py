"""Ctrl-C, SIGTERM or SIGHUP while llama.cpp calls back into Python (its log while a model loads or a context is
made): the KeyboardInterrupt (Terminated for SIGTERM/SIGHUP) is delivered once the C call returns
(kvcli.native.signals_deferred), not printed by ctypes as "Exception ignored ... Traceback" and lost, which let
`kvcli run` carry on after a Ctrl-C during its model load, and a SIGTERM'd eval go on until killed."""
from __future__ import annotations

import ctypes
import signal

import pytest

import kvcli.native as native
from kvcli.cli import terminate_as_interrupt
from kvcli.errors import Terminated
from kvcli.native.session import NativeSession

pytestmark = pytest.mark.usefixtures("sigint_raises")


@pytest.fixture()
def interrupting_log():
    """install(sig): llama.cpp's log sink replaced by one that raises `sig` at the first line it gets, as a Ctrl-C
    or a kill would land (Python runs the handler inside the callback); returns the lines seen. kvcli's sink is put
    back."""
    L = native.load_llama_cpp()
    seen: list[bytes] = []

    raised = []

    def sink(level, text, user_data):
        seen.append(text)
        if len(seen) == 1:
            signal.raise_signal(raised[0])
    cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(sink)

    def install(sig=signal.SIGINT):
        raised.append(sig)
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


@pytest.fixture()
def terminate_raises():
    """kvcli's own SIGTERM/SIGHUP handlers (kvcli.cli.terminate_as_interrupt), put back as they were after."""
    before = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGHUP)}   # nohup: not ignored
    terminate_as_interrupt()
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)
    Terminated.signum = None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_kill_while_a_model_loads_stops_after_the_load(tiny_model, interrupting_log, terminate_raises, sig):
    handler = signal.getsignal(sig)
    seen = interrupting_log(sig)
    with pytest.raises(Terminated):
        NativeSession(tiny_model, n_ctx=0)
    assert len(seen) > 1 and Terminated.signum == sig   # the load went on to its end, then the stop came
    assert signal.getsignal(sig) is handler             # kvcli's handler is back in place
