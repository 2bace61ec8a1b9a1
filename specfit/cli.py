"""``specfit <command> [overrides]``: every argument after the command is a Hydra override.

Hydra's own flags work too (``--cfg job`` prints the composed config, ``-m`` sweeps, ``--help``).
Problems the user can fix are printed as one line (``specfit: error: ...``), exit status 2.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

from specfit.errors import SpecfitError

USAGE = """usage: specfit <command> [key=value ...] [hydra flags]

commands:
  demo       decode built-in prompts with several methods and print the comparison (the main job)
  bench      compare methods side by side:  specfit bench methods=[ar,eagle3,specfit] workloads=[prose,gsm]
  generate   decode a prompt:  specfit generate model.path=DIR prompt="..." cache=lru cache.capacity=16
  calibrate  measure the cost model's constants for this model, cache, copy engine and machine
  record     write a trace of every position of the greedy output:  specfit record model=tiny trace.path=DIR
  replay     run selectors, caches and cost models over a trace, vs the oracle:
             specfit replay trace.path=DIR selector=specfit predictor=history cache=lru cache.capacity=16
  report     results.jsonl files or run directories -> report.md with PNG plots
  plugins    list registered plugins (--json for machine-readable output)
  train-tokenizer / train-target / train-drafter
             train a BPE tokenizer, a Qwen3-MoE target, an EAGLE-3 head (for any supported MoE target)
  eval-target  held-out perplexity against a unigram baseline, and repetition in greedy output

Overrides use Hydra syntax; `specfit <command> --cfg job` shows every key. Docs: docs/user-guide.md
"""

# command -> (primary config, job)
HYDRA_COMMANDS: dict[str, str] = {"generate": "config", "demo": "demo", "bench": "bench", "calibrate": "calibrate",
                                 "record": "record", "replay": "replay"}

# command -> (module, config dataclass, function): trainers, configured by their dataclass alone
TRAIN_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train-tokenizer": ("specfit.training.tokenizer", "TrainTokenizerConfig", "train_tokenizer"),
    "train-target": ("specfit.training.target", "TrainTargetConfig", "train_target"),
    "train-drafter": ("specfit.training.drafter", "TrainDrafterConfig", "train_drafter"),
    "eval-target": ("specfit.training.target", "EvalTargetConfig", "eval_target"),
}

# Hydra flags that take a value: skipped when pre-validating overrides.
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}
_SWEEP = re.compile(r"(^|=)\s*(range|choice|glob|interval|shuffle|sort|tag)\(|,")


def _fail(message: str) -> None:
    print(f"specfit: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def plain_overrides(args: list[str]) -> list[str]:
    """The key=value overrides of ``args`` that compose() can check up front (no flags, sweeps, hydra.*)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a.startswith("-"):
            skip = a in _FLAGS_WITH_VALUE
            continue
        key = a.split("=", 1)[0].lstrip("+~")
        if "=" in a and not key.startswith("hydra") and not _SWEEP.search(a.split("=", 1)[1] if "=" in a else a):
            out.append(a)
    return out


def _job(command: str) -> Callable:
    def job(cfg, output_dir: Path, overrides: list[str]) -> None:
        if command == "generate":
            from specfit.commands.generate import run

            run(cfg, output_dir)
        elif command in ("demo", "bench"):
            from specfit.commands.bench import run

            run(cfg, output_dir, overrides)
        elif command == "calibrate":
            from specfit.commands.calibrate import run

            run(cfg, output_dir)
        elif command == "record":
            from specfit.commands.record import run

            run(cfg, output_dir)
        elif command == "replay":
            from specfit.commands.replay import run

            run(cfg, output_dir, overrides)

    return job


def _trainer(command: str) -> Callable:
    """Store the trainer's config dataclass as a Hydra config and return the job that runs it."""
    import importlib

    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    module_name, config_class, function = TRAIN_COMMANDS[command]
    module = importlib.import_module(module_name)
    ConfigStore.instance().store(name=command, node=getattr(module, config_class))

    def job(cfg, output_dir: Path, overrides: list[str]) -> None:
        result = getattr(module, function)(OmegaConf.to_object(cfg))
        print(f"{command}: wrote {result}")

    return job


def _run_hydra(command: str, args: list[str]) -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from specfit.config import compose
    from specfit.registry import get_plugins

    get_plugins()  # plugin configs must be in Hydra's ConfigStore before it composes
    if command in TRAIN_COMMANDS:
        job = _trainer(command)
        config_name = command
    else:
        job = _job(command)
        config_name = HYDRA_COMMANDS[command]
    overrides = plain_overrides(args)
    is_query = any(a in ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i") for a in args)
    if not is_query and not any(a in ("-m", "--multirun") for a in args):
        compose(overrides, config_name=config_name)  # one clear line for a bad key, before Hydra's verbose report

    @hydra.main(version_base="1.3", config_path="pkg://specfit.conf", config_name=config_name)
    def app(cfg) -> None:
        hc = HydraConfig.get()
        try:
            job(cfg, Path(hc.runtime.output_dir), list(hc.overrides.task))
        except SpecfitError as exc:
            _fail(str(exc))

    sys.argv = [f"specfit-{command}", *args]
    app()


def _report(args: list[str]) -> None:
    import argparse

    from specfit.report import write_report

    parser = argparse.ArgumentParser(prog="specfit report", description="results.jsonl files or run directories -> report.md and PNG plots")
    parser.add_argument("results", nargs="+", help="results.jsonl files, or directories searched for them (a sweep)")
    parser.add_argument("--out", default=None, help="output directory (default: beside the first results)")
    ns = parser.parse_args(args)
    first = Path(ns.results[0])
    out = Path(ns.out) if ns.out else (first if first.is_dir() else first.parent)
    print(f"report: {write_report(ns.results, out)}")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, rest = args[0], args[1:]
    try:
        if command == "plugins":
            from specfit.commands.plugins import run

            run(as_json="--json" in rest)
        elif command == "report":
            _report(rest)
        elif command in HYDRA_COMMANDS or command in TRAIN_COMMANDS:
            _run_hydra(command, rest)
        else:
            _fail(f"unknown command {command!r}\n{USAGE}")
    except SpecfitError as exc:
        _fail(str(exc))


if __name__ == "__main__":
    main()
