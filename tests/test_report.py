"""Sweeps (Hydra multirun, in process and through a launcher) collected into one report."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specfit.cli import main
from specfit.commands.report import run_label, sweep_axes, verify_split, write_report

BENCH = ["model=tiny", "methods=[ar,eagle3_nocache]", "drafter.top_k=3", "drafter.depth=2", "drafter.total_tokens=4",
         "prompt_ids=[5,17,99]", "max_new_tokens=5", "cache.copy=emulated"]


def captured_plots(monkeypatch) -> dict:
    """The figures the report saves, by file name, and the summary rows its plots were drawn from."""
    from specfit.commands import report
    figures: dict = {}
    save, plots = report._save, report._plots

    def keep(fig, out, name):  # noqa: ANN001, ANN202
        figures[name] = fig.axes[0]  # read before the original closes the figure (the axes stay)
        return save(fig, out, name)

    def drawn(summary, out):  # noqa: ANN001, ANN202
        figures["summary"] = list(summary)
        return plots(summary, out)

    monkeypatch.setattr(report, "_save", keep)
    monkeypatch.setattr(report, "_plots", drawn)
    return figures


def test_sweep_is_collected_into_one_report(tmp_path, capsys, monkeypatch):
    main(["bench", "-m", *BENCH, "cache.capacity=2,4", f"hydra.sweep.dir={tmp_path}"])
    assert len(list(tmp_path.glob("*/results.jsonl"))) == 2
    pytest.importorskip("matplotlib")
    figures = captured_plots(monkeypatch)
    report = write_report([tmp_path], tmp_path / "report")
    text = report.read_text()
    for label in ("ar (capacity=2)", "ar (capacity=4)", "eagle3_nocache (capacity=2)", "emulated"):
        assert label in text
    for png in ("throughput.png", "acceptance.png", "breakdown.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000
    summary = figures["summary"]
    assert len(summary) == 4  # two methods at two capacities, one workload
    # the bars are the summary's throughputs, one per run label, in its order
    bars = [p.get_height() for p in figures["throughput.png"].patches]
    assert bars == pytest.approx([s["output_throughput"] for s in summary]) and min(bars) > 0
    # one point per run; each stacked column of the breakdown adds up to its time per token
    assert len(figures["acceptance.png"].collections) == len(summary)
    columns = np.zeros(len(summary))
    for patch in figures["breakdown.png"].patches:
        columns[round(patch.get_x() + patch.get_width() / 2)] += patch.get_height()
    per_token = [1e3 * (s["draft_seconds"] + s["select_seconds"] + sum(verify_split(s))) / s["num_output_tokens"]
                 for s in summary]
    assert columns == pytest.approx(per_token) and columns.min() > 0


def test_report_command_and_bad_input(tmp_path, capsys):
    main(["bench", *BENCH, f"hydra.run.dir={tmp_path}"])
    main(["report", str(tmp_path / "results.jsonl"), "--out", str(tmp_path / "r")])
    assert "report:" in capsys.readouterr().out and (tmp_path / "r" / "report.md").is_file()
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path / "bad.jsonl")])
    assert info.value.code == 2


def test_report_points_a_hydra_style_out_dir_to_its_flag(tmp_path, capsys, monkeypatch):
    """`specfit report RESULTS out_dir=DIR` (the other commands' style) names --out, not just "no results"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results.jsonl").write_text('{"method": "ar", "output_throughput": 1.0, "num_output_tokens": 8, "total_seconds": 8.0}\n')
    with pytest.raises(SystemExit) as info:
        main(["report", "results.jsonl", "out_dir=r"])
    assert info.value.code == 2
    assert "--out DIR, not out_dir=" in capsys.readouterr().err


def test_a_results_file_reached_twice_is_read_once(tmp_path, monkeypatch):
    """A run directory and its results.jsonl (or one path given twice) count each run once."""
    from specfit.commands.report import read_rows

    run = tmp_path / "run"
    run.mkdir()
    (run / "results.jsonl").write_text('{"method": "ar", "output_throughput": 1.0, "num_output_tokens": 8, '
                                       '"total_seconds": 8.0}\n')
    monkeypatch.chdir(tmp_path)
    assert len(read_rows([run, run / "results.jsonl", "run/results.jsonl", "run/../run/results.jsonl"])) == 1
    assert "1 decoding runs" in write_report([run, run / "results.jsonl"], tmp_path / "r").read_text()


def test_estimator_rows_of_several_traces_say_which_trace():
    from specfit.commands.report import acceptance_rows

    def row(trace: str) -> dict:
        return {"command": "replay", "trace": trace, "method": "specfit", "acceptance_estimator": "path_prob",
                "acceptance_reliability": [[0.1, 0.1, 10]]}

    assert [r["label"] for r in acceptance_rows([row("/t/prose-1")])] == ["specfit (path_prob)"]
    assert [r["label"] for r in acceptance_rows([row("/t/prose-1"), row("/t/gsm-1")])] == \
        ["specfit (path_prob) on prose-1", "specfit (path_prob) on gsm-1"]
    # `specfit record` names every trace `trace` in its run directory: then the paths tell them apart
    assert [r["label"] for r in acceptance_rows([row("/out/a/trace"), row("/out/b/trace")])] == \
        ["specfit (path_prob) on /out/a/trace", "specfit (path_prob) on /out/b/trace"]


def test_sweep_axes_are_what_differs_within_a_method():
    rows = [{"method": "ar", "config": {"cache": {"capacity": c, "name": "lru"}, "max_new_tokens": 8}} for c in (2, 4)]
    assert sweep_axes(rows) == ["cache.capacity"]


def test_a_generate_row_is_labelled_by_what_decoded_not_the_default_selector():
    # `specfit generate` rows carry no method; the base config names selector=eagle3 even without a drafter
    assert run_label({"drafter": "none", "selector": "eagle3"}) == "ar"
    assert run_label({"drafter": "eagle3", "selector": "specfit"}) == "specfit"
    assert run_label({"method": "ar_prefetch", "drafter": "none", "selector": "none"}) == "ar_prefetch"


def _importable(name: str) -> bool:
    """find_spec of a dotted name imports its parent, which may be missing too (no hydra_plugins at
    all on a machine without the cluster extra: the module failed to import there)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.slow  # ~11 s of process start-ups; the in-process sweep above covers the report
@pytest.mark.skipif(not _importable("hydra_plugins.hydra_submitit_launcher"),
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


def _prefetch_row(method: str, stall: float, issued: int, used: int, misses: int, tokens: int = 10) -> dict:
    return {"method": method, "workload": "w", "output_throughput": tokens / 1.0, "num_output_tokens": tokens,
            "total_seconds": 1.0, "cycles": tokens, "draft_seconds": 0.1, "select_seconds": 0.05,
            "verify_compute_seconds": 0.5, "verify_seconds": 0.8, "h2d_seconds": 0.3, "h2d_stall_seconds": stall,
            "link_busy_seconds": 0.3, "h2d_emulated": True, "expert_cache_hits": 20, "expert_cache_misses": misses,
            "prefetch_issued": issued, "prefetch_used": used, "prefetch_wasted": issued - used, "config": {}}


def test_prefetch_precision_recall_and_stall_in_the_table():
    """Precision = used / issued, recall = used / (used + misses), stall per token; summed over runs."""
    from specfit.results import comparison_table, mean_stats, prefetch_figures

    # 1 s in all, 0.2 s of it stalled: with every copy hidden for free, 1 / 0.8 = 1.25x
    assert prefetch_figures(_prefetch_row("a", 0.2, 0, 0, 5)) == {"stall_ms_per_token": pytest.approx(20.0),
                                                                  "stall_free_bound": pytest.approx(1.25)}
    figures = prefetch_figures(_prefetch_row("p", 0.05, 8, 6, 2))
    assert figures == {"stall_ms_per_token": pytest.approx(5.0), "prefetch_precision": pytest.approx(0.75),
                       "prefetch_recall": pytest.approx(0.75), "stall_free_bound": pytest.approx(1 / 0.95)}
    assert "stall_free_bound" not in prefetch_figures(_prefetch_row("n", 0.0, 0, 0, 0))  # nothing stalled
    prefill = {**_prefetch_row("a", 0.2, 0, 0, 5), "prefill_h2d_stall_seconds": 0.3}  # the prefill's stall counts
    assert prefetch_figures(prefill)["stall_free_bound"] == pytest.approx(2.0)
    both = mean_stats([_prefetch_row("p", 0.05, 8, 6, 2), _prefetch_row("p", 0.15, 2, 0, 8)])
    assert both["prefetch_issued"] == 10 and both["h2d_stall_seconds"] == pytest.approx(0.2)
    assert both["prefetch_precision"] == pytest.approx(0.6) and both["prefetch_recall"] == pytest.approx(6 / 16)
    assert both["stall_ms_per_token"] == pytest.approx(10.0) and both["stall_free_bound"] == pytest.approx(2 / 1.8)
    table = comparison_table([_prefetch_row("ar", 0.2, 0, 0, 5), _prefetch_row("ar_prefetch", 0.05, 8, 6, 2)])
    header, _, ar, pf = table.splitlines()
    assert "stall ms/tok" in header and "pf prec" in header and "pf recall" in header
    assert ar.split()[0] == "ar" and pf.split()[0] == "ar_prefetch"
    assert "20.00" in ar and "5.00" in pf and "0.75" in pf


def test_breakdown_shows_the_stall_apart_from_compute(tmp_path):
    """An emulated pipelined run: compute is the verification time less the measured stall, not less
    the issued H2D seconds (partly hidden); other runs keep the H2D seconds as the wait."""
    from specfit.commands.report import verify_split

    assert verify_split(_prefetch_row("p", 0.05, 8, 6, 2)) == (pytest.approx(0.75), pytest.approx(0.05))
    old = {"verify_compute_seconds": 0.5, "h2d_seconds": 0.3}  # a row from before issue 14
    assert verify_split(old) == (0.5, 0.3)
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (_prefetch_row("ar", 0.2, 0, 0, 5),
                                                             _prefetch_row("ar_prefetch", 0.05, 8, 6, 2))))
    text = write_report([path], tmp_path / "report").read_text()
    assert "pf recall" in text and "the share of the copies the passes needed" in text


def test_bench_rows_and_table_carry_the_pipelined_figures(tmp_path, capsys):
    """results.jsonl rows carry the stall, link and prefetch counts; the table prefetch's precision,
    recall and stall per token, with the legend."""
    main(["bench", "model=tiny", "methods=[ar,ar_prefetch]", "prompt_ids=[5,17,99]", "max_new_tokens=6",
          "cache.copy=emulated", "cache.capacity=2", f"hydra.run.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert "stall ms/tok" in out and "pf recall" in out and "prefetch: pf prec" in out
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    for row in rows:
        for key in ("h2d_stall_seconds", "prefetch_issued", "prefetch_used", "prefetch_wasted", "link_busy_seconds"):
            assert key in row, key
    assert any(r["prefetch_issued"] for r in rows if r["method"] == "ar_prefetch")
    assert not any(r["prefetch_issued"] for r in rows if r["method"] == "ar")
    for row in rows:  # the link's waits are measured: compute is the passes' time less that stall, not
        # less every copy's charge (prefetches land while the passes compute: that went negative)
        assert row["h2d_stall_measured"] and 0.0 < row["verify_compute_seconds"] <= row["verify_seconds"]
        assert row["verify_compute_seconds"] == pytest.approx(row["verify_seconds"] - row["h2d_stall_seconds"])


def _timed(method: str, prompt: int, repeat: int, seconds: float, workload: str = "w") -> dict:
    return {"method": method, "workload": workload, "prompt_index": prompt, "repeat": repeat,
            "num_output_tokens": 10, "total_seconds": seconds, "output_throughput": 10 / seconds, "cycles": 10,
            "config": {}}


def test_paired_ratio_is_the_geometric_mean_of_run_ratios_with_a_bootstrap_interval():
    """Runs pair by workload, prompt and repeat (not by position); a steady 2x is 2x with no spread;
    a noisy one has an interval around its geometric mean, the same on every call (fixed seed)."""
    from specfit.results import paired_ratio

    base = [_timed("ar", p, r, 1.0 + 0.5 * p) for r in range(2) for p in range(3)]
    twice = [_timed("fast", p, r, (1.0 + 0.5 * p) / 2) for r in range(2) for p in reversed(range(3))]
    steady = paired_ratio(twice, base)
    assert (steady.ratio, steady.low, steady.high, steady.pairs) == (pytest.approx(2.0), pytest.approx(2.0),
                                                                     pytest.approx(2.0), 6)
    ratios = [1.3, 0.8, 1.1, 1.2, 0.9, 1.0]
    noisy = [_timed("n", p, r, b["total_seconds"] / ratios[3 * r + p]) for r in range(2) for p in range(3)
             for b in base if (b["prompt_index"], b["repeat"]) == (p, r)]
    got = paired_ratio(noisy, base)
    assert got.ratio == pytest.approx(float(np.exp(np.log(ratios).mean())))
    assert got.low < got.ratio < got.high and got.low >= min(ratios) and got.high <= max(ratios)
    assert paired_ratio(noisy, base) == got
    assert paired_ratio([], base) is None
    other = [_timed("n", p, r, 1.0, workload="v") for r in range(2) for p in range(3)]  # no common workload
    assert paired_ratio(other, base) is None
    # two jobs of the same prompts and repeats (a report over both): each pairs within its own job
    slow_job = [dict(r, total_seconds=3 * r["total_seconds"]) for r in base]
    both = paired_ratio([*twice, *[dict(r, total_seconds=3 * r["total_seconds"]) for r in twice]], [*base, *slow_job])
    assert (both.ratio, both.low, both.high, both.pairs) == (pytest.approx(2.0), pytest.approx(2.0), pytest.approx(2.0), 12)
    unkeyed = [{k: v for k, v in r.items() if k != "prompt_index"} for r in twice]  # paired in order, if at all
    assert paired_ratio(unkeyed[:3], unkeyed[:3]).pairs == 3 and paired_ratio(unkeyed[:3], unkeyed) is None


def test_bench_prints_the_paired_ratio_per_workload_and_for_all_workloads(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [7, 3, 12]}\n')
    # two workloads: inline (workload.prompt_ids) and jsonl (the file, after workload.prompt_ids)
    main(["bench", "model=tiny", "methods=[ar,ar_prefetch]", "workloads=[inline,jsonl]", f"workload.path={prompts}",
          "workload.prompt_ids=[[5,17,99]]", "max_new_tokens=4", "repeats=2", "cache.copy=emulated",
          "cache.capacity=2", f"hydra.run.dir={tmp_path}/run"])
    out = capsys.readouterr().out
    assert out.count("paired [95% CI]") == 3 and "all workloads together" in out
    summary = [json.loads(line) for line in (tmp_path / "run" / "summary.jsonl").read_text().splitlines()]
    overall = [s for s in summary if s["workload"] == "all"]
    assert [s["method"] for s in overall] == ["ar", "ar_prefetch"] and overall[1]["paired_runs"] == 6  # (1 + 2) x 2
    assert overall[0]["speedup_paired"] == pytest.approx(1.0)
    low, mid, high = (overall[1][k] for k in ("speedup_ci95_low", "speedup_paired", "speedup_ci95_high"))
    assert low <= mid <= high


def test_bench_says_what_prefetch_could_give_each_method_run_without_it():
    from specfit.commands.bench import stall_free_line
    from specfit.results import mean_stats

    summary = [{**mean_stats([_prefetch_row("ar", 0.2, 0, 0, 5)]), "prefetch": "none", "cache": "lru"},
               {**mean_stats([_prefetch_row("ar_prefetch", 0.05, 8, 6, 2)]), "prefetch": "auto", "cache": "lru"},
               {**mean_stats([_prefetch_row("ar_nocache", 0.5, 0, 0, 9)]), "prefetch": "none", "cache": "none"}]
    assert stall_free_line(summary) == "the most prefetch could speed up (every copy hidden, at no host cost): ar 1.25x"
    assert stall_free_line(summary[1:]) == ""  # with prefetch already, or with a cache that cannot prefetch


def test_bench_says_where_the_lookahead_gate_paused_it_and_runs_sum_the_counts():
    from specfit.commands.bench import paused_line
    from specfit.results import mean_stats

    runs = [{**_prefetch_row("ar_prefetch", 0.05, 8, 6, 2), "prefetch_lookahead_passes": 10,
             "prefetch_lookahead_paused_passes": 30},
            {**_prefetch_row("ar_prefetch", 0.05, 8, 6, 2), "prefetch_lookahead_passes": 10,
             "prefetch_lookahead_paused_passes": 50}]
    both = mean_stats(runs)
    assert (both["prefetch_lookahead_passes"], both["prefetch_lookahead_paused_passes"]) == (20, 80)
    older = mean_stats([_prefetch_row("ar_prefetch", 0.05, 8, 6, 2), *runs])  # a row from before the counters
    assert (older["prefetch_lookahead_passes"], older["prefetch_issued"]) == (20, 24)
    assert paused_line([both, mean_stats([_prefetch_row("ar", 0.2, 0, 0, 5)])]).endswith(": ar_prefetch 80%")
    assert paused_line([{**both, "prefetch_lookahead_paused_passes": 0}]) == ""
