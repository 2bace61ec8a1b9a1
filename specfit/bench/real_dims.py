"""The runtime at Qwen3-30B-A3B's layer dimensions against transformers (issue 13, "The bar").

    python -m specfit.bench.real_dims --out docs/results/real_dims.jsonl [--workdir DIR] [--device cuda]

Builds (once: ``--workdir`` keeps it for later runs) a random-weight Qwen3-MoE checkpoint with
Qwen3-30B-A3B's layer dimensions (hidden 2048, 128 experts of width 768, top-8, 32 query / 4 KV
heads of 128) but ``--layers`` (2) layers and a ``--vocab`` of 32,768 (the real 151,936 would make
the embeddings alone 1.2 GB in bf16 and the 60-row ``lm_head`` the largest matmul of the pass),
saved in bf16 with ``save_pretrained``. Then measures one 60-token pass (a prefill-like block:
60 tokens touch about as many experts as a 60-node verification) with ``cache=full``:

- **ops**: aten operations dispatched by one pass (a ``TorchDispatchMode`` counter), for specfit's
  runtime with each expert compute (``model.expert_compute``, where that setting exists) and each
  numerics (``model.numerics``, where it exists), and for transformers' own model loaded with
  ``experts_implementation="grouped_mm"``; ratio to transformers;
- **time**: median wall time per pass over ``--repeats`` passes after a warm-up, all methods
  interleaved in one loop; the ratio to transformers is the median of the per-repeat ratios
  (passes of one repeat run back to back, so a shared machine's changing load cancels out);
- **memory**: peak host memory (``ru_maxrss``) of a fresh subprocess building the engine
  (``specfit.build``, bf16, ``cache=full`` and ``cache=lru``) or running transformers'
  ``from_pretrained``, minus that of a subprocess that only imported torch and transformers, as a
  ratio to the checkpoint's bytes on disk.

The bar: ops <= 1.5x and time <= 1.1x transformers' grouped_mm; peak <= 1.5x the checkpoint with
full and lru. Prints a table; appends one JSON line per row to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

BAR_OPS = 1.5
BAR_TIME = 1.1
BAR_MEMORY = 1.5
REFERENCE = "transformers/grouped_mm"


@dataclass(frozen=True)
class Dims:
    """The checkpoint's architecture (a Qwen3MoeConfig's fields)."""

    hidden: int = 2048
    experts: int = 128
    intermediate: int = 768  # moe_intermediate_size
    top_k: int = 8
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    layers: int = 2
    vocab: int = 32768


QWEN3_30B_A3B = Dims()


@dataclass
class Row:
    """One measured method; a ratio is to transformers' grouped_mm on the same checkpoint."""

    measure: str  # ops | time | memory
    method: str  # e.g. specfit/cache=full/compute=grouped/numerics=native, transformers/grouped_mm
    value: float  # ops per pass | ms per pass | peak bytes above the baseline
    ratio: float | None  # ops and time: to transformers; memory: to the checkpoint's bytes
    bar: float | None
    met: bool | None
    extra: dict[str, Any]
    dims: dict[str, int]
    device: str
    tokens: int
    checkpoint_bytes: int
    torch: str
    transformers: str
    host: str


# ---------------------------------------------------------------------------------------- checkpoint


def qwen3_moe_config(dims: Dims) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=4 * dims.hidden,
        moe_intermediate_size=dims.intermediate, num_hidden_layers=dims.layers, num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads, head_dim=dims.head_dim, num_experts=dims.experts,
        num_experts_per_tok=dims.top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
    )


def checkpoint(dims: Dims, workdir: Path, seed: int = 0, device: str = "cpu") -> Path:
    """A bf16 checkpoint of ``dims`` in ``workdir``; reused when one with the same dims and seed is there.

    The random weights are drawn on ``device``: a GPU fills gigabytes in seconds, where the CPU
    initialisation of 4 layers at Qwen3-30B-A3B's dims took over 100 s on a 16-core GPU host. Its
    random numbers differ from the CPU's (and may differ between GPU models), so the device is part
    of the checkpoint's name."""
    device = torch.device(device).type
    suffix = "" if device == "cpu" else f"-{device}"
    path = workdir / f"qwen3moe-{'-'.join(str(v) for v in asdict(dims).values())}-s{seed}{suffix}"
    stamp = path / "real_dims.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == {"dims": asdict(dims), "seed": seed}:
        return path
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    print(f"# building the checkpoint {path} (random weights, bf16)", file=sys.stderr, flush=True)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3_moe_config(dims), dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()  # the caller builds engines next, in this process
    stamp.write_text(json.dumps({"dims": asdict(dims), "seed": seed}))
    return path


