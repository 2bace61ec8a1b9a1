"""Is speculative decoding in bf16 lossless? Divergence of EAGLE-3 and SpecFit from AR (issue 13).

    python -m specfit.bench.numerics --out docs/results/numerics.jsonl [--prompts 12] [--max-new-tokens 64]

For the demo pair loaded in bf16 (``model.dtype=bfloat16``) and the tiny families (tiny-qwen3-moe,
tiny-olmoe, tiny-mixtral: their seeded random weights saved as a bf16 checkpoint, so that the fp32
reference reads the same values; a random EAGLE-3 head; random prompts), and for
each ``model.numerics`` (``native``, ``exact``; where the setting does not exist yet, the one
numerics ``model.dtype`` gives), decodes greedily with AR, EAGLE-3 and SpecFit (the
``method_presets`` of the same names) and compares token by token:

- each speculative method against **the same engine settings' AR output** (the bar: identical),
- every method against an **fp32 reference** (AR with ``model.dtype=float32``; fp32 is exact).

A row counts the prompts whose output differs and the first differing position of each. The demo
pair decodes the prose workload's held-out prompts (``workload=prose``, from the data directory),
or the package's ``assets/demo/prompts.jsonl`` when the data directory is missing (the output says
which). Also reports time per generated token (wall clock on this machine; all engines of a model
decode prompt by prompt in turn) of each row, so native and exact can be compared on CPU. Prints a table; appends one JSON line per row to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

METHODS = ("ar", "eagle3", "specfit")
TINY_FAMILIES = ("tiny-qwen3-moe", "tiny-olmoe", "tiny-mixtral")
DEFAULT_NUMERICS = "model.dtype"  # the label when ModelConfig has no numerics setting (before issue 13)
# SpecFit's cost constants (seconds) unless --calibrate: a GPU-like setup (Qwen3-30B-A3B expert misses over
# PCIe 4.0), fixed so that no run spends minutes calibrating; they decide the tree sizes verified, not the
# tokens (greedy output is the same for any constants when decoding is lossless).
FIXED_CONSTANTS = ("cost_model.c0=0.01", "cost_model.c_tok=0.0002", "cost_model.c_miss=0.0004",
                   "cost_model.c_hit=0.00001", "cost_model.c_level=0.002", "cost_model.c_draft0=0.001")


@dataclass
class Row:
    model: str  # demo | a tiny family
    dtype: str  # model.dtype of the compared run
    numerics: str  # native | exact | model.dtype (no numerics setting in this checkout)
    method: str  # ar | eagle3 | specfit
    against: str  # "ar": the same settings' AR output; "fp32": AR in float32
    prompts: int
    differ: int  # prompts whose output is not token-identical
    first_diff: list[int | None]  # per prompt: the first differing position (None: identical)
    ms_per_token: float  # wall time of the compared run per generated token
    tokens: int  # generated tokens in the compared run, all prompts
    prompt_source: str
    torch: str
    host: str


@dataclass
class Run:
    """One engine's outputs over the prompts."""

    outputs: list[list[int]]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


def numerics_settings() -> list[str]:
    """``model.numerics``' values when this checkout has the setting, else the one ``model.dtype`` gives."""
    from specfit.model.config import ModelConfig

    has = any(f.name == "numerics" for f in dataclasses.fields(ModelConfig))
    return ["native", "exact"] if has else [DEFAULT_NUMERICS]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def demo_prompts(count: int) -> tuple[list[str], str]:
    """The prose workload's held-out prompts, or the shipped demo prompts when the data is missing."""
    import specfit
    from specfit.errors import SpecfitError
    from specfit.workloads import load_workload

    try:
        cfg = specfit.compose(["model=demo", "workload=prose", f"workload.num_prompts={count}"])
        prompts = load_workload(cfg.workload)[:count]
        if len(prompts) == count:
            return [str(p) for p in prompts], f"workload=prose (held-out documents, {count} prompts)"
    except SpecfitError:
        pass
    from specfit.config import asset_path

    lines = Path(asset_path("demo/prompts.jsonl")).read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][:count]
    return prompts, f"specfit/assets/demo/prompts.jsonl ({len(prompts)} prompts; the data directory is missing)"


def random_prompts(count: int, vocab: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=length).tolist() for _ in range(count)]


def tiny_checkpoint(name: str, workdir: Path, seed: int) -> Path:
    """A tiny family's seeded weights saved in bf16, so that the bf16 runs and the fp32 reference
    read the same values (a built-in model made in each dtype would have different random weights)."""
    from specfit.model.builtin import build_builtin
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = workdir / f"{name}-s{seed}"
    if not (path / "config.json").is_file():
        build_builtin(name, seed=seed, dtype=torch.float32).to(torch.bfloat16).save_pretrained(path)
    return path


def build_engine(model: Sequence[str], method: str, dtype: str, numerics: str, max_new_tokens: int,
                 extra: Sequence[str] = ()) -> Any:
    """An engine for one method (a ``method_presets`` entry) on CPU, greedy; ``model``: the model's
    overrides; ``extra``: overrides for the methods with a cost model."""
    import specfit

    preset = list(specfit.compose(list(model)).method_presets[method])
    overrides = [*model, *preset, f"model.dtype={dtype}", "model.device=cpu", f"max_new_tokens={max_new_tokens}",
                 "ignore_eos=true"]
    if any(o.startswith("cost_model=") for o in preset):
        overrides += extra
    if numerics not in (DEFAULT_NUMERICS, "-"):
        overrides.append(f"model.numerics={numerics}")
    return specfit.build(specfit.compose(overrides))


