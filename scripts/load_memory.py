"""Peak host memory of building an engine from a checkpoint, relative to the checkpoint's bytes.

Not a test (it writes a few hundred MB and takes a minute): issue 13's bar is a peak of at most
1.5x the checkpoint's bytes in bf16 with ``cache=full`` and ``cache=lru``. Each case runs in a fresh
subprocess: a tiny engine is built first (so every module the build imports is loaded: their
memory is not the checkpoint's), the peak resident size is reset (``/proc/self/clear_refs``), then
``specfit.build`` runs; the figure is the peak (``VmHWM``) minus the resident memory before the build. ``--hf`` also measures the old path (transformers'
``from_pretrained``, then the engine copies the experts into its store).

    .venv/bin/python scripts/load_memory.py                  # the demo target and a ~200 MB random one
    .venv/bin/python scripts/load_memory.py --ckpt DIR --hf  # any checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "specfit" / "assets" / "demo" / "target"

CHILD = r"""
import gc, json, sys
import torch
torch.set_num_threads(1)
import specfit
from specfit.api import Engine

path, cache, numerics, how = sys.argv[1:5]

def status(key):
    with open("/proc/self/status") as f:
        return int(f.read().split(key + ":")[1].split()[0]) * 1024

# Warm up: every module a build imports (plug-ins, Hydra, the model's code) is imported now, on a tiny model
specfit.build(specfit.compose(["model=tiny", "model.device=cpu", f"cache={cache}", "drafter=none"]), calibrate_now=False)
from specfit.model.checkpoint import check_architecture
check_architecture(path)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident size (VmHWM) to the current one
before = status("VmRSS")
overrides = [f"model.path={path}", "model.dtype=bfloat16", f"model.numerics={numerics}", "model.device=cpu",
             f"cache={cache}", "drafter=none"]
if how == "streamed":
    engine = specfit.build(specfit.compose(overrides), calibrate_now=False)
else:
    from specfit.model.checkpoint import load_checkpoint
    from specfit.registry import get_plugins
    model = load_checkpoint(path, "bfloat16")
    policy = get_plugins()["cache"].get(cache).cls()
    engine = Engine(model, cache=policy, device="cpu", numerics=numerics)
print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"), "info": {k: engine.info.get(k) for k in (
    "expert_host_bytes", "expert_device_bytes", "dense_device_bytes", "numerics", "expert_dtype", "dense_dtype")}}))
"""


def random_checkpoint(path: Path, megabytes: int = 200) -> Path:
    """A Qwen3-MoE of random bf16 weights, about ``megabytes`` MB (experts ~95% of it), in two shards."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    layers = max(1, round(megabytes / 72))  # 32 experts x 3 x 512 x 768 x 2 bytes = 75 MB a layer
    config = Qwen3MoeConfig(vocab_size=8192, hidden_size=768, intermediate_size=1024, moe_intermediate_size=512,
                            num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                            num_experts=32, num_experts_per_tok=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size=f"{megabytes // 2 + 10}MB")
    return path


def measure(path: Path, cache: str, numerics: str, how: str) -> dict:
    with tempfile.TemporaryDirectory() as home:  # whatever the build stores goes nowhere lasting
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), cache, numerics, how], capture_output=True,
                             text=True, cwd=ROOT, check=False, env={**os.environ, "SPECFIT_HOME": home})
    if out.returncode:
        raise SystemExit(f"{path} {cache} {how}: failed\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", action="append", help="checkpoint directories (default: demo + a random one)")
    parser.add_argument("--hf", action="store_true", help="also measure from_pretrained + Engine (the old path)")
    parser.add_argument("--numerics", default="exact,native")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(p) for p in args.ckpt] if args.ckpt else [DEMO, random_checkpoint(Path(tmp) / "random")]
        print("checkpoint | MB | how | cache | numerics | peak - before (MB) | x checkpoint | expert host / device / dense MB")
        for path in paths:
            size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            for how in ["streamed"] + (["from_pretrained"] if args.hf else []):
                for cache in ("full", "lru"):
                    for numerics in args.numerics.split(","):
                        r = measure(path, cache, numerics, how)
                        grown = r["peak"] - r["before"]
                        info = r["info"]
                        mem = " / ".join(f"{(info[k] or 0) / 1e6:.1f}" for k in (
                            "expert_host_bytes", "expert_device_bytes", "dense_device_bytes"))
                        print(f"{path.name} | {size / 1e6:.1f} | {how} | {cache} | {numerics} | {grown / 1e6:.1f} | "
                              f"{grown / size:.2f} | {mem}", flush=True)


if __name__ == "__main__":
    main()
