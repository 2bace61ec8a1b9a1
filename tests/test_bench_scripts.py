"""Smoke tests of the issue-13 benchmarks (specfit.bench.real_dims, specfit.bench.numerics) and the
GPU script, at tiny settings, so that they cannot rot between the runs that measure with them."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from specfit.bench import numerics, real_dims

ROOT = Path(__file__).resolve().parents[1]
TINY_DIMS = ["--hidden", "64", "--experts", "8", "--intermediate", "32", "--top-k", "2", "--heads", "4",
             "--kv-heads", "2", "--head-dim", "16", "--layers", "2", "--vocab", "128"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_real_dims_counts_ops_and_times_a_pass_against_transformers(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    args = ["--out", str(out), "--workdir", str(tmp_path / "work"), "--measures", "ops,time", "--tokens", "6",
            "--repeats", "1", *TINY_DIMS]
    assert real_dims.main(args) == 0
    rows = _rows(out)
    ops = {r["method"]: r for r in rows if r["measure"] == "ops"}
    reference = ops.pop(real_dims.REFERENCE)
    assert reference["ratio"] == 1.0 and reference["value"] > 0
    assert ops and all(m.startswith("specfit/cache=full") for m in ops)
    for r in ops.values():
        assert r["ratio"] == pytest.approx(r["value"] / reference["value"])
        assert r["met"] == (r["ratio"] <= real_dims.BAR_OPS)
    times = [r for r in rows if r["measure"] == "time"]
    assert len(times) == len(ops) + 1 and all(len(r["extra"]["ms"]) == 1 and r["value"] > 0 for r in times)
    assert {r["dims"]["vocab"] for r in rows} == {128} and rows[0]["checkpoint_bytes"] > 0
    assert "transformers/grouped_mm" in capsys.readouterr().out

    # the checkpoint is built once per dims and seed, then reused
    [ckpt] = (tmp_path / "work").iterdir()
    weights = sorted(ckpt.glob("*.safetensors"))
    assert weights and real_dims.checkpoint_bytes(ckpt) == rows[0]["checkpoint_bytes"]
    stamp = weights[0].stat().st_mtime_ns
    assert real_dims.checkpoint(real_dims.Dims(64, 8, 32, 2, 4, 2, 16, 2, 128), tmp_path / "work") == ckpt
    assert weights[0].stat().st_mtime_ns == stamp


def test_real_dims_variants_cover_every_setting():
    assert real_dims.specfit_variants({}) == [{}]
    variants = real_dims.specfit_variants({"expert_compute": ["loop", "grouped"], "numerics": ["native", "exact"]})
    assert len(variants) == 4 and {"expert_compute": "grouped", "numerics": "exact"} in variants
    assert real_dims.method_name("lru", {"expert_compute": "loop"}) == "specfit/cache=lru/compute=loop"


def test_real_dims_refuses_an_unknown_measure(tmp_path):
    with pytest.raises(SystemExit, match="unknown"):
        real_dims.main(["--measures", "ops,speed", "--workdir", str(tmp_path), *TINY_DIMS])


@pytest.mark.slow
def test_real_dims_memory_rows(tmp_path):
    """Peak memory: fresh subprocesses (each imports torch and transformers: tens of seconds)."""
    out = tmp_path / "rows.jsonl"
    assert real_dims.main(["--out", str(out), "--workdir", str(tmp_path), "--measures", "memory", *TINY_DIMS]) == 0
    rows = _rows(out)
    assert {r["method"] for r in rows} >= {"transformers/from_pretrained"}
    assert any(r["method"].startswith("specfit/cache=lru") for r in rows)
    assert all(r["measure"] == "memory" and r["extra"]["baseline_bytes"] > 0 for r in rows)


def test_first_difference():
    assert numerics.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert numerics.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert numerics.first_difference([1, 2], [1, 2, 3]) == 2


def test_numerics_compares_methods_with_ar_and_fp32(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path / "home"))
    out = tmp_path / "rows.jsonl"
    assert numerics.main(["--out", str(out), "--models", "tiny-olmoe", "--prompts", "2", "--max-new-tokens", "4",
                          "--tiny-prompt-len", "6", "--methods", "ar,eagle3,specfit"]) == 0
    rows = _rows(out)
    settings = numerics.numerics_settings()
    reference = [r for r in rows if r["dtype"] == "float32"]
    assert len(reference) == 1 and reference[0]["tokens"] == 8  # the reference's own row: its time
    compared = [r for r in rows if r["dtype"] == "bfloat16"]
    # per numerics: AR vs fp32, and each speculative method vs AR and vs fp32
    assert len(compared) == 5 * len(settings) and {r["numerics"] for r in compared} == set(settings)
    for r in compared:
        assert r["prompts"] == 2 and len(r["first_diff"]) == 2 and r["tokens"] == 8
        assert r["differ"] == sum(d is not None for d in r["first_diff"])
    # fixed cost constants: SpecFit never calibrated
    assert not [f for f in (tmp_path / "home").rglob("*.json") if not f.name.endswith(".selector.json")]


def test_numerics_refuses_an_unknown_method():
    with pytest.raises(SystemExit, match="unknown"):
        numerics.main(["--methods", "ar,medusa"])


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_bundle.sh", "estimator_eval.sh"])
def test_measurement_scripts_parse(script):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    done = subprocess.run([bash, "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_real_dims_decode_compares_resident_lru_and_prefetch_with_identical_output(tmp_path, capsys):
    """scripts/real_dims_decode.py (gpu_check.sh's real-transfer decode) at tiny dims on the CPU:
    builds the checkpoint once, decodes seeded-sampled tokens with every method, same tokens."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("real_dims_decode", ROOT / "scripts" / "real_dims_decode.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "decode"
    args = ["--device", "cpu", "--copy", "emulated", "--layers", "2", "--hidden", "64", "--experts", "8",
            "--intermediate", "32", "--top-k", "2", "--capacity", "2", "--prompts", "1", "--prompt-len", "8",
            "--new-tokens", "6", "--repeats", "1", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    assert script.main(args) == 0
    assert "output tokens identical across methods: yes" in capsys.readouterr().out
    rows = _rows(out / "results.jsonl")
    assert [r["method"] for r in rows] == ["ar_full", "ar", "ar_prefetch"]
    assert len({tuple(r["output_ids"]) for r in rows}) == 1 and len(set(rows[0]["output_ids"])) > 1  # sampled
    assert rows[0]["expert_cache_misses"] == 0 and rows[1]["expert_cache_misses"] > 0
    assert rows[2]["prefetch_issued"] > 0 and all(r["config"]["warmup"] == 1 for r in rows)


def test_lookahead_cost_times_every_part_of_the_hook(capsys, tmp_path, monkeypatch):
    """scripts/lookahead_cost.py on the demo pair, one prompt per workload: every part was timed
    (a renamed method would leave its row at zero calls), and the nesting holds."""
    import importlib.util

    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path))
    spec = importlib.util.spec_from_file_location("lookahead_cost", ROOT / "scripts" / "lookahead_cost.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--prompts", "1", "--tokens", "6"]) == 0
    out = capsys.readouterr().out
    rows = {}
    for label, _ in script.PARTS:
        line = next(line for line in out.splitlines() if line.strip().startswith(label))
        us, per_token, ms = (float(v) for v in line.split()[-3:])
        assert per_token > 0 and us > 0, line
        rows[label] = ms
    hook, router, copy = (rows[script.PARTS[i][0]] for i in (0, 1, 7))
    assert router < hook and copy > 0


def test_draft_level_cost_times_every_part_of_a_level(capsys):
    """scripts/draft_level_cost.py at the demo's dims, a few cycles: every part was timed (a renamed
    method would leave its column at zero) and every level was drafted."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("draft_level_cost", ROOT / "scripts" / "draft_level_cost.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--dims", "demo", "--cycles", "3", "--warmup", "1", "--depth", "3", "--vocab", "512"]
    assert script.main(args) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("demo")).split()
    values = [float(v) for v in row[1:]]
    assert all(v > 0 for v in values[:5]), row  # predict, acceptance, problem, search, prefetch plan
    assert values[-1] == 3.0  # levels per cycle: every level drafted
