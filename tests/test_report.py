"""Sweeps (Hydra multirun, in process and through a launcher) collected into one report."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specfit.cli import main
from specfit.report import sweep_axes, write_report

BENCH = ["model=tiny", "methods=[ar,eagle3_nocache]", "drafter.top_k=3", "drafter.depth=2", "drafter.total_tokens=4",
         "prompt_ids=[5,17,99]", "max_new_tokens=5", "cache.copy=emulated"]


def test_sweep_is_collected_into_one_report(tmp_path, capsys):
    main(["bench", "-m", *BENCH, "cache.capacity=2,4", f"hydra.sweep.dir={tmp_path}"])
    assert len(list(tmp_path.glob("*/results.jsonl"))) == 2
    report = write_report([tmp_path], tmp_path / "report")
    text = report.read_text()
    for label in ("ar (capacity=2)", "ar (capacity=4)", "eagle3_nocache (capacity=2)", "emulated"):
        assert label in text
    for png in ("throughput.png", "acceptance.png", "breakdown.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000


def test_report_command_and_bad_input(tmp_path, capsys):
    main(["bench", *BENCH, f"hydra.run.dir={tmp_path}"])
    main(["report", str(tmp_path / "results.jsonl"), "--out", str(tmp_path / "r")])
    assert "report:" in capsys.readouterr().out and (tmp_path / "r" / "report.md").is_file()
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path / "bad.jsonl")])
    assert info.value.code == 2


def test_sweep_axes_are_what_differs_within_a_method():
    rows = [{"method": "ar", "config": {"cache": {"capacity": c, "name": "lru"}, "max_new_tokens": 8}} for c in (2, 4)]
    assert sweep_axes(rows) == ["cache.capacity"]


@pytest.mark.slow  # ~11 s of process start-ups; the in-process sweep above covers the report
@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                    reason="needs the cluster extra (hydra-submitit-launcher)")
def test_sweep_through_the_submitit_launcher_on_a_local_instance(tmp_path):
    """The same launcher runs SLURM jobs with hydra/launcher=submitit_slurm; here it runs local processes."""
    exe = Path(sys.executable).with_name("specfit")
    done = subprocess.run([exe, "generate", "-m", "hydra/launcher=submitit_local", "model=tiny", "prompt_ids=[5,17,99]",
                           "max_new_tokens=3", "cache.capacity=2,4", f"hydra.sweep.dir={tmp_path}",
                           "hydra.launcher.timeout_min=10"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(p.read_text().splitlines()[0]) for p in sorted(tmp_path.glob("*/results.jsonl"))]
    assert sorted(r["cache_slots_per_layer"] for r in rows) == [2, 4]
