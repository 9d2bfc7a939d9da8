"""A fuzz harness for the command line: random valid and invalid combinations of every command's flags
and inputs, each run as a real `python -m kvcli.cli` process and classified by how it ended.

    ok           exit 0
    clean error  exit 2 with exactly one line on stderr, starting "kvcli: error:"
    internal     exit 1 ("internal error"), a traceback anywhere, or any other exit code / stderr shape
    crash        killed by a signal (segfault, abort, ...)
    hang         still running after the time limit (killed)

Cases come from a seeded generator (`make_cases(seed, n)`), so a seed names a run exactly. They run on a tiny
random GGUF (kvcli/testing/tiny_gguf.py), so each is short; inputs are documents (text, empty, binary,
non-UTF-8, missing, a directory), .kvc files (valid, truncated, random bytes), bad model files, policies
(every one and unknown ones), budgets, policy arguments, chunking, --max-cache, cache types and sampling
flags. benchmarks/fuzz.py is the command line; tests/fuzz/test_fuzz.py runs a few dozen cases in CI.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvcli import policies
from kvcli.testing.tiny_gguf import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ("ok", "clean error", "internal", "crash", "hang")

# each value list: (valid values, invalid values); an invalid one is drawn with probability BAD
BAD = 0.06
# every policy of the registry (kvcli/policies, the one list), and a name in capitals (names are case-insensitive)
POLICIES = ([*policies.available(), "SnapKV"], ["truncate", "bogus", ""])
BUDGETS = (["4", "8", "16", "24", "32", "48", "64", "128"], ["0", "-3", "abc", "2.5", "99999999999", "1"])
POLICY_ARGS = (["window=4", "window=8", "kernel=3", "kernel=1"],
               ["window=0", "window=abc", "kernel=2", "bogus=1", "window", "=3", "window=8;x"])
CHUNKS = (["0", "16", "32", "64"], ["1", "-1", "abc"])
MAX_CACHE = (["48", "96", "128"], ["16", "0", "x"])
CACHE_TYPES = (["f16", "q8_0", "q4_0", "f32"], ["q5_1", ""])
TEMPERATURES = (["0", "0.7", "1.5"], ["nan", "inf", "-1", "abc", "11"])
SEEDS = (["0", "1", "42", "4294967294"], ["-1", "4294967296"])
SAMPLING = [("--top-k", (["0", "5"], ["-2", "x"])), ("--top-p", (["0.5", "1"], ["1.5", "nan"])),
            ("--min-p", (["0", "0.1"], ["-0.1"])), ("--repeat-penalty", (["1", "1.1"], ["0", "-1", "nan"])),
            ("--repeat-last-n", (["-1", "0", "16"], ["-5"])), ("--presence-penalty", (["0", "0.5"], ["inf"])),
            ("--frequency-penalty", (["0", "0.5", "-0.5"], ["x"])), ("--dry-multiplier", (["0", "0.8"], ["-1", "nan"])),
            ("--dry-base", (["1.75", "1"], ["0.5"])), ("--dry-allowed-length", (["2", "5"], ["0"])),
            ("--dry-penalty-last-n", (["-1", "0", "32"], ["-7"]))]
MAX_TOKENS = (["2", "4", "6"], ["0", "-1", "x"])


def pick(rnd: random.Random, values: tuple) -> str:
    """A valid value, or (with probability BAD) an invalid one."""
    good, bad = values
    return rnd.choice(bad if rnd.random() < BAD else good)


@dataclass
class Fixtures:
    """Files the cases refer to by name ({doc}, {kvc:...}, ...), written once into `root`."""
    root: Path
    model: Path
    paths: dict = field(default_factory=dict)


def write_fixtures(root: Path) -> Fixtures:
    root.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(root / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ctx_train=512)
    fx = Fixtures(root, model)
    text = ("The ferry to Ashby leaves at nine. The harbour master is Ines Duarte. Parcels go on the lower deck. "
            "Tickets cost four euros; children travel free. ")
    files = {"doc": text * 3, "long": text * 30, "empty": "", "spaces": "   \n\n  ",
             "unicode": "Ünïcödé ☃ 中文 " * 20}
    for name, body in files.items():
        (root / f"{name}.txt").write_text(body, encoding="utf-8")
        fx.paths[name] = root / f"{name}.txt"
    (root / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 20)
    (root / "adir").mkdir(exist_ok=True)
    (root / "junk.kvc").write_bytes(bytes((i * 37) % 256 for i in range(4096)))
    (root / "empty.kvc").write_bytes(b"")
    (root / "bad.gguf").write_bytes(b"GGUF" + bytes(60))
    (root / "text.gguf").write_text("not a model")
    fx.paths.update(binary=root / "binary.bin", latin1=root / "latin1.txt", adir=root / "adir",
                    missing=root / "missing.txt", junk_kvc=root / "junk.kvc", empty_kvc=root / "empty.kvc",
                    bad_model=root / "bad.gguf", text_model=root / "text.gguf")
    good = root / "good.kvc"
    r = subprocess.run([sys.executable, "-m", "kvcli.cli", "compress", "--doc", str(fx.paths["doc"]), "-o", str(good),
                        "--policy", "snapkv", "--budget", "48", "--policy-arg", "window=8", "-q", "--force"],
                       cwd=ROOT, env=case_env(fx),
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"fuzz fixtures: compress failed: {r.stderr.strip()}")
    fx.paths["good_kvc"] = good
    raw = good.read_bytes()
    (root / "cut.kvc").write_bytes(raw[: len(raw) // 2])
    fx.paths["cut_kvc"] = root / "cut.kvc"
    return fx


def case_env(fx: Fixtures) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCLI_")}
    env.update(KVCLI_MODEL=str(fx.model), KVCLI_CONFIG=str(fx.root / "none.toml"), PYTHONPATH=str(ROOT),
               KVCLI_THREADS="1")
    (fx.root / "none.toml").write_text("")
    return env


@dataclass
class Case:
    index: int
    argv: list[str]
    stdin: str = ""

    def command(self) -> str:
        return " ".join(["kvcli", *(a if a and " " not in a else repr(a) for a in self.argv)])


def _doc(rnd: random.Random, fx: Fixtures) -> str:
    return str(fx.paths[pick(rnd, (["doc"] * 4 + ["long", "unicode"], ["empty", "spaces", "binary", "latin1",
                                                                        "adir", "missing"]))])


def _kvc(rnd: random.Random, fx: Fixtures) -> str:
    return str(fx.paths[pick(rnd, (["good_kvc"], ["cut_kvc", "junk_kvc", "empty_kvc", "missing", "adir"]))])


def _maybe(rnd, p, *items):
    return list(items) if rnd.random() < p else []


def _compression(rnd: random.Random) -> list[str]:
    out = ["--policy", pick(rnd, POLICIES)] if rnd.random() < 0.9 else []
    out += _maybe(rnd, 0.85, "--budget", pick(rnd, BUDGETS))
    for _ in range(rnd.choice([0, 0, 0, 0, 1, 1, 2])):
        out += ["--policy-arg", pick(rnd, POLICY_ARGS)]
    out += _maybe(rnd, 0.3, "--chunk", pick(rnd, CHUNKS))
    out += _maybe(rnd, 0.15, "--max-cache", pick(rnd, MAX_CACHE))
    out += _maybe(rnd, 0.1, "--chunk-scoring", pick(rnd, (["question", "chunk"], ["bogus"])))
    out += _maybe(rnd, 0.25, "--cache-type", pick(rnd, CACHE_TYPES))
    return out


def _sampling(rnd: random.Random) -> list[str]:
    out = ["-n", pick(rnd, MAX_TOKENS)]
    out += _maybe(rnd, 0.3, "--temperature", pick(rnd, TEMPERATURES))
    out += _maybe(rnd, 0.2, "--seed", pick(rnd, SEEDS))
    for flag, values in rnd.sample(SAMPLING, rnd.choice([0, 0, 1, 2])):
        out += [flag, pick(rnd, values)]
    return out


def _model(rnd: random.Random, fx: Fixtures) -> list[str]:
    r = rnd.random()
    if r < 0.04:
        return ["--model", str(fx.paths[rnd.choice(["bad_model", "text_model", "missing", "adir"])])]
    return []


def make_case(rnd: random.Random, fx: Fixtures, index: int) -> Case:
    cmd = rnd.choices(["run", "chat", "compress", "bench", "eval", "policies", "info", "junk"],
                      weights=[40, 18, 14, 5, 5, 4, 3, 3])[0]
    q = pick(rnd, (["Who is the harbour master?", "When does the ferry leave?", "x" * 300], ["", "   "]))
    if cmd == "run":
        argv = ["run", q, *_model(rnd, fx), *_sampling(rnd)]
        stdin = ""
        if rnd.random() < 0.15:
            argv += ["--cache", _kvc(rnd, fx)]
            if rnd.random() < 0.3:
                argv += ["--policy", pick(rnd, POLICIES)]
        else:
            argv += _compression(rnd)
            if rnd.random() < 0.8:
                argv += ["--doc", _doc(rnd, fx)]
            else:
                stdin = rnd.choice(["Ferries leave at nine.", "", "\x00\x01 binary"])
        argv += _maybe(rnd, 0.5, "--json") + _maybe(rnd, 0.5, "-q")
        argv += _maybe(rnd, 0.05, "--engine", rnd.choice(["native", "bogus"]))
        argv += _maybe(rnd, 0.05, "--out", str(fx.paths[rnd.choice(["adir", "missing"])]) + rnd.choice(["", "/x/y"]))
        return Case(index, argv, stdin)
    if cmd == "chat":
        argv = ["chat", *_model(rnd, fx), *_sampling(rnd)]
        if rnd.random() < 0.2:
            argv += ["--cache", _kvc(rnd, fx)]
        else:
            argv += ["--doc", _doc(rnd, fx), *_compression(rnd)]
        lines = rnd.sample(["Who is the harbour master?", "/stats", "/help", "/policy bogus", "/budget -3",
                            "/reset", "/bogus", "How much is a ticket?", "/save " + str(fx.paths["adir"])],
                           rnd.choice([1, 2, 3]))
        return Case(index, argv + _maybe(rnd, 0.3, "--json") + _maybe(rnd, 0.5, "-q"), "\n".join(lines) + "\n")
    if cmd == "compress":
        out = fx.root / f"out-{index}.kvc"
        target = rnd.choice([str(out)] * 6 + [str(fx.paths["adir"]), str(fx.paths["missing"]) + "/x.kvc",
                                               str(fx.paths["good_kvc"])])
        argv = ["compress", "-o", target, *_model(rnd, fx), *_compression(rnd), "--doc", _doc(rnd, fx)]
        argv += _maybe(rnd, 0.3, "--question", q) + _maybe(rnd, 0.5, "-q") + _maybe(rnd, 0.3, "--json")
        return Case(index, argv)
    if cmd == "bench":
        pols = ",".join(rnd.sample(POLICIES[0][:6], 2)) if rnd.random() < 0.9 else "bogus,,"
        argv = ["bench", "--docs", _doc(rnd, fx), "--policies", pols,
                "--budgets", pick(rnd, (["16,32", "32"], ["", "x", "0"])),
                "--gen", pick(rnd, (["2"], ["0"])),
                "--repeat", "1", "-q"]
        argv += _maybe(rnd, 0.3, "--cache-type", pick(rnd, (["f16", "q8_0", "f16,q4_0"], ["zz"])))
        argv += _maybe(rnd, 0.2, "--policy-arg", pick(rnd, (["snapkv.window=4"], ["snapkv", "x.y=1"])))
        argv += _maybe(rnd, 0.2, "--chunk", pick(rnd, CHUNKS))
        return Case(index, argv)
    if cmd == "eval":
        argv = ["eval", "niah", "--policies", pick(rnd, (["full,snapkv", "snapkv"], ["bogus", "truncate"])),
                "--budgets", pick(rnd, (["32", "16,64"], ["-1", ""])),
                "--lengths", pick(rnd, (["128", "256"], ["0", "z"])),
                "--depths", pick(rnd, (["0.5", "0.1,0.9"], ["2", "x"])), "--samples", "1", "-q"]
        return Case(index, argv + _maybe(rnd, 0.2, "--chunk", pick(rnd, (["64"], ["1", "-1", "abc"]))))
    if cmd == "policies":
        return Case(index, ["policies", *_maybe(rnd, 0.7, "--explain", pick(rnd, POLICIES)),
                            *_maybe(rnd, 0.3, "--json")])
    if cmd == "info":
        return Case(index, ["info", *([str(fx.paths[rnd.choice(["bad_model", "text_model", "missing"])])]
                                     if rnd.random() < 0.5 else []), *_maybe(rnd, 0.5, "--json")])
    return Case(index, rnd.choice([["bogus"], ["run"], ["run", "--bogus", "x"], ["chat", "-n"], ["--budget", "3"],
                                   ["run", "x", "--policy-arg"], ["eval", "niah", "--samples", "0"]]))


def make_cases(seed: int, n: int, fx: Fixtures) -> list[Case]:
    rnd = random.Random(seed)
    return [make_case(rnd, fx, i) for i in range(n)]


@dataclass
class Outcome:
    case: Case
    cls: str
    returncode: int | None
    seconds: float
    stderr_tail: str


def classify(returncode: int | None, stderr: str) -> str:
    if returncode is None:
        return "hang"
    if returncode < 0:
        return "crash"
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    if "Traceback (most recent call last)" in stderr:
        return "internal"
    if returncode == 0:
        return "ok"
    if returncode == 2 and lines and lines[-1].startswith("kvcli: error:") and \
            sum(ln.startswith("kvcli: error:") for ln in lines) == 1 and not lines[-1].count("\n"):
        return "clean error"
    return "internal"


def run_case(case: Case, fx: Fixtures, timeout: float) -> Outcome:
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "kvcli.cli", *case.argv], cwd=ROOT, env=case_env(fx),
                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         errors="replace", start_new_session=True)
    try:
        _, err = p.communicate(case.stdin, timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        rc = None
    return Outcome(case, classify(rc, err), rc, time.monotonic() - t0, err[-600:])


def run(seed: int, n: int, workdir: Path, timeout: float = 60.0, log=None, jobs: int = 1, jsonl=None) -> dict:
    """Run n cases from `seed` (`jobs` at a time); returns the report (counts per class, the failures in
    full). `jsonl`: a file that gets one line per finished case, so an interrupted long run keeps its results."""
    fx = write_fixtures(workdir)
    outcomes = []
    sink = open(jsonl, "a", encoding="utf-8") if jsonl else None
    try:
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            for o in pool.map(lambda c: run_case(c, fx, timeout), make_cases(seed, n, fx)):
                outcomes.append(o)
                if sink:
                    sink.write(json.dumps({"index": o.case.index, "class": o.cls, "returncode": o.returncode,
                                           "seconds": round(o.seconds, 2), "command": o.case.command(),
                                           "stderr": o.stderr_tail[-300:]}) + "\n")
                    sink.flush()
                if log:
                    log(f"[{o.case.index + 1}/{n}] {o.cls:<11} {o.seconds:5.1f}s  {o.case.command()[:150]}")
    finally:
        if sink:
            sink.close()
    counts = Counter(o.cls for o in outcomes)
    bad = [o for o in outcomes if o.cls in ("internal", "crash", "hang")]
    clean = [o for o in outcomes if o.cls == "clean error"]
    return {"seed": seed, "cases": n, "timeout_s": timeout, "counts": {c: counts.get(c, 0) for c in CLASSES},
            "clean_error_samples": sorted({o.stderr_tail.strip().splitlines()[-1][:160] for o in clean})[:40],
            "failures": [{"command": o.case.command(), "stdin": o.case.stdin, "class": o.cls,
                          "returncode": o.returncode, "stderr": o.stderr_tail} for o in bad]}


def format_report(r: dict) -> str:
    c = r["counts"]
    lines = [f"fuzz: {r['cases']} cases, seed {r['seed']}, timeout {r['timeout_s']:g}s: "
             + ", ".join(f"{c[k]} {k}" for k in CLASSES)]
    for f in r["failures"]:
        lines.append(f"  {f['class'].upper()} (exit {f['returncode']}): {f['command']}")
        lines.append("    " + f["stderr"].strip().replace("\n", "\n    ")[-400:])
    return "\n".join(lines)


def dump(r: dict, path) -> None:
    Path(path).write_text(json.dumps(r, indent=1), encoding="utf-8")
