"""kvcli serve's parallel decode (kvcli/apps/serve_decode.py): requests in flight together share their document's
cells, each with its own question, selection, sampling, stop strings and max_tokens, and decode in one batch per token.

On the tiny random model (2 layers, f16 cache, flash attention, one thread, as kvcli serve runs):
- a request alone decodes what it decoded before the loop existed (the existing tests of tests/test_serve.py and
  tests/test_resident.py hold that unchanged);
- requests decoded together get the tokens they get alone (greedy), and logits within LOGIT_TOL of alone: the CPU
  flash-attention kernel sums a sequence's cells in cell order, in tiles, and beside other requests a flight's tokens
  land in cells between (or freed by) the others', so the f16 rounding differs; a flight's steps before any other
  request joined it are bit-identical;
- a cancelled request frees its sequences at once while another keeps decoding; a request that does not fit beside
  the others waits and is answered as alone; requests about two documents decode together.
Then a real `kvcli serve` process on the tiny model: two streams interleaved, a client that hangs up mid-stream while
another is answered, usage and stats per request.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from tests.test_serve import raw, serving

LOGIT_TOL = 5e-2   # measured: at most 0.016 on these prompts (max |logit| difference, every step)
DOC = " ".join(f"Entry {i}: the {w} station logged code {1000 + 37 * i}." for i, w in
               enumerate(["north", "south", "river", "stone", "light", "delta", "gamma", "alpha"] * 6))
DOC2 = " ".join(f"Line {i}: the {w} pump ran {10 + 3 * i} hours." for i, w in enumerate(["red", "blue", "green",
                                                                                          "grey"] * 12))
QUESTIONS = ("Which code did the river station log?", "What did the gamma station log last?",
             "Name the stone station's code.", "How many entries are there?")


@pytest.fixture()
def engine(tiny_2k, cache_dir):
    made = []

    def make(n_ctx=2048, parallel=4, max_tokens=40):
        from kvcli.apps.serve import Choice, Engine, MemoryStore
        from kvcli.generate import Sampling
        d = Choice(policy="snapkv", budget=48, policy_args={}, max_tokens=max_tokens, sampling=Sampling.greedy(),
                   ignore_eos=True)
        e = Engine(tiny_2k, model_id="tiny", n_ctx=n_ctx, cache_type="f16", threads=1, defaults=d,
                   store=MemoryStore(None), parallel=parallel)
        e.logged = {}   # answer sequence -> the logits each pick read from it
        logits = e.session.logits

        def logged(seq=0):
            x = logits(seq)
            e.logged.setdefault(seq, []).append(x.copy())
            return x
        e.session.logits = logged
        made.append(e)
        return e
    yield make
    for e in made:
        e.close()


def prompt(e, question, doc=DOC):
    return e.chat_prompt([{"role": "user", "content": f"{doc}\n\n{question}"}])


def alone(e, p, c=None):
    """(answer, logits per step) of `p` asked alone."""
    e.logged.clear()
    a = e.answer(p, c or e.defaults)
    return a, np.array(e.logged[0])


def run_all(e, flights_by_step: dict, until_done=True) -> None:
    """Step the engine, beginning the requests of flights_by_step[k] (callables) before step k."""
    k = 0
    while (k <= max(flights_by_step) or e.flights) and until_done:
        for begin in flights_by_step.get(k, ()):
            begin()
        if e.flights:
            e.step()
        k += 1


def flight_alone(e, p, c=None):
    """(flight, logits per step) of `p` begun and decoded with no other request in flight."""
    e.logged.clear()
    f = e.begin(p, c or e.defaults)
    while e.flights:
        e.step()
    return f, np.array(e.logged[f.seq])


def test_requests_decoded_together_get_their_tokens_alone(engine):
    """Four questions begun three steps apart (each one's prefill, plan and gather between two steps of the others),
    decoded together, against each asked alone: the same plan, the same greedy tokens, logits within LOGIT_TOL; the
    first one's steps before the second joined are bit-identical to its alone run in an engine with the same history."""
    e1, e2 = engine(), engine()
    for e in (e1, e2):
        e.answer(prompt(e, "Hello?"), e.defaults)   # the document read and resident: every question shares it
    solo = [flight_alone(e1, prompt(e1, q)) for q in QUESTIONS]
    e2.logged.clear()
    flights = []
    run_all(e2, {3 * i: [lambda q=q: flights.append(e2.begin(prompt(e2, q), e2.defaults))]
                 for i, q in enumerate(QUESTIONS)})
    for f, (g, logits) in zip(flights, solo):
        got = np.array(e2.logged[f.seq])   # the picks of its answer sequence
        assert np.array_equal(f.r.plan.slots, g.r.plan.slots)
        assert f.answer.text == g.answer.text and f.answer.completion_tokens == g.answer.completion_tokens == 40
        np.testing.assert_allclose(got, logits, rtol=0, atol=LOGIT_TOL)
        assert f.answer.stats["decoded_with"] > 1 and f.answer.finish_reason == "length"
    assert np.array_equal(np.array(e2.logged[flights[0].seq])[:3], solo[0][1][:3])
    assert len({f.seq for f in flights}) == 4 and flights[0].seq == 0   # each its own answer sequence
    # nothing held after them but the document and its extension (the last question's prompt)
    kept = {d.extension.seq for d in e2.residents.docs.values() if d.extension is not None}
    assert not e2.flights and len(kept) == 1 and all(
        e2.session.seq(q).cells == 0 for q in [*e2.answer_seqs, *e2.question_seqs] if q not in kept)


def test_a_cancelled_request_frees_its_sequences_while_another_decodes(engine):
    e = engine(max_tokens=60)
    e.answer(prompt(e, "Hello?"), e.defaults)
    pa, pb = prompt(e, QUESTIONS[0]), prompt(e, QUESTIONS[1])
    b_alone, _ = alone(e, pb)
    left = threading.Event()
    fa = e.begin(pa, e.defaults, cancelled=left.is_set)
    fb = e.begin(pb, e.defaults)
    for _ in range(5):
        e.step()
    held = e.session.cells_used()
    a_cells = e.session.seq(fa.seq).cells
    left.set()   # the client of A leaves
    ended = e.step()
    assert fa in ended and fa.answer.finish_reason == "cancelled" and fa.answer.completion_tokens == 5
    assert e.session.seq(fa.seq).cells == 0 and fa.seq not in e.flights   # its answer sequence freed at once
    assert e.session.cells_used() <= held - a_cells + 1                   # (B took one more cell this step)
    while e.flights:
        e.step()
    assert fb.answer.text == b_alone.text and fb.answer.completion_tokens == 60


def test_max_tokens_stop_and_sampling_per_request(engine):
    e = engine()
    e.answer(prompt(e, "Hello?"), e.defaults)
    from kvcli.generate import Sampling
    p1, p2, p3 = (prompt(e, q) for q in QUESTIONS[:3])
    c1 = replace(e.defaults, max_tokens=7)
    c3 = replace(e.defaults, sampling=Sampling(temperature=0.9, seed=11), max_tokens=25)
    s1, s3 = alone(e, p1, c1)[0], alone(e, p3, c3)[0]
    full2 = alone(e, p2)[0].text
    stop = full2[12:15]   # a stop string the second answer reaches
    c2 = replace(e.defaults, stop=[stop])
    s2 = alone(e, p2, c2)[0]
    assert s2.finish_reason == "stop" and s2.text == full2[:full2.find(stop)]
    fs = [e.begin(p, c) for p, c in ((p1, c1), (p2, c2), (p3, c3))]
    while e.flights:
        e.step()
    for f, s in zip(fs, (s1, s2, s3)):
        a = f.answer
        assert (a.text, a.finish_reason, a.completion_tokens) == (s.text, s.finish_reason, s.completion_tokens)
    assert fs[0].answer.completion_tokens == 7 and fs[2].answer.completion_tokens == 25


def test_requests_about_two_documents_decode_together(engine):
    e = engine()
    for doc in (DOC, DOC2):
        e.answer(prompt(e, "Hello?", doc), e.defaults)
    ps = [prompt(e, QUESTIONS[0]), prompt(e, "Which pump ran longest?", DOC2), prompt(e, QUESTIONS[2])]
    solo = [alone(e, p)[0] for p in ps]
    fs = [e.begin(p, e.defaults) for p in ps]
    assert len({id(f.doc) for f in fs}) == 2 and len(e.residents.docs) == 2
    while e.flights:
        e.step()
    for f, s in zip(fs, solo):
        assert f.answer.text == s.text and f.answer.stats["document_read_tokens"] == 0
        assert f.answer.stats["decoded_with"] == 3.0


def test_a_request_that_does_not_fit_waits_and_is_answered_as_alone(engine):
    """A context that holds the document and one answer of 300 tokens: the second request waits in the Scheduler's
    queue (never an error), begins when the first has ended, and answers as it does alone; the document the first
    was answered from is not freed for it."""
    from kvcli.apps.serve_decode import Scheduler
    e = engine(n_ctx=1280, max_tokens=300)
    e.answer(prompt(e, "Hello?"), e.defaults)
    pa, pb = prompt(e, QUESTIONS[0]), prompt(e, QUESTIONS[1])
    assert len(pa) + 300 + 48 < 1280 < len(pa) + 2 * (300 + 48)
    solo = [alone(e, p)[0] for p in (pa, pb)]
    s = Scheduler(e)
    try:
        futs = [s.submit(pa, e.defaults), s.submit(pb, e.defaults)]
        got = [f.result(timeout=300) for f in futs]
    finally:
        s.close()
    assert [a.text for a in got] == [a.text for a in solo]
    assert got[0].stats["decoded_with"] == 1.0 and got[1].stats["decoded_with"] == 1.0   # one after the other
    assert got[1].stats["queued_s"] > 0 and got[1].stats["document_read_tokens"] == 0 and e.residents.freed == 0


def test_exclusive_forms_and_errors_through_the_scheduler(engine):
    """A bad request beside flights gets its own error; the others go on."""
    from kvcli.apps.serve import BadRequest
    from kvcli.apps.serve_decode import Scheduler
    e = engine()
    s = Scheduler(e)
    try:
        good = s.submit(prompt(e, QUESTIONS[0]), e.defaults)
        bad = s.submit([5], e.defaults)   # one token: refused
        with pytest.raises(BadRequest):
            bad.result(timeout=300)
        assert good.result(timeout=300).completion_tokens == 40
    finally:
        s.close()
    assert not e.flights and s.waiting == 0


# ---------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    model = write_tiny_llama(tmp_path_factory.mktemp("tinyserve") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                             head_dim=16, n_ctx_train=4096)
    log = tmp_path_factory.mktemp("serve-parallel") / "server.log"
    args = ["--model", str(model), "--policy", "snapkv", "--budget", "48", "--ctx", "4096", "--max-tokens", "40",
            "--threads", "1", "--store", "memory", "--dry-multiplier", "0", "--parallel", "4"]
    with serving(args, log, {"KVCLI_CACHE": str(tmp_path_factory.mktemp("kvcache"))}) as (port, proc):
        yield {"port": port, "proc": proc, "log": log, "model": model.stem}


def body(server, question, **more) -> bytes:
    return json.dumps({"model": server["model"], "messages": [{"role": "user", "content": f"{DOC}\n\n{question}"}],
                       **more}).encode()


def ask(server, question, **more) -> dict:
    status, out = raw("POST", server["port"], "/v1/chat/completions", body(server, question, **more),
                      {"Content-Type": "application/json"})
    assert status == 200, out
    return out


def stream(server, question, events: list, name: str, **more) -> None:
    """Read a stream, appending (name, time, chunk) to `events` as each arrives."""
    c = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=300)
    c.request("POST", "/v1/chat/completions", body=body(server, question, stream=True, **more),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    buf = b""
    while True:
        data = r.read1(65536)
        if not data:
            break
        buf += data
        while b"\n\n" in buf:
            line, buf = buf.split(b"\n\n", 1)
            text = line.decode()[6:]
            if text != "[DONE]":
                events.append((name, time.perf_counter(), json.loads(text)))
    c.close()


def streamed(events, name) -> tuple[str, dict]:
    mine = [ch for n, _, ch in events if n == name]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in mine if ch["choices"])
    return text, mine[-1]


