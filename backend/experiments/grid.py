"""Grids of independent runs (needle cells, sweep documents, task samples): serially in this process, or on Ray.

A grid is a list of jobs, each a plain JSON-able dict naming its kind ("needle", "sweep" or "task"), its model
and its payload. A ``Worker`` loads each model once and runs jobs; it returns plain rows (dicts).

* ``address=None``: one in-process worker runs the jobs in order (the default).
* ``address="local"``: start Ray on this machine (``ray.init(num_cpus=workers)``), one actor per CPU.
* ``address="ray://host:10001"`` or ``"host:6379"``: join a running Ray cluster (``ray start``, KubeRay).

Each actor loads the model once; there is a task per job, handed to whichever actor is free, and the driver
merges the rows back in job order, so the table is the same however the jobs ran. When the cluster has
GPUs, each actor asks for a share of one (``gpu_share``). Nothing finished is computed twice: every trace
goes through the worker's store (``KVLENS_STORE_DIR`` on its node), and the driver appends each finished
job's rows to a JSON-lines checkpoint, which a re-run reads first (after a crash, only the missing jobs run).
Jobs and rows cross processes as JSON-able dicts; nothing the grid writes or reads is pickled.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

Progress = Callable[[int, int], None]  # (jobs done, jobs in all)


class GridError(RuntimeError):
    """A job failed, or Ray could not start: one line saying which and why."""


def job_key(job: dict) -> str:
    """The checkpoint's key of a job: the sha256 of its canonical JSON."""
    return hashlib.sha256(json.dumps(job, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Worker:
    """Runs grid jobs in one process, each model loaded once (``models.shared_model`` caches it)."""

    def __init__(self, no_cache: bool = False, threads: int | None = None):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.store = None
        if not no_cache:
            from ..traces.store import TraceStore

            store = TraceStore()
            self.store = store if store.available else None

    def _model(self, job: dict):
        import torch

        from ..engine.models import shared_model

        lm = shared_model(job["model"], job.get("device", "cpu"), job.get("dtype", "float32"))
        if torch.cuda.is_available() and lm.model.device.type != "cuda":
            lm.model.to("cuda")  # Ray gave this actor (a share of) a GPU
        return lm

    def run(self, job: dict) -> list[dict]:
        lm = self._model(job)
        payload = job["payload"]
        if job["kind"] == "needle":
            from .needle import Cell, run_cell

            rows = run_cell(lm, Cell(**payload["cell"]), payload["specs"], self.store, payload["new_tokens"])
        elif job["kind"] == "sweep":
            from .sweep import sweep

            ids = lm.encode(payload["text"])[: payload["max_tokens"]]
            frame = sweep(lm, ids, [tuple(j) for j in payload["jobs"]], store=self.store,
                          max_rows=payload.get("max_rows", 32)).table
            rows = json.loads(frame.to_json(orient="records"))
            for row in rows:
                row["document"] = payload["document"]
        elif job["kind"] == "task":
            from .task_runs import run_sample

            rows = run_sample(lm, payload["task"], payload["length"], payload["sample"], payload["specs"],
                              payload["setting"], payload["chat"], self.store)
        else:
            raise ValueError(f"unknown job kind {job['kind']!r}")
        return [{"model": job["model"], **row} for row in rows]


def _read_checkpoint(path: Path | None) -> dict[str, list[dict]]:
    done: dict[str, list[dict]] = {}
    if path is None or not path.exists():
        return done
    text = path.read_text()
    if text and not text.endswith("\n"):  # cut short by a crash: the next job's line starts on a line of its own
        with path.open("a") as out:
            out.write("\n")
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            done[entry["key"]] = entry["rows"]
        except (ValueError, KeyError, TypeError):  # a line cut short by a crash: that job runs again
            continue
    return done


def pending(jobs: Sequence[dict], checkpoint: Path | None) -> list[dict]:
    """The jobs ``run_grid`` would compute: those ``checkpoint`` does not hold yet."""
    done = _read_checkpoint(checkpoint)
    return [job for job in jobs if job_key(job) not in done]


def run_grid(jobs: Sequence[dict], address: str | None = None, workers: int | None = None,
             checkpoint: Path | None = None, no_cache: bool = False, gpu_share: float | None = None,
             progress: Progress | None = None) -> list[list[dict]]:
    """The rows of every job, in job order. See the module docstring for ``address``."""
    keys = [job_key(job) for job in jobs]
    done = _read_checkpoint(checkpoint)
    todo = [i for i, key in enumerate(keys) if key not in done]
    finished = len(jobs) - len(todo)

    def record(i: int, rows: list[dict]) -> None:
        nonlocal finished
        done[keys[i]] = rows
        if checkpoint is not None:
            with checkpoint.open("a") as out:
                out.write(json.dumps({"key": keys[i], "rows": rows}) + "\n")
        finished += 1
        if progress:
            progress(finished, len(jobs))

    if todo and address is None:
        worker = Worker(no_cache=no_cache)
        for i in todo:
            try:
                record(i, worker.run(jobs[i]))
            except Exception as err:  # one line naming the job; the checkpoint keeps what finished
                raise GridError(f"job {i + 1} of {len(jobs)} failed: {_one_line(err)}") from None
    elif todo:
        _run_on_ray([(i, jobs[i]) for i in todo], address, workers, no_cache, gpu_share, record, len(jobs))
    return [done[key] for key in keys]


def _run_on_ray(todo: list[tuple[int, dict]], address: str, workers: int | None, no_cache: bool,
                gpu_share: float | None, record: Callable[[int, list[dict]], None], total: int) -> None:
    try:
        import ray
    except ImportError:
        raise GridError("--ray needs the ray package (pip install -r requirements.txt)") from None
    started = not ray.is_initialized()
    try:
        if started and address == "local":
            ray.init(num_cpus=workers or os.cpu_count() or 1, include_dashboard=False, log_to_driver=False)
        elif started:
            ray.init(address=address, log_to_driver=False)
    except Exception as err:  # a wrong address, or no cluster there
        raise GridError(f"could not start or join Ray at {address}: {str(err).splitlines()[0]}") from None
    try:
        resources = ray.cluster_resources()
        n_actors = min(len(todo), workers or max(int(resources.get("CPU", 1)), 1))
        gpus = resources.get("GPU", 0)
        share = gpu_share if gpu_share is not None else (min(1.0, gpus / n_actors) if gpus else 0)
        # One CPU (and torch thread) per actor: actors, not threads, use the cores.
        remote = ray.remote(num_cpus=1, num_gpus=share)(Worker)
        actors = [remote.remote(no_cache=no_cache, threads=1) for _ in range(n_actors)]
        queue, pending = list(todo), {}
        for actor in actors:
            if queue:
                i, job = queue.pop(0)
                pending[actor.run.remote(job)] = (i, actor)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            i, actor = pending.pop(ready[0])
            try:
                rows = ray.get(ready[0])
            except Exception as err:
                raise GridError(f"job {i + 1} of {total} failed on Ray: "
                                f"{_one_line(getattr(err, 'cause', None) or err)}") from None
            record(i, rows)
            if queue:
                j, job = queue.pop(0)
                pending[actor.run.remote(job)] = (j, actor)
    finally:
        if started:
            ray.shutdown()


def _one_line(err: BaseException) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def stderr_progress(what: str) -> Progress:
    def progress(done: int, total: int) -> None:
        print(f"{what}: {done} of {total} done", file=sys.stderr, flush=True)
    return progress
