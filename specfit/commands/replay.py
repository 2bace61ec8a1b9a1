"""``specfit replay trace.path=DIR``: selectors, caches and cost models over a recorded trace.

One method comes from the config's own selector / predictor / cache / cost model; ``methods=[...]``
names several presets (as ``specfit bench`` does). Unless ``replay.oracle=false``, the oracle is
replayed with each distinct (cache, cost model) of those methods, and every method is reported as
a fraction of its oracle's predicted tokens per second.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specfit.config import override_key
from specfit.messages import note_once
from specfit.api import build_selector
from specfit.calibrate.setup_state import note_state_file_setup
from specfit.types.cost_profiles import cost_profile
from specfit.plugins.cost_models.union import OVERRIDES as COST_OVERRIDES
from specfit.errors import ConfigError
from specfit.registry import get_plugins
from specfit.files import check_results_file
from specfit.results import append_jsonl
from specfit.trace.format import Trace, load_trace
from specfit.trace.replay import ReplayResult, draft_time_mode, model_loader, replay

COLUMNS = [
    ("method", "method", "{}"),
    ("cache", "cache_desc", "{}"),
    ("tok/cycle", "tokens_per_cycle", "{:.2f}"),
    ("verified/cyc", "verified_nodes_per_cycle", "{:.1f}"),
    ("levels/cyc", "draft_levels_per_cycle", "{:.1f}"),
    ("misses", "expert_cache_misses", "{}"),
    ("hit rate", "expert_cache_hit_rate", "{:.2f}"),
    ("pred s", "predicted_seconds", "{:.3f}"),
    ("pred tok/s", "predicted_tokens_per_second", "{:.1f}"),
    ("of oracle", "oracle_fraction", "{:.3f}"),
    ("recall", "predictor_recall", "{:.2f}"),
    ("brier", "acceptance_brier", "{:.4f}"),  # the acceptance estimator's forecasts (cost-aware selectors)
]


@dataclass
class _Run:
    name: str
    cfg: DictConfig
    config: dict[str, Any]  # resolved, as written to the results
    setup: str  # cache and cost model: runs with the same setup share one oracle
    result: ReplayResult


def method_configs(cfg: DictConfig, overrides: list[str]) -> list[tuple[str, DictConfig]]:
    """(name, config) per method: the presets named by ``methods``, else the config itself."""
    if not cfg.methods:
        return [(str(cfg.selector.name), cfg)]
    from specfit.commands.bench import check_overrides, method_config

    check_overrides(cfg, overrides)
    configs = [(str(m), method_config(cfg, str(m), None, overrides)) for m in cfg.methods]
    for _, c in configs:  # a replay charges every method the cost model's time, used by its selector or not
        if c.get("cost_model") is None and cfg.get("cost_model") is not None:
            c.cost_model = cfg.cost_model
    return configs


def replay_config(trace: Trace, cfg: DictConfig, name: str, model: Any, draft_time: str,
                  oracle: bool = False, warmup: int = 0) -> ReplayResult:
    """Build the plugins a config names and replay them (``oracle``: with the oracle selector and
    no predictor). ``warmup`` cycles are first replayed with throwaway plugins, so one-time costs
    (compiling the search, loading caches) are not charged as selection time."""
    plugins = get_plugins()

    def parts(note: bool = True) -> dict[str, Any]:
        made = {kind: plugins[kind].create(cfg[kind]) if cfg.get(kind) is not None else None
                for kind in ("cache", "cost_model", "predictor")}
        if cfg.get("selector") is not None:  # with the acceptance group's estimator, for cost-aware selectors
            made["selector"] = build_selector(cfg.selector, None if oracle else cfg.get("acceptance"), note)
        # prefetch: draft-time prefetches on the replay's modelled link (the oracle replays without)
        made["prefetcher"] = plugins["prefetch"].create(cfg.prefetch) if cfg.get("prefetch") is not None and not oracle else None
        if oracle:
            from specfit.plugins.selectors.oracle import OracleSelector

            made["selector"], made["predictor"] = OracleSelector(), None
        elif cfg.get("drafter") is not None and cfg.drafter.name == "none":  # ar: the trees go unused
            from specfit.plugins.selectors.none import NoDraftSelector

            made["selector"] = NoDraftSelector()
        if not oracle:  # the oracle knows the outcomes: no estimator, and no note that it uses none
            note_state_file_setup(made["selector"], trace.meta.info.get("acceptance_setup"))
        if cfg.replay.get("cost_profile") is not None and made["cost_model"] is not None:  # charged and planned with
            made["cost_model"].set_constants(cost_profile(cfg.replay.cost_profile).constants)
        return made

    if warmup > 0:
        replay(trace, **parts(note=False), draft_time=draft_time, model=model, max_cycles=warmup)  # noted once, below
    return replay(trace, **parts(), draft_time=draft_time, model=model, method=name)


# keys of a live decode that a replay has no use for: the trace fixed the prompts and the greedy output
_NOT_REPLAYED = ("prompt", "prompt_ids", "prompt_file", "max_new_tokens", "stop_token_ids", "ignore_eos", "sampling",
                 "workload", "workloads", "repeats", "warmup")
_NOT_REPLAYED_HINTS = {"warmup": "; replay.warmup sets the replay's warm-up cycles",
                       "sampling": "; traces are recorded greedily"}


# the live copy engine's keys: a replay copies nothing and charges each copy with its cost model
_NOT_CHARGED = ("cache.copy", "cache.link")


def check_replay_overrides(overrides: list[str]) -> None:
    """Keys of a live decode a replay cannot apply (the trace fixed prompts, output and trees; it copies
    nothing): one line each. The CLI asks before it folds method-only keys into presets, where a
    ``drafter.*`` key would hide among the presets' own ``drafter=`` choices."""
    for o in overrides:
        key = override_key(o)
        group = key.split(".", 1)[0]
        if any(key == k or key.startswith(k + ".") for k in _NOT_CHARGED):
            raise ConfigError(f"{key}: specfit replay copies nothing and charges every cycle with its cost model (the "
                              f"calibration the trace names, replay.cost_profile=..., or cost_model.c_miss=... and the "
                              f"other constants), so {key} does not apply")
        if group in _NOT_REPLAYED:
            hint = _NOT_REPLAYED_HINTS.get(group, f"; record a trace with it (specfit record {o})")
            raise ConfigError(f"{key}: specfit replay replays the prompts and greedy output recorded in the trace, "
                              f"so {key} does not apply{hint}")
        if group == "drafter" and not (key == "drafter" and o.split("=", 1)[-1].strip() == "none"):
            raise ConfigError(f"{key}: specfit replay replays the trees drafted when the trace was recorded, so only "
                              f"drafter=none (plain decoding) applies; record a trace with it (specfit record {o})")


