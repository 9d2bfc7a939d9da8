"""`kvcli check --chunk N`: both engines read the prompt in chunks with the driver (kvcli/drivers/chunked.py); L1 at
every planning step, L2 on the first chunk, L3 on the end results (see kvcli/drivers/check/__init__.py). `Origins`
follows the original prompt positions through every plan (also used by benchmarks/needle_survival.py)."""
from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from kvcli.drivers import chunked, compress
from kvcli.drivers.check.allowances import l2_allowances, note_allowances
from kvcli.drivers.check.comparators import compare_observations, jaccard_per_head
from kvcli.drivers.check.verdicts import (announce_read, arithmetic_verdict, l1_verdict, observed_windows, passed,
                                          plans_verdict)
from kvcli.errors import KvcliError
from kvcli.planning.formats import Plan


class Origins:
    """The original prompt index held by each (layer, KV head, slot) of a sequence read in chunks, followed
    through the plans of the chunked driver. Engine-independent: in both engines a compaction leaves
    B = plan.max_kept slots and the next tokens enter at slots B, B+1, ... in prompt order. A (l, h)
    keeping k entries holds them in slots 0..k-1 (a compaction without re-indexing) or B-k..B-1 (with:
    right-aligned); the other slots are dead padding, -1 here."""

    def __init__(self, n_layer: int, n_head_kv: int):
        self.ids = [[np.zeros(0, np.int64) for _ in range(n_head_kv)] for _ in range(n_layer)]
        self.width = 0        # slots held after the last compaction
        self.consumed = 0     # prompt tokens entered so far

    def _grow(self, n_slots: int) -> None:
        new = n_slots - self.width
        if new < 0:
            raise KvcliError(f"the sequence holds {n_slots} slots, fewer than the {self.width} its last plan left")
        fresh = np.arange(self.consumed, self.consumed + new, dtype=np.int64)
        self.ids = [[np.concatenate([h, fresh]) for h in layer] for layer in self.ids]
        self.consumed += new
        self.width = n_slots

    def on_plan(self, n_slots: int, plan: Plan, reindexed: bool = True) -> None:
        """A plan made over `n_slots` slots was applied (with re-indexing: right-aligned slots)."""
        self._grow(n_slots)
        width = plan.max_kept
        out = []
        for l, layer in enumerate(self.ids):
            row = []
            for h, ids in enumerate(layer):
                slots = np.full(width, -1, np.int64)   # a dead slot a plan picks stays dead (-1)
                start = plan.first_slot(l, h, reindexed)
                slots[start: start + plan.n_kept[l, h]] = ids[plan.kept(l, h)]
                row.append(slots)
            out.append(row)
        self.ids, self.width = out, width

    def kept(self, n_slots: int) -> list[list[np.ndarray]]:
        """Original positions live in each (layer, KV head) of a sequence of `n_slots` slots now."""
        self._grow(n_slots)
        return [[h[h >= 0] for h in layer] for layer in self.ids]


def _merge_l1(steps: list[dict]) -> dict:
    """One L1 verdict for all planning steps of a chunked prefill."""
    out = {"pass": all(s["pass"] for s in steps), "steps": len(steps),
           "steps_differing": sum(not s["pass"] for s in steps),
           "identical_budgets": all(s["identical_budgets"] for s in steps),
           "heads_differing": sum(s["heads_differing"] for s in steps),
           "merged_rows": sum(s.get("merged_rows", 0) for s in steps),
           "merge_max_abs": max((s["merge_max_abs"] for s in steps), default=0.0),
           "log_mult_max_abs": max((s["log_mult_max_abs"] for s in steps), default=0.0),
           "entries": [s["entries"] for s in steps], "first_difference": None}
    for i, s in enumerate(steps):
        if not s["pass"]:
            out["first_difference"] = f"step {i}: {s['first_difference']}"
            break
    return out


