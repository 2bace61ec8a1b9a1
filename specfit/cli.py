"""``specfit <command> [overrides]``: every argument after the command is a Hydra override.

Hydra's own flags work too (``--cfg job`` prints the composed config, ``-m`` sweeps, ``--help``).
How a run ends, whatever went wrong (``verbose=true`` or ``HYDRA_FULL_ERROR=1`` adds the traceback):

- a problem the user can fix (a SpecfitError, a Hydra/OmegaConf config error, a file that cannot be
  read or written): one line ``specfit: error: ...`` on stderr, exit status 2;
- Ctrl-C: ``specfit: interrupted``, exit status 130;
- anything else is a bug: ``specfit: internal error: <Type>: <message> (...)``, exit status 1.
"""

from __future__ import annotations

import itertools
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

from specfit.errors import ConfigError, SpecfitError

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
  serve      an OpenAI-compatible HTTP server for one engine (same config as generate):
             specfit serve model=demo drafter=eagle3 selector=specfit cost_model=union predictor=history server.port=8000
  plugins    list registered plugins (--json for machine-readable output)
  train-tokenizer / train-target / train-drafter
             train a BPE tokenizer, a Qwen3-MoE target, an EAGLE-3 head (for any supported MoE target)
  eval-target  held-out perplexity against a unigram baseline, and repetition in greedy output
             (out=FILE; default: evaluation.json in the run directory):  specfit eval-target model_dir=DIR
  distill-data  the target's greedy continuations of training-split prompts, as .npy rows for
             train-drafter's train_files (self-distillation):  specfit distill-data target_dir=DIR out=F.npy
  fit-acceptance  fit the learned acceptance model on a trace, score every estimator on held-out ones:
             specfit fit-acceptance trace.path=DIR held_out=[DIR2]
  fit-probe  fit a trained EAGLE-3 head's acceptance probe on the target's own text (rows from distill-data):
             specfit fit-probe target_dir=DIR head_dir=HEAD train_files=[rows.npy] eval_files=[heldout.npy]

