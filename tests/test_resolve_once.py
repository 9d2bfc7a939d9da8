"""A compression resolved once: kvcli serve's `resolve_once` per (model, policy, budget, arguments), and kvcli
eval's configurations resolved at the start (`_check_policies`) and taken as they are by every sample."""
from __future__ import annotations

import pytest

from kvcli.errors import KvcliError
from kvcli.evaluation import runner
from kvcli.planning import planner
from kvcli.planning.planner import resolve, resolve_once


def test_resolve_once_gives_the_same_compression_for_the_same_ask(tiny_1k, monkeypatch):
    monkeypatch.setattr(planner, "_RESOLVED", {})
    a = resolve_once(tiny_1k, "snapkv", 64, {"window": 8})
    assert resolve_once(tiny_1k, "snapkv", 64, {"window": 8}) is a
    assert a == resolve(tiny_1k, "snapkv", 64, {"window": 8}) and a.params["window"] == 8
    assert resolve_once(tiny_1k, "snapkv", 64, {"window": 16}) is not a
    assert resolve_once(tiny_1k, "snapkv", 32, {"window": 8}) is not a
    # a long-lived server keeps the last RESOLVED_KEPT asks
    monkeypatch.setattr(planner, "RESOLVED_KEPT", 2)
    resolve_once(tiny_1k, "snapkv", 48)
    assert len(planner._RESOLVED) == 2 and resolve_once(tiny_1k, "snapkv", 64, {"window": 8}) is not a


def test_resolve_once_keeps_no_mistake(tiny_1k, monkeypatch):
    monkeypatch.setattr(planner, "_RESOLVED", {})
    with pytest.raises(KvcliError) as direct:
        resolve(tiny_1k, "snapkv", None)
    for _ in range(2):   # each ask raises resolve's one message again
        with pytest.raises(KvcliError) as once:
            resolve_once(tiny_1k, "snapkv", None)
        assert str(once.value) == str(direct.value)
    assert planner._RESOLVED == {}


def test_eval_resolves_each_configuration_once_before_the_samples(tiny_1k, monkeypatch):
    calls = []
    real = runner.resolve
    monkeypatch.setattr(runner, "resolve", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    unavailable, resolved = runner._check_policies(tiny_1k, ["full", "snapkv", runner.TRUNCATE], [48, 64], {})
    assert unavailable == {} and sorted(calls, key=str) == sorted(resolved, key=str)
    assert set(resolved) == {("full", None), ("snapkv", 48), ("snapkv", 64)}
    assert resolved[("snapkv", 64)].budget == 64
    with pytest.raises(KvcliError, match="window"):   # a bad argument stops the run before it starts
        runner._check_policies(tiny_1k, ["snapkv"], [48], {"snapkv": {"window": -1}})


def test_batch_resolves_its_compression_once_for_the_worker(tiny_1k, monkeypatch):
    from kvcli.apps import batch
    calls = []
    real = batch.resolve
    monkeypatch.setattr(batch, "resolve", lambda *a, **k: calls.append(a[1:3]) or real(*a, **k))
    settings = batch.Settings("Summarise.", model=str(tiny_1k), policy="snapkv", budget=64, max_tokens=8)
    checked = batch.check_settings(settings)
    worker = batch.Worker(settings, checked)
    try:
        assert worker._resolved("Summarise.") is checked[1] and worker._resolved("Other?") is checked[1]
    finally:
        worker.close()
    assert calls == [("snapkv", 64)]   # snapkv's parameters do not depend on the question: resolved once
