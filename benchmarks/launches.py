"""What a GPU would be sent per prompt block, counted on the CPU: the launches, host synchronisations and copies
of the engine's device path per block, beside the model's own.

    python -m benchmarks.launches [--model gemma3-270m] [--policies sinks,h2o,tova,a2sf] [--budget 128]
                                  [--chunk 128] [--blocks 4] [--where 12] [--record] [--triton]

A run of Full plus the eviction rows in prompt mode, on the path it takes on a GPU (``attention.DEVICE_WALK``: the
running-score rows of a layer walk together, one Triton launch per block and layer). Every aten call is seen
(``TorchDispatchMode``): each that is not a view or a bare allocation would be one kernel launch on a GPU, and each
call of a Triton kernel is one more, whatever it does inside. A host synchronisation is what makes the host wait for
the GPU: a tensor read into numpy or a list (``Tensor.numpy``, ``.tolist``; on a GPU, ``.cpu().numpy()``), a value
read into Python (``aten._local_scalar_dense``: ``.item()``, ``bool(t)``), and an operation whose output's size
depends on the data (``nonzero``, ``masked_select``). A copy from the host (``torch.from_numpy``, ``torch.as_tensor``
of an array) is counted apart: it queues, it does not wait. On a CPU ``.cpu()`` is no call at all, so a sync is
counted where the data is read, which is where a GPU would wait.

The walk's kernels run in the numba walk they are tested against (``--triton``: in Triton's interpreter, at seconds a
launch; the same counts and traces). Per block is the difference between a run over ``budget + (blocks + 2) *
chunk`` tokens and one over ``budget + 2 * chunk``, divided by ``blocks``: blocks where every row evicts. "The
model's own" are the launches of the model's modules (called from the runner's forward call, with no KV Lens code in
between): as many for one row as for a batch of rows, so the rest is the engine's. ``--where N`` lists the N KV Lens
lines (the innermost frame in backend/ or kernels/) that sent most launches, and every line that synchronised or
copied. The counts do not depend on the machine: they say what the host sends, not how long the GPU takes.
"""
from __future__ import annotations

import argparse
import collections
import inspect
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend.engine import attention, runner
from kernels import eviction_walk, eviction_walk_triton
from backend.engine.runner import compute_traces, default_record_layers
from backend.policies import parse_spec

from .common import model
from .scaling import long_text

ROOT = Path(__file__).resolve().parents[1]
OURS = (str(ROOT / "backend") + os.sep, str(ROOT / "kernels") + os.sep)
ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "nonzero_static", "unique", "_unique2"}


def _ours():
    """The innermost KV Lens frame of the current call (in backend/ or kernels/), or None."""
    frame = sys._getframe(2)
    while frame is not None and not frame.f_code.co_filename.startswith(OURS):
        frame = frame.f_back
    return frame


def _site(frame) -> str:
    """A frame's file:line, or "model" for none of KV Lens's (transformers' and torch's own)."""
    return "model" if frame is None else f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_lineno}"


def _model_call() -> int:
    """The line of the runner's forward call into the model (``runner._forward``)."""
    lines, start = inspect.getsourcelines(runner._forward)
    return start + next(i for i, line in enumerate(lines) if "lm.model.model(" in line)


MODEL_CALL = _model_call()


def _the_models(frame) -> bool:
    """Was the call made by the model's own modules (under the runner's forward call, no KV Lens frame in between)?"""
    return frame is not None and frame.f_code is runner._forward.__code__ and frame.f_lineno == MODEL_CALL


class Counter(TorchDispatchMode):
    """Counts launches, syncs and host-to-device copies, and the sites that sent the launches."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.launches = self.syncs = self.copies = self.model = 0  # model: the launches of the model's own modules
        self.sites = collections.Counter() if sites else None
        self.paused = False  # inside a kernel: what it does is its one launch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.paused:
            pass
        elif name in SYNCING:
            self.sync()
        elif not func.is_view and name not in ALLOCATIONS:
            frame = _ours()
            self.launches += 1
            self.model += _the_models(frame)
            if self.sites is not None:
                self.sites[_site(frame)] += 1
        return func(*args, **(kwargs or {}))

    def sync(self) -> None:
        self.syncs += 1
        if self.sites is not None:
            self.sites["sync " + _site(_ours())] += 1

    def copy(self) -> None:
        self.copies += 1
        if self.sites is not None:
            self.sites["copy " + _site(_ours())] += 1

    @contextmanager
    def kernel(self):
        """A Triton kernel's launch: one, whatever it does inside."""
        self.launches += 1
        if self.sites is not None:
            self.sites[_site(_ours())] += 1
        self.paused = True
        try:
            with torch.utils._python_dispatch._disable_current_modes():
                yield
        finally:
            self.paused = False