Overrides use Hydra syntax; `specfit <command> --cfg job` shows every key. A mistake is one line
(exit status 2); verbose=true adds the traceback. Docs: docs/user-guide.md
"""

# command -> (primary config, job)
HYDRA_COMMANDS: dict[str, str] = {"generate": "config", "demo": "demo", "bench": "bench", "calibrate": "calibrate",
                                 "record": "record", "replay": "replay", "serve": "serve"}

# command -> (module, config dataclass, function): trainers, configured by their dataclass alone
TRAIN_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train-tokenizer": ("specfit.training.tokenizer", "TrainTokenizerConfig", "train_tokenizer"),
    "train-target": ("specfit.training.target", "TrainTargetConfig", "train_target"),
    "train-drafter": ("specfit.training.drafter", "TrainDrafterConfig", "train_drafter"),
    "eval-target": ("specfit.training.target", "EvalTargetConfig", "eval_target"),
    "distill-data": ("specfit.training.distill", "DistillDataConfig", "distill_data"),
    "fit-acceptance": ("specfit.commands.fit_acceptance", "FitAcceptanceConfig", "fit_acceptance"),
    "fit-probe": ("specfit.training.probe", "FitProbeConfig", "fit_probe"),
}

_TRUE = ("true", "1", "yes", "on")


def _fail(message: str) -> NoReturn:
    print(f"specfit: error: {_one_line(message)}", file=sys.stderr)
    raise SystemExit(2)


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def _from_config_library(exc: BaseException) -> bool:
    """Hydra and OmegaConf raise their own types for config mistakes (an override that does not parse)."""
    return any(c.__module__.split(".")[0] in ("hydra", "omegaconf") for c in type(exc).__mro__)


def exit_for(exc: BaseException, verbose: bool = False) -> NoReturn:
    """End the process for ``exc``: one line and an exit status (see the module docstring).

    A command that saved its progress when interrupted may say how to resume in the
    KeyboardInterrupt it re-raises: ``raise KeyboardInterrupt("resume with: specfit ...")``.
    """
    if isinstance(exc, KeyboardInterrupt):
        note = _one_line(str(exc))
        print(f"specfit: interrupted{'; ' + note if note else ''}", file=sys.stderr)
        raise SystemExit(130)
    if isinstance(exc, SystemExit):
        raise exc
    if isinstance(exc, BrokenPipeError):  # `specfit plugins --json | head`: the reader left; nothing to say
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        except (OSError, ValueError):  # stdout is no file (captured): nothing will flush to the pipe
            pass
        raise SystemExit(1)
    if verbose:
        traceback.print_exception(exc)
    if isinstance(exc, SpecfitError):
        _fail(str(exc))
    if _from_config_library(exc):
        from specfit.config import one_line_config_error

        _fail(one_line_config_error(exc))
    if isinstance(exc, OSError):  # the machine, not specfit: a missing or unwritable path, a full disk
        _fail(f"{exc.filename}: {exc.strerror or exc}" if exc.filename is not None else str(exc))
    hint = "" if verbose else " (run with verbose=true for the traceback)"
    print(f"specfit: internal error: {type(exc).__name__}: {_one_line(str(exc))}{hint}", file=sys.stderr)
    raise SystemExit(1)


def verbose_requested(args: list[str]) -> bool:
    """``verbose=true`` among the overrides, or HYDRA_FULL_ERROR=1 (Hydra's own switch for tracebacks)."""
    if os.environ.get("HYDRA_FULL_ERROR", "").strip().lower() in _TRUE:
        return True
    return any(a.split("=", 1)[1].strip().lower() in _TRUE for a in args if _is_verbose(a))


def _is_verbose(arg: str) -> bool:
    from specfit.config import override_key

    return "=" in arg and override_key(arg) == "verbose"


def _hydra_args(args: list[str]):
    """Parse the command line as Hydra will, so that a bad flag is one line, not argparse's usage."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()

    def error(message: str) -> NoReturn:
        stray = message.removeprefix("unrecognized arguments:").split()
        if message.startswith("unrecognized arguments:") and stray and all("=" in a for a in stray):
            raise ConfigError(f"the settings {' '.join(stray)} come after a Hydra flag that ends the settings: keep "
                              f"all key=value settings together, the flags before or after them "
                              f"(e.g. -m model=demo max_new_tokens=8,16, or model=demo --cfg job)")
        raise ConfigError(f"{message} (settings are key=value; Hydra flags: --cfg job, -m, --help)")

    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(args)


def _parsed_overrides(args: list[str]) -> Iterator[tuple[str, Any]]:
    """Each override of ``args`` (flags and their values skipped) with Hydra's parse of it, or None
    where it does not parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, skip = OverridesParser.create(), False
    for a in args:
        if skip:
            skip = False
            continue
        if a.startswith("-"):
            skip = a in ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                         "--config-dir", "-cd", "--experimental-rerun")
            continue
        try:
            yield a, parser.parse_overrides([a])[0]
        except Exception:  # noqa: BLE001 - compose() or Hydra names the problem
            yield a, None


def _settings(args: list[str]) -> Iterator[tuple[str, Any]]:
    """:func:`_parsed_overrides` without Hydra's own settings (``hydra.*``: Hydra checks them)."""
    from specfit.config import override_key

    for a, parsed in _parsed_overrides(args):
        key = override_key(a)
        if not (key == "hydra" or key.startswith("hydra.")):
            yield a, parsed


def plain_overrides(args: list[str]) -> list[str]:
    """The overrides of ``args`` that compose() can check up front (no flags, sweeps or hydra.* keys).

    An override that does not parse is kept: compose() then reports it in one line."""
    return [a for a, parsed in _settings(args) if parsed is None or not parsed.is_sweep_override()]


#: A sweep's jobs checked before the first one runs (each compose takes tens of milliseconds).
SWEEP_JOBS_CHECKED = 64


def sweep_jobs(args: list[str]) -> list[list[str]]:
    """The overrides of each job a ``-m`` sweep runs, as Hydra's basic sweeper expands it (every
    combination of the comma lists and ranges), without ``hydra.*`` keys; an override that does not
    parse is kept as it is, so compose() names it."""
    import itertools

    axes = []
    for _, parsed in _settings(args):
        if parsed is not None and parsed.is_sweep_override():
            try:
                axes.append([f"{parsed.get_key_element()}={v}" for v in parsed.sweep_string_iterator()])
            except Exception:  # noqa: BLE001 - a sweep only its sweeper enumerates (interval(...)): it checks
                return []
    plain = plain_overrides(args)
    return [plain + list(combo) for combo in itertools.islice(itertools.product(*axes), SWEEP_JOBS_CHECKED)]


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
        elif command == "serve":
            from specfit.commands.serve import run

            run(cfg, output_dir)

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


