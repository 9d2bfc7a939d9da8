#!/usr/bin/env python3
"""Time to answer: kvcli against the tools a user would pick instead, on one prompt, alternating rounds.

    python benchmarks/time_to_answer.py [--tokens 4000] [--rounds 3] [--budget 256] [--max-tokens 24]
        [--threads N] [--tools kvcli-snapkv,kvcli-full,stock-full,kvpress-snapkv]
        [--kvpress-venv /work/kvpress-venv] [--stock-lib DIR] [--json-out benchmarks/results/time-to-answer.json]

Tools (each run in a fresh process per round; the order rotates from round to round):
- kvcli-snapkv: `kvcli run --policy snapkv --budget B --chunk 0` with kvpress's SnapKV parameters
  (window 64, kernel 5, avg pooling, mean over the GQA group), so both keep the same kind of set;
- kvcli-full: `kvcli run --policy full` (llama.cpp's own graph, flash attention, as kvcli runs it);
- stock-full: llama-cpp-python's own `Llama` class (its defaults: n_batch = n_ubatch = 512, flash attention
  off) on STOCK llama.cpp, the same commit built without kvcli's patches (benchmarks/build_stock_llama.py);
  greedy `Llama.generate` over the same prompt tokens;
- stock-full-fa: the same with flash attention on, as kvcli runs: kvcli-full against it is the cost of
  kvcli's patches and driver alone, stock-full against it the cost of the attention kernel choice;
- kvpress-snapkv: kvpress 0.5.5's SnapKVPress (window 64, kernel 5) on the same GGUF loaded by transformers
  (float32), in its own venv (benchmarks/setup_kvpress.sh): the press hooks compress the prompt during its
  prefill, then a greedy decode continues at the original positions, as kvpress's pipeline does. The
  compression ratio is chosen so that kvpress keeps exactly B entries per layer and KV head.

All tools get the same prompt tokens (the chat-templated logbook document + its question, tokenised by
kvcli) and the same thread count. Recorded per run: wall time of the process, load time, prefill /
compress / decode split as each tool reports or as timed around its calls, the answer, the 1-minute
load before and after; plus the machine. The kept sets of kvcli's and kvpress's snapkv are compared
once (untimed): per (layer, KV head) overlap of the kept positions.

The runners of the other tools are this same file (`--runner stock|kvpress SPEC.json`), importing only
the standard library at the top, so the kvpress venv never imports kvcli and kvcli never imports kvpress.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("kvcli-snapkv", "kvcli-full", "stock-full", "stock-full-fa", "kvpress-snapkv")
KVPRESS_SNAPKV = {"window": 64, "kernel": 5, "pool": "avg", "gqa": "mean"}   # SnapKVPress's defaults
TOKENS_PER_WORD = 1.376   # SmolLM2 on the logbook text (examples/make_docs.py)


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def emit(result: dict) -> None:
    """A runner's one line of JSON on stdout (the parent reads the last line)."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


# ------------------------------------------------------------------------------ runners (child processes)
def run_stock(spec: dict) -> None:
    """llama-cpp-python's Llama on the library LLAMA_CPP_LIB_PATH names (the parent sets it to stock llama.cpp)."""
    t0 = time.perf_counter()
    import llama_cpp  # noqa: PLC0415
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=len(spec["tokens"]) + spec["max_tokens"] + 16,
                          n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          flash_attn=spec.get("flash_attn", False), verbose=False)
    t1 = time.perf_counter()
    out, first_at = [], None
    for tok in llm.generate(spec["tokens"], temp=0.0, reset=True):
        if first_at is None:
            first_at = time.perf_counter()   # the prompt's prefill (and sampling its first token)
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
            break
        out.append(tok)
        if len(out) >= spec["max_tokens"]:
            break
    t2 = time.perf_counter()
    emit({"load_s": t1 - t0, "prefill_s": first_at - t1, "compress_s": 0.0, "decode_s": t2 - first_at,
          "generated_tokens": len(out), "answer": llm.detokenize(out).decode("utf-8", "replace"),
          "n_batch": llm.n_batch, "n_ubatch": llm.context_params.n_ubatch,
          "flash_attn": bool(llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED),
          "library": os.environ.get("LLAMA_CPP_LIB_PATH"), "system_info": llama_cpp.llama_print_system_info().decode()})


