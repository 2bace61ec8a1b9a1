"""Interrupted `specfit bench` and `specfit record`: what completed survives, and resuming completes the job.

The fast tests interrupt in-process (a KeyboardInterrupt raised by the Nth decode, as Ctrl-C would)
and then run the resume command the job printed. The slow ones start the real command as a
subprocess, wait for the first row or sequence on disk, send SIGINT or SIGKILL, check what survived,
resume, and compare with an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from specfit.cli import main
from specfit.errors import ConfigError
from specfit.files import read_jsonl
from specfit.trace import load_trace
from specfit.trace.format import TraceError

PROMPTS = "workload.prompt_ids=[[5,17,99],[3,42,7],[8,9,10],[11,12,13,14]]"
DRAFTER = ["drafter.top_k=3", "drafter.depth=2", "drafter.total_tokens=6"]
BENCH = ["bench", "model=tiny", "methods=[eagle3_nocache,eagle3]", *DRAFTER, PROMPTS, "max_new_tokens=6", "cache.copy=torch",
         "~cost_model", "~predictor", "selector=eagle3",
         "warmup=0"]  # Ctrl-C after N decodes: no untimed warm-up decodes before the counted ones
RECORD = ["record", "model=tiny", *DRAFTER, "~cost_model", PROMPTS, "max_new_tokens=8"]
ROWS = 2 * 4  # methods x prompts


def _rows(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "results.jsonl")  # a torn last line (SIGKILL mid-write) is not a row


def _key(row: dict) -> tuple:
    return row["method"], row["prompt_index"], row["repeat"]


def _resume_args(stderr: str, command: str) -> list[str]:
    """The arguments of the resume command an interrupted job printed (after ``specfit``)."""
    line = next(x for x in stderr.splitlines() if "resume with: " in x)
    args = shlex.split(line.split("resume with: ", 1)[1])
    assert args[:2] == ["specfit", command] and "resume=true" in args
    return args[1:]


def _interrupt_after(monkeypatch, completed: int) -> None:
    """Raise KeyboardInterrupt (Ctrl-C) when decode number ``completed + 1`` starts."""
    from specfit.api import Engine

    original, calls = Engine.generate, {"n": 0}

    def generate(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > completed:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", generate)


def _interrupted(args: list[str], capsys) -> str:
    with pytest.raises((KeyboardInterrupt, SystemExit)) as info:  # the CLI turns Ctrl-C into exit 130
        main(args)
    if isinstance(info.value, SystemExit):
        assert info.value.code == 130
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted bench and record runs of the same jobs."""
    root = tmp_path_factory.mktemp("reference")
    main([*BENCH, f"hydra.run.dir={root / 'bench'}"])
    main([*RECORD, f"hydra.run.dir={root / 'record'}"])
    return {"bench": {_key(r): r for r in _rows(root / "bench")}, "trace": load_trace(root / "record" / "trace")}


def _same_trace(a, b) -> None:
    assert len(a.sequences) == len(b.sequences)
    for sa, sb in zip(a.sequences, b.sequences):
        for name, array in sa.arrays().items():
            if name != "level_seconds":  # measured time
                assert np.array_equal(array, sb.arrays()[name], equal_nan=array.dtype.kind == "f"), name  # NaN: not expanded


def _check_bench_resume(run_dir: Path, reference: dict, survived: int, args: list[str]) -> None:
    rows = _rows(run_dir)
    assert len(rows) == survived and all("output_ids" in r for r in rows)  # every line whole
    for r in rows:
        assert r["output_ids"] == reference["bench"][_key(r)]["output_ids"]
    main(args)
    rows = _rows(run_dir)
    assert sorted(map(_key, rows)) == sorted(reference["bench"])  # nothing twice, nothing missing
    for r in rows:
        assert r["output_ids"] == reference["bench"][_key(r)]["output_ids"]
    assert (run_dir / "summary.jsonl").is_file()


def _check_record_resume(trace_dir: Path, reference: dict, survived: int, args: list[str]) -> None:
    assert len(list(trace_dir.glob("seq-*.npz"))) == survived and not (trace_dir / "meta.json").exists()
    with pytest.raises(TraceError, match="incomplete trace.*resume=true"):
        load_trace(trace_dir)
    main(args)
    _same_trace(load_trace(trace_dir), reference["trace"])
    assert not (trace_dir / "partial.json").exists()


