"""``specfit calibrate``: measure the cost model's constants for this model, cache, copy engine and machine."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from specfit.api import build, calibrate
from specfit.types.costs import POOR_FIT
from specfit.commands.generate import prompts_of
from specfit.errors import ConfigError
from specfit.files import check_results_file, check_writable
from specfit.results import append_jsonl


def run(cfg: DictConfig, output_dir: Path) -> dict:
    if cfg.cost_model is None:
        raise ConfigError("specfit calibrate measures a cost model: set cost_model=union")
    try:
        prompts = prompts_of(cfg)
    except ConfigError:
        prompts = None  # seeded random prompts
    results = check_results_file(output_dir / cfg.results_file)  # before measuring
    # cost_model.calibration=FILE: the constants go there (auto: this setup's file under $SPECFIT_HOME)
    source = cfg.cost_model.get("calibration", "auto")
    path = None if source in ("auto", None) else check_writable(source, "cost_model.calibration")
    engine = build(cfg, calibrate_now=False)
    constants, report = calibrate(engine, prompts, max_new_tokens=cfg.max_new_tokens, path=path, trust_poor=True)
    engine.cost_model.set_constants(constants)
    c = constants
    print(f"c0={c.c0 * 1e3:.3f}ms c_tok={c.c_tok * 1e3:.3f}ms c_miss={c.c_miss * 1e3:.3f}ms c_hit={c.c_hit * 1e3:.3f}ms "
          f"c_level={c.c_level * 1e3:.3f}ms c_draft0={c.c_draft0 * 1e3:.3f}ms  ({report['cycles_fit']} cycles)")
    print(f"held-out cycle-time error: median {100 * report['cycle_time_ape_median']:.1f}%, "
          f"p90 {100 * report['cycle_time_ape_p90']:.1f}% ({report['cycles_held_out']} cycles)")
    if report["cycle_time_ape_median"] > POOR_FIT:
        print(f"warning: a median error above {POOR_FIT:.0%} means the host was busy while measuring (its slow "
              "cycles are left out of the fit, but not all of them could be): measure again on a quiet host; "
              "automatic calibrations measure a stored file like this one again")
    print(f"stored: {report['path']}")
    append_jsonl(results, [{"command": "calibrate", **c.to_json(), **report}])
    return report
