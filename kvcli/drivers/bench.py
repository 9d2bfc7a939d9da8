"""`kvcli bench`: speed, memory and quality of every policy x budget x cache type, measured.

For each document and configuration, in a fresh native session sized for that document:

1. prefill + compress through the one compression driver (`kvcli.drivers.compress`: `prefill_and_compress`, or
   `Shared` for configurations that share a prefill): prefill tok/s, compression time and its share of
   prefill + compression;
2. KV cells and bytes read from the live cache (`session.stats`), never computed from the budget;
3. decode of exactly `gen` tokens, teacher-forced on the full-cache (f16) greedy continuation, so
   every configuration decodes the same tokens: decode tok/s (median of `repeat` runs, min-max; the
   generated tokens are removed from the cache between runs), greedy agreement (share of steps whose
   argmax equals the full cache's token) and mean next-token KL(full || this) over those steps;
4. peak memory of the configuration as a user would pay it: `kvcli run` of the same document, instruction,
   policy, budget, cache type, chunking and `gen` tokens in a fresh child process, whose own peak RSS (from
   the OS) and allocated KV buffer are reported (`peak_rss_bytes`, `kv_bytes_allocated`), so no row shows a
   saving the process does not have; next to the cells held (`kv_bytes`, as wide as the widest layer), the
   bytes of the live entries alone (`kv_bytes_live`, what a ragged per-layer layout would hold) and the
   budget's own (`kv_bytes_budget`: budget x the bytes of one cell).

Decoding continues past an end-of-generation token, so every configuration decodes exactly `gen`.

Batch throughput at equal memory: a context of `ctx` cells and up to `batch` sequences; the
compressed (or full) state of each document, saved after step 1, is loaded into sequence after
sequence while it fits (its measured cells + `gen` cells to decode into, for every held sequence);
then all held sequences decode `gen` tokens together, one `llama_decode` per step. Loading saved
states is how `kvcli compress -o` + `kvcli chat --cache` work; it also spares re-prefilling.

The full f16 cache is always measured first: it is the baseline every quality figure refers to.
A policy or cache type that cannot run is reported with the reason, never left out.
"""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import kvcli
from kvcli import doc_formats, policies
from kvcli.drivers.lockstep import Lockstep
from kvcli.drivers.chunked import plan_chunking
from kvcli.drivers.compress import Shared, prefill_and_compress, resolve
from kvcli.documents import read_document
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import kl, log_softmax, machine, spread
from kvcli.evaluation.report import write_text
from kvcli.models import read_model_info
from kvcli.engines import SeqSnapshot, cache_state, open_native

BENCH_INSTRUCTION = "Summarise the document above in three sentences."
DOC_SUFFIXES = (".txt", ".md", ".text", ".rst", ".pdf", ".epub", ".docx", ".html", ".htm")
CTX_PAD = 256


@dataclass(frozen=True)
class Config:
    policy: str
    budget: int | None
    cache_type: str

    @property
    def label(self) -> str:
        b = "" if self.budget is None else f"@{self.budget}"
        return f"{self.policy}{b}/{self.cache_type}"


@dataclass
class Doc:
    name: str
    text: str
    tokens: list[int] = field(default_factory=list, repr=False)


@dataclass
class Reference:
    """The full f16 cache's greedy continuation of a document and its log-probabilities."""
    tokens: list[int]
    logp: list[np.ndarray]          # log-softmax before each generated token (len == len(tokens))


def load_docs(paths) -> list[Doc]:
    """Files, or directories (their *.txt/*.md files, sorted), read with kvcli's document checks."""
    out = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in DOC_SUFFIXES)
            if not files:
                raise KvcliError(f"{p} holds no document (*{', *'.join(DOC_SUFFIXES)})")
            out += [Doc(f.name, read_document(str(f))) for f in files]
        else:
            out.append(Doc(path.name, read_document(str(path))))
    if not out:
        raise KvcliError("no document: pass --docs FILE[,FILE...] or a directory")
    return out