def check_replayable(trace: Trace, cfg: DictConfig, name: str, method: DictConfig) -> None:
    """A method replays the trace's own trees (or none: plain decoding), so a method that drafts with
    another drafter, or asks for other draft settings, is refused with one line naming both: its
    figures would be the trace's drafter's, under its name."""
    if not cfg.get("methods"):
        return  # one method, labelled by its selector: the base config's drafter only marks that it speculates
    recorded = trace.meta.drafter
    drafter = method.get("drafter")
    own = "none" if drafter is None else str(drafter.name)
    if own not in ("none", recorded.get("name")):
        raise ConfigError(f"method {name} drafts with drafter={own}, but the trace {cfg.trace.path} holds the trees of "
                          f"drafter={recorded.get('name')}: a replay cannot draft, so its figures would be "
                          f"{recorded.get('name')}'s; record a trace with drafter={own} (specfit record drafter={own} "
                          "...) and replay that")
    for o in [str(o) for o in (cfg.method_presets.get(name) or [])]:
        key, _, value = o.lstrip("+").partition("=")
        if not key.startswith("drafter."):
            continue
        setting = key.split(".", 1)[1]
        if setting in recorded and str(recorded[setting]) == value.strip():
            continue  # what the trace was drafted with: nothing differs
        held = f"{setting}={recorded[setting]}" if setting in recorded else f"the settings {sorted(recorded)}"
        raise ConfigError(f"method {name} sets {key}={value.strip()}, but the trace {cfg.trace.path} was drafted with "
                          f"{held} (drafter={recorded.get('name')}): a replay replays the recorded trees; record a "
                          f"trace with {key}={value.strip()}")


