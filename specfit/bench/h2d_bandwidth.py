"""Pinned-host-to-device bandwidth of the copy engines for Qwen3-30B-A3B-sized experts (CUDA only).

Compares, per batch size (experts per call):

- ``triton``: :class:`TritonCopyEngine`, one kernel reading pinned host memory zero-copy;
- ``torch``: :class:`TorchCopyEngine`, one ``copy_(non_blocking=True)`` per expert;
- ``memcpy``: a single ``dst.copy_(src)`` of the same total bytes, contiguous (one large
  ``cudaMemcpyAsync``): the link's practical ceiling.

Timing: CUDA events on the current stream bracket ``iters`` back-to-back calls. The engines order
their copy stream after the current stream and make it wait on their completion event, so the
events cover every copy fully. Each iteration copies different source experts (rotating through the
whole store, far larger than L2) so no run is served from cache. Results print as a table and are
appended as JSONL.

    python -m specfit.bench.h2d_bandwidth --out docs/results/h2d_bandwidth.jsonl
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass
class BenchRow:
    engine: str
    batch: int
    expert_bytes: int
    bytes_per_batch: int
    iters: int
    ms_per_batch: float  # CUDA-event time per call
    gbps: float  # bytes_per_batch / event time, GB/s (1e9)
    wall_ms_per_batch: float  # host wall time per call over the same loop (includes launch overhead)
    correct: bool
    settings: dict
    device: str
    torch: str
    triton: str | None


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=128, help="experts in the host store (Qwen3-30B-A3B: 128)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-30B-A3B: 2048)")
    p.add_argument("--intermediate", type=int, default=768, help="expert intermediate size (Qwen3-30B-A3B: 768)")
    p.add_argument("--batches", default="1,8,32,64", help="experts per copy call, comma separated")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--triton-configs", default="16384x4,65536x8",
        help="Triton block_bytes x num_warps settings to try, comma separated",
    )
    p.add_argument("--out", default="h2d_bandwidth.jsonl", help="JSONL file to append results to")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _random_store(E: int, P: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Random expert weights in pinned host memory, generated on the GPU one expert at a time."""
    store = torch.empty(E, P, dtype=dtype, pin_memory=True)
    g = torch.Generator(device=device).manual_seed(seed)
    for e in range(E):
        store[e].copy_(torch.randn(P, generator=g, device=device, dtype=torch.float32).to(dtype))
    torch.cuda.synchronize(device)
    return store