def configs(policies: list[str], budgets: list[int], cache_types: list[str]) -> list[Config]:
    """The baseline (full f16) first, then every cache type x policy x budget."""
    out = [Config("full", None, "f16")]
    for ct in cache_types:
        for p in policies:
            for b in ([None] if p == "full" else budgets):
                c = Config(p, b, ct)
                if c not in out:
                    out.append(c)
    return out


def availability(policy: str) -> str | None:
    """None when the native engine can run `policy`, else why not (reported in the results)."""
    try:
        spec = policies.get(policy)
    except KvcliError:
        return f"not available: no policy '{policy}' in this kvcli (kvcli policies lists them)"
    if not spec.native:
        return f"not available: '{policy}' has no native (llama.cpp) implementation yet"
    return None


def cache_type_problem(cache_type: str, model_path) -> str | None:
    """llama.cpp quantises K/V rows per head in blocks: a head_dim that is not a multiple of the block
    cannot use that cache type (llama.cpp would refuse the context)."""
    import gguf  # noqa: PLC0415
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[cache_type.upper()]][0]
    hd = read_model_info(model_path).head_dim
    if hd % block:
        return f"not available: cache type {cache_type} needs head_dim a multiple of {block} (this model: {hd})"
    return None


def context_cells(n_prompt: int, gen: int, n_ctx_train: int, compressions=()) -> int:
    """Cells for a prompt and its `gen` tokens; with one of `compressions` (the configurations' resolved
    Compressions) whose policy has a second pass after the prompt (`PolicySpec.room_after`, with its defaults), room
    for that pass instead when that is more."""
    gen = max([gen] + [c.spec.room_after(n_prompt) for c in compressions])
    need = n_prompt + gen + 1
    return min(-(-need // CTX_PAD) * CTX_PAD, max(n_ctx_train, need))


class Bench:
    """One benchmark run; `run()` returns the JSON-ready result dict."""

    def __init__(self, model_path, docs: list[Doc], policies: list[str], budgets: list[int],
                 cache_types: list[str], *, gen: int = 32, repeat: int = 3, batch: int = 0, ctx: int | None = None,
                 policy_args: dict | None = None, instruction: str = BENCH_INSTRUCTION, threads: int | None = None,
                 share_prefill: bool = True, log=None, chunk: int | None = None, chunk_scoring: str = "question"):
        if gen < 1:
            raise KvcliError("--gen must be >= 1")
        if repeat < 1:
            raise KvcliError("--repeat must be >= 1")
        if batch < 0:
            raise KvcliError("--batch must be >= 0")
        self.model_path = str(model_path)
        self.docs = docs
        self.policies = policies
        self.budgets = budgets
        self.cache_types = cache_types
        self.gen, self.repeat, self.batch = gen, repeat, batch
        self.ctx = ctx
        self.policy_args = policy_args or {}
        self.instruction = instruction
        self.threads = threads
        if chunk and batch:
            raise KvcliError("--batch measures caches of whole prefills: it does not combine with --chunk")
        self.chunk = chunk or None   # chunked prefill (kvcli/drivers/chunked.py): every configuration reads alone
        self.chunk_scoring = chunk_scoring
        self.share_prefill = share_prefill and not self.chunk
        self.log = log or (lambda msg: None)
        self.refs: dict[str, Reference] = {}
        self.states: dict[tuple, dict] = {}   # (config, doc) -> saved state file + what restoring it needs
        self._state_dir = None
        self.resolved: dict[tuple, object] = {}   # (policy, budget) -> its Compression, resolved once
        self.unread: dict[str, str] = {}   # doc name -> its reads, said before the first (`_announce`)
        for p in policies:  # a bad --policy-arg or budget is an input error, before any measuring
            if availability(p) is None:
                for b in budgets:
                    self.compression(p, b)

    def compression(self, policy: str, budget: int | None):
        """The configuration's Compression (kvcli.planning.planner.resolve), resolved once and reused."""
        if (policy, budget) not in self.resolved:
            self.resolved[(policy, budget)] = resolve(self.model_path, policy, budget,
                                                      self.policy_args.get(policy, {}))
        return self.resolved[(policy, budget)]

    # -------------------------------------------------------------------------- sessions
    def _session(self, cache_type: str, n_ctx: int, n_seq: int = 1):
        return open_native(self.model_path, n_ctx=n_ctx, n_seq=n_seq, cache_type=cache_type, flash_attn=True,
                           n_threads=self.threads)

    def _tokenize(self) -> int:
        """Template and tokenise every document once; returns the model's training context."""
        s = self._session("f16", n_ctx=0)
        try:
            for d in self.docs:
                prompt = s.apply_chat_template([{"role": "user",
                                                 "content": f"{d.text.strip()}\n\n{self.instruction}"}])
                d.tokens = s.tokenize(prompt)
                if len(d.tokens) + self.gen >= s.n_ctx_train and not self.chunk:
                    raise KvcliError(f"{d.name}: {len(d.tokens)} prompt tokens + {self.gen} generated exceed the "
                                     f"model's context ({s.n_ctx_train}): read it in chunks with --chunk N")
            return s.n_ctx_train
        finally:
            s.close()

    def _announce(self, session, doc: Doc, chunk: int | None) -> str:
        """Before a document's first read: a long read says its token count and estimated time (doc_formats
        .announce_read, one line on stderr, as kvcli run says it; a probe may be prefilled in the session's empty
        sequence 0). Returns the key the read's measured speed is recorded under."""
        form = "chunked" if chunk else "prefill"
        reads = self.unread.pop(doc.name, None)
        if reads is None:
            return doc_formats.speed_key(session, form)
        how = f"in chunks of {chunk}" if chunk else "in one prefill"
        return doc_formats.announce_read(session, doc.tokens, form, f"reading it {how} ({reads})", probe_seq=0)

    # -------------------------------------------------------------------------- one configuration
    def measure(self, cfg: Config, doc: Doc, n_ctx_train: int) -> dict:
        row = {"doc": doc.name, "policy": cfg.policy, "budget": cfg.budget, "cache_type": cfg.cache_type,
               "config": cfg.label, "prompt_tokens": len(doc.tokens), "gen_tokens": self.gen}
        why = availability(cfg.policy) or cache_type_problem(cfg.cache_type, self.model_path)
        if why:
            row["status"] = why
            return row
        n = len(doc.tokens)
        chunking = None
        try:
            comp = self.compression(cfg.policy, cfg.budget)
            if self.chunk:
                chunking = plan_chunking(n, self.gen + 1, n_ctx_train, comp,
                                         None if cfg.policy == "full" else self.chunk,
                                         cell_bytes=read_model_info(self.model_path).cell_bytes(cfg.cache_type))
            session = self._session(cfg.cache_type, chunking.n_ctx if chunking else
                                    context_cells(n, self.gen, n_ctx_train, (comp,)))
        except KvcliError as e:
            row["status"] = f"error: {e}"
            return row
        try:
            key = self._announce(session, doc, chunking.chunk if chunking else None)
            rep = prefill_and_compress(session, doc.tokens, comp, seq=0,
                                       chunk=chunking.chunk if chunking else None,
                                       cap=chunking.cap if chunking else None, scoring=self.chunk_scoring)
            doc_formats.record_read_speed(key, n, rep.prefill_s + rep.compress_s)   # as kvcli run records it
            first = session.logits(0)
            row.update({
                "prefill_s": rep.prefill_s, "prefill_tok_s": n / rep.prefill_s if rep.prefill_s > 0 else None,
                "compress_s": rep.compress_s,
                "compress_share": rep.compress_s / (rep.prefill_s + rep.compress_s),
                **self._cache_figures(session, cfg), **rep.as_stats(),
            })
            if rep.note:
                row["note"] = rep.note
            self._decode_and_score(session, row, cfg, doc, first)
            row["status"] = "ok"
        except Exception as e:  # a bug below kvcli bench: reported on its row, the other rows still run
            row["status"] = _status(e)
        finally:
            session.close()
        return row

    def _cache_figures(self, session, cfg: Config) -> dict:
        """Cells and bytes of sequence 0, measured from the live cache, and the budget's bytes."""
        st = session.stats(0)
        return {"kv_cells": st["kv_cells"], "kv_bytes": st["kv_bytes"], "kv_bytes_full": st["kv_bytes_full"],
                "kv_bytes_live": st["kv_bytes_live"], "per_layer_cells": st["per_layer_cells"],
                "kv_bytes_budget": None if cfg.budget is None else cfg.budget * session.bytes_per_cell()}

    def _decode_and_score(self, session, row: dict, cfg: Config, doc: Doc, first) -> None:
        """Decode repeats, quality against the baseline, and (for --batch) the saved state."""
        n = len(doc.tokens)
        ref = self.refs.get(doc.name)
        tok_s, logps = [], None
        for r in range(self.repeat):
            forced = None if ref is None else ref.tokens
            toks, lp, dt = _decode(session, first, self.gen, forced)
            tok_s.append(self.gen / dt)
            if r == 0:
                logps, gen_tokens = lp, toks
            session.rollback(0, self.gen)
        if ref is None and cfg.label == Config("full", None, "f16").label:
            ref = self.refs[doc.name] = Reference(gen_tokens, logps)  # the baseline's greedy continuation
        d = spread(tok_s)
        row.update({"decode_tok_s": d["median"], "decode_tok_s_min": d["min"], "decode_tok_s_max": d["max"],
                    "decode_repeats": d["n"]})
        if ref is None:  # the full cache could not run (a document read in chunks): nothing to compare with
            row.update(agreement=None, kl_mean=None, quality_note="no full-cache baseline for this document")
        else:
            agree = [int(np.argmax(lp)) == t for lp, t in zip(logps, ref.tokens)]
            row["agreement"] = float(np.mean(agree))
            row["kl_mean"] = float(np.mean([kl(a, b) for a, b in zip(ref.logp, logps)]))
        if self.batch:  # saved to a file, to be loaded by the batch test
            self.states[(cfg, doc.name)] = {"path": self._save_state(session, cfg, doc), "next_pos": n,
                                            "first": int(np.argmax(first)), "prompt_tokens": n}

    def measure_shared(self, cfgs: list[Config], doc: Doc, n_ctx_train: int) -> list[dict]:
        """Configurations of one cache type that observe the same way share one prefill, timed once:
        budgets never change the prefill. Each then restores the prefilled state, plans, applies its
        plan (timed as its compression; kvcli.drivers.compress.Shared), decodes and is scored exactly as in
        `measure`."""
        n = len(doc.tokens)
        rows, groups = {}, {}
        for cfg in cfgs:
            row = {"doc": doc.name, "policy": cfg.policy, "budget": cfg.budget, "cache_type": cfg.cache_type,
                   "config": cfg.label, "prompt_tokens": n, "gen_tokens": self.gen}
            rows[cfg] = row
            why = availability(cfg.policy) or cache_type_problem(cfg.cache_type, self.model_path)
            if why:
                row["status"] = why
                continue
            comp = self.compression(cfg.policy, cfg.budget)
            if comp.fit_note(n):
                row["note"] = comp.fit_note(n)
            kinds, w = comp.observe if comp.compresses(n) else ((), 0)   # no observation: full's prefill
            groups.setdefault((cfg.cache_type, tuple(sorted(kinds)), w), []).append((cfg, comp))
        self.unread[doc.name] = _reads(len(groups), "one per cache type and observation")
        for (ct, kinds, w), members in groups.items():
            self.log(f"{doc.name} ({n} tokens): prefill on {ct}" + (f", observing {'+'.join(kinds)}"
                                                                   f"{f' (window {w})' if w else ''}" if kinds else "")
                     + f" for {', '.join(c.label for c, _ in members)}")
            self._run_group(members, doc, n_ctx_train, ct, rows)
        return [rows[c] for c in cfgs]

    def _run_group(self, members, doc, n_ctx_train, ct, rows) -> None:
        n = len(doc.tokens)
        try:
            session = self._session(ct, context_cells(n, self.gen, n_ctx_train, [comp for _, comp in members]))
        except KvcliError as e:
            for cfg, _ in members:
                rows[cfg]["status"] = f"error: {e}"
            return
        try:
            self._announce(session, doc, None)
            shared = Shared(session, doc.tokens, [comp for _, comp in members])
            if shared.error is not None:
                for cfg, _ in members:
                    rows[cfg]["status"] = _status(shared.error)
                return
            for cfg, comp in members:
                row = rows[cfg]
                try:
                    applied = shared.apply(comp)
                    if applied.error is not None:
                        raise applied.error
                    row.update({"prefill_s": shared.prefill_s, "prefill_tok_s": n / shared.prefill_s,
                                "prefill_shared_by": len(members), "compress_s": applied.compress_s,
                                "compress_share": applied.compress_s / (shared.prefill_s + applied.compress_s),
                                **self._cache_figures(session, cfg)})
                    if applied.reconstruct_s is not None:
                        row["reconstruct_s"] = applied.reconstruct_s
                    self._decode_and_score(session, row, cfg, doc, shared.first)
                    row["status"] = "ok"
                except Exception as e:  # a bug below kvcli bench: reported on its row
                    row["status"] = _status(e)
                self.log("  " + cfg.label + ": " + short_line(row))
        finally:
            session.close()

    def _save_state(self, session, cfg: Config, doc: Doc) -> Path:
        if self._state_dir is None:
            self._state_dir = tempfile.TemporaryDirectory(prefix="kvcli-bench-")
        path = Path(self._state_dir.name) / f"{len(self.states)}.state"
        path.write_bytes(cache_state(session, 0))
        return path

    # -------------------------------------------------------------------------- peak memory, in a fresh process
    def measure_memory(self, row: dict, doc: Doc) -> None:
        """Peak RSS and allocated KV buffer of the row's configuration in a fresh child process: `kvcli run` of
        the same prompt, policy, budget, cache type and chunking, decoding `gen` tokens. A child that fails
        turns the row into an error: a memory figure is measured or absent, never guessed."""
        chunk = self.chunk if self.chunk and row["policy"] != "full" else 0   # 0: one prefill, as the row's
        cmd = [sys.executable, "-m", "kvcli.cli", "run", "--doc", "-", "--model", self.model_path,
               "--policy", row["policy"], "--cache-type", row["cache_type"], "--max-tokens", str(self.gen),
               "--system", "", "--chunk", str(chunk), "--chunk-scoring", self.chunk_scoring, "--json", "--quiet"]
        if row["budget"] is not None:
            cmd += ["--budget", str(row["budget"])]
        for k, v in self.policy_args.get(row["policy"], {}).items():
            cmd += ["--policy-arg", f"{k}={v}"]
        here = str(Path(kvcli.__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
                   **({"KVCLI_THREADS": str(self.threads)} if self.threads else {}))
        r = subprocess.run(cmd + ["--", self.instruction], input=doc.text.encode("utf-8"), capture_output=True,
                           env=env)
        if r.returncode != 0:
            why = (r.stderr.decode("utf-8", "replace").strip().splitlines() or [f"exit code {r.returncode}"])[-1]
            row["status"] = f"error: the peak-memory run failed: {why}"
            return
        stats = json.loads(r.stdout)["stats"]
        row.update(peak_rss_bytes=stats["peak_rss_bytes"], kv_bytes_allocated=stats["kv_bytes_allocated"],
                   peak_rss_scope="fresh process (kvcli run)")

    # -------------------------------------------------------------------------- equal-memory batch
    def measure_batch(self, cfg: Config, rows: list[dict]) -> dict:
        out = {"policy": cfg.policy, "budget": cfg.budget, "cache_type": cfg.cache_type, "config": cfg.label,
               "ctx": self.ctx, "batch": self.batch, "gen_tokens": self.gen}
        mine = [r for r in rows if r["config"] == cfg.label]
        bad = [r for r in mine if r.get("status") != "ok"]
        if bad or not mine:  # the same reason as the per-document rows
            out["status"] = bad[0]["status"] if bad else "not measured"
            return out
        states = [self.states[(cfg, d.name)] for d in self.docs]
        session = self._session(cfg.cache_type, self.ctx, n_seq=self.batch)
        try:
            held, cells = [], 0
            lockstep = Lockstep(session, reserve=self.gen)  # every held sequence keeps room for its `gen` tokens
            for i in range(self.batch):
                s = states[i % len(states)]
                need = [r for r in mine if r["doc"] == self.docs[i % len(states)].name][0]["kv_cells"]
                if not lockstep.fits(need):
                    break
                cells += session.restore_seq(SeqSnapshot(state=s["path"].read_bytes(), next_pos=s["next_pos"],
                                                         cells=need, prompt_tokens=s["prompt_tokens"]), i)
                lockstep.hold(i)
                held.append((i, s["first"]))
            out["ctx"] = session.n_ctx  # llama.cpp may round the requested size up
            out["docs_held"] = len(held)
            out["cells_held"] = cells
            out["kv_bytes_held"] = int(sum(session.stats(i)["kv_bytes"] for i, _ in held))
            if not held:
                out["status"] = f"no document fits a {session.n_ctx}-cell context"
                return out
            toks = {i: t for i, t in held}
            t0 = time.perf_counter()
            for _ in range(self.gen):
                lockstep.step(toks)
                toks = {i: int(np.argmax(session.logits(i))) for i, _ in held}
            dt = time.perf_counter() - t0
            out["decode_s"] = dt
            out["aggregate_tok_s"] = len(held) * self.gen / dt
            out["per_seq_tok_s"] = self.gen / dt
            out["status"] = "ok" if len(held) == self.batch else f"ok (only {len(held)} of {self.batch} fit)"
        except KvcliError as e:
            out["status"] = f"error: {e}"
        finally:
            session.close()
        return out

    # -------------------------------------------------------------------------- all
    def run(self) -> dict:
        try:
            return self._run()
        finally:  # the saved states go, whatever happened
            self.states.clear()
            if self._state_dir is not None:
                self._state_dir.cleanup()
                self._state_dir = None

    def _run(self) -> dict:
        where = machine(self.threads)  # before measuring: it records the load the run started under
        n_ctx_train = self._tokenize()
        cfgs = configs(self.policies, self.budgets, self.cache_types)
        if self.batch:
            longest = max(len(d.tokens) for d in self.docs)
            self.ctx = self.ctx or context_cells(longest, self.gen, n_ctx_train)
        rows = []
        for doc in self.docs:
            if self.share_prefill:
                rows += self.measure_shared(cfgs, doc, n_ctx_train)
                continue
            runnable = [c for c in cfgs if not (availability(c.policy)
                                                or cache_type_problem(c.cache_type, self.model_path))]
            self.unread[doc.name] = _reads(len(runnable), "one per configuration")
            for cfg in cfgs:
                self.log(f"{doc.name} ({len(doc.tokens)} tokens): {cfg.label}")
                row = self.measure(cfg, doc, n_ctx_train)
                rows.append(row)
                self.log("  " + short_line(row))
        for doc in self.docs:
            for r in rows:
                if r["doc"] == doc.name and r.get("status") == "ok":
                    self.log(f"{doc.name}: peak memory of {r['config']} in a fresh process")
                    self.measure_memory(r, doc)
        base = {r["doc"]: r for r in rows if r["config"] == Config("full", None, "f16").label}
        for r in rows:
            b = base.get(r["doc"])
            if r.get("status") == "ok" and b and b.get("status") == "ok":
                r["kv_bytes_vs_full"] = r["kv_bytes"] / b["kv_bytes"]
                r["decode_speedup_vs_full"] = r["decode_tok_s"] / b["decode_tok_s"]
        batch = []
        if self.batch:
            for cfg in cfgs:
                self.log(f"batch at {self.ctx} cells: {cfg.label}")
                batch.append(self.measure_batch(cfg, rows))
                self.log("  " + batch_line(batch[-1]))
            bfull = [b for b in batch if b["config"] == Config("full", None, "f16").label and "aggregate_tok_s" in b]
            for b in batch:
                if bfull and "aggregate_tok_s" in b:
                    b["throughput_vs_full"] = b["aggregate_tok_s"] / bfull[0]["aggregate_tok_s"]
        return {"kind": "bench", "model": self.model_path, "machine": where,
                "settings": {"policies": self.policies, "budgets": self.budgets, "cache_types": self.cache_types,
                             "gen": self.gen, "repeat": self.repeat, "batch": self.batch, "ctx": self.ctx,
                             "share_prefill": self.share_prefill, "chunk": self.chunk,
                             "chunk_scoring": self.chunk_scoring if self.chunk else None,
                             "instruction": self.instruction, "policy_args": self.policy_args,
                             "docs": [{"name": d.name, "tokens": len(d.tokens)} for d in self.docs]},
                "rows": rows, "batch": batch}


def _reads(n: int, why: str) -> str:
    """How many times bench reads a document, as its notice says it."""
    return f"the first of its {n} reads, {why}" if n > 1 else "its one read"


def _status(e: Exception) -> str:
    """A row's status for what stopped it: an input or run error, or a bug below kvcli bench."""
    return f"error: {e}" if isinstance(e, KvcliError) else f"internal error: {type(e).__name__}: {e}"


def _decode(session, first_logits: np.ndarray, gen: int, forced: list[int] | None):
    """Decode `gen` tokens into sequence 0: greedy, or the `forced` tokens when given. Returns the tokens,
    the log-probabilities before each of them, and the seconds spent in decode + logits reads."""
    logits, toks, logps, dt = first_logits, [], [], 0.0
    for i in range(gen):
        logps.append(log_softmax(logits))
        tok = int(np.argmax(logits)) if forced is None else forced[i]
        toks.append(tok)
        t0 = time.perf_counter()
        session.step({0: tok})
        logits = session.logits(0)
        dt += time.perf_counter() - t0
    return toks, logps, dt


# ------------------------------------------------------------------------------ text output
def _f(v, fmt="{:.1f}", none="-"):
    return none if v is None else fmt.format(v)


def short_line(r: dict) -> str:
    if r.get("status") != "ok":
        return r.get("status", "?")
    return (f"prefill {_f(r['prefill_tok_s'])} tok/s, compress {r['compress_s']:.3f}s, "
            f"{r['kv_cells']} cells {r['kv_bytes'] / 1e6:.2f} MB, decode {_f(r['decode_tok_s'])} tok/s, "
            f"agree {_f(r['agreement'], '{:.0%}')}, KL {_f(r['kl_mean'], '{:.3f}')}")


def batch_line(b: dict) -> str:
    if "aggregate_tok_s" not in b:
        return b.get("status", "?")
    return f"{b['docs_held']} docs held ({b['cells_held']} cells), {b['aggregate_tok_s']:.1f} tok/s together"


def table(result: dict) -> str:
    """The terminal table: one line per document x configuration, then the batch table."""
    head = (f"{'doc':<18} {'config':<22} {'prefill':>8} {'comp%':>6} {'decode tok/s (min-max)':>24} "
            f"{'cells':>6} {'KV MB':>7} {'xfull':>6} {'live MB':>7} {'alloc MB':>8} {'peak MB':>7} {'agree':>6} "
            f"{'KL':>7}")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        doc = f"{r['doc'][:12]}({r['prompt_tokens']})"
        if r.get("status") != "ok":
            lines.append(f"{doc:<18} {r['config']:<22} {r.get('status')}")
            continue
        dec = f"{r['decode_tok_s']:.1f} ({r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f})"
        lines.append(f"{doc:<18} {r['config']:<22} {r['prefill_tok_s']:>8.1f} {100 * r['compress_share']:>6.1f} "
                     f"{dec:>24} {r['kv_cells']:>6} {r['kv_bytes'] / 1e6:>7.2f} "
                     f"{_f(r.get('kv_bytes_vs_full'), '{:.3f}'):>6} {r['kv_bytes_live'] / 1e6:>7.2f} "
                     f"{r['kv_bytes_allocated'] / 1e6:>8.2f} "
                     f"{_f(r['peak_rss_bytes'] and r['peak_rss_bytes'] / 1e6, '{:.0f}'):>7} "
                     f"{_f(r['agreement'] and 100 * r['agreement'], '{:.0f}%'):>6} {_f(r['kl_mean'], '{:.3f}'):>7}")
    if result.get("batch"):
        s = result["settings"]
        lines += ["", f"batch at equal memory: {s['ctx']} cells, up to {s['batch']} sequences, "
                      f"{s['gen']} tokens each, decoded together"]
        bh = f"{'config':<22} {'held':>5} {'cells':>7} {'KV MB':>7} {'tok/s total':>12} {'xfull':>6}  status"
        lines += [bh, "-" * len(bh)]
        for b in result["batch"]:
            if "aggregate_tok_s" not in b:
                lines.append(f"{b['config']:<22} {'':>5} {'':>7} {'':>7} {'':>12} {'':>6}  {b.get('status')}")
                continue
            lines.append(f"{b['config']:<22} {b['docs_held']:>5} {b['cells_held']:>7} {b['kv_bytes_held'] / 1e6:>7.2f} "
                         f"{b['aggregate_tok_s']:>12.1f} {_f(b.get('throughput_vs_full'), '{:.2f}'):>6}  {b['status']}")
    return "\n".join(lines)


CSV_FIELDS = ["doc", "prompt_tokens", "policy", "budget", "cache_type", "status", "prefill_tok_s", "prefill_s",
              "compress_s", "compress_share", "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max",
              "decode_repeats", "kv_cells", "kv_bytes", "kv_bytes_full", "kv_bytes_vs_full",
              "decode_speedup_vs_full", "kv_bytes_live", "kv_bytes_budget", "kv_bytes_allocated", "peak_rss_bytes",
              "agreement", "kl_mean", "note"]


def write_csv(result: dict, path: str) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in result["rows"]:
        w.writerow(r)
    if result.get("batch"):
        buf.write("\n")
        bf = ["policy", "budget", "cache_type", "status", "ctx", "batch", "docs_held", "cells_held", "kv_bytes_held",
              "aggregate_tok_s", "per_seq_tok_s", "throughput_vs_full"]
        w = csv.DictWriter(buf, fieldnames=bf, extrasaction="ignore")
        w.writeheader()
        for b in result["batch"]:
            w.writerow(b)
    write_text(path, buf.getvalue())


def write_json(result: dict, path: str) -> None:
    write_text(path, json.dumps(result, indent=1, default=_jsonable))


def _jsonable(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


__all__ = ["Bench", "Config", "Doc", "asdict", "configs", "load_docs", "table", "write_csv", "write_json"]