def decode_interleaved(engines: dict[tuple[str, str, str], Any], prompts: Sequence[Any]) -> dict[tuple[str, str, str], Run]:
    """Every engine's greedy outputs over ``prompts``, prompt by prompt across engines (a shared
    machine's drift spreads over all of them); each engine is warmed up first, not charged."""
    for engine in engines.values():
        engine.generate(prompts[0], max_new_tokens=2)
    runs = {key: Run([], 0.0) for key in engines}
    for prompt in prompts:
        for key, engine in engines.items():
            start = time.perf_counter()
            runs[key].outputs.append(list(engine.generate(prompt).token_ids))
            runs[key].seconds += time.perf_counter() - start
    return runs


def compare(model: str, dtype: str, numerics: str, method: str, against: str, run: Run, reference: Run,
            source: str) -> Row:
    diffs = [first_difference(o, r) for o, r in zip(run.outputs, reference.outputs)]
    return Row(model, dtype, numerics, method, against, len(diffs), sum(d is not None for d in diffs), diffs,
               run.seconds * 1e3 / max(run.tokens, 1), run.tokens, source, torch.__version__, platform.node())


def measure_model(model: str, overrides: Sequence[str], prompts: Sequence[Any], source: str, max_new_tokens: int,
                  numerics: Sequence[str], methods: Sequence[str], dtype: str = "bfloat16",
                  extra: Sequence[str] = ()) -> list[Row]:
    """Every (numerics, method) of one model against its AR and against fp32 AR."""
    print(f"# {model}: {len(prompts)} prompts from {source}, {max_new_tokens} new tokens", file=sys.stderr, flush=True)
    reference = ("float32", "-", "ar")
    keys = [reference] + [(dtype, n, m) for n in numerics for m in methods]
    engines = {key: build_engine(overrides, key[2], key[0], key[1], max_new_tokens, extra) for key in keys}
    runs = decode_interleaved(engines, prompts)
    fp32 = runs[reference]
    rows = [compare(model, "float32", "-", "ar", "fp32", fp32, fp32, source)]  # the reference's own time
    for n in numerics:
        for m in methods:
            run = runs[(dtype, n, m)]
            if m != "ar":
                rows.append(compare(model, dtype, n, m, "ar", run, runs[(dtype, n, "ar")], source))
            rows.append(compare(model, dtype, n, m, "fp32", run, fp32, source))
    return rows


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="numerics.jsonl", help="JSONL file to append rows to")
    p.add_argument("--prompts", type=int, default=12, help="prompts per model")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--models", default="demo," + ",".join(TINY_FAMILIES), help="demo and/or tiny families")
    p.add_argument("--methods", default=",".join(METHODS), help="ar (always) and any of eagle3,specfit")
    p.add_argument("--dtype", default="bfloat16", help="the compared runs' model.dtype (the reference is float32)")
    p.add_argument("--tiny-prompt-len", type=int, default=24)
    p.add_argument("--calibrate", action="store_true",
                   help="SpecFit's cost model calibrated per setup (minutes each) instead of fixed constants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = ["ar"] + [m for m in args.methods.split(",") if m and m != "ar"]
    if set(methods) - set(METHODS):
        raise SystemExit(f"--methods: unknown {sorted(set(methods) - set(METHODS))}; choose from {', '.join(METHODS)}")
    numerics = numerics_settings()
    extra = () if args.calibrate else FIXED_CONSTANTS
    rows: list[Row] = []
    workdir = Path(tempfile.mkdtemp(prefix="specfit-numerics-"))
    for model in [m for m in args.models.split(",") if m]:
        if model == "demo":
            prompts, source = demo_prompts(args.prompts)
            rows += measure_model("demo", ["model=demo"], prompts, source, args.max_new_tokens, numerics, methods, args.dtype,
                                  extra)
        elif model in TINY_FAMILIES:
            from specfit.model.builtin import builtin_config

            vocab = builtin_config(model).vocab_size
            prompts = random_prompts(args.prompts, vocab, args.tiny_prompt_len, args.seed)
            source = (f"random token ids (seed {args.seed}, {args.tiny_prompt_len} tokens); weights of model.builtin="
                      f"{model} (seed {args.seed}) saved in bf16; random EAGLE-3 head")
            ckpt = tiny_checkpoint(model, workdir, args.seed)
            rows += measure_model(model, [f"model.path={ckpt}"], prompts, source, args.max_new_tokens, numerics,
                                  methods, args.dtype, extra)
        else:
            raise SystemExit(f"--models: unknown {model!r}; choose from demo, {', '.join(TINY_FAMILIES)}")
    shutil.rmtree(workdir, ignore_errors=True)
    _print(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for r in rows:
            f.write(json.dumps(asdict(r)) + "\n")
    print(f"# appended {len(rows)} rows to {out}")
    return 0


def _print(rows: list[Row]) -> None:
    header = f"{'model':<15} {'dtype':<9} {'numerics':<11} {'method':<8} {'vs':<5} {'differ':>7} {'first diff':<16} {'ms/tok':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        firsts = sorted(d for d in r.first_diff if d is not None)
        first = ",".join(map(str, firsts[:4])) + ("..." if len(firsts) > 4 else "") if firsts else "-"
        vs = "self" if r.dtype == "float32" and r.method == "ar" else r.against
        print(f"{r.model:<15} {r.dtype:<9} {r.numerics:<11} {r.method:<8} {vs:<5} {r.differ:>3}/{r.prompts:<3} "
              f"{first:<16} {r.ms_per_token:>7.1f}")


if __name__ == "__main__":
    sys.exit(main())
