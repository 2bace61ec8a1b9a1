"""Real copy/compute overlap of the asynchronous copy engines, measured (``scripts/gpu_check.sh``).

A stand-in for a pass over ``--layers`` MoE layers: each layer's compute is ``--matmuls`` square
matmuls on the compute stream, each layer needs ``--experts`` experts copied from the pinned host
store. Three schedules, each timed over whole passes (host wall clock, device synchronised at the
end of each pass only):

- ``copy``: the copies alone; ``compute``: the compute alone;
- ``serial``: per layer, issue its copy, wait, compute (today's on-demand runtime);
- ``pipelined``: the copy for layer l+1 is issued before layer l's compute (what a prefetcher does),
  each layer waits only on its own ticket.

``hidden`` = (serial - pipelined) / min(copy, compute): the fraction of the smaller of the two that
overlapping hid (1.0 = perfect overlap). On CPU (the dry run) copies are synchronous: expect ~0.
Prints one JSON line per copy engine, and appends them to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specfit.offload.copy.factory import make_copy_engine


def _timed(fn, device: torch.device, repeats: int) -> float:  # noqa: ANN001
    """Median seconds of ``fn()`` (one pass), the device synchronised before and after each."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])  # the first is a warm-up
    return times[len(times) // 2]


def measure(kind: str, device: torch.device, layers: int, experts: int, expert_mb: float, dim: int,
            matmuls: int, repeats: int) -> dict:
    p = int(expert_mb * 2**20) // 2  # bf16 elements per expert
    store = torch.randn(layers * experts, p, dtype=torch.bfloat16)
    if device.type == "cuda":
        store = store.pin_memory()
    slots = [torch.empty(experts, p, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    engine = make_copy_engine(kind, device)
    a = torch.randn(dim, dim, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    dst = torch.arange(experts)

    def src(layer: int) -> torch.Tensor:
        return torch.arange(layer * experts, (layer + 1) * experts)

    def compute() -> None:
        x = a
        for _ in range(matmuls):
            x = x @ a
        x.sum()

    def copies() -> None:
        for layer in range(layers):
            engine.issue(store, src(layer), slots[layer], dst).wait()

    def computes() -> None:
        for _ in range(layers):
            compute()

    def serial() -> None:
        for layer in range(layers):
            engine.issue(store, src(layer), slots[layer], dst).wait()
            compute()

    def pipelined() -> None:
        ticket = engine.issue(store, src(0), slots[0], dst)
        for layer in range(layers):
            following = engine.issue(store, src(layer + 1), slots[layer + 1], dst) if layer + 1 < layers else None
            ticket.wait()
            compute()
            ticket = following

    t = {name: _timed(fn, device, repeats) for name, fn in
         (("copy", copies), ("compute", computes), ("serial", serial), ("pipelined", pipelined))}
    hidden = (t["serial"] - t["pipelined"]) / max(min(t["copy"], t["compute"]), 1e-12)
    gb = layers * experts * p * 2 / 1e9
    return {"copy_engine": kind, "device": str(device), "layers": layers, "experts_per_layer": experts,
            "expert_mb": expert_mb, **{f"{k}_ms": round(1e3 * v, 3) for k, v in t.items()},
            "copy_gbps": round(gb / t["copy"], 2), "hidden_fraction": round(hidden, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copies", default="torch,triton")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--expert-mb", type=float, default=9.0)  # a Qwen3-30B-A3B expert in bf16
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--matmuls", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    for kind in args.copies.split(","):
        try:
            row = measure(kind, device, args.layers, args.experts, args.expert_mb, args.dim, args.matmuls,
                          args.repeats)
        except Exception as exc:  # one engine failing must not hide the others' figures
            row = {"copy_engine": kind, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
