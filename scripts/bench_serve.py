"""Benchmark specfit serve on the demo pair: requests/s, time to first token and inter-token
latency (p50, p99) for AR and SpecFit, each server on 127.0.0.1 with streamed requests from a few
concurrent clients. Not a test: numbers depend on the machine (and on how busy it is).

    python scripts/bench_serve.py [--requests 32] [--clients 4] [--max-tokens 48] [--methods ar,specfit]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx
import torch
from omegaconf import OmegaConf

import specfit
from specfit.serve.runner import BackgroundServer

METHODS = {
    "ar": ["drafter=none", "selector=none"],
    "eagle3": ["drafter=eagle3", "selector=eagle3"],
    "specfit": ["drafter=eagle3", "selector=specfit", "cost_model=union", "predictor=history"],
}
PROMPTS = ["Once upon a time", "And God said unto Moses", "KING HENRY:", "Natalia has 48 apples and"]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


def bench(method: str, requests: int, clients: int, max_tokens: int) -> dict[str, float]:
    cfg = specfit.compose(["model=demo", *METHODS[method], "server.port=0", f"server.max_waiting={requests}"],
                          config_name="serve")
    with BackgroundServer(specfit.build(cfg), OmegaConf.to_object(cfg.server)) as server:
        ttft, itl, tokens, lock = [], [], [0], threading.Lock()
        todo = list(range(requests))

        def client() -> None:
            with httpx.Client(timeout=300) as c:
                while True:
                    with lock:
                        if not todo:
                            return
                        i = todo.pop()
                    body = {"model": "specfit", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,
                            "temperature": 0, "stream": True}
                    start = last = time.perf_counter()
                    first = True
                    with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if not line.startswith("data:") or line == "data: [DONE]":
                                continue
                            ids = json.loads(line[5:])["choices"][0]["token_ids"]
                            if not ids:
                                continue
                            now = time.perf_counter()
                            with lock:
                                tokens[0] += len(ids)
                                if first:
                                    ttft.append(now - start)
                                else:  # a cycle of several tokens: its interval shared among them
                                    itl.extend([(now - last) / len(ids)] * len(ids))
                            first, last = False, now

        threads = [threading.Thread(target=client) for _ in range(clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    return {"req/s": requests / wall, "tok/s": tokens[0] / wall, "ttft_p50_ms": 1e3 * pct(ttft, 0.5),
            "ttft_p99_ms": 1e3 * pct(ttft, 0.99), "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--methods", default="ar,specfit")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the demo pair is small)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.requests} streamed requests, {args.clients} clients, max_tokens={args.max_tokens}, greedy")
    print(f"{'method':<9} {'req/s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)")
    for method in args.methods.split(","):
        r = bench(method, args.requests, args.clients, args.max_tokens)
        print(f"{method:<9} {r['req/s']:7.2f} {r['tok/s']:7.1f} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:9.1f} "
              f"{r['itl_p50_ms']:8.2f} {r['itl_p99_ms']:8.2f}")


if __name__ == "__main__":
    main()