def checkpoint_bytes(path: Path) -> int:
    """The weights' bytes on disk (every safetensors file, headers included)."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# ---------------------------------------------------------------------------------------- methods


def specfit_settings(device: torch.device, compute: str = "", numerics: str = "") -> dict[str, list[str]]:
    """The ``model.`` settings this checkout has that change the pass: expert compute and numerics.

    Detected from :class:`specfit.model.config.ModelConfig`, so the harness runs before and after they
    exist. Expert compute: every implementation but ``auto`` (``triton`` on CUDA only: on a CPU it
    runs only in Triton's interpreter). ``compute`` / ``numerics``: comma lists that keep a subset."""
    from specfit.model.config import ModelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    settings: dict[str, list[str]] = {}
    if "expert_compute" in fields:
        from specfit.offload.compute.factory import IMPLEMENTATIONS

        settings["expert_compute"] = [c for c in IMPLEMENTATIONS if c != "auto" and (c != "triton" or device.type == "cuda")]
    if "numerics" in fields:
        settings["numerics"] = ["native", "exact"]
    for key, keep in (("expert_compute", compute), ("numerics", numerics)):
        wanted = [v for v in keep.split(",") if v]
        if wanted and key in settings:
            unknown = set(wanted) - set(settings[key])
            if unknown:
                raise SystemExit(f"--{key.replace('expert_', '')}: {sorted(unknown)} not among {settings[key]}")
            settings[key] = [v for v in settings[key] if v in wanted]
    return settings


def specfit_variants(settings: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every combination of ``settings``' values (one empty variant when there are none)."""
    variants: list[dict[str, str]] = [{}]
    for key, values in settings.items():
        variants = [{**v, key: value} for v in variants for value in values]
    return variants


def method_name(cache: str, variant: dict[str, str]) -> str:
    parts = [f"cache={cache}"] + [f"{k.replace('expert_', '')}={v}" for k, v in variant.items()]
    return "specfit/" + "/".join(parts)


def build_specfit(ckpt: Path, cache: str, device: str, dtype: str, variant: dict[str, str]) -> Any:
    """``specfit.build`` of the checkpoint for plain decoding: the engine (its model is the target)."""
    import specfit

    overrides = [f"model.path={ckpt}", f"model.dtype={dtype}", f"model.device={device}", "drafter=none",
                 "selector=none", f"cache={cache}"] + [f"model.{k}={v}" for k, v in variant.items()]
    return specfit.build(specfit.compose(overrides))


def build_transformers(ckpt: Path, device: str, dtype: str, experts: str = "grouped_mm") -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype), experts_implementation=experts)
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------- measures


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten operations dispatched while active (what a GPU would launch, roughly)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> int:
    with OpCounter() as counter:
        fn()
    return counter.count