def test_two_streams_interleave_and_each_gets_its_own_answer(tiny_server):
    ask(tiny_server, "Hello?")   # reads the document
    long_q, short_q = QUESTIONS[0], QUESTIONS[1]
    alone_long = ask(tiny_server, long_q, max_tokens=800, ignore_eos=True)["choices"][0]["message"]["content"]
    alone_short = ask(tiny_server, short_q, max_tokens=30, ignore_eos=True)
    events: list = []
    a = threading.Thread(target=stream, args=(tiny_server, long_q, events, "a"),
                         kwargs={"max_tokens": 800, "ignore_eos": True})
    a.start()
    deadline = time.time() + 120
    while not any(n == "a" and ch["choices"] and ch["choices"][0]["delta"].get("content") for n, _, ch in events):
        assert time.time() < deadline and a.is_alive()
        time.sleep(0.01)
    stream(tiny_server, short_q, events, "b", max_tokens=30, ignore_eos=True)
    a.join(300)
    text_a, last_a = streamed(events, "a")
    text_b, last_b = streamed(events, "b")
    assert text_a == alone_long and text_b == alone_short["choices"][0]["message"]["content"]
    # b's chunks arrived between a's first and last: the two were decoded (and streamed) together
    times_a = [t for n, t, _ in events if n == "a"]
    assert times_a[0] < min(t for n, t, _ in events if n == "b") and max(t for n, t, _ in events if n == "b") < \
        times_a[-1]
    assert last_b["kvcli"]["decoded_with"] == 2.0 and last_a["kvcli"]["decoded_with"] > 1.0
    assert last_b["choices"][0]["finish_reason"] == "length"


