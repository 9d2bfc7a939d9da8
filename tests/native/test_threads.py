"""Thread count: the default (usable CPUs, not the host's), and that it changes speed only, never results."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvcli.errors import KvcliError
from kvcli.native import threads as ns


def test_default_threads_follows_affinity_quota_and_load(monkeypatch, tmp_path):
    monkeypatch.delenv("KVCLI_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})   # taskset to 6 of 8
    monkeypatch.setattr(ns, "_busy_cpus", lambda: 30.0)
    monkeypatch.setattr(ns, "_cgroup_cpu_quota", lambda: None)
    assert ns.default_threads() == 6          # the machine's load says nothing about our 6 CPUs
    monkeypatch.setattr(ns, "_cgroup_cpu_quota", lambda: 2)      # a container limited to 2 CPUs
    assert ns.default_threads() == 2
    monkeypatch.setattr(ns, "_cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))     # the whole machine
    for load, threads in ((0.2, 8), (2.6, 5), (7.6, 1), (30.0, 1)):
        monkeypatch.setattr(ns, "_busy_cpus", lambda load=load: load)
        assert ns.default_threads() == threads, load
    monkeypatch.setenv("KVCLI_THREADS", "3")
    assert ns.default_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("KVCLI_THREADS", bad)
        with pytest.raises(KvcliError, match="KVCLI_THREADS"):
            ns.default_threads()


def test_busy_cpus_counts_the_other_runnable_tasks_now(tmp_path, monkeypatch):
    f = tmp_path / "stat"
    f.write_text("cpu  1 2 3 4\nctxt 99\nprocs_running 3\nprocs_blocked 0\n")
    assert ns._busy_cpus(str(f), samples=2) == 2.0        # three runnable, this process one of them
    f.write_text("procs_running 1\n")
    assert ns._busy_cpus(str(f), samples=1) == 0.0
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert ns._busy_cpus(str(tmp_path / "missing"), samples=1) == 1.5   # no /proc: the load average
    assert ns._busy_cpus(samples=1) is not None                           # this machine's /proc/stat


def test_cgroup_quota_file(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("max 100000\n")
    assert ns._cgroup_cpu_quota(str(f)) is None
    f.write_text("150000 100000\n")     # 1.5 CPUs: two threads
    assert ns._cgroup_cpu_quota(str(f)) == 2
    f.write_text("200000 100000\n")
    assert ns._cgroup_cpu_quota(str(f)) == 2
    assert ns._cgroup_cpu_quota(str(tmp_path / "absent")) is None


def test_thread_count_changes_no_logit(tiny_model, session_factory):
    """ggml gives each output element to one thread: 1 and 2 threads produce identical logits, through an
    observed prefill, a compaction and decode steps."""
    from kvcli.drivers.compress import prefill_and_compress, resolve
    toks = [int(t) for t in np.random.default_rng(0).integers(3, 200, 180)]
    logits = []
    for threads in (1, 2):
        s = session_factory(tiny_model, n_threads=threads, n_batch=64)
        prefill_and_compress(s, toks, resolve(s.model_path, "snapkv", 48, {"window": 8}))
        out = [s.logits(0)]
        for t in (5, 6, 7):
            s.step({0: t})
            out.append(s.logits(0))
        logits.append(np.stack(out))
    assert np.array_equal(logits[0], logits[1])


def test_run_threads_option(run_kvcli, tiny_model, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper wrote in the log every night. " * 30)
    answers = []
    for threads in ("1", "2"):
        r = run_kvcli("run", "What did the keeper do?", "--model", tiny_model, "--doc", doc, "--policy", "snapkv",
                      "--budget", "64", "-n", "8", "--threads", threads, "--json", "--quiet")
        assert r.returncode == 0, r.stderr
        answers.append(json.loads(r.stdout)["answer"])
    assert answers[0] == answers[1]
    r = run_kvcli("run", "q", "--model", tiny_model, "--doc", doc, "--threads", "0")
    assert r.returncode == 2 and "--threads" in r.stderr and "Traceback" not in r.stderr