def test_interrupted_bench_keeps_completed_runs_and_resumes(reference, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    _interrupt_after(monkeypatch, 3)
    err = _interrupted([*BENCH, f"hydra.run.dir={run_dir}"], capsys)
    assert f"3 completed runs are in {run_dir / 'results.jsonl'}" in err
    monkeypatch.undo()
    _check_bench_resume(run_dir, reference, 3, _resume_args(err, "bench"))
    assert "resume: 3 of 8 runs" in capsys.readouterr().err


def test_resume_reruns_rows_of_another_config_and_can_extend_a_job(reference, tmp_path, capsys):
    """Rows of a different config in the same results file are not taken for this job's; more
    repeats (or methods, workloads) only add the missing runs."""
    run_dir = tmp_path / "run"
    main([*BENCH, "max_new_tokens=5", f"hydra.run.dir={run_dir}"])
    main([*BENCH, "resume=true", f"hydra.run.dir={run_dir}"])
    assert "resume: 0 of 8 runs" in capsys.readouterr().err
    rows = [r for r in _rows(run_dir) if r["config"]["max_new_tokens"] == 6]
    assert sorted(map(_key, rows)) == sorted(reference["bench"])
    main([*BENCH, "repeats=2", "resume=true", f"hydra.run.dir={run_dir}"])
    assert "resume: 8 of 16 runs" in capsys.readouterr().err
    rows = [r for r in _rows(run_dir) if r["config"]["max_new_tokens"] == 6]
    assert sorted(map(_key, rows)) == sorted([*reference["bench"], *((m, i, 1) for m, i, _ in reference["bench"])])
    for r in rows:
        assert r["output_ids"] == reference["bench"][(r["method"], r["prompt_index"], 0)]["output_ids"]


def test_interrupted_record_keeps_completed_sequences_and_resumes(reference, tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    _interrupt_after(monkeypatch, 2)
    err = _interrupted([*RECORD, "trace.overwrite=true", f"hydra.run.dir={run_dir}"], capsys)
    assert f"2 of 4 sequences are saved in {run_dir / 'trace'}" in err
    monkeypatch.undo()
    args = _resume_args(err, "record")
    assert "trace.overwrite=true" not in args  # resuming continues the trace; overwriting would discard it
    _check_record_resume(run_dir / "trace", reference, 2, args)


def test_record_refuses_to_mix_an_incomplete_trace_with_another_config(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    _interrupt_after(monkeypatch, 1)
    _interrupted([*RECORD, f"hydra.run.dir={run_dir}"], capsys)
    monkeypatch.undo()
    with pytest.raises(SystemExit):  # without resume=true: refused, nothing overwritten by mistake
        main([*RECORD, f"hydra.run.dir={run_dir}"])
    assert "holds an incomplete recording: continue it with resume=true" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*RECORD, "max_new_tokens=9", "resume=true", f"hydra.run.dir={run_dir}"])
    assert "max_new_tokens differs" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "record", "generate"])