def _run_hydra(command: str, args: list[str], verbose: bool) -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from specfit.config import check_config, compose, store_configs

    store_configs()  # plugin configs must be in Hydra's ConfigStore before it composes
    if command in TRAIN_COMMANDS:
        job = _trainer(command)
        config_name = command
    else:
        job = _job(command)
        config_name = HYDRA_COMMANDS[command]
    _check_override_syntax(command, args)
    flags = _hydra_args(args)
    is_query = flags.help or flags.hydra_help or flags.cfg or flags.info or flags.shell_completion
    elsewhere = flags.config_path or flags.config_name or flags.config_dir or flags.experimental_rerun
    if not is_query:
        _note_given_twice(args)
    elif flags.cfg:  # say what it shows: the keys of the options chosen, not of every option
        print(f"# specfit {command} --cfg {flags.cfg}: the config these settings compose (the keys of the chosen "
              f"options; another option's keys: choose it, e.g. cache=none --cfg job); every group's options: "
              f"specfit {command} --help", file=sys.stderr)
    if not (is_query or elsewhere or flags.multirun):
        # one clear line for a bad key or value, before Hydra starts and before any model is built
        values = _override_values(args)
        _check_command_keys(command, values)  # first: a key this command ignores needs no checking of its value
        try:
            composed = compose(plain_overrides(args), config_name=config_name)
        except ConfigError:
            if command not in METHOD_COMMANDS:
                raise
            args = _fold_method_overrides(command, args, config_name)  # keys only some methods have, or a clearer error
            values = _override_values(args)
            composed = compose(plain_overrides(args), config_name=config_name)
        check_config(composed)
        _check_prompt_or_workload(values)
        _check_run_dir(values)
    elif flags.multirun and not (is_query or elsewhere):  # every job (up to 64), before the first one runs
        for overrides in sweep_jobs(args):
            try:
                composed = compose(overrides, config_name=config_name)
            except ConfigError as exc:
                if command in METHOD_COMMANDS:
                    _explain_unfolded(command, overrides, config_name, exc)
                raise
            check_config(composed)
            _check_prompt_or_workload(_override_values(overrides))
            _check_command_keys(command, _override_values(overrides))
        _check_run_dir(_override_values(args), "hydra.sweep.dir")

    @hydra.main(version_base="1.3", config_path="pkg://specfit.conf", config_name=config_name)
    def app(cfg) -> None:
        hc = HydraConfig.get()
        try:
            check_config(cfg)  # again: a multirun job's config was not checked up front
            _check_prompt_or_workload(_override_values(list(hc.overrides.task)))
            job(cfg, Path(hc.runtime.output_dir), list(hc.overrides.task))
        except BaseException as exc:  # noqa: BLE001 - a multirun job's error would be swallowed by Hydra
            exit_for(exc, verbose)

    sys.argv = [f"specfit-{command}", *args]
    full_error = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises its errors: main() prints them as one line
    try:
        app()
    finally:
        if full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = full_error


# commands that compare methods (methods=[...], method_presets)
METHOD_COMMANDS = ("bench", "demo", "replay")


def _fold_method_overrides(command: str, args: list[str], config_name: str) -> list[str]:
    """``args`` with the overrides only some methods have moved into their presets
    (:func:`specfit.commands.bench.fold_method_overrides`); flags and ``hydra.*`` keys stay as they are.
    A replay's keys are checked first: a ``drafter.*`` key must not hide among the presets' drafters."""
    from specfit.commands.bench import fold_method_overrides

    plain = plain_overrides(args)
    if command == "replay":
        from specfit.commands.replay import check_replay_overrides

        check_replay_overrides(plain)
    folded = fold_method_overrides(plain, config_name)
    if folded is plain:
        return args
    return [a for a in args if a not in plain or a in folded] + [o for o in folded if o not in args]


def _explain_unfolded(command: str, overrides: list[str], config_name: str, error: ConfigError) -> None:
    """A sweep job's overrides failed to compose: where a plain run would have moved some of them
    into the presets of the methods that take them, say so (a sweep cannot: Hydra composes each job
    from its overrides as given); where no method takes one, the fold's own error names it."""
    folded = _fold_method_overrides(command, overrides, config_name)  # a replay's keys checked first
    moved = [o for o in overrides if o not in folded]
    if moved:
        takers = [o.split("=", 1)[0].lstrip("+").removeprefix("method_presets.") for o in folded
                  if o.lstrip("+").startswith("method_presets.")]
        raise ConfigError(f"{error}. {', '.join(moved)} only applies to some methods ({', '.join(takers)}): a plain "
                          "run moves it into their presets, a -m sweep cannot; run one plain command per value, "
                          "or sweep the preset itself") from None