def run(cfg: DictConfig, output_dir: Path, overrides: list[str]) -> list[dict[str, Any]]:
    if not cfg.trace.path:
        raise ConfigError("set trace.path=DIR: a trace written by `specfit record`")
    check_replay_overrides(overrides)
    constants = {f"cost_model.{k}" for k in COST_OVERRIDES}
    given_constants = [override_key(o) for o in overrides if override_key(o) in constants]
    calibration = [o.split("=", 1)[-1].strip() for o in overrides if override_key(o) == "cost_model.calibration"]
    if cfg.replay.get("cost_profile") is not None and calibration and calibration[-1] not in ("", "null"):
        raise ConfigError(f"cost_model.calibration and replay.cost_profile={cfg.replay.cost_profile} both set the "
                          "replay's cost constants, and the profile's win: give one")
    trace = load_trace(cfg.trace.path)
    check_results_file(output_dir / cfg.results_file)  # before the replays run
    draft_time = draft_time_mode(str(cfg.replay.draft_time))  # "recorded" is the earlier name of "measured"
    profile = cfg.replay.get("cost_profile")
    if profile is not None:  # another machine's constants: its drafting time is modelled too
        if draft_time == "measured" and any(override_key(o) == "replay.draft_time" for o in overrides):
            note_once(f"replay.cost_profile={profile} models the drafting time too: replay.draft_time=measured "
                      "(this host's drafting) does not apply")
        draft_time = "modelled"
    warmup = int(cfg.replay.warmup) if draft_time == "measured" else 0
    given = cfg.model.path or cfg.model.builtin
    model = model_loader(trace, OmegaConf.to_object(cfg.model) if given else None)

    start = time.perf_counter()
    runs: list[_Run] = []
    methods = method_configs(cfg, overrides)
    for name, c in methods:  # every method first: none replays another drafter's trees under its name
        check_replayable(trace, cfg, name, c)
    for name, c in methods:
        config = OmegaConf.to_container(c, resolve=True)
        result = replay_config(trace, c, name, model, draft_time, warmup=warmup)
        runs.append(_Run(name, c, config, _setup(config), result))
    oracles = {r.setup: r for r in runs if r.result.selector == "oracle"}
    if cfg.replay.oracle:
        for r in list(runs):
            if r.setup not in oracles:
                result = replay_config(trace, r.cfg, "oracle", model, draft_time, oracle=True, warmup=warmup)
                config = {**r.config, "selector": {"name": "oracle"}, "predictor": None}
                oracles[r.setup] = _Run("oracle", r.cfg, config, r.setup, result)
                runs.append(oracles[r.setup])
    wall = time.perf_counter() - start

    rows, table = [], []
    for r in runs:
        summary = r.result.summary()
        oracle = oracles.get(r.setup)
        if oracle is not None:
            best = oracle.result.summary()["predicted_tokens_per_second"]
            summary["oracle_fraction"] = summary["predicted_tokens_per_second"] / best if best else 0.0
        table.append({**summary, "cache_desc": f"{r.result.cache}:{r.result.slots_per_layer}"})
        rows.append({"command": "replay", "trace": str(cfg.trace.path), **summary,
                     "time": "modelled" if profile is not None else "charged", "cost_profile": profile,
                     "cost_constants": r.result.constants, "config": r.config})

    _print_header(trace, cfg)
    print(replay_table(table))
    replaying = sum(r.result.wall_seconds for r in runs)
    print(f"\nreplayed {len(runs)} runs over {trace.positions} positions in {replaying:.2f}s "
          f"({len(runs) * trace.positions / replaying if replaying > 0 else 0:.0f} positions/s; {wall:.2f}s with "
          f"set-up and warm-up); draft time: {draft_time}")
    if profile is not None:
        over = f", with {', '.join(given_constants)} as given" if given_constants else ""
        print(f"time: modelled on cost profile {profile} ({cost_profile(profile).description}; "
              f"specfit.types.cost_profiles){over}, not measured")
    for r in rows:  # modelled prefetch, and what a prefetcher could not replay (lookahead)
        if r.get("prefetch_note"):
            print(f"prefetch={r['prefetch']} ({r['method']}): {r['prefetch_note']}")
    if any(r["divergences"] for r in rows):
        print("WARNING: some accepted paths disagree with the recorded output (tree-pass numerics); "
              "those cycles were cut at the disagreement (see 'divergences')")
    path = append_jsonl(output_dir / cfg.results_file, rows)
    print(f"results: {path}")
    return rows


def _setup(config: dict[str, Any]) -> str:
    return json.dumps({k: config.get(k) for k in ("cache", "cost_model")}, sort_keys=True, default=str)


def _print_header(trace: Trace, cfg: DictConfig) -> None:
    meta, d = trace.meta, trace.meta.drafter
    print(f"trace {cfg.trace.path}: {len(trace.sequences)} sequences, {trace.positions} positions; drafter "
          f"{d.get('name')} (depth {d.get('depth')}, total_tokens {d.get('total_tokens')}); "
          f"model {meta.info.get('model', '?')}")
    for note in trace.notes:  # e.g. a format-1 trace: what the learned estimator falls back on
        print(f"note: {note}")
    report = meta.calibration or {}
    if "cycle_time_ape_median" in report and cfg.replay.get("cost_profile") is None:  # a profile charges its own
        print(f"cost model error at calibration (held-out cycles): median "
              f"{100 * report['cycle_time_ape_median']:.1f}%, p90 {100 * report['cycle_time_ape_p90']:.1f}%")


def replay_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of replayed methods ('-' where a column does not apply)."""
    if not rows:
        return "(no results)"
    table = [[fmt.format(r[key]) if r.get(key) is not None else "-" for _, key, fmt in COLUMNS] for r in rows]
    header = [name for name, _, _ in COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    return "\n".join(lines)
