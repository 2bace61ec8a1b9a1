"""``specfit bench`` (and ``specfit demo``): methods side by side on the same prompts.

Each method is a list of overrides (``method_presets``) composed on top of the job's config, per
workload. Engines are built once per (method, workload), over one load of the model (its experts
in one host store that every method's engine reads); prompts then run interleaved across
methods, ``repeats`` times, so drift of a shared machine spreads evenly over the methods. One JSON
line per run goes to the results file as soon as the run completes (so an interrupted bench
keeps every completed run, and ``resume=true`` skips them); the table reports means, with speedups
against the baseline (autoregressive decoding) and against vanilla EAGLE-3 without a cache, and the
paired speed-up over the baseline: the geometric mean of run-by-run ratios with a 95% bootstrap
interval, which says whether the run resolved a difference on a noisy machine. With several
workloads, a last table takes them all together.

A method whose selector does not require a cost model runs without one (the base config selects
``cost_model=union`` for every method so that its keys can be overridden), so only the methods that
use a cost model calibrate one. ``answers_dir=DIR`` also writes Spec-Bench's answer files.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from specfit.api import build, load_shared_target, model_settings
from specfit.model.loading import LoadedModel
from specfit.commands.generate import describe_prompts, prompts_of
from specfit.config import (TAKES_ALL_PROMPTS, compose, given_overrides, num_prompts_unused, override_key,
                            unread_workload_key)
from specfit.errors import ConfigError
from specfit.files import check_results_file, check_writable, read_jsonl, write_atomic
from specfit.progress import progress
from specfit.messages import note_once
from specfit.registry import get_plugins
from specfit.results import append_jsonl, comparison_table, mean_stats, paired_fields, run_config, spec_bench_answers


# What `specfit demo` means on a CPU, printed under its table.
CPU_DEMO_NOTE = """\
What this means: on this CPU a draft level of the demo head costs about as much as a target pass, so
drafting rarely pays and speculative methods run near autoregressive speed (SpecFit's draft gate
stops drafting where it loses; vanilla EAGLE-3 drafts every cycle and pays for it). On a GPU running
Qwen3-30B-A3B with offloaded experts a level costs a fraction of a millisecond and a pass is dominated
by expert transfers: there the question is which subtree is worth its experts' copies. To see that,
record a trace and replay it under a GPU cost profile (MODELLED, not measured):
  specfit record model=demo drafter=eagle3 workload=jsonl 'workload.path=${specfit.asset:demo/prompts.jsonl}' \\
      trace.path=traces/demo
  specfit replay trace.path=traces/demo methods=[ar,eagle3,specfit] replay.cost_profile=qwen3-30b-a3b-24gb-pcie4
