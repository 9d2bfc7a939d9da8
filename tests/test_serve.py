"""kvcli serve as a real process on the default model, talked to with the official `openai` client (and raw HTTP
where the wire format itself is checked: server-sent events, error statuses, a client that hangs up).

One server for the module (snapkv @ 64, an API key, a small context and body limit so the refusals are cheap to
provoke); a ~350-token logbook is the document every question carries in its user message.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import threading
import time

import openai   # a test dependency (requirements.txt): missing, these tests fail rather than skip
import pytest

from tests.conftest import KVCLI, ROOT

KEY = "test-key-123"
CTX = 1024
BODY_LIMIT = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def document():
    from kvcli.evaluation.logbook import make_document
    text, planted = make_document(260, facts=2, seed=5)
    return text, planted


@contextlib.contextmanager
def serving(args: list[str], log, env: dict):
    """A `kvcli serve ARGS` process on a free port, answering /health: yields (port, process); stopped after."""
    port = free_port()
    with open(log, "w") as err:
        proc = subprocess.Popen([*KVCLI, "serve", *args, "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err, env={**os.environ, "KVCLI_API_KEY": "", **env})
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, f"kvcli serve exited: {log.read_text()}"
            try:
                if raw("GET", port, "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline, "kvcli serve did not answer /health in 180 s"
            time.sleep(0.3)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    args = ["--model", str(default_model), "--policy", "snapkv", "--budget", "64", "--api-key", KEY, "--ctx",
            str(CTX), "--max-body-bytes", str(BODY_LIMIT), "--max-tokens", "16",
            "--threads", "1"]   # one thread: on a busy machine two wait for each other at every node
    # its stores in the test's own document store
    with serving(args, log, {"KVCLI_CACHE": str(tmp_path_factory.mktemp("kvcache"))}) as (port, proc):
        yield {"port": port, "proc": proc, "log": log, "model": default_model.stem}


def raw(method: str, port: int, path: str, body: bytes | None = None, headers: dict | None = None,
        timeout: float = 300):
    """(status, decoded JSON or text) of one plain HTTP request."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        data = r.read().decode()
        try:
            return r.status, json.loads(data)
        except ValueError:
            return r.status, data
    finally:
        c.close()


def auth(extra: dict | None = None) -> dict:
    return {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(extra or {})}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key=KEY, max_retries=0, timeout=300)


def messages(document, question: str) -> list[dict]:
    return [{"role": "user", "content": f"{document[0]}\n\n{question}"}]


def stats(resp) -> dict:
    return resp.model_extra["kvcli"]


def alive(server) -> None:
    assert server["proc"].poll() is None
    status, body = raw("GET", server["port"], "/health")
    assert status == 200 and body["status"] == "ok"


# ---------------------------------------------------------------------------------- answers
def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [server["model"]]
    alive(server)


def test_document_read_once(server, client, document):
    """The first question reads the document; the second (another question, the same document) restores it."""
    q1, q2 = (f["question"] for f in document[1])
    first = client.chat.completions.create(model=server["model"], messages=messages(document, q1))
    s1 = stats(first)
    assert first.object == "chat.completion" and first.choices[0].message.content
    assert first.usage.prompt_tokens == s1["prompt_tokens"] > 300
    assert first.usage.completion_tokens > 0
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert s1["policy"] == "snapkv" and s1["budget"] == 64
    # prompts whose store was made by an earlier test would restore: this document is new to the server
    assert s1["document_read_tokens"] > 300 and s1["prefix_reused_tokens"] == 0
    assert s1["kv_cells"] < s1["prompt_tokens"] and s1["kv_bytes"] < s1["kv_bytes_full"]   # compressed

    second = client.chat.completions.create(model=server["model"], messages=messages(document, q2))
    s2 = stats(second)
    assert s2["document_read_tokens"] == 0                      # not read again
    assert s2["prefix_reused_tokens"] >= s1["document_read_tokens"] - 40
    assert s2["prefilled_tokens"] < 64                          # the question (and the policy's window) only
    assert s2["prefix_reused_tokens"] + s2["prefilled_tokens"] == second.usage.prompt_tokens
    assert s2["store_entries"] == s1["store_entries"]


