"""Host cost of the fitted next-layer router (prefetch.source=fitted) at Qwen3-30B-A3B's router dims.

48 MoE layers, hidden 2048, 128 experts, random router weights; times ``observe`` for passes of
1, 60 and 2048 tokens (learning and the one refit a pass may do included), one pair's refit, and
the memory it holds. CPU by default;
``--device cuda`` where there is one.

    python scripts/next_router_cost.py [--threads 2] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from specfit.plugins._kit.next_router import NextLayerRouter
from specfit.plugins._kit.router_probe import Router

LAYERS, HIDDEN, EXPERTS = 48, 2048, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        routers = [Router((torch.randn(EXPERTS, HIDDEN, generator=g) * 0.02).to(device, dtype), None, torch.nn.Identity())
                   for _ in range(LAYERS)]
        router = NextLayerRouter(routers)
        for tokens in (1, 60, 2048):
            xs = [torch.randn(tokens, HIDDEN, generator=g).to(device, dtype) for _ in range(LAYERS)]
            for layer in range(LAYERS):  # warm-up
                router.observe(layer, xs[layer])
            repeats = 20 if tokens < 100 else 3
            sync()
            start = time.perf_counter()
            for _ in range(repeats):
                for layer in range(LAYERS):
                    router.observe(layer, xs[layer])
            sync()
            seconds = (time.perf_counter() - start) / repeats
            print(f"{str(dtype):15s} pass of {tokens:4d} tokens: {1e3 * seconds:8.2f} ms, {1e6 * seconds / LAYERS:8.1f} us a layer")
        sync()
        start = time.perf_counter()
        router.fit(0)
        sync()
        tensors = [*router.gram, *router.cross, router._hidden, *router.project, *router.weight, *router.bias,
                   *router.fused, *router.fused_bias, router.last]
        state = sum(t.numel() * t.element_size() for t in tensors)
        print(f"{'':15s} one pair's refit {1e3 * (time.perf_counter() - start):.2f} ms (a pass refits at most one); "
              f"state {state / 2**20:.1f} MiB (the stacked router weights included)")


if __name__ == "__main__":
    main()