Measured and modelled figures, with their commands: docs/results.md."""


def _config_name() -> str:
    return HydraConfig.get().job.config_name if HydraConfig.initialized() else "bench"


def method_config(cfg: DictConfig, method: str, workload: str | None, overrides: list[str]) -> DictConfig:
    """The config of one method: the job's overrides on top of its preset.

    An override applies to every method whose config has that key (``drafter.top_k=4`` changes
    the EAGLE-3 methods and leaves ``ar`` alone); :func:`check_overrides` makes sure each one
    applies to at least one method, so a typo is still an error. A group the preset also names
    takes the command line's choice (``methods=[specfit] predictor=oracle`` replays SpecFit with
    the oracle predictor, not the preset's history predictor), as in any Hydra command line.
    """
    if method not in cfg.method_presets:
        raise ConfigError(f"methods: {method!r} has no entry in method_presets (known: {', '.join(cfg.method_presets)})")
    preset = list(cfg.method_presets[method])
    others = [list(cfg.method_presets[m]) for m in cfg.get("methods") or () if m != method and m in cfg.method_presets]
    note_replaced_choices(method, preset, overrides, others)
    last = [f"workload={workload}"] if workload else []  # the run's workload, from workloads=[...]
    try:
        return compose(preset + overrides + last, config_name=_config_name())
    except ConfigError:
        check_preset(method, preset + last)
        usable = [o for o in overrides if _composes(preset + [o] + last)]
        return compose(preset + usable + last, config_name=_config_name())


# the groups method presets tell their methods apart by (a cost model only acts where the selector requires one)
PART_GROUPS = ("drafter", "selector", "predictor", "acceptance", "cache", "prefetch")


def _choices(preset: list[str]) -> dict[str, str]:
    return dict(o.lstrip("+").split("=", 1) for o in preset if "=" in o)


def note_replaced_choices(method: str, preset: list[str], overrides: list[str],
                          others: list[list[str]] = ()) -> None:
    """Say once (stderr) where the command line changes what a method's preset makes of it: a group
    or key the preset sets otherwise (``cache=lru`` gives ``ar_nocache`` a cache,
    ``selector.draft_gate=true`` turns ``specfit_nogate``'s gate on), or a part group it leaves to the
    base config where another method of the run (``others``, their presets) sets it: ``prefetch=auto``
    makes ``ar`` prefetch too, beside ``ar_prefetch``. The user asked for it, but may not know it."""
    chosen = _choices(preset)
    set_elsewhere = {k for p in others for k in _choices(p)}
    for o in overrides:
        key, sep, value = o.lstrip("+").partition("=")
        if not sep:
            continue
        if key in chosen and chosen[key] != value:
            note_once(f"{o} replaces method {method}'s {key}={chosen[key]}")
        elif key in PART_GROUPS and key not in chosen and key in set_elsewhere:
            note_once(f"{o} applies to method {method} too (its preset leaves {key} to the base config)")


def without_unused_cost_model(cfg: DictConfig) -> DictConfig:
    """``cfg`` without its cost model when the selector does not require one (``requires``).

    Such a selector never consults it, so the method's output and timing are the same without it,
    and it neither calibrates (minutes, for ``ar`` or ``eagle3``) nor is recorded as if it were used.
    (``specfit replay`` keeps it: a replay charges every method's cycles with the cost model.)
    """
    if cfg.get("cost_model") is None:
        return cfg
    selector = get_plugins()["selector"].get(cfg.selector.name).cls
    if "cost_model" not in selector.requires:
        cfg.cost_model = None
    return cfg


def fold_method_overrides(overrides: list[str], config_name: str) -> list[str]:
    """``overrides`` with each one that only some methods' parts have moved into those methods' presets.

    Hydra composes the base config with every override before the job starts, so
    ``methods=[ar,ar_prefetch] prefetch.gate=false`` would fail there (the base's ``prefetch=none``
    has no gate) although it is meant for ``ar_prefetch``, whose ``prefetch=auto`` has one. Such an
    override joins the presets it composes with (``method_presets.ar_prefetch=[..., "prefetch.gate=false"]``),
    so each method's recorded config says what it ran with; one no method takes is left as it was,
    for the usual one-line error.
    """
    if _composes(overrides, config_name):
        return overrides
    kept: list[str] = []
    deferred: list[str] = []
    for o in overrides:  # in order: a group choice (prefetch=auto) lets its keys compose after it
        (kept if _composes(kept + [o], config_name) else deferred).append(o)
    cfg = compose(kept, config_name=config_name)
    presets = {str(m): list(cfg.method_presets[m]) for m in cfg.get("methods") or () if m in cfg.method_presets}
    grown: dict[str, list[str]] = {}
    moved: set[str] = set()
    for o in deferred:
        for m, preset in presets.items():
            if _composes(preset + kept + [o], config_name):
                grown.setdefault(m, list(preset)).append(o)
                moved.add(o)
    for o in deferred:
        if o not in moved:  # no method takes it: the error of a method whose preset chose its group says why
            _raise_for_a_chooser(o, presets, kept, config_name)
    if not moved:
        return overrides
    keys = {f"method_presets.{m}" for m in grown}
    prefix = {override_key(o): o[: len(o) - len(o.lstrip("+"))] for o in overrides if override_key(o) in keys}
    rest = [o for o in overrides if o not in moved and override_key(o) not in keys]
    return rest + [f"{prefix.get(f'method_presets.{m}', '')}method_presets.{m}="  # +/++ as the user added it
                   f"[{','.join(json.dumps(e, ensure_ascii=False) for e in preset)}]" for m, preset in grown.items()]


def _raise_for_a_chooser(override: str, presets: dict[str, list[str]], kept: list[str], config_name: str) -> None:
    """For an override no method takes (``prefetch.gat=false``): the error composing it with the first
    method whose preset chooses its group (``ar_prefetch``: prefetch=auto, "did you mean prefetch.gate?"),
    which names the key better than the base config's choice (``prefetch=none`` has no settings)."""
    group = override_key(override).split(".", 1)[0]
    for m, preset in presets.items():
        choice = _choices(preset).get(group)
        if choice is not None:
            try:
                compose(preset + kept + [override], config_name=config_name)
            except ConfigError as exc:
                raise ConfigError(f"{override}: no method of methods={list(presets)} takes it; in {m} "
                                  f"({group}={choice}): {exc}") from None


def _composes(overrides: list[str], config_name: str | None = None) -> bool:
    try:
        compose(overrides, config_name=config_name or _config_name())
        return True
    except ConfigError:
        return False


def check_preset(method: str, preset: list[str]) -> None:
    """A :class:`ConfigError` naming ``method_presets.<method>`` when its entries do not compose."""
    try:
        compose(preset, config_name=_config_name())
    except ConfigError as exc:
        raise ConfigError(f"method_presets.{method}={preset}: does not compose ({exc})") from exc


def check_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """Each method is named once, and each override applies to at least one of them (a typo is an error)."""
    twice = sorted({str(m) for m in cfg.methods if list(cfg.methods).count(m) > 1})
    if twice:
        raise ConfigError(f"methods={list(cfg.methods)} names {', '.join(twice)} more than once: rows are labelled by "
                          "method, so a second run of one would be indistinguishable (use repeats=N for more runs)")
    if any(_composes(list(cfg.method_presets.get(m, [])) + overrides) for m in cfg.methods):
        return  # one method takes them all: one composition instead of one per override and method
    for m in cfg.methods:  # a broken preset is the preset's fault, not the first override's
        check_preset(m, list(cfg.method_presets.get(m, [])))
    for o in overrides:
        if not any(_composes(list(cfg.method_presets.get(m, [])) + [o]) for m in cfg.methods):
            compose([o], config_name=_config_name())  # raises the error that names the key
            raise ConfigError(f"override {o!r} applies to none of the methods {list(cfg.methods)}")


def _progress(total: int, initial: int = 0) -> Any:
    """A bar on a terminal, else one line per completed run (stderr)."""
    return progress(total, "bench", unit="run", initial=initial)


# keys of a bench row that are not the run's stats (the rest is ``GenerationOutput.stats``)
_ROW_KEYS = {"command", "method", "workload", "workload_kind", "workload_split", "prompt_index", "repeat", "config",
             "output_ids", "accept_lengths"}


def resume_command(output_dir: Path, replace: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> str:
    """The command line that continues this job: its overrides (less the keys in ``drop``),
    ``resume=true``, the same run directory."""
    replace = dict(replace or {})
    command, task, hydra = "bench", [], []
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        command, task = hc.job.config_name, list(hc.overrides.task)
        hydra = [o for o in hc.overrides.hydra if not o.startswith(("hydra.run.dir=", "hydra.mode="))]
    args = []
    for o in task:
        key = override_key(o)
        if key == "resume" or key in drop:
            continue
        args.append(f"{key}={replace.pop(key)}" if key in replace else o)
    args += [f"{k}={v}" for k, v in replace.items()] + hydra + ["resume=true", f"hydra.run.dir={output_dir}"]
    return " ".join(["specfit", command, *map(shlex.quote, args)])


def _completed(path: Path, configs: dict[str, DictConfig]) -> dict[tuple[str, str, int, int], dict[str, Any]]:
    """Bench rows already in the results file whose method config is this job's (``resume=true``)."""
    if not path.is_file():
        return {}
    wanted = {m: _plain(c) for m, c in configs.items()}
    done = {}
    for row in read_jsonl(path):
        method = row.get("method")
        if row.get("command") == "bench" and method in wanted and _plain(row.get("config")) == wanted[method]:
            done[(row.get("workload"), method, row.get("prompt_index"), row.get("repeat"))] = row
    return done


# keys that choose which runs a job makes, not what one run does: a resumed job may change them
# (e.g. add a method or a repeat to a finished bench)
_JOB_KEYS = ("resume", "methods", "workloads", "repeats", "method_presets", "baseline")


def release_memory() -> None:
    """Collect the engines just dropped (device slots, dense copies) and return the GPU's cached blocks."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shared_target(cfg: DictConfig, targets: dict[str, LoadedModel]) -> LoadedModel:
    """The model of ``cfg``, loaded the first time a method asks for it: methods (and workloads)
    with the same ``model`` settings share one load and one host copy of its experts. Six methods
    of Qwen3-30B-A3B otherwise held six copies of its 58 GB of bf16 experts in host memory."""
    key = json.dumps(model_settings(cfg), sort_keys=True, default=str)
    if key not in targets:
        targets[key] = load_shared_target(cfg)
    return targets[key]


def stall_free_line(summary: list[dict[str, Any]]) -> str:
    """What prefetch could give each method run without it: its speed with every copy hidden at no
    host cost (its stall removed), as a multiple of its own speed. On a host whose compute is slow
    against the link, the stall is a small share of the time and no prefetcher can do much."""
    bounds = [f"{r['method']} {r['stall_free_bound']:.2f}x" for r in summary  # cache=none cannot prefetch
              if r.get("prefetch", "none") == "none" and r.get("cache") != "none" and "stall_free_bound" in r]
    if not bounds:
        return ""
    return "the most prefetch could speed up (every copy hidden, at no host cost): " + ", ".join(bounds)


def paused_line(summary: list[dict[str, Any]]) -> str:
    """The share of passes each method's look-ahead was paused by its gate (``prefetch.gate``),
    which pauses it while its host time is more than the stall it removes."""
    paused = []
    for r in summary:
        ran, off = r.get("prefetch_lookahead_passes", 0), r.get("prefetch_lookahead_paused_passes", 0)
        if off:
            paused.append(f"{r['method']} {off / (ran + off):.0%}")
    if not paused:
        return ""
    return ("look-ahead paused, its host time above the stall it removed (prefetch.gate), in this share of passes: "
            + ", ".join(paused))


def prefetch_notes(summary: list[dict[str, Any]]) -> list[str]:
    """The lines under a table about prefetch: what it could give, where its gate paused it."""
    return [line for line in (stall_free_line(summary), paused_line(summary)) if line]


def _baseline(cfg: DictConfig, methods: dict[str, Any]) -> str:
    """The method paired ratios are taken over: ``baseline`` when it ran, else the first one (as
    :func:`specfit.results.comparison_table` picks its row)."""
    return cfg.baseline if cfg.baseline in methods else next(iter(methods))


def _plain(config: Any) -> Any:
    """A run's config as stored in a results row, without the keys that only shape the job."""
    if isinstance(config, DictConfig):
        config = run_config(config)
    if not isinstance(config, dict):
        return None
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in _JOB_KEYS}, default=str))