def test_a_client_that_leaves_frees_its_request_while_another_is_answered(tiny_server):
    """B streams a long answer; A joins it, streams a few tokens and hangs up: A stops at its next step and frees its
    sequences, B goes on and answers what it answers alone, having decoded beside A for a while."""
    ask(tiny_server, "Hello?")
    expected = ask(tiny_server, QUESTIONS[2], max_tokens=2000, ignore_eos=True)
    events: list = []
    b = threading.Thread(target=stream, args=(tiny_server, QUESTIONS[2], events, "b"),
                         kwargs={"max_tokens": 2000, "ignore_eos": True})
    b.start()
    deadline = time.time() + 120
    while not any(ch["choices"] and ch["choices"][0]["delta"].get("content") for _, _, ch in events):
        assert time.time() < deadline and b.is_alive()
        time.sleep(0.01)
    c = http.client.HTTPConnection("127.0.0.1", tiny_server["port"], timeout=300)
    c.request("POST", "/v1/chat/completions", body=body(tiny_server, QUESTIONS[3], stream=True, max_tokens=1000,
                                                        ignore_eos=True),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    seen = b""
    while seen.count(b"data: ") < 4:
        seen += r.read1(4096)
    c.close()   # hang up mid-answer
    b.join(300)
    text, last = streamed(events, "b")
    assert text == expected["choices"][0]["message"]["content"]
    assert last["choices"][0]["finish_reason"] == "length" and last["kvcli"]["decoded_with_most"] == 2
    deadline = time.time() + 60
    while (health := raw("GET", tiny_server["port"], "/health")[1])["decoding"] and time.time() < deadline:
        time.sleep(0.1)
    assert health["decoding"] == 0 and health["waiting"] == 0 and health["parallel"] == 4
    lines = [ln for ln in tiny_server["log"].read_text().splitlines() if ln.startswith("chat:")]
    gone = [ln for ln in lines if ln.endswith("cancelled")]
    assert gone and int(gone[-1].split(" generated")[0].rsplit(" ", 1)[1]) < 1000