class _KernelOnTheCpu:
    """Stands in for one of ``eviction_walk_triton``'s kernels: ``kernel[grid](*args, r0, ...)`` walks rows r0 ..
    r0 + grid[0] - 1 with the numba walk, the one the kernels are tested against, row after row, and counts one
    launch. Triton's interpreter takes seconds a launch, which would make a count take hours."""

    def __init__(self, counter: "Counter"):
        self.counter = counter

    def __getitem__(self, grid):
        def launch(w, flags, positions, state, probs, dropped_at, attn, params, n, width, first, held, r0, **meta):
            with self.counter.kernel():
                for r in range(r0, r0 + grid[0]):
                    _walk_row(r, w, flags, positions, state, probs, dropped_at, attn if meta["RECORD"] else None,
                              params[r].tolist(), first, held)
        return launch


def _walk_row(r, w, flags, positions, state, probs, dropped_at, attn, params, first, held):
    (budget, sinks, recent, by_position, layer, start, decay,
     gumbel, seed, layer_index, tau_init, tau_end, steps) = params
    s = int(start)
    alive = flags[r, :, s:].numpy().astype(bool)
    dropped = dropped_at[r, :, s:].numpy().copy()
    score = state[r, :, s:].numpy().copy()
    row_probs = np.zeros(probs[r, ..., s:].shape, probs.numpy().dtype)
    row_attn = np.zeros(attn[r, :, :, s:].shape) if attn is not None else np.zeros((0, 0, 0))
    eviction_walk.walk(w[r, ..., s:].numpy(), alive, positions[r, :, s:].numpy(), score, first, held - s,
                       int(budget), float(decay), bool(by_position), int(sinks), int(recent), bool(layer), row_probs,
                       dropped, row_attn, bool(gumbel), int(seed), int(layer_index), tau_init, tau_end, int(steps))
    flags[r, :, s:] = torch.from_numpy(alive.astype(np.int8))
    dropped_at[r, :, s:] = torch.from_numpy(dropped)
    state[r, :, s:] = torch.from_numpy(score)
    probs[r] = 0
    probs[r, ..., s:] = torch.from_numpy(row_probs)
    if attn is not None:
        attn[r, :, :, s:] = torch.from_numpy(row_attn)


@contextmanager
def counting(sites: bool = False, triton: bool = False):
    """A ``Counter`` that also sees numpy reads, copies from numpy and the walk's Triton launches while the block
    runs. ``triton``: the walk's own kernels, in Triton's interpreter; else their work is done by the numba walk
    outside the count (``_KernelOnTheCpu``)."""
    counter = Counter(sites)
    numpy, tolist, from_numpy, as_tensor = torch.Tensor.numpy, torch.Tensor.tolist, torch.from_numpy, torch.as_tensor
    kernels = {name: getattr(eviction_walk_triton, name) for name in ("_walk_kernel", "_walk_layer_kernel")}

    def reading(method):
        def read(self, *args, **kwargs):
            if not counter.paused:
                counter.sync()
            return method(self, *args, **kwargs)
        return read

    def copied(fn):
        def call(*args, **kwargs):
            if not counter.paused and not isinstance(args[0], torch.Tensor):  # a tensor already there: no copy
                counter.copy()
            return fn(*args, **kwargs)
        return call

    torch.Tensor.numpy, torch.Tensor.tolist = reading(numpy), reading(tolist)
    torch.from_numpy, torch.as_tensor = copied(from_numpy), copied(as_tensor)
    for name, kernel in kernels.items():
        setattr(eviction_walk_triton, name, _Counted(kernel, counter) if triton else _KernelOnTheCpu(counter))
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.numpy, torch.Tensor.tolist = numpy, tolist
        torch.from_numpy, torch.as_tensor = from_numpy, as_tensor
        for name, kernel in kernels.items():
            setattr(eviction_walk_triton, name, kernel)


