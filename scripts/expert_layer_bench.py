"""One offloaded MoE layer at real dimensions: aten ops and time per expert compute implementation.

    .venv/bin/python scripts/expert_layer_bench.py [--device cpu] [--impls loop,grouped] [--dtypes float32,bfloat16]

Random weights in Qwen3-30B-A3B's layer dimensions (hidden 2048, 128 experts of width 768, top-8),
one pass of ``--tokens`` (60) tokens through ``OffloadRuntime.run_layer`` with every expert resident
(``cache=full``: no copies, only the compute). Reports, per dtype and implementation, the aten
operations one layer dispatches (a ``TorchDispatchMode`` counter), the median wall time of the
layer over ``--repeats`` runs, and the largest difference from ``loop`` (the reference). A quick
measurement, not a test; ``specfit.bench.real_dims`` is the full benchmark against transformers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from specfit.offload.copy.factory import make_copy_engine
from specfit.offload.store import HostExpertStore
from specfit.offload.discovery import moe_spec
from specfit.offload.runtime import OffloadRuntime
from specfit.plugins.caches.full import FullCache


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _Experts(nn.Module):
    """Shapes only (meta): the store holds the weights."""

    def __init__(self, experts: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden, dtype=dtype, device="meta"))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter, dtype=dtype, device="meta"))
        self.act_fn = nn.SiLU()


class _Layer(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts


class _Model(nn.Module):
    def __init__(self, args: argparse.Namespace, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_experts_per_tok=args.top_k)
        self.layers = nn.ModuleList([_Layer(_Experts(args.experts, args.hidden, args.intermediate, dtype))])


def runtime(args: argparse.Namespace, store: HostExpertStore, impl: str, dtype: torch.dtype) -> OffloadRuntime:
    model = _Model(args, dtype)
    device = torch.device(args.device)
    return OffloadRuntime(model, FullCache(), make_copy_engine("torch", device), device, store=store, compute=impl)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--impls", default="loop,grouped")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--activations", default="same", help="same (hidden in the weights' dtype) or float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON line per row instead of a table")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(args.seed)
        spec = moe_spec(_Model(args, dtype))
        # small values keep bf16 and fp32 outputs comparable; generated once, shared by every runtime
        weights = torch.randn(spec.num_experts, spec.expert_numel, generator=gen, dtype=dtype).mul_(0.02)
        act_dtype = dtype if args.activations == "same" else getattr(torch, args.activations)
        hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device, act_dtype)
        logits = torch.randn(args.tokens, args.experts, generator=gen)
        top_w, top_i = logits.softmax(-1).topk(args.top_k, dim=-1)
        top_i, top_w = top_i.to(device), top_w.to(device, act_dtype)
        runtimes, outputs, ops = {}, {}, {}
        for impl in args.impls.split(","):
            store = HostExpertStore(spec)  # cache=full releases the store's layer after the preload: one each
            store.layers[0] = weights
            rt = runtimes[impl] = runtime(args, store, impl, dtype)
            rt.run_layer(0, hidden, top_i, top_w, nn.SiLU())  # warm-up (and Triton's autotuning)
            counter = OpCounter()
            with counter:
                outputs[impl] = rt.run_layer(0, hidden, top_i, top_w, nn.SiLU())
            ops[impl] = counter.ops
        times: dict[str, list[float]] = {impl: [] for impl in runtimes}
        for _ in range(args.repeats):  # interleaved: a shared machine's drift spreads over every implementation
            for impl, rt in runtimes.items():
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                rt.run_layer(0, hidden, top_i, top_w, nn.SiLU())
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[impl].append(time.perf_counter() - start)
        reference = next(iter(outputs.values()))
        for impl, rt in runtimes.items():
            out = outputs[impl]
            diff = (out.float() - reference.float()).abs().max().item()
            rows.append({"dtype": dtype_name, "activations": str(act_dtype).removeprefix("torch."), "impl": rt.compute.name,
                         "tokens": args.tokens, "distinct_experts": int(top_i.unique().numel()), "ops": ops[impl],
                         "ms": round(1000 * statistics.median(times[impl]), 2), "max_diff_vs_first": diff,
                         "identical_to_first": bool(torch.equal(out, reference)), "device": str(device)})
        del runtimes, outputs
        del weights
    for row in rows:
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{row['dtype']:>9} act {row['activations']:>9} {row['impl']:>8}: {row['ops']:5d} ops  "
                  f"{row['ms']:9.2f} ms/layer  max|diff| vs {args.impls.split(',')[0]} {row['max_diff_vs_first']:.3g}"
                  f"{' (identical)' if row['identical_to_first'] else ''}  ({row['distinct_experts']} experts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