def _write_answers(folder: Path, answers: dict[str, list[dict[str, Any]]], rows: list[dict[str, Any]],
                   engines: dict[str, Any]) -> None:
    """Add a workload's rows to the Spec-Bench answers and rewrite each method's file atomically."""
    tokenizers = {m: e.tokenizer for m, e in engines.items()}
    for method, lines in spec_bench_answers(rows, tokenizers).items():
        answers.setdefault(method, []).extend(lines)
        write_atomic(folder / f"{method}.jsonl", "".join(json.dumps(a) + "\n" for a in answers[method]))


def _check_num_prompts_applies(cfg: DictConfig, overrides: list[str]) -> None:
    """``workload.num_prompts`` given for a bench whose workloads all take every prompt they hold
    (inline, jsonl) would do nothing: say so (the config check sees one workload, not the list)."""
    if not cfg.workloads or not any(override_key(o) == "workload.num_prompts" for o in overrides):
        return
    kinds = {method_config(cfg, cfg.methods[0], w, overrides).workload.kind for w in cfg.workloads}
    if kinds <= set(TAKES_ALL_PROMPTS):
        raise num_prompts_unused(cfg.workload.num_prompts, f"workloads={list(cfg.workloads)} (each takes all its prompts)")


def _check_workloads(cfg: DictConfig, overrides: list[str]) -> None:
    """Each name in ``workloads=[...]`` is a workload config, named as such (a typo there made every
    method's preset look broken), and named once (rows are labelled by workload); ``workload.kind``
    beside the list, which applies to every workload of it, must not contradict one's own kind (prose
    prompts would run labelled gsm); and a ``workload.*`` key must be one some listed workload reads."""
    kind = next((o.split("=", 1)[1] for o in overrides if override_key(o) == "workload.kind" and "=" in o), None)
    twice = sorted({str(w) for w in cfg.workloads if list(cfg.workloads).count(w) > 1})
    if twice:
        raise ConfigError(f"workloads={list(cfg.workloads)} names {', '.join(twice)} more than once: rows are labelled "
                          "by workload, so a second run of one would be indistinguishable (use repeats=N for more runs)")
    kinds = []
    for w in cfg.workloads:
        try:
            own = compose([f"workload={w}"], config_name=_config_name()).workload.kind
        except ConfigError as exc:
            raise ConfigError(f"workloads={list(cfg.workloads)}: {w!r} is not a workload ({exc})") from exc
        if kind is not None and own != cfg.workload.kind:
            raise ConfigError(f"workload.kind={kind} contradicts workloads={list(cfg.workloads)}: workload {w} is "
                              f"kind {own}; drop workload.kind (each workload of the list has its own kind)")
        kinds.append(own)
    unread = unread_workload_key(given_overrides(overrides), kinds) if kinds else None  # read by none of the list
    if unread is not None:
        override, readers = unread
        raise ConfigError(f"{override} does not apply to workloads={list(cfg.workloads)}: only kind="
                          f"{' or '.join(readers)} reads it")