class _Counted:
    """A Triton kernel whose launches are counted (``--triton``)."""

    def __init__(self, kernel, counter: "Counter"):
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kwargs):
            with self.counter.kernel():
                return launch(*args, **kwargs)
        return counted


def measure(name: str, policies: list[str], budget: int, chunk: int, blocks: int, where: int,
            triton: bool = False, record: bool = False) -> dict:
    lm = model(name, "cpu", "float32")
    ids = lm.tokenizer(long_text()).input_ids
    specs = [f"{policy}:budget={budget}" for policy in policies]
    attention.DEVICE_WALK = True  # the GPU's path: the running-score rows of a layer walk together (DeviceWalk)
    if not triton:
        eviction_walk_triton.usable = lambda device: True

    def run(tokens: int, sites: bool = False) -> Counter:
        with counting(sites, triton) as counter:
            compute_traces(lm, specs, [parse_spec(s) for s in specs], ids[:tokens], mode="prompt", chunk=chunk,
                           record_layers=default_record_layers(lm) if record else ())
        return counter

    short, long = budget + 2 * chunk, budget + (blocks + 2) * chunk
    start = time.perf_counter()
    run(short)  # warm-up: imports, first allocations
    first, last = run(short), run(long, sites=where > 0)
    per_block = {key: (getattr(last, key) - getattr(first, key)) / blocks
                 for key in ("launches", "model", "syncs", "copies")}
    per_block["model_launches"] = per_block.pop("model")
    layers = lm.n_layers
    rows = len(policies) + 1
    result = {"model": name, "rows": rows, "record": record, "layers": layers, "budget": budget, "chunk": chunk,
              "blocks": blocks,
              **per_block,
              # The model's own launches are the same for one row or a batch of them; the rest is the engine's.
              "engine_per_layer_row": (per_block["launches"] - per_block["model_launches"]) / layers / rows,
              "syncs_per_layer": per_block["syncs"] / layers, "seconds": time.perf_counter() - start}
    if where:
        # The same sites over the short run, subtracted: what the ``blocks`` blocks sent.
        sites = last.sites
        sites.subtract(run(short, sites=True).sites)
        launches = [(site, count) for site, count in sites.most_common() if not site.startswith(("sync ", "copy "))]
        waits = [(site, count) for site, count in sites.most_common() if site.startswith(("sync ", "copy ")) and count]
        result["where"] = [(site, count / blocks) for site, count in launches[:where] + waits]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m", help="a packaged model, a model directory or a .gguf")
    parser.add_argument("--policies", default="sinks,h2o,tova,a2sf")
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=128, help="prompt tokens per forward call (a block)")
    parser.add_argument("--blocks", type=int, default=4, help="blocks past the budget and two more, counted")
    parser.add_argument("--where", type=int, default=12, help="list the KV Lens lines that sent most launches")
    parser.add_argument("--record", action="store_true", help="also record the app's layers (attention, keys)")
    parser.add_argument("--triton", action="store_true",
                        help="walk in the Triton kernel itself, in Triton's interpreter (seconds a launch; the same "
                             "counts), not in the numba walk it is tested against")
    args = parser.parse_args()
    if args.triton and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--triton: set TRITON_INTERPRET=1, so that the kernel runs in Triton's interpreter on a CPU")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    r = measure(args.model, policies, args.budget, args.chunk, args.blocks, args.where, args.triton, args.record)
    print(f"{r['model']}: Full + {', '.join(policies)} at budget {r['budget']}, prompt mode, blocks of {r['chunk']}"
          f"{', recording the app layers' if r['record'] else ''}; "
          f"per block past the budget (mean of {r['blocks']}), as a GPU would be sent them:\n")
    print("| rows | layers | launches per block | the model's own | the engine's, per layer and row "
          "| host syncs per block | per layer | copies from the host per block |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {r['rows']} | {r['layers']} | {r['launches']:,.0f} | {r['model_launches']:,.0f} | "
          f"{r['engine_per_layer_row']:.1f} | {r['syncs']:.0f} | {r['syncs_per_layer']:.1f} | {r['copies']:.0f} |")
    if r.get("where"):
        print("\nWhere most launches, and every sync and copy, came from (per block):\n")
        for site, count in r["where"]:
            print(f"- {site}: {count:.1f}")
    print(f"\n({r['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