def forward(model: Any, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One pass of all of ``ids`` (no KV cache kept), returning the logits."""

    def run() -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=False).logits

    return run


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall milliseconds of one call (the device synchronised before and after)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def paired_ratio(ms: list[float], reference: list[float]) -> float:
    """The median over repeats of this method's time over the reference's in the same repeat: the
    passes of one repeat run back to back, so a shared machine's load changing mid-run cancels out
    (a ratio of medians would compare passes from different load regimes)."""
    return statistics.median(m / r for m, r in zip(ms, reference))


def peak_rss(kind: str, ckpt: Path, device: str, dtype: str, variant: dict[str, str]) -> int:
    """Peak resident bytes of a fresh interpreter doing ``kind`` (see :func:`_child`)."""
    cmd = [sys.executable, "-m", "specfit.bench.real_dims", "--child", kind, "--ckpt", str(ckpt),
           "--device", device, "--dtype", dtype, "--variant", json.dumps(variant)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{kind} child failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["maxrss"])


def _child(kind: str, ckpt: Path, device: str, dtype: str, variant: dict[str, str]) -> None:
    """The body of a memory subprocess: import torch and transformers (the baseline), then build."""
    import transformers  # noqa: F401 - part of the baseline

    if kind == "transformers":
        model = build_transformers(ckpt, device, dtype)
    elif kind.startswith("specfit-"):
        model = build_specfit(ckpt, kind.removeprefix("specfit-"), device, dtype, variant)
    elif kind != "baseline":
        raise SystemExit(f"unknown --child {kind}")
    print(json.dumps({"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


# ---------------------------------------------------------------------------------------- main


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="real_dims.jsonl", help="JSONL file to append rows to")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "specfit-real-dims"),
                   help="where the checkpoint is built and kept for later runs")
    p.add_argument("--device", default="cpu", help="cpu | cuda (memory is measured on the host either way)")
    p.add_argument("--dtype", default="bfloat16", help="the engines' model.dtype (float32: an exact-identity check)")
    p.add_argument("--tokens", type=int, default=60, help="tokens in the pass")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per method (median), after one warm-up")
    p.add_argument("--measures", default="ops,time,memory", help="any of ops,time,memory")
    p.add_argument("--compute", default="", help="model.expert_compute values to run (default: every one there is)")
    p.add_argument("--numerics", default="", help="model.numerics values to run (default: every one there is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    for f in dataclasses.fields(Dims):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="{}", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        _child(args.child, Path(args.ckpt), args.device, args.dtype, json.loads(args.variant))
        return 0
    import transformers

    dims = Dims(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Dims)})
    measures = {m for m in args.measures.split(",") if m}
    if measures - {"ops", "time", "memory"}:
        raise SystemExit(f"--measures: unknown {sorted(measures - {'ops', 'time', 'memory'})}")
    device = torch.device(args.device)
    ckpt = checkpoint(dims, Path(args.workdir), args.seed, device=args.device)
    size = checkpoint_bytes(ckpt)
    settings = specfit_settings(device, args.compute, args.numerics)
    variants = specfit_variants(settings)
    common = dict(dims=asdict(dims), device=str(device), tokens=args.tokens, checkpoint_bytes=size,
                  torch=torch.__version__, transformers=transformers.__version__, host=platform.node())
    print(f"# checkpoint {ckpt}: {size / 1e9:.3f} GB bf16; {dims.layers} layers, hidden {dims.hidden}, "
          f"{dims.experts} experts x {dims.intermediate}, top-{dims.top_k}, vocab {dims.vocab:,}; "
          f"{args.tokens}-token pass, cache=full, model.dtype={args.dtype}, device {device}; "
          f"settings found: {settings or 'none (expert compute: loop; numerics: model.dtype)'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    # each part's rows are appended as soon as it ends: a run cut short by a timeout keeps them
    if measures & {"ops", "time"}:
        rows += _append(out, _pass_rows(args, ckpt, device, variants, common))
    if "memory" in measures:
        rows += _append(out, _memory_rows(args, ckpt, variants, size, common))
    _print(rows)
    print(f"# appended {len(rows)} rows to {out}")
    return 0


def _append(out: Path, rows: list[Row]) -> list[Row]:
    with out.open("a") as f:
        for r in rows:
            f.write(json.dumps(asdict(r)) + "\n")
    return rows


def _pass_rows(args: argparse.Namespace, ckpt: Path, device: torch.device, variants: list[dict[str, str]],
               common: dict[str, Any]) -> list[Row]:
    """Ops and time of one pass. For the time, every method stays alive so that the timed passes
    interleave; ops alone build, measure and free one method at a time (the peak is one model)."""
    measures = set(args.measures.split(","))
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=gen).to(device)
    builders: dict[str, Callable[[], Any]] = {
        REFERENCE: lambda: build_transformers(ckpt, str(device), args.dtype)}
    loop_of: dict[str, str] = {}  # each method's reference implementation: the loop with the same numerics
    for variant in variants:
        name = method_name("full", variant)
        builders[name] = lambda v=variant: build_specfit(ckpt, "full", str(device), args.dtype, v).model
        if "expert_compute" in variant:
            loop_of[name] = method_name("full", {**variant, "expert_compute": "loop"})
    methods: dict[str, Callable[[], torch.Tensor]] = {}
    logits: dict[str, torch.Tensor] = {}  # from the warm-up pass: outputs to compare
    ops: dict[str, int] = {}
    for name, build in builders.items():
        fn = forward(build(), ids)
        logits[name] = fn().float().cpu()
        if "ops" in measures:
            ops[name] = count_ops(fn)
        if "time" in measures:
            methods[name] = fn
        del fn
        gc.collect()
    ms: dict[str, list[float]] = {name: [] for name in builders}
    for _ in range(args.repeats if methods else 0):
        for name, fn in methods.items():
            ms[name].append(timed(fn, device))
    rows = []
    for name in builders:
        extra = {"argmax_agrees_with": {}, "identical_to": {}}
        for other in (REFERENCE, loop_of.get(name)):
            if other in logits and other != name:
                extra["argmax_agrees_with"][other] = float((logits[name].argmax(-1) == logits[other].argmax(-1)).float().mean())
                extra["identical_to"][other] = bool(torch.equal(logits[name], logits[other]))
        if name in ops:
            rows.append(Row("ops", name, ops[name], ops[name] / ops[REFERENCE], BAR_OPS if name != REFERENCE else None,
                            ops[name] / ops[REFERENCE] <= BAR_OPS if name != REFERENCE else None,
                            {**extra, "ops_per_layer": ops[name] / args.layers}, **common))
        if ms[name]:
            med, ref = statistics.median(ms[name]), statistics.median(ms[REFERENCE])
            ratio = paired_ratio(ms[name], ms[REFERENCE])
            rows.append(Row("time", name, med, ratio, BAR_TIME if name != REFERENCE else None,
                            ratio <= BAR_TIME if name != REFERENCE else None,
                            {**extra, "ms": ms[name], "ms_per_layer": med / args.layers,
                             "ratio_of_medians": med / ref}, **common))
    return rows


def _memory_rows(args: argparse.Namespace, ckpt: Path, variants: list[dict[str, str]], size: int,
                 common: dict[str, Any]) -> list[Row]:
    """Peak host memory of building, one fresh subprocess at a time, above the import baseline."""
    base = peak_rss("baseline", ckpt, "cpu", args.dtype, {})
    rows = []
    runs = [("transformers", {}, "transformers/from_pretrained")]
    # the settings that change memory: the cache, and numerics (exact keeps dense weights in fp32)
    memory_variants = list({v.get("numerics"): {k: x for k, x in v.items() if k == "numerics"} for v in variants}.values())
    for cache in ("full", "lru"):
        runs += [(f"specfit-{cache}", v, method_name(cache, v)) for v in memory_variants]
    for kind, variant, name in runs:
        peak = peak_rss(kind, ckpt, str(args.device), args.dtype, variant) - base
        bar = BAR_MEMORY if kind != "transformers" else None
        rows.append(Row("memory", name, peak, peak / size, bar, peak / size <= bar if bar else None,
                        {"baseline_bytes": base}, **common))
    return rows


def _print(rows: list[Row]) -> None:
    header = f"{'measure':<7} {'method':<58} {'value':>14} {'ratio':>7} {'bar':>5}  met  note"
    print(header)
    print("-" * len(header))
    units = {"ops": "ops", "time": "ms", "memory": "MB"}
    for r in rows:
        value = r.value / 1e6 if r.measure == "memory" else r.value
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}x"
        bar = "" if r.bar is None else f"{r.bar:.1f}x"
        met = "" if r.met is None else ("yes" if r.met else "NO")
        note = "of checkpoint" if r.measure == "memory" else f"vs {REFERENCE}"
        if r.measure != "memory" and r.extra.get("identical_to"):
            note += "; " + ", ".join(f"{'identical to' if same else 'differs from'} {o}"
                                     for o, same in r.extra["identical_to"].items())
        print(f"{r.measure:<7} {r.method:<58} {value:>10.1f} {units[r.measure]:<3} {ratio:>7} {bar:>5}  {met:<4} {note}")


if __name__ == "__main__":
    sys.exit(main())