@dataclass
class _Job:
    """What every workload of one bench job shares: its settings, files, loaded models and count."""

    cfg: DictConfig
    overrides: list[str]
    results: Path
    answers_dir: Path | None
    answers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # Spec-Bench lines per method
    targets: dict[str, LoadedModel] = field(default_factory=dict)  # each model loaded once, experts shared
    finished: int = 0  # runs of this job on disk (resumed ones included)


def _run_workload(job: _Job, workload: str | None) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]],
                                                            list[dict[str, Any]]]:
    """Every method on one workload's prompts, interleaved; prints its table. Returns the rows, each
    method's stats and the summary. Its engines live only here, so they are freed when it returns."""
    cfg, results = job.cfg, job.results
    configs = {m: without_unused_cost_model(method_config(cfg, m, workload, job.overrides)) for m in cfg.methods}
    any_cfg = next(iter(configs.values()))
    prompts = prompts_of(any_cfg)
    about = describe_prompts(any_cfg)
    done = _completed(results, configs) if cfg.resume else {}
    engines = {m: build(c, check_prompts=prompts, shared_target=shared_target(c, job.targets))
               for m, c in configs.items()}
    for _ in range(cfg.warmup if prompts else 0):
        for engine in engines.values():
            engine.generate(prompts[0])
    rows: list[dict[str, Any]] = []
    per_method: dict[str, list[dict[str, Any]]] = {m: [] for m in engines}
    outputs: dict[int, dict[str, list[int]]] = {}
    total = cfg.repeats * len(prompts) * len(engines)
    skipped = sum((about["workload"], m, i, r) in done for r in range(cfg.repeats)
                  for i in range(len(prompts)) for m in engines)
    job.finished += skipped
    if cfg.resume:
        print(f"resume: {skipped} of {total} runs of workload {about['workload']} are already in {results} "
              f"(same config); running the other {total - skipped}", file=sys.stderr)
    with _progress(total, skipped) as bar:
        for repeat in range(cfg.repeats):
            for i, prompt in enumerate(prompts):
                for method, engine in engines.items():
                    row = done.get((about["workload"], method, i, repeat))
                    if row is None:
                        out = engine.generate(prompt)
                        stats = out.stats
                        row = {"command": "bench", "method": method, **about, "prompt_index": i,
                               "repeat": repeat, **stats, "output_ids": out.token_ids,
                               "accept_lengths": [c.committed for c in out.cycles],
                               "config": run_config(configs[method])}
                        append_jsonl(results, [row])
                        job.finished += 1
                        bar.update()
                    else:
                        stats = {k: v for k, v in row.items() if k not in _ROW_KEYS}
                    per_method[method].append(stats)
                    if "output_ids" in row:
                        outputs.setdefault(i, {})[method] = row["output_ids"]
                    rows.append(row)
    identical = all(len({tuple(v) for v in o.values()}) == 1 for o in outputs.values())
    base = _baseline(cfg, per_method)
    summary = [{"method": m, **about, **mean_stats(s), **paired_fields(s, per_method[base]),
                "outputs_identical": identical} for m, s in per_method.items()]
    print(f"\nworkload {about['workload']} ({about['workload_split']}): {len(prompts)} prompts x "
          f"{cfg.repeats} repeats, {cfg.max_new_tokens} new tokens, "
          f"{'greedy' if cfg.sampling.temperature == 0 else f'sampling T={cfg.sampling.temperature}'}")
    print(comparison_table(summary, baseline=cfg.baseline))
    print(f"output tokens identical across methods: {'yes' if identical else 'NO'}")
    if any(r.get("prefetch_issued") for r in summary):
        print("prefetch: pf prec = prefetched experts used / prefetched; pf recall = prefetched experts "
              "used / (those + misses); stall ms/tok = time compute waited on copies per output token")
    for line in prefetch_notes(summary):  # could prefetch help? where was it paused?
        print(line)
    if job.answers_dir is not None:
        _write_answers(job.answers_dir, job.answers, rows, engines)
    return rows, per_method, summary


