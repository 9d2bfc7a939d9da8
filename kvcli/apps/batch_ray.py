"""`kvcli batch --ray`: the same batch on a Ray cluster.

One actor per node (or per `cpus` cores, or `workers` of them) each holds a `kvcli.apps.batch.Worker`: its
own model and its own shared KV cache, scheduled exactly as a local batch. The driver reads and keys the
documents (workers need no shared file system, only kvcli and the model on every node), puts the ones
still to answer on a job queue that the workers take from as their caches make room, and writes every
result line that comes back into the same JSONL file, with the same resume semantics as a local batch.
Ray is optional (`pip install 'kvcli[ray]'`); nothing here is imported without --ray.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from kvcli.apps.batch import Worker
from kvcli.errors import KvcliError

POLL_S = 0.2


def import_ray():
    try:
        import ray  # noqa: PLC0415
    except ImportError:
        raise KvcliError("--ray needs Ray, an optional extra: pip install 'kvcli[ray]' (or -r requirements-ray.txt)") \
            from None
    return ray


def start(ray, address: str, cpus: int | None, workers: int | None) -> None:
    """Connect to the cluster at `address` ('auto': the one this machine belongs to), or start a local
    instance ('local', sized for `workers` x `cpus`)."""
    kw = dict(logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)
    try:
        if address == "local":
            ray.init(num_cpus=(workers or 1) * (cpus or 1) if workers else None, **kw)
        else:
            ray.init(address=address, **kw)
    except Exception as e:  # noqa: BLE001 - Ray raises plain Exception for a cluster that does not come up
        raise KvcliError(f"--ray {address}: Ray did not start: {_cause(e)}") from None


def worker_count(ray, cpus: int | None, workers: int | None) -> int:
    if workers:
        return workers
    if cpus:  # one worker per `cpus` cores of the cluster
        return max(int(ray.cluster_resources().get("CPU", 0)) // cpus, 1)
    return max(sum(1 for n in ray.nodes() if n.get("Alive")), 1)   # one per node


def _actor_class(ray):
    @ray.remote
    class RayWorker:
        """A kvcli.apps.batch.Worker on one Ray node."""

        def __init__(self, settings):
            self.worker = Worker(settings)

        def run(self, jobs, results, name: str) -> None:
            def take():
                while (job := jobs.get()) is not None:
                    yield job

            def emit(line):
                if line.get("stats") is not None:
                    line["stats"]["worker"] = name
                results.put(line)
            self.worker.say = lambda line: results.put({"notice": line})   # the driver says it
            try:
                self.worker.run(take(), emit)
            finally:
                self.worker.close()

    return RayWorker


def run(batch, address: str, cpus: int | None = None, workers: int | None = None, log=None) -> int:
    """Run `batch` (a kvcli.apps.batch.Batch) on Ray; returns the number of workers used."""
    ray = import_ray()
    from ray.util.queue import Empty, Full, Queue  # noqa: PLC0415
    start(ray, address, cpus, workers)
    try:
        n = worker_count(ray, cpus, workers)
        settings = replace(batch.settings, threads=cpus) if cpus else batch.settings
        (log or (lambda m: None))(f"kvcli: {n} Ray worker{'s' * (n > 1)} on "
                                  f"{sum(1 for x in ray.nodes() if x.get('Alive'))} node(s)")
        queue_opts = {"num_cpus": 0}
        jobs, results = Queue(maxsize=2 * n, actor_options=queue_opts), Queue(actor_options=queue_opts)
        cls = _actor_class(ray).options(num_cpus=cpus or 1, scheduling_strategy="SPREAD")
        actors = [cls.remote(settings) for _ in range(n)]
        runs = {a.run.remote(jobs, results, f"ray-{i}"): i for i, a in enumerate(actors)}
        feed, held, ends = batch.jobs(), None, n   # `held`: a job the full queue did not take yet
        while runs:
            while ends:  # keep the job queue topped up; after the last job, one end mark per worker
                item = held if held is not None else next(feed, None)
                try:
                    jobs.put_nowait(item)
                except Full:
                    held = item
                    break
                held = None
                ends -= item is None
            try:
                batch.receive(results.get(timeout=POLL_S))
                continue
            except Empty:
                pass
            done, _ = ray.wait(list(runs), timeout=0)
            for ref in done:
                i = runs.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise KvcliError(f"Ray worker {i} failed: {_cause(e)} (the lines written so far are kept: "
                                     "re-run to finish)") from None
        while True:  # what the last workers put just before they returned
            try:
                batch.receive(results.get_nowait())
            except Empty:
                break
        return n
    finally:
        ray.shutdown()


def _cause(e) -> str:
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return (text[-1] if text else type(cause).__name__)[:300]


__all__ = ["run", "import_ray"]
