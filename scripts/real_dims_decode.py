"""Decoding at Qwen3-30B-A3B's layer dimensions with experts offloaded: AR with and without the
look-ahead prefetch, through a real copy engine (``scripts/gpu_check.sh``).

    python scripts/real_dims_decode.py --device cuda --copy torch --layers 6 --out DIR

Builds (once, in ``--workdir``) the random-weight bf16 checkpoint of ``specfit.bench.real_dims`` with
``--layers`` layers (hidden 2048, 128 experts of width 768, top-8: one expert is 9.4 MB), writes
``--prompts`` seeded random prompts of ``--prompt-len`` token ids, and runs ``specfit bench`` on them:
``ar_full`` (every expert resident: no copies, the floor), ``ar`` (LRU cache of ``--capacity`` experts
a layer, every miss copied on demand) and ``ar_prefetch`` (the same cache, ``prefetch=auto``: the
fitted look-ahead copies each layer's predicted experts while the layer before it computes). The
bench's table and results.jsonl land in ``--out``; outputs must be identical across methods (the
bench says so). Greedy decoding of random weights repeats one token, whose experts then stay
resident, so the default samples (``--temperature 1``, seeded: every method commits the same
tokens): the tokens vary, their routing is close to random, and the LRU hit rate is near
capacity / 128, a harder case for the cache than a trained model's and the same for every method.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from specfit import cli
from specfit.bench.real_dims import QWEN3_30B_A3B, checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copy", default="torch", help="cache.copy: torch | triton | emulated")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--capacity", type=int, default=32, help="cache slots a layer (of 128 experts)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed decodes per engine first (kernel compilation)")
    ap.add_argument("--methods", default="ar_full,ar,ar_prefetch")
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    ap.add_argument("--expert-compute", default="auto", help="model.expert_compute: auto | grouped | triton | loop")
    ap.add_argument("--hidden", type=int, default=QWEN3_30B_A3B.hidden)
    ap.add_argument("--experts", type=int, default=QWEN3_30B_A3B.experts)
    ap.add_argument("--intermediate", type=int, default=QWEN3_30B_A3B.intermediate)
    ap.add_argument("--top-k", type=int, default=QWEN3_30B_A3B.top_k)
    ap.add_argument("--workdir", default="/tmp/specfit-real-dims")
    ap.add_argument("--out", default="real-dims-decode")
    args = ap.parse_args(argv)

    dims = dataclasses.replace(QWEN3_30B_A3B, layers=args.layers, hidden=args.hidden, experts=args.experts,
                               intermediate=args.intermediate, top_k=args.top_k)
    ckpt = checkpoint(dims, Path(args.workdir), device=args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    gen = torch.Generator().manual_seed(0)
    with prompts.open("w") as f:
        for _ in range(args.prompts):
            ids = torch.randint(0, dims.vocab, (args.prompt_len,), generator=gen).tolist()
            f.write(json.dumps({"prompt_ids": ids}) + "\n")
    overrides = [f"model.path={ckpt}", "model.dtype=bfloat16", f"model.device={args.device}", "workload=jsonl",
                 f"workload.path={prompts}", f"methods=[{args.methods}]", f"cache.capacity={args.capacity}",
                 f"cache.copy={args.copy}", f"max_new_tokens={args.new_tokens}", f"repeats={args.repeats}",
                 f"warmup={args.warmup}", "ignore_eos=true", f"sampling.temperature={args.temperature}",
                 f"model.expert_compute={args.expert_compute}", f"hydra.run.dir={out}"]
    print("# specfit bench", " ".join(overrides), flush=True)
    cli.main(["bench", *overrides])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