# groups only some commands read: given to another, they would change nothing without a word
_COMMAND_GROUPS = {"replay": ("replay",), "trace": ("record", "replay"), "server": ("serve",)}


# groups a command does not read, and why
_UNREAD_GROUPS = {"record": (("selector", "predictor", "acceptance"),
                             "records with its own selector (every node any selector could verify) and predicts "
                             "nothing, so {key} does not apply; give it to specfit replay")}
# whole keys (not groups) a command does not take: the demo decodes its own prompts (workload.max_prompts
# still limits them)
_COMPARISON_KEYS = ("methods", "method_presets", "workloads", "repeats", "warmup", "baseline", "answers_dir")
_ONE_DECODE = ("decodes with the config's own parts, so {key} (a comparison setting) does not apply; "
               "compare methods with specfit bench {key}=...")
_UNTAKEN_KEYS = {"demo": (("workload", "workloads"),
                          "decodes its shipped prompts, so {key} does not apply (their rows would be labelled "
                          "demo); for other workloads: specfit bench model=demo workloads=[prose,gsm]"),
                 "generate": (_COMPARISON_KEYS, _ONE_DECODE),
                 "calibrate": (_COMPARISON_KEYS, _ONE_DECODE),
                 "serve": ((*_COMPARISON_KEYS, "prompt", "prompt_ids", "prompt_file"),
                           "serves its clients' prompts, so {key} does not apply; the config's sampling and "
                           "max_new_tokens are the requests' defaults")}


def _check_command_keys(command: str, values: dict[str, Any]) -> None:
    """``replay.*`` for ``specfit replay``, ``trace.*`` for ``record`` and ``replay``: elsewhere, one line;
    so for a group a command does not read (``selector`` for ``record``). A trainer's command (its own
    dataclass: only its keys, ``trace.path`` for fit-acceptance) is not asked."""
    if command not in HYDRA_COMMANDS:
        return
    unread, why = _UNREAD_GROUPS.get(command, ((), ""))
    untaken, untaken_why = _UNTAKEN_KEYS.get(command, ((), ""))
    for key in values:
        name = key.lstrip("+~")
        if name.startswith("method_presets."):  # +method_presets.NAME=[...] adds a method
            name = "method_presets"
        if name in untaken:
            raise ConfigError(f"{name}: specfit {command} {untaken_why.format(key=name)}")
        group = name.split(".", 1)[0]
        if group in unread:
            raise ConfigError(f"{name}: specfit {command} {why.format(key=name)}")
        readers = _COMMAND_GROUPS.get(group)
        if readers and command not in readers:
            by = " and ".join(f"specfit {r}" for r in readers)
            raise ConfigError(f"{name}: only {by} read{'s' if len(readers) == 1 else ''} it; "
                              f"specfit {command} would ignore it")


def _check_override_syntax(command: str, args: list[str]) -> None:
    """The first mistakes of a shell command line, each one line with its fix: a value the shell
    split at a space (``prompt=Hello world``), or a comma that makes the value a Hydra list
    (``prompt=Hello, world``). Other parse errors are left to compose(), which names them."""
    overrides = list(_parsed_overrides(args))

    def words_from(start: int) -> list[str]:  # the bare words (no '=') from overrides[start] on
        return [a for a, _ in itertools.takewhile(lambda o: "=" not in o[0], overrides[start:])]

    def stdin_hint(key: str) -> str:
        return "; or read the prompt from standard input: prompt_file=-" if key == "prompt" else ""

    for i, (arg, parsed) in enumerate(overrides):
        if parsed is not None:
            continue
        key, eq, value = arg.partition("=")
        if not eq:
            if not (i and "=" in overrides[i - 1][0]):
                raise ConfigError(f"{arg!r} is not a key=value setting (e.g. model=demo prompt='Hi'; "
                                  f"`specfit {command} --help` lists the keys to start with)")
            k, _, v = overrides[i - 1][0].partition("=")
            whole = " ".join([v, *words_from(i)])
            raise ConfigError(f"{arg!r} is not a key=value setting: the shell split {k}={whole} at a space; quote the "
                              f"whole setting, '{k}={whole}'{stdin_hint(k)}")
        if "," in value and not value.lstrip().startswith(("[", "{", "'", '"')):
            words = words_from(i + 1)
            text = " ".join([value, *words]).replace('"', '\\"')
            raise ConfigError(f"cannot parse {arg}{' ' + ' '.join(words) if words else ''}: a comma makes the "
                              f"value a list for Hydra; quote it inside the shell's quotes, '{key}=\"{text}\"'"
                              f"{stdin_hint(key)}")