def _time_loop(fn, iters: int, device: torch.device) -> tuple[float, float]:  # noqa: ANN001
    """(event ms per call, host wall ms per call) for ``iters`` calls of ``fn(k)``."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    start.record(stream)
    for k in range(iters):
        fn(k)
    end.record(stream)
    end.synchronize()
    wall = time.perf_counter() - t0
    return start.elapsed_time(end) / iters, wall * 1e3 / iters


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "h2d_bandwidth: no CUDA device (torch.cuda.is_available() is False); this benchmark measures "
            "pinned-host-to-GPU copies and needs a GPU with a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2

    from specfit.offload.copy.torch import TorchCopyEngine
    from specfit.offload.copy.triton import TritonCopyEngine

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None

    device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    E, H, I = args.experts, args.hidden, args.intermediate
    P = 3 * I * H  # gate_up [2I, H] + down [H, I]
    elem = torch.finfo(dtype).bits // 8
    expert_bytes = P * elem
    batches = [int(b) for b in args.batches.split(",") if b]
    if max(batches) > E:
        raise SystemExit(f"largest batch {max(batches)} exceeds --experts {E}")
    S = max(batches)
    dev_name = torch.cuda.get_device_name(device)
    print(
        f"# {dev_name}; torch {torch.__version__}; triton {triton_version}; host {platform.node()}; "
        f"expert {expert_bytes:,} B (H={H}, I={I}, bf16); store {E} experts = {E * expert_bytes / 1e9:.2f} GB pinned"
    )

    store = _random_store(E, P, dtype, device, args.seed)
    slots = torch.empty(S, P, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(args.seed)

    engines: list[tuple[str, object, dict]] = []
    for cfg in [c for c in args.triton_configs.split(",") if c]:
        block_bytes, num_warps = (int(x) for x in cfg.split("x"))
        eng = TritonCopyEngine(device, block_bytes=block_bytes, num_warps=num_warps, timing="none")
        engines.append(("triton", eng, eng.describe()))
    eng = TorchCopyEngine(device, timing="none")
    engines.append(("torch", eng, eng.describe()))

    rows: list[BenchRow] = []
    total_iters = args.warmup + args.iters
    for b in batches:
        bytes_per_batch = b * expert_bytes
        perm = torch.randperm(E, generator=gen)
        # Iteration k reads experts perm[(k*b + j) % E]: different experts each call, so L2 (tens of
        # MB) never holds the source; destinations are a random subset of slots.
        src_sets = [perm[(torch.arange(b) + k * b) % E] for k in range(total_iters)]
        dst = torch.randperm(S, generator=gen)[:b]

        for name, engine, settings in engines:
            def call(k: int, engine=engine) -> None:  # noqa: ANN001
                engine.copy(store, src_sets[k % total_iters], slots, dst)

            for k in range(args.warmup):  # includes Triton JIT compilation on the first call
                call(k)
            torch.cuda.synchronize(device)
            ms, wall_ms = _time_loop(lambda k: call(args.warmup + k), args.iters, device)
            last = src_sets[(args.warmup + args.iters - 1) % total_iters]
            correct = bool(torch.equal(slots[dst].cpu().view(torch.int16), store[last].view(torch.int16)))
            rows.append(BenchRow(name, b, expert_bytes, bytes_per_batch, args.iters, ms,
                                 bytes_per_batch / (ms * 1e-3) / 1e9, wall_ms, correct, settings,
                                 dev_name, torch.__version__, triton_version))

        # One contiguous cudaMemcpyAsync of the same bytes; the source block start rotates likewise.
        n_starts = E - b + 1
        dst_block = slots[:b]

        def memcpy(k: int) -> None:
            s0 = (k * b) % n_starts
            dst_block.copy_(store[s0 : s0 + b], non_blocking=True)

        for k in range(args.warmup):
            memcpy(k)
        ms, wall_ms = _time_loop(lambda k: memcpy(args.warmup + k), args.iters, device)
        s_last = ((args.warmup + args.iters - 1) * b) % n_starts
        correct = bool(torch.equal(dst_block.cpu().view(torch.int16), store[s_last : s_last + b].view(torch.int16)))
        rows.append(BenchRow("memcpy", b, expert_bytes, bytes_per_batch, args.iters, ms,
                             bytes_per_batch / (ms * 1e-3) / 1e9, wall_ms, correct,
                             {"name": "memcpy", "op": "dst.copy_(src, non_blocking=True)"},
                             dev_name, torch.__version__, triton_version))

    header = f"{'engine':<8} {'settings':<22} {'batch':>5} {'MB/batch':>9} {'ms/batch':>9} {'GB/s':>7} {'wall ms':>8} ok"
    print(header)
    print("-" * len(header))
    for r in rows:
        tag = f"block={r.settings['block_bytes']},w={r.settings['num_warps']}" if r.engine == "triton" else ""
        print(f"{r.engine:<8} {tag:<22} {r.batch:>5} {r.bytes_per_batch / 1e6:>9.1f} {r.ms_per_batch:>9.3f} "
              f"{r.gbps:>7.2f} {r.wall_ms_per_batch:>8.3f} {'yes' if r.correct else 'NO'}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for r in rows:
            f.write(json.dumps(asdict(r)) + "\n")
    print(f"# wrote {len(rows)} rows to {out}")
    return 0 if all(r.correct for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