def run_kvpress(spec: dict) -> None:
    """kvpress's SnapKVPress on the GGUF loaded by transformers in float32 (runs in the kvpress venv)."""
    t0 = time.perf_counter()
    import torch  # noqa: PLC0415
    import kvpress  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: PLC0415
    torch.set_num_threads(spec["threads"])
    model_path = Path(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                 dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    n = len(spec["tokens"])
    ratio = spec["compression_ratio"]
    press = kvpress.SnapKVPress(compression_ratio=ratio, window_size=spec["window"], kernel_size=spec["kernel"])
    kept, compress_s = {}, [0.0]
    score, compress = press.score, press.compress

    def timed_compress(module, *a, **kw):
        t = time.perf_counter()
        r = compress(module, *a, **kw)
        compress_s[0] += time.perf_counter() - t
        return r

    def recorded_score(module, *a, **kw):
        s = score(module, *a, **kw)   # [batch, n_head_kv, n]; ScorerPress keeps the top int(n * (1 - ratio))
        kept[int(module.layer_idx)] = s[0].topk(int(n * (1 - ratio)), dim=-1).indices.sort(dim=-1).values.tolist()
        return s

    press.compress, press.score = timed_compress, recorded_score
    ids = torch.tensor([spec["tokens"]])
    t1 = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache()
        with press(model):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        t2 = time.perf_counter()
        out, eog = [], set(spec["eog"])
        nxt = int(logits.argmax())
        while nxt not in eog and len(out) < spec["max_tokens"]:
            out.append(nxt)
            if len(out) == spec["max_tokens"]:
                break
            pos = torch.tensor([[n + len(out) - 1]])   # the original positions, as kvpress's pipeline continues
            logits = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, position_ids=pos,
                           use_cache=True, logits_to_keep=1).logits[0, -1]
            nxt = int(logits.argmax())
        t3 = time.perf_counter()
    import transformers  # noqa: PLC0415
    emit({"load_s": t1 - t0, "prefill_s": t2 - t1 - compress_s[0], "compress_s": compress_s[0], "decode_s": t3 - t2,
          "generated_tokens": len(out), "answer": tok.decode(out), "cache_entries": int(cache.get_seq_length()),
          "kept": [kept[l] for l in sorted(kept)] if spec.get("record_kept") else None,
          "versions": {"kvpress": spec.get("kvpress_version", "0.5.5"), "torch": torch.__version__,
                       "transformers": transformers.__version__}})


RUNNERS = {"stock": run_stock, "kvpress": run_kvpress}


# ------------------------------------------------------------------------------ the parent
def make_prompt(n_tokens: int, seed: int, model: Path | None = None):
    """The logbook document, its question, the model, and the chat-templated prompt's tokens (kvcli's)."""
    sys.path.insert(0, str(ROOT))
    from kvcli.evaluation.logbook import make_document  # noqa: PLC0415
    from kvcli.models import default_model_path  # noqa: PLC0415
    from kvcli.native.session import NativeSession  # noqa: PLC0415
    from kvcli.templating import build_prompt  # noqa: PLC0415
    model = model or default_model_path()
    s = NativeSession(model, n_ctx=0)
    words = max(50, round((n_tokens - 60) / TOKENS_PER_WORD))
    text, planted = make_document(words, facts=1, seed=seed)
    question = planted[0]["question"]
    tokens = s.tokenize(build_prompt(s, text, question))
    eog = [t for t in range(s.n_vocab) if s.is_eog(t)]
    s.close()
    return model, text, question, planted[0].get("answer"), tokens, eog


def compression_ratio(n: int, kept: int) -> float:
    """A ratio for which kvpress's int(n * (1 - ratio)) is exactly `kept`."""
    r = 1.0 - (kept + 0.5) / n
    if int(n * (1 - r)) != kept:
        raise SystemExit(f"no compression ratio keeps exactly {kept} of {n} entries")
    return r


def run_child(cmd: list[str], env: dict | None = None) -> tuple[dict, float]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1]), wall


def kvcli_cmd(a, doc: Path, question: str, policy: str) -> list[str]:
    cmd = [sys.executable, "-m", "kvcli.cli", "run", question, "--doc", str(doc), "--model", str(a.model),
           "--policy", policy,
           "--max-tokens", str(a.max_tokens), "--chunk", "0", "--threads", str(a.threads), "--json", "--quiet"]
    if policy != "full":
        cmd += ["--budget", str(a.budget)]
        cmd += [x for k, v in KVPRESS_SNAPKV.items() for x in ("--policy-arg", f"{k}={v}")]
    return cmd