def _note_given_twice(args: list[str]) -> None:
    """Of a key given twice Hydra keeps the last value: said, not refused, since a script that adds
    an override to a base command line (as the tests do) means exactly that."""
    from specfit.messages import note_once

    seen: dict[str, str] = {}
    for arg, parsed in _parsed_overrides(args):
        if parsed is None or parsed.is_delete():  # compose() names the first; ~key after key=... is its own error
            continue
        key = parsed.key_or_group
        if key in seen and seen[key] != arg:
            note_once(f"{key} is given twice ({seen[key]}, then {arg}): the last one applies")
        seen[key] = arg


def _override_values(args: list[str]) -> dict[str, Any]:
    """Each plain override's key and value as Hydra parses them (quotes stripped, lists as lists;
    None for ``key=null`` and ``~key``). Sweeps and overrides that do not parse are left out:
    compose() or Hydra report the latter."""
    return {o.key_or_group: None if o.is_delete() else o.value()
            for _, o in _parsed_overrides(args) if o is not None and not o.is_sweep_override()}


def _check_prompt_or_workload(values: dict[str, Any]) -> None:
    """A prompt replaces the workload's prompts (``specfit demo prompt=...`` runs the demo on it), so
    a workload the user names beside a prompt would be ignored without a word: say so instead."""
    def names_a_workload(key: str, value: Any) -> bool:  # the inline workload is the prompt itself
        if not (key in ("workload", "workloads") or key.startswith("workload.")):
            return False
        return any(v != "inline" for v in value) if isinstance(value, list) else value not in (None, "inline")

    prompt = next((k for k in ("prompt", "prompt_ids", "prompt_file") if values.get(k) is not None), None)
    workload = next((k for k, v in values.items() if names_a_workload(k, v)), None)
    if prompt and workload:
        raise ConfigError(f"give {prompt} or {workload}, not both: {prompt} replaces the workload's prompts")


def _check_run_dir(values: dict[str, Any], key: str = "hydra.run.dir") -> None:
    """An explicit ``hydra.run.dir`` (a sweep's ``hydra.sweep.dir``) that cannot be created is named,
    not reported as a bare path. Called last among the checks: it creates the folder, as Hydra would next."""
    run_dir = values.get(key)
    if not isinstance(run_dir, str) or "${" in run_dir:  # an interpolation is Hydra's to resolve
        return
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{key}={run_dir}: cannot create the run folder: {exc.strerror or exc}") from exc


def _arg_parser(prog: str, description: str):
    """argparse, but a mistake is one ``specfit: error:`` line rather than usage and a message."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise ConfigError(f"{prog}: {message} (see {prog} --help)")

    return Parser(prog=prog, description=description)


def _report(args: list[str]) -> None:
    from specfit.commands.report import write_report

    parser = _arg_parser("specfit report", "results.jsonl files or run directories -> report.md and PNG plots")
    parser.add_argument("results", nargs="+", help="results.jsonl files, or directories searched for them (a sweep)")
    parser.add_argument("--out", default=None, help="output directory (default: beside the first results)")
    ns = parser.parse_args(args)
    first = Path(ns.results[0])
    out = Path(ns.out) if ns.out else (first if first.is_dir() else first.parent)
    print(f"report: {write_report(ns.results, out)}")


def _plugins(args: list[str]) -> None:
    from specfit.commands.plugins import run

    parser = _arg_parser("specfit plugins", "list registered plugins")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    run(as_json=parser.parse_args(args).json)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    if args[0] == "--version":
        from specfit.version import __version__

        print(f"specfit {__version__}")
        return
    command, rest = args[0], args[1:]
    verbose = verbose_requested(rest)
    if command in TRAIN_COMMANDS:
        rest = [a for a in rest if not _is_verbose(a)]  # a CLI switch here, not a trainer setting
    try:
        if command == "plugins":
            _plugins(rest)
        elif command == "report":
            _report(rest)
        elif command in HYDRA_COMMANDS or command in TRAIN_COMMANDS:
            _run_hydra(command, rest, verbose)
        else:
            known = ", ".join([*HYDRA_COMMANDS, "report", "plugins", *TRAIN_COMMANDS])
            _fail(f"unknown command {command!r} (commands: {known}; `specfit --help` shows how to use them)")
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every way a run can end gets its one line
        exit_for(exc, verbose)


if __name__ == "__main__":
    main()