def run(cfg: DictConfig, output_dir: Path, overrides: list[str]) -> list[dict[str, Any]]:
    """Run every method on every prompt; each row is on disk as soon as its run completes.

    With ``resume=true`` the runs already in the results file (same method config, workload,
    prompt and repeat) are not run again: their rows count in the table as they are. Ctrl-C
    prints the command that resumes the job before the interrupt ends it.
    """
    if not cfg.methods:
        raise ConfigError("methods is empty: name the methods to compare, e.g. methods=[ar,eagle3,specfit]")
    if cfg.baseline not in cfg.methods and any(override_key(o) == "baseline" for o in overrides):
        # a default baseline that did not run gives way to the first method; one the user named must run
        raise ConfigError(f"baseline={cfg.baseline} is not among methods={list(cfg.methods)}: add it to methods "
                          f"(without baseline=, speedups are over the first method, {cfg.methods[0]})")
    if cfg.workloads and any(override_key(o) == "workload" for o in overrides):  # the list's choice would win
        raise ConfigError(f"give workload=NAME or workloads=[...], not both (workloads={list(cfg.workloads)} runs each "
                          f"of them; add the other to that list)")
    _check_workloads(cfg, overrides)
    check_overrides(cfg, overrides)
    _check_num_prompts_applies(cfg, overrides)
    results = check_results_file(output_dir / cfg.results_file)
    answers_dir = None if cfg.answers_dir is None else check_writable(output_dir / cfg.answers_dir, "answers_dir",
                                                                       directory=True)
    workloads = list(cfg.workloads) or [None]
    rows: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    all_runs: dict[str, list[dict[str, Any]]] = {}  # every workload's runs per method, in the same order
    job = _Job(cfg, overrides, results, answers_dir)
    try:
        for workload in workloads:
            workload_rows, per_method, summary = _run_workload(job, workload)
            rows += workload_rows
            summaries += summary
            for m, s in per_method.items():
                all_runs.setdefault(m, []).extend(s)
            release_memory()  # the workload's engines are gone: free them before the next are built
    except KeyboardInterrupt:
        print(f"specfit: interrupted: {job.finished} completed runs are in {results}; resume with: "
              f"{resume_command(output_dir)}", file=sys.stderr, flush=True)
        raise
    if len(workloads) > 1 and all_runs:
        base = _baseline(cfg, all_runs)
        overall = [{"method": m, "workload": "all", **mean_stats(s), **paired_fields(s, all_runs[base])}
                   for m, s in all_runs.items()]
        summaries += overall
        print(f"\nall workloads together ({', '.join(str(w) for w in workloads)}):")
        print(comparison_table(overall, baseline=base))
        for line in prefetch_notes(overall):
            print(line)
    append_jsonl(output_dir / "summary.jsonl", summaries)
    if any(r.get("h2d_emulated") for r in summaries):
        print("H2D times are EMULATED (cache.copy=emulated): each copy is charged the reference link's time.")
    if _config_name() == "demo":
        import torch

        if cfg.model.device == "cpu" or not torch.cuda.is_available():
            print(CPU_DEMO_NOTE)
    print(f"results: {results}")
    if answers_dir is not None:
        print(f"answers (Spec-Bench format, one file per method): {answers_dir}")
    return rows