def test_unwritable_destinations_fail_before_any_decoding(command, tmp_path, monkeypatch, capsys):
    _interrupt_after(monkeypatch, 0)  # any decode would raise KeyboardInterrupt instead of exit 2
    (tmp_path / "file").write_text("x")
    args = {"bench": BENCH, "record": RECORD, "generate": ["generate", "model=tiny", "prompt_ids=[1,2]"]}[command]
    with pytest.raises(SystemExit) as info:
        main([*args, f"results_file={tmp_path / 'file' / 'results.jsonl'}", f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith("specfit: error: results_file=") and "is a file" in err
    if command == "record":
        with pytest.raises(SystemExit) as info:
            main([*args, f"trace.path={tmp_path / 'file' / 'trace'}", f"hydra.run.dir={tmp_path / 'run'}"])
        err = capsys.readouterr().err.strip()
        assert info.value.code == 2 and err.startswith("specfit: error: trace.path=") and "is a file" in err


def test_calibration_destination_is_checked_before_measuring(tmp_path, monkeypatch, capsys):
    _interrupt_after(monkeypatch, 0)
    (tmp_path / "home").write_text("not a directory")
    monkeypatch.setenv("SPECFIT_HOME", str(tmp_path / "home"))
    with pytest.raises(SystemExit) as info:
        main(["calibrate", "model=tiny", "cost_model=union", "drafter=eagle3", *DRAFTER, f"hydra.run.dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and "calibration file" in err and "is a file, not a directory" in err


# --------------------------------------------------------------------------- trace folder safety


def _trace(tmp_path, reference) -> Path:
    path = tmp_path / "t"
    reference["trace"].save(path)
    return path


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside.npz", "sub/../../outside.npz", "..", "", 7])
def test_load_trace_refuses_file_names_that_leave_the_folder(reference, tmp_path, name):
    path = _trace(tmp_path, reference)
    (tmp_path / "outside.npz").write_bytes((path / "seq-00000.npz").read_bytes())
    meta = json.loads((path / "meta.json").read_text())
    meta["sequences"][0]["file"] = name
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TraceError, match=r"meta.json: sequence file .* lies outside the trace folder"):
        load_trace(path)


def test_load_trace_refuses_a_symlink_out_of_the_folder(reference, tmp_path):
    path = _trace(tmp_path, reference)
    outside = tmp_path / "outside.npz"
    (path / "seq-00000.npz").rename(outside)
    (path / "seq-00000.npz").symlink_to(outside)
    with pytest.raises(TraceError, match=r"'seq-00000.npz' lies outside the trace folder"):
        load_trace(path)
    (path / "seq-00000.npz").unlink()
    (path / "inner.npz").symlink_to(path / "seq-00001.npz")  # a link that stays inside is fine
    meta = json.loads((path / "meta.json").read_text())
    meta["sequences"][0]["file"] = "inner.npz"
    (path / "meta.json").write_text(json.dumps(meta))
    assert isinstance(load_trace(path).sequences[0].prompt, np.ndarray)
    assert issubclass(TraceError, ConfigError)


# --------------------------------------------------------------------------- real signals (slow)


_SLOW_DECODE = """
import sys, time
from specfit.api import Engine
_generate = Engine.generate
def generate(self, *args, **kwargs):
    out = _generate(self, *args, **kwargs)
    time.sleep(0.4)  # a decode long enough to be interrupted in the middle of the job
    return out
Engine.generate = generate
from specfit.cli import main
main(sys.argv[1:])
"""


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", _SLOW_DECODE, *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the job ended before it could be interrupted: {proc.communicate()}"
        assert time.monotonic() < deadline, "nothing reached the disk in time"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_killed_bench_subprocess_resumes_to_the_uninterrupted_result(reference, tmp_path, sig, capsys):
    run_dir = tmp_path / "run"
    proc = _start([*BENCH, f"hydra.run.dir={run_dir}"], tmp_path)
    results = run_dir / "results.jsonl"
    _wait_for(lambda: results.is_file() and results.read_text().count("\n") >= 1, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    survived = len(_rows(run_dir))
    assert 1 <= survived < ROWS
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and err.strip().endswith("specfit: interrupted") and "Traceback" not in err
        args = _resume_args(err, "bench")
    else:
        assert proc.returncode == -signal.SIGKILL
        args = [*BENCH, "resume=true", f"hydra.run.dir={run_dir}"]
    _check_bench_resume(run_dir, reference, survived, args)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_killed_record_subprocess_resumes_to_the_uninterrupted_trace(reference, tmp_path, sig, capsys):
    run_dir = tmp_path / "run"
    proc = _start([*RECORD, f"hydra.run.dir={run_dir}"], tmp_path)
    trace_dir = run_dir / "trace"
    _wait_for(lambda: (trace_dir / "seq-00000.npz").is_file(), proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    survived = len(list(trace_dir.glob("seq-*.npz")))  # complete files only: each was renamed into place
    assert 1 <= survived < 4
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and err.strip().endswith("specfit: interrupted") and "Traceback" not in err
        args = _resume_args(err, "record")
    else:
        assert proc.returncode == -signal.SIGKILL
        args = [*RECORD, "resume=true", f"hydra.run.dir={run_dir}"]
    _check_record_resume(trace_dir, reference, survived, args)