def test_streaming_matches_and_ends_with_done(server, client, document):
    q = document[1][0]["question"]
    whole = client.chat.completions.create(model=server["model"], messages=messages(document, q))
    pieces, finish = [], None
    for ch in client.chat.completions.create(model=server["model"], messages=messages(document, q), stream=True):
        assert ch.object == "chat.completion.chunk"
        if ch.choices and ch.choices[0].delta.content:
            pieces.append(ch.choices[0].delta.content)
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
    assert "".join(pieces) == whole.choices[0].message.content   # greedy: the same answer, streamed
    assert finish == whole.choices[0].finish_reason

    # the wire: data: lines of JSON chunks, the usage chunk asked for, then data: [DONE]
    body = json.dumps({"model": server["model"], "messages": messages(document, q), "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    status, text = raw("POST", server["port"], "/v1/chat/completions", body, auth())
    assert status == 200
    events = [e for e in text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 300
    assert chunks[-2]["kvcli"]["document_read_tokens"] == 0


def test_completions_and_policy_per_request(server, client, document):
    out = client.completions.create(model=server["model"], prompt="The capital of France is", max_tokens=4)
    assert out.object == "text_completion" and out.choices[0].text and out.usage.completion_tokens <= 4
    q = document[1][1]["question"]
    full = client.chat.completions.create(model=server["model"], messages=messages(document, q),
                                          extra_body={"kvcli": {"policy": "full"}})
    s = stats(full)
    assert s["policy"] == "full" and s["budget"] is None
    assert s["kv_cells"] == s["prompt_tokens"] and s["document_read_tokens"] == 0   # uncompressed, not re-read
    small = client.chat.completions.create(model=server["model"], messages=messages(document, q),
                                           extra_body={"kvcli": {"budget": 48, "policy_args": {"window": 16}}})
    assert stats(small)["budget"] == 48 and stats(small)["kv_cells"] < s["kv_cells"]


def test_two_clients_at_once(server, client, document):
    """Two requests in flight together are both answered, each as it is answered alone."""
    qs = [f["question"] for f in document[1]]
    alone = [client.chat.completions.create(model=server["model"], messages=messages(document, q))
             .choices[0].message.content for q in qs]
    together, errors = [None, None], []

    def ask(i):
        try:
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key=KEY, max_retries=0,
                              timeout=300)
            together[i] = c.chat.completions.create(model=server["model"], messages=messages(document, qs[i]))
        except Exception as e:   # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert [r.choices[0].message.content for r in together] == alone
    assert all(stats(r)["document_read_tokens"] == 0 for r in together)


def test_disconnect_mid_answer_stops_it(server, client, document):
    body = json.dumps({"model": server["model"], "messages": messages(document, "Write a long story."),
                       "stream": True, "max_tokens": 400}).encode()
    c = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=300)
    c.request("POST", "/v1/chat/completions", body=body, headers=auth())
    r = c.getresponse()
    assert r.status == 200
    seen = b""
    while seen.count(b"data: ") < 4:   # the role chunk and a few tokens
        seen += r.read1(4096)
    c.close()   # hang up mid-answer
    # the server goes on: the next request is answered, and the dropped one stopped well before its 400 tokens
    after = client.chat.completions.create(model=server["model"], messages=messages(document, "Say yes."),
                                           max_tokens=2)
    assert after.choices[0].message.content is not None
    alive(server)
    assert "client left" in server["log"].read_text()
    line = [ln for ln in chat_lines(server) if ln.endswith("cancelled")]
    assert line and int(line[-1].split(" generated")[0].rsplit(" ", 1)[1]) < 400


def test_resident_document_answers_later_questions_and_cites_on_request(server, client, document):
    """Later questions about a document share its resident cells (nothing restored, nothing read), each answered from
    a selection gathered for it; `kvcli.cite` adds the passages the answer came from, ranked, lines of the message."""
    q1, q2 = (f["question"] for f in document[1][:2])
    client.chat.completions.create(model=server["model"], messages=messages(document, q1))
    plain = client.chat.completions.create(model=server["model"], messages=messages(document, q2))
    s = stats(plain)
    assert s["document_read_tokens"] == 0 and s["resident_documents"] >= 1
    assert s["reselect_restore_s"] < 0.05 and "citations" not in plain.model_extra
    cited = client.chat.completions.create(model=server["model"], messages=messages(document, q2),
                                           extra_body={"kvcli": {"cite": True}})
    got = cited.model_extra["citations"]
    assert got and [c["rank"] for c in got] == list(range(1, len(got) + 1))
    assert all(c["quote"] and c["quote"] in document[0] for c in got)
    assert cited.choices[0].message.content == plain.choices[0].message.content
    alive(server)


def test_question_window_prefills_only_the_question(server, client, document):
    """A later question over a resident document prefills only the tokens it does not share with the stored ones,
    and snapkv's window is those (at most its 32); "window_from": "policy" cuts the stored entries back to prefill
    the whole window, as `kvcli run` would. ignore_eos (llama-server's field) runs the answer to max_tokens."""
    q1, q2 = (f["question"] for f in document[1][:2])
    client.chat.completions.create(model=server["model"], messages=messages(document, q1))
    short = client.chat.completions.create(model=server["model"], messages=messages(document, q2), max_tokens=12,
                                           extra_body={"ignore_eos": True})
    s = stats(short)
    assert s["document_read_tokens"] == 0 and 8 <= s["window"] < 32
    assert s["prefilled_tokens"] == s["window"] == s["prompt_tokens"] - s["prefix_reused_tokens"]
    assert short.usage.completion_tokens == 12 and short.choices[0].finish_reason == "length"
    whole = stats(client.chat.completions.create(model=server["model"], messages=messages(document, q2),
                                                 extra_body={"kvcli": {"window_from": "policy"}}))
    assert whole["window"] == 32 and whole["prefilled_tokens"] >= 32


def test_conversation_turn_restores_the_last_prompt(server, client, document):
    """The next turn of a conversation (its messages, the answer, a new question) restores the last prompt's full
    cache kept beside the document, not the document alone."""
    q1, q2 = (f["question"] for f in document[1])
    first = client.chat.completions.create(model=server["model"], messages=messages(document, q1))
    turn = messages(document, q1) + [{"role": "assistant", "content": first.choices[0].message.content},
                                     {"role": "user", "content": q2}]
    s = stats(client.chat.completions.create(model=server["model"], messages=turn))
    assert s["restored_from"] == "conversation" and s["document_read_tokens"] == 0
    assert s["prefix_reused_tokens"] > stats(first)["prompt_tokens"] - 40


def test_new_document_after_a_shared_system_prompt_is_stored(server, client):
    """A second document after the same long system prompt restores the system prompt and becomes a store of its
    own (it prefilled more than NEW_STORE_MIN tokens), which its next question restores."""
    from kvcli.evaluation.logbook import make_document
    system = {"role": "system", "content": "You answer questions about station logbooks. " * 12}
    docs = [make_document(220, facts=1, seed=s) for s in (11, 12)]

    def ask(i):
        text, planted = docs[i]
        return stats(client.chat.completions.create(model=server["model"], messages=[
            system, {"role": "user", "content": f"{text}\n\n{planted[0]['question']}"}]))

    first = ask(0)
    assert first["document_read_tokens"] > 300
    other = ask(1)   # the system prompt restored from the first document's store, the new document prefilled
    assert other["document_read_tokens"] == 0 and 64 <= other["prefix_reused_tokens"] < 200
    assert other["new_store_tokens"] == other["prompt_tokens"]
    assert other["store_entries"] == first["store_entries"] + 1
    again = ask(1)
    assert again["document_read_tokens"] == 0 and again["prefilled_tokens"] < 64


def test_column_sum_policy_per_request(server, client, document):
    """h2o scores by the column sums of every query, which cannot be cut back to a shorter prefix, and which the
    stores read for snapkv lack: its first question reads again the prefix the prompt shares with them, up to the
    line break before the question, with the sums; every later question about the document restores that whole."""
    qs = [f["question"] for f in document[1]] + ["What was the weather on day 1?"]
    h2o = {"kvcli": {"policy": "h2o", "budget": 64}}
    s = [stats(client.chat.completions.create(model=server["model"], messages=messages(document, q), extra_body=h2o))
         for q in qs]
    assert all(x["policy"] == "h2o" for x in s)
    assert 300 < s[0]["document_read_tokens"] < s[0]["prompt_tokens"] - 8 and s[0]["prefilled_tokens"] < 40
    for later in s[1:]:
        assert later["document_read_tokens"] == 0 and later["prefix_reused_tokens"] == s[0]["document_read_tokens"]


def chat_lines(server) -> list[str]:
    return [ln for ln in server["log"].read_text().splitlines() if ln.startswith("chat:")]


def test_disconnect_without_streaming_stops_it(server, document):
    """A client that leaves mid-answer stops the generation at a token. A client that left before its request's
    turn (a loaded machine: tokenizing, waiting for the model), or an answer done before the server saw the client
    leave (a fast one, or one whose room in the module's shared context ran out first), tests nothing: tried again,
    leaving sooner or later."""
    # ignore_eos: the answer runs to the context's end unless stopped
    body = json.dumps({"model": server["model"], "messages": messages(document, "Write a long story, please."),
                       "max_tokens": 4000, "ignore_eos": True}).encode()
    seen = []
    for wait in (1.0, 0.4, 0.25, 0.15, 2.0, 5.0):   # a fast answer can run out of room in 0.45 s
        before = len(chat_lines(server))
        c = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=wait)
        c.request("POST", "/v1/chat/completions", body=body, headers=auth())
        try:
            c.getresponse().read()
            seen.append(f"answered within {wait} s")
            continue
        except TimeoutError:
            c.close()   # gone before the answer: the server sees it (polled every quarter second), stops at a token
        deadline = time.time() + 60
        while len(chat_lines(server)) == before and time.time() < deadline:
            time.sleep(0.2)
        line = chat_lines(server)[before:][-1]
        seen.append(line)
        if line.endswith("cancelled"):
            generated = int(line.split(" generated")[0].rsplit(" ", 1)[1])
            assert generated < CTX - int(line.split(" prompt tokens")[0].rsplit(" ", 1)[1]) - 1, line
            break
        if line.endswith((", length", ", stop")):
            continue   # the answer was done before the server saw the client leave (its room in the context ran out)
        assert "client left before its turn" in line, line
    else:
        pytest.fail(f"never left mid-answer: {seen}")
    alive(server)


