"""No file runs code, destinations are checked before decoding, outputs are written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from specfit.errors import ConfigError, ModelError
from specfit.files import append_jsonl_lines, check_results_file, check_writable, read_jsonl, write_atomic


class _Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


# --------------------------------------------------------------------------- trainer checkpoints


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    import random

    from specfit.training.common import load_state, rng_state, set_rng_state

    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.random(), np.random.normal(), torch.rand(1)  # a cached gaussian, advanced states
    state = {"model": {}, "optimizer": {}, "step": 7, "rng": rng_state(), "config": {"seed": 1}}
    torch.save(state, tmp_path / "state.pt")
    expected = (random.random(), np.random.normal(), np.random.rand(), float(torch.rand(1)))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(load_state(tmp_path / "state.pt")["rng"])
    assert (random.random(), np.random.normal(), np.random.rand(), float(torch.rand(1))) == expected


def test_a_pickle_payload_in_state_pt_is_refused_and_does_not_run(tmp_path):
    from specfit.training.common import load_state

    marker = tmp_path / "ran.txt"
    bad = tmp_path / "state.pt"
    torch.save({"model": {}, "optimizer": {}, "step": 1, "config": {}, "rng": _Payload(marker)}, bad)
    with pytest.raises(ModelError, match="refused to load") as info:
        load_state(bad)
    assert str(bad) in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("trainer", ["target", "drafter"])
def test_trainers_resume_refuses_a_crafted_state_pt(tmp_path, trainer):
    """The trainers load state.pt before any model or data (after checking that the paths they were
    given exist); a payload there is refused, not run."""
    marker = tmp_path / "ran.txt"
    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    (tmp_path / "target").mkdir()  # exist: the trainers' path checks pass, state.pt is read next
    (tmp_path / "target" / "config.json").write_text("{}")  # a saved model's mark (train-drafter checks it)
    (tmp_path / "tok").mkdir()
    torch.save({"model": {}, "optimizer": {}, "step": 1, "config": {}, "rng": _Payload(marker)},
               out / "checkpoint" / "state.pt")
    if trainer == "target":
        from specfit.training.target import TrainTargetConfig, train_target

        cfg, run = TrainTargetConfig(out_dir=str(out), tokenizer_dir=str(tmp_path / "tok"), resume=True), train_target
    else:
        from specfit.training.drafter import TrainDrafterConfig, train_drafter

        cfg, run = TrainDrafterConfig(out_dir=str(out), target_dir=str(tmp_path / "target"), resume=True), train_drafter
    with pytest.raises(ModelError, match="state.pt: refused to load"):
        run(cfg)
    assert not marker.exists()


def test_every_torch_load_in_the_repository_is_weights_only():
    import ast

    root = Path(__file__).resolve().parents[1]
    calls = 0
    for file in [*(root / "specfit").rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "scripts").rglob("*.py")]:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                calls += 1
                safe = [k for k in node.keywords if k.arg == "weights_only" and getattr(k.value, "value", None) is True]
                assert safe, f"{file}:{node.lineno}: torch.load without weights_only=True"
    assert calls >= 3  # the trainers' loader, the EAGLE-3 checkpoint reader, the tests


# --------------------------------------------------------------------------- atomic files


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX file modes")
def test_write_atomic_gives_the_umasks_mode_or_keeps_the_files_own(tmp_path):
    """A report or a results file is readable as any file the user writes is (mkstemp's 0600 is not
    what an atomic write should leave), and a file's own mode survives being rewritten."""
    umask = os.umask(0o022)
    os.umask(umask)
    fresh = write_atomic(tmp_path / "report.md", "x")
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~umask
    fresh.chmod(0o640)
    write_atomic(fresh, "y")
    assert fresh.stat().st_mode & 0o777 == 0o640 and fresh.read_text() == "y"


def test_write_atomic_replaces_whole_files_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "a.json"
    write_atomic(path, "old\n")
    with pytest.raises(RuntimeError):
        write_atomic(path, lambda f: (f.write(b"half"), (_ for _ in ()).throw(RuntimeError("killed"))))
    assert path.read_text() == "old\n"  # the failed write changed nothing
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]


def test_jsonl_append_repairs_a_torn_last_line_and_readers_skip_it(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    append_jsonl_lines(path, [{"a": 1}, {"a": 2}])
    with path.open("a") as f:  # a crash in the middle of a row
        f.write('{"a": 3, "b": [1, 2')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
    append_jsonl_lines(path, [{"a": 4}])
    assert path.read_text().splitlines() == ['{"a": 1}', '{"a": 2}', '{"a": 4}']
    assert "dropped an incomplete last line" in capsys.readouterr().err
    with path.open("a") as f:  # a complete row written by hand without its newline is kept
        f.write('{"a": 5}')
    assert read_jsonl(path)[-1] == {"a": 5}
    append_jsonl_lines(path, [{"a": 6}])
    assert [r["a"] for r in read_jsonl(path)] == [1, 2, 4, 5, 6]


def test_a_corrupt_line_inside_a_results_file_names_file_and_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"a": 1}\nnot json\n{"a": 2}\n')
    with pytest.raises(ConfigError, match=r"results.jsonl: line 2 is not JSON"):
        read_jsonl(path)


def test_an_indented_json_document_is_named_as_one(tmp_path):
    path = tmp_path / "learned.json"  # fit-acceptance's model, given to report by mistake
    path.write_text('{\n  "state": {"weights": [1.0]}\n}\n')
    with pytest.raises(ConfigError, match="learned.json: one JSON document, not JSON lines"):
        read_jsonl(path, "report")


@pytest.mark.parametrize("text", ["my notes\nline two", "one line, no newline"])
def test_a_file_that_is_not_json_lines_is_refused_never_cut(tmp_path, text):
    path = tmp_path / "notes.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"notes.txt: line \d is not JSON"):
        check_results_file(path)
    with pytest.raises(ConfigError, match="not a specfit results file"):
        append_jsonl_lines(path, [{"a": 1}])
    assert path.read_text() == text


# --------------------------------------------------------------------------- destinations


def test_check_writable_names_the_key_and_the_problem(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"^results_file=.*file/out/results.jsonl: .*is a file, not a directory"):
        check_writable(blocker / "out" / "results.jsonl", "results_file")
    with pytest.raises(ConfigError, match=r"^trace.path=.*: exists and is not a directory"):
        check_writable(blocker, "trace.path", directory=True)
    with pytest.raises(ConfigError, match=r"is a directory, not a file"):
        check_writable(tmp_path, "results_file")
    assert check_writable(tmp_path / "new" / "deeper" / "r.jsonl", "results_file") == tmp_path / "new" / "deeper" / "r.jsonl"
    assert not (tmp_path / "new").exists()  # checking creates nothing


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_check_writable_refuses_a_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=r"^results_file=.*ro/r.jsonl: cannot write there"):
            check_writable(ro / "r.jsonl", "results_file")
    finally:
        ro.chmod(0o755)


def test_report_refuses_an_unwritable_output_before_reading(tmp_path):
    from specfit.commands.report import write_report

    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps({"method": "ar", "output_throughput": 1.0, "num_output_tokens": 1,
                                   "total_seconds": 1.0}) + "\n")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"--out=.*file/report: .*is a file"):
        write_report([results], tmp_path / "file" / "report")