def run_chunked(native, model_path, tokens, names, specs, settings, th, log, t0) -> dict:
    """kvcli check --chunk: both engines read `tokens` in chunks with the driver, kvcli.drivers.compress (see the module
    doc)."""
    from kvcli.reference.session import ReferenceSession  # noqa: PLC0415

    n, levels, chunk = len(tokens), set(settings.levels), settings.chunk
    reserve = settings.n_tokens + 8
    sizing = {}
    for name in names:   # sizes (and bad combinations) before the reference engine is loaded
        if name == "full":
            continue
        c = chunked.plan_chunking(n, reserve, native.n_ctx_train, specs[name], chunk,
                                  cell_bytes=native.bytes_per_cell())
        if c.chunk is None:
            raise KvcliError(f"the prompt ({n} tokens) fits in one chunk of {chunk}: choose a smaller --chunk "
                             "(or drop it to check a single prefill)")
        sizing[name] = c
    if not sizing:
        raise KvcliError("chunked prefill compresses after every chunk: choose a compressing policy")
    n_ctx = max(c.n_ctx for c in sizing.values())
    native.create_context(n_ctx)
    announce_read(native, tokens, chunk)
    log(f"{n} prompt tokens in chunks of {chunk}; loading the reference engine")
    reference = ReferenceSession(model_path, n_ctx=native.n_ctx, n_threads=settings.threads)
    info = native.info
    reindexed = not chunked.keeps_positions(info)   # sliding-window models keep positions
    report = {"model": str(model_path), "prompt_tokens": n, "n_ctx": native.n_ctx, "budget": settings.budget,
              "chunk": chunk,
              "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(settings).items()},
              "thresholds": th.as_dict(), "policies": []}

    if 2 in levels:   # the first chunk's observation, the one both engines compute from the same tokens
        log("L2: observation of the first chunk in both engines")
        first = tokens[:chunk]
        window = observed_windows(specs, sizing, settings.l2_window, len(first))
        try:
            native.clear(0)
            reference.clear(0)
            kinds = ("window", "colsum", "kv")
            nat_obs = native.prefill(first, seq=0, observe=kinds, window=window)
            ref_obs = reference.prefill(first, seq=0, observe=kinds, window=window)
            allow = l2_allowances(model_path, first, settings, native.n_ctx, reference)
            report["l2"] = compare_observations(nat_obs, ref_obs, th, allow)
            report["l2"]["tokens"] = len(first)
            note_allowances(report["l2"], allow, native.info)
        except KvcliError as e:
            report["l2"] = {"pass": False, "error": str(e)}

    for name in names:
        cfg = specs[name]
        entry = {"policy": name, "note": ""}
        report["policies"].append(entry)
        if name not in sizing:
            entry["skipped"] = "chunked prefill needs a compressing policy"
            continue
        if not (cfg.spec.native and cfg.spec.reference):
            entry["skipped"] = f"no {'native' if not cfg.spec.native else 'reference'} implementation"
            log(f"{name}: skipped ({entry['skipped']})")
            continue
        log(f"{name}: chunked prefill in both engines, L1 at every step, L3")
        reading = dict(instruction=settings.instruction, chunk=chunk, cap=sizing[name].cap,
                       scoring=settings.chunk_scoring)
        try:
            l1_steps, origins_n, plans_n = [], Origins(info.n_layer, info.n_head_kv), []

            def native_step(step, obs, plan_n, cfg=cfg, l1_steps=l1_steps, origins=origins_n, plans_n=plans_n):
                if 1 in levels:
                    l1_steps.append(l1_verdict(cfg, obs, plan_n, th))
                origins.on_plan(obs.n, plan_n, reindexed)
                plans_n.append(plan_n)

            native.clear(0)
            rep_n = compress.prefill_and_compress(native, tokens, cfg, planner="native", on_step=native_step,
                                                  **reading)
            entry["chunks"] = len(rep_n.steps)
            entry["steps"] = [[s.cells_before, s.cells_after] for s in rep_n.steps]
            if 1 in levels:
                entry["l1"] = _merge_l1(l1_steps)
            if 3 in levels:
                kept_n = origins_n.kept(native.stats(0)["kv_cells"])
                state_n = native.save_seq(0)
                # arithmetic: the reference engine reads the prompt in the same chunks with the native plans
                replay = iter(plans_n)

                def native_plans(spec, params, budget, obs, replay=replay):
                    plan = next(replay, None)
                    if plan is None:
                        raise KvcliError("the reference engine planned more steps than the native engine")
                    return plan

                reference.clear(0)
                rep_a = compress.prefill_and_compress(reference, tokens, cfg, planner=native_plans, **reading)
                entry["l3"] = arithmetic_verdict(native, reference, settings, th,
                                                 peak_cells=[rep_n.peak_cells, rep_a.peak_cells])
                native.restore_seq(state_n, 0)
                # plan agreement: the reference engine reads them with its own plans
                origins_r = Origins(info.n_layer, info.n_head_kv)
                reference.clear(0)
                rep_r = compress.prefill_and_compress(
                    reference, tokens, cfg, planner="reference",
                    on_step=lambda step, obs, plan, o=origins_r: o.on_plan(obs.n, plan, reindexed), **reading)
                kept_r = origins_r.kept(reference.stats(0)["kv_cells"])
                entry["plans"] = plans_verdict(native, reference, jaccard_per_head(kept_n, kept_r), settings, th,
                                               peak_cells=[rep_n.peak_cells, rep_r.peak_cells],
                                               reference_steps=[[s.cells_before, s.cells_after] for s in rep_r.steps])
                entry["l3"]["reference_steps"] = [[s.cells_before, s.cells_after] for s in rep_a.steps]
        except KvcliError as e:
            entry["error"] = str(e)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    report["passed"] = passed(report)
    return report