def one_run(tool: str, a, doc: Path, question: str, spec_path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if tool.startswith("kvcli"):
        r, wall = run_child(kvcli_cmd(a, doc, question, tool.split("-")[1]), env)
        s = r["stats"]
        rec = {k: s.get(k) for k in ("prefill_s", "compress_s", "decode_s", "generated_tokens", "kv_cells")}
        rec["answer"] = r["answer"]
    elif tool.startswith("stock"):
        env["LLAMA_CPP_LIB_PATH"] = str(a.stock_lib)
        env.pop("PYTHONPATH")
        rec, wall = run_child([sys.executable, __file__, "--runner", "stock", str(spec_path),
                               *(["--flash-attn"] if tool.endswith("-fa") else [])], env)
        if "KVCLI = 1" in rec["system_info"]:
            raise SystemExit(f"{a.stock_lib} is kvcli's patched llama.cpp, not the stock one")
    else:
        env.pop("PYTHONPATH")
        rec, wall = run_child([str(a.kvpress_venv / "bin" / "python"), __file__, "--runner", "kvpress",
                               str(spec_path)], env)
    rec["answer_s"] = round(sum(rec[k] or 0.0 for k in ("prefill_s", "compress_s", "decode_s")), 4)
    rec["process_wall_s"] = round(wall, 4)
    return rec


def kept_overlap(a, model, tokens: list[int], kvpress_kept: list) -> dict:
    """kvcli's snapkv plan (native planner, same parameters) against kvpress's kept positions."""
    import numpy as np  # noqa: PLC0415
    from kvcli.drivers.compress import prefill_and_compress, resolve  # noqa: PLC0415
    from kvcli.native.session import NativeSession  # noqa: PLC0415
    with NativeSession(model, n_ctx=len(tokens) + 16, n_threads=a.threads) as s:
        rep = prefill_and_compress(s, tokens, resolve(s.model_path, "snapkv", a.budget, dict(KVPRESS_SNAPKV)))
        ours = rep.plan.kept_lists()   # slots = positions: a fresh sequence
    shares = [len(np.intersect1d(ours[l][h], kvpress_kept[l][h])) / a.budget
              for l in range(len(ours)) for h in range(len(ours[l]))]
    return {"mean": round(float(np.mean(shares)), 4), "min": round(float(np.min(shares)), 4),
            "identical_heads": int(sum(x == 1.0 for x in shares)), "heads": len(shares)}


def summarise(runs: list[dict], tools: list[str]) -> dict:
    med = {}
    for t in tools:
        rs = [r for r in runs if r["tool"] == t]
        med[t] = {k: round(statistics.median(r[k] for r in rs), 4)
                  for k in ("answer_s", "prefill_s", "compress_s", "decode_s", "process_wall_s")}
    out = {"median": med}
    if {"kvcli-snapkv", "kvpress-snapkv"} <= set(tools):
        out["kvpress_over_kvcli_answer"] = round(med["kvpress-snapkv"]["answer_s"] / med["kvcli-snapkv"]["answer_s"], 3)
    if {"kvcli-snapkv", "stock-full"} <= set(tools):
        out["kvcli_snapkv_over_stock_answer"] = round(med["kvcli-snapkv"]["answer_s"]
                                                      / med["stock-full"]["answer_s"], 3)
        k, st = med["kvcli-snapkv"], med["stock-full"]
        out["kvcli_snapkv_prefill_compress_over_stock_prefill"] = round(
            (k["prefill_s"] + k["compress_s"]) / st["prefill_s"], 3)
    for ours, theirs in (("kvcli-full", "stock-full"), ("kvcli-full", "stock-full-fa"), ("stock-full",
                                                                                         "stock-full-fa")):
        if {ours, theirs} <= set(tools):
            out[f"{ours}_over_{theirs}_answer".replace("-", "_")] = round(
                med[ours]["answer_s"] / med[theirs]["answer_s"], 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runner", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    ap.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("--flash-attn", action="store_true", help=argparse.SUPPRESS)   # the stock runner's
    ap.add_argument("--tokens", type=int, default=4000, help="about this many prompt tokens (default 4000)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every tool (default: all "
                                                                             "cores)")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, from {', '.join(TOOLS)}")
    ap.add_argument("--seed", type=int, default=0, help="seed of the logbook document")
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the bundled SmolLM2-135M Q4_1)")
    ap.add_argument("--kvpress-venv", type=Path, default=Path(os.environ.get("KVPRESS_VENV", "/work/kvpress-venv")))
    ap.add_argument("--stock-lib", type=Path, default=None,
                    help="stock llama.cpp libraries (default: $KVCLI_CACHE/stock-lib, built by build_stock_llama.py)")
    ap.add_argument("--json-out", type=Path, default=ROOT / "benchmarks" / "results" / "time-to-answer.json")
    a = ap.parse_args(argv)
    if a.runner:
        RUNNERS[a.runner](json.loads(Path(a.spec).read_text()) | {"flash_attn": a.flash_attn})
        return 0

    tools = [t.strip() for t in a.tools.split(",") if t.strip()]
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        raise SystemExit(f"unknown tool(s) {', '.join(bad)}: choose from {', '.join(TOOLS)}")
    if any(t.startswith("stock") for t in tools):
        from kvcli.native.build import cache_dir  # noqa: PLC0415
        a.stock_lib = a.stock_lib or cache_dir() / "stock-lib"
        if not (a.stock_lib / "libllama.so").exists():
            raise SystemExit(f"no stock llama.cpp in {a.stock_lib}: run python benchmarks/build_stock_llama.py")
    if "kvpress-snapkv" in tools and not (a.kvpress_venv / "bin" / "python").exists():
        raise SystemExit(f"no kvpress venv at {a.kvpress_venv}: run bash benchmarks/setup_kvpress.sh {a.kvpress_venv}")

    from kvcli.evaluation.measure import machine  # noqa: PLC0415
    where = machine(a.threads)
    model, text, question, answer, tokens, eog = make_prompt(a.tokens, a.seed, a.model)
    a.model = model
    n = len(tokens)
    with tempfile.TemporaryDirectory(prefix="kvcli-tta-") as tmp:
        doc, spec_path = Path(tmp) / "doc.txt", Path(tmp) / "spec.json"
        doc.write_text(text)
        spec = {"model": str(model), "tokens": tokens, "eog": eog, "max_tokens": a.max_tokens, "threads": a.threads,
                "compression_ratio": compression_ratio(n, a.budget), "window": KVPRESS_SNAPKV["window"],
                "kernel": KVPRESS_SNAPKV["kernel"]}
        spec_path.write_text(json.dumps(spec))
        print(f"{n} prompt tokens, budget {a.budget}, {a.max_tokens} tokens, {a.threads} threads, "
              f"{a.rounds} rounds of {', '.join(tools)}", file=sys.stderr)
        runs = []
        for rnd in range(a.rounds):
            order = tools[rnd % len(tools):] + tools[:rnd % len(tools)]
            for tool in order:
                before = load_1m()
                rec = one_run(tool, a, doc, question, spec_path)
                rec.update(tool=tool, round=rnd, load_1m_before=before, load_1m_after=load_1m())
                runs.append(rec)
                print(f"round {rnd} {tool}: answer {rec['answer_s']:.2f} s (prefill {rec['prefill_s']:.2f}, "
                      f"compress {rec['compress_s']:.2f}, decode {rec['decode_s']:.2f}), process "
                      f"{rec['process_wall_s']:.2f} s, load {before}-{rec['load_1m_after']}", file=sys.stderr)
        overlap = None
        if {"kvcli-snapkv", "kvpress-snapkv"} <= set(tools):
            spec["record_kept"] = True
            spec_path.write_text(json.dumps(spec))
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            kv, _ = run_child([str(a.kvpress_venv / "bin" / "python"), __file__, "--runner", "kvpress",
                               str(spec_path)], env)
            overlap = kept_overlap(a, model, tokens, kv["kept"])
    result = {"machine": where, "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()
                       if k not in ("runner", "spec")},
              "prompt_tokens": n, "question": question, "expected_answer": answer,
              "kvpress_compression_ratio": spec["compression_ratio"], "snapkv_params": KVPRESS_SNAPKV,
              "kept_overlap_kvcli_vs_kvpress": overlap, "summary": summarise(runs, tools), "runs": runs}
    a.json_out.parent.mkdir(parents=True, exist_ok=True)
    a.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
