"""Peak memory of `kvcli run` per policy and reading mode, each in its own process (issue #19).

    python benchmarks/memory.py DOC [DOC ...] [--budget 256] [--json-out FILE]

For every document: `kvcli run --policy full`, snapkv read in one go (`--chunk 0`), then every compressing
policy with bounded reading (the default with a budget) and snapkv under `--max-cache 1024`. Each run is a
fresh process under `/usr/bin/time -f %M` (the kernel's maximum resident set, KiB), next to the
`peak_rss_bytes` and `kv_bytes_allocated` of its own --json stats. RSS does not depend on the machine's
load, so this is fair to run on a busy machine; the answer's 16 tokens only make the run complete.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench_common import ROOT, run_max_rss
POLICIES = ("streamingllm", "snapkv", "h2o", "pyramidkv", "windowkv", "dynamickv", "compresskv", "d2o", "spindlekv")
QUESTION = "What happened at the station? Answer in one sentence."


def runs(budget: int) -> list[tuple[str, str, list[str]]]:
    """(key, label, arguments) of every run; `--only` takes keys or the policy names before their ':'."""
    out = [("full", "full", ["--policy", "full"]),
           ("snapkv:one-go", f"snapkv@{budget}, one go (--chunk 0)",
            ["--policy", "snapkv", "--budget", str(budget), "--chunk", "0"])]
    out += [(p, f"{p}@{budget}, bounded (default)", ["--policy", p, "--budget", str(budget)]) for p in POLICIES]
    out.append(("snapkv:max-cache", f"snapkv@{budget}, --max-cache 1024",
                ["--policy", "snapkv", "--budget", str(budget), "--max-cache", "1024"]))
    return out


def measure(doc: Path, label: str, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "kvcli.cli", "run", "--doc", str(doc), "-n", "16", "--json", "--quiet", *args,
           QUESTION]
    r, max_rss = run_max_rss(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    row = {"doc": doc.name, "run": label, "command": "kvcli run --doc DOC -n 16 " + " ".join(args)}
    if r.returncode != 0:
        row["error"] = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return row
    s = json.loads(r.stdout)["stats"]
    row.update(time_max_rss_bytes=max_rss,
               peak_rss_bytes=s["peak_rss_bytes"], kv_bytes_allocated=s["kv_bytes_allocated"],
               kv_cells_allocated=s["kv_cells_allocated"], peak_kv_cells=s.get("peak_kv_cells"),
               kv_bytes=s["kv_bytes"], kv_bytes_live=s["kv_bytes_live"], kv_bytes_full=s["kv_bytes_full"],
               prompt_tokens=s["prompt_tokens"], chunks=s.get("chunks"))
    return row


def table(rows: list[dict]) -> str:
    out = ["| doc (tokens) | run | peak RSS MB (time %M) | peak_rss_bytes MB | KV allocated MB (cells) | "
           "peak cells | KV held MB | live MB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['doc']} | {r['run']} | error: {r['error']} | | | | | |")
            continue
        out.append(f"| {r['doc']} ({r['prompt_tokens']}) | {r['run']} | {r['time_max_rss_bytes'] / 1e6:.0f} | "
                   f"{r['peak_rss_bytes'] / 1e6:.0f} | {r['kv_bytes_allocated'] / 1e6:.1f} "
                   f"({r['kv_cells_allocated']}) | "
                   f"{r['peak_kv_cells']} | {r['kv_bytes'] / 1e6:.2f} | {r['kv_bytes_live'] / 1e6:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("docs", nargs="+")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--only", default=None, help="Comma-separated runs: policy names (snapkv: its three runs) or "
                    "keys (snapkv:one-go, snapkv:max-cache).")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    rows = []
    for d in a.docs:
        for key, label, args in runs(a.budget):
            if a.only and not {key, key.split(":")[0]} & set(a.only.split(",")):
                continue
            rows.append(measure(Path(d).resolve(), label, args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if a.json_out:
                Path(a.json_out).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print(table(rows))


if __name__ == "__main__":
    main()