# ---------------------------------------------------------------------------------- refusals
def test_malformed_json(server):
    status, body = raw("POST", server["port"], "/v1/chat/completions", b'{"model": ', auth())
    assert status == 400 and body["error"]["code"] == "invalid_json" and body["error"]["message"]
    alive(server)


@pytest.mark.parametrize("change,param", [({"model": "no-such-model"}, "model"),
                                          ({"temperature": "hot"}, "temperature"),
                                          ({"max_tokens": 0}, "max_tokens"),
                                          ({"messages": []}, "messages"),
                                          ({"kvcli": {"policy": "no-such-policy"}}, "kvcli"),
                                          ({"kvcli": {"policy": "snapkv", "budget": -3}}, "kvcli"),
                                          ({"kvcli": {"window_from": "everything"}}, "kvcli"),
                                          ({"ignore_eos": "yes"}, "ignore_eos")])
def test_bad_parameter(server, change, param):
    body = {"model": server["model"], "messages": [{"role": "user", "content": "hi"}], **change}
    status, out = raw("POST", server["port"], "/v1/chat/completions", json.dumps(body).encode(), auth())
    assert status == 400 and out["error"]["param"] == param, out
    alive(server)


def test_bad_parameter_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert "unknown model" in str(e.value)


def test_prompt_too_long(server, client):
    """Past the context, what bounded reading cannot serve is refused, with the reason: `full` (it keeps every
    entry) and a column-sum policy (its sums are not replayed)."""
    long = "station log entry " * (CTX // 2)
    for kv, why in (({"policy": "full"}, "policy 'full'"), ({"policy": "h2o", "budget": 64}, "column sums")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": long}],
                                           extra_body={"kvcli": kv})
        assert e.value.status_code == 400 and e.value.body["code"] == "context_length_exceeded"
        assert "prompt too long" in str(e.value) and why in str(e.value)
    alive(server)


def test_a_quantised_server_refuses_bounded_reading(default_model, tmp_path):
    """A server whose cache is q8_0 does not read past its context in bounded chunks (that would quantise the kept
    keys again at every chunk: reselect_bounded.store_types): such a prompt is refused with the reason and the
    fix, and the server goes on."""
    args = ["--model", str(default_model), "--policy", "snapkv", "--budget", "64", "--api-key", KEY, "--ctx",
            str(CTX), "--max-tokens", "4", "--threads", "1", "--cache-type", "q8_0"]
    with serving(args, tmp_path / "server.log", {"KVCLI_CACHE": str(tmp_path / "kvcache")}) as (port, proc):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=300)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=default_model.stem, extra_body={"kvcli": {"policy": "snapkv"}},
                                      messages=[{"role": "user", "content": "station log entry " * (CTX // 2)}])
        assert e.value.body["code"] == "context_length_exceeded" and "--cache-type f16" in str(e.value)
        ok = c.chat.completions.create(model=default_model.stem, messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].message.content is not None and proc.poll() is None


def test_bounded_reading_past_the_context(server, client):
    """A prompt past the server's context with a window policy is served as kvcli chat serves a long document: its
    document part (up to the question) read once in bounded chunks and stored; another question about it streams the
    stored chunks, re-selected for it, without reading it."""
    from kvcli.evaluation.logbook import make_document
    text, planted = make_document(900, facts=2, seed=21)

    def ask(fact):
        return client.chat.completions.create(model=server["model"], max_tokens=8, messages=[
            {"role": "user", "content": f"{text}\n\n{fact['question']}"}])

    first = ask(planted[0])
    s1 = stats(first)
    assert s1["prompt_tokens"] > CTX and first.choices[0].message.content
    # the document up to its question: read in chunks, the answer decoded from the budget's entries
    assert CTX < s1["document_read_tokens"] < s1["prompt_tokens"] - 8 and s1["bounded_chunks"] >= 2
    assert s1["restored_from"] == "new store" and s1["kv_cells"] <= 2 * 64
    s2 = stats(ask(planted[1]))   # another question: the stored chunks streamed, only the question prefilled
    assert s2["document_read_tokens"] == 0 and s2["restored_from"] == "document"
    assert s2["prefix_reused_tokens"] >= s2["prompt_tokens"] - 64 and s2["prefilled_tokens"] <= 64
    assert s2["bounded_chunks"] == s1["bounded_chunks"] and s2["store_entries"] >= 1
    alive(server)


def test_api_key(server):
    body = json.dumps({"model": server["model"], "messages": [{"role": "user", "content": "hi"}]}).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, out = raw("POST", server["port"], "/v1/chat/completions", body,
                          {"Content-Type": "application/json", **headers})
        assert status == 401 and out["error"]["code"] == "invalid_api_key"
    assert raw("GET", server["port"], "/v1/models")[0] == 401
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    alive(server)


def test_body_over_the_limit(server):
    big = json.dumps({"model": server["model"], "messages": [{"role": "user", "content": "x" * BODY_LIMIT}]})
    status, out = raw("POST", server["port"], "/v1/chat/completions", big.encode(), auth())
    assert status == 413 and out["error"]["code"] == "request_too_large"
    alive(server)


def test_not_found_is_an_error_body(server):
    status, out = raw("GET", server["port"], "/v1/nothing", headers=auth())
    assert status == 404 and out["error"]["message"]


def test_port_in_use_and_bad_flags_are_one_line(cli_runner):
    from kvcli.cli import cli
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = cli_runner.invoke(cli, ["serve", "--port", str(s.getsockname()[1])])
    assert r.exit_code == 2 and r.output.strip().startswith("kvcli: error: cannot listen on 127.0.0.1:")
    assert len(r.output.strip().splitlines()) == 1
    r = cli_runner.invoke(cli, ["serve", "--policy", "snapkv"])
    assert r.exit_code == 2 and "needs --budget" in r.output
    r = cli_runner.invoke(cli, ["serve", "--store-max-bytes", "lots"])
    assert r.exit_code == 2 and "--store-max-bytes" in r.output


def test_memory_store_evicts_least_recently_used():
    from kvcli.apps.serve import MemoryStore
    from kvcli.drivers.reselect import StoredDocument

    def doc(first):
        return StoredDocument(tokens=[first, 1, 2, 3], split=4, nbytes=100, keep=False)

    store = MemoryStore(max_bytes=250)
    a, b, c = doc(10), doc(20), doc(30)
    store.add(a)
    store.add(b)
    assert store.best([20, 1, 2, 9]) == (b, 3) and store.best([99]) == (None, 0)
    store.touch(a)            # a used last: b is the least recently used
    store.add(c)
    assert a in store and c in store and b not in store
    assert store.stats()["store_entries"] == 2 and store.stats()["store_evicted"] == 1
    big = StoredDocument(tokens=[40], split=1, nbytes=400, keep=False)
    store.add(big)            # alone above the cap: nothing else stays, and neither does it
    assert store.stats()["store_entries"] == 0
