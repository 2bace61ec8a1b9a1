"""The wheel works where the editable install hides what it lacks: built from this tree, installed
into a fresh virtual environment outside it (the pinned torch first, as the user guide says), it
runs `specfit plugins`, `specfit generate` on the shipped demo pair, a one-prompt bench and the
Python API. Takes a minute or two (the install), so it runs once, in one test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the pinned build (Makefile, pyproject.toml)


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def test_a_wheel_installed_in_a_fresh_venv_runs_every_entry_point(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(SPECFIT_HOME=str(tmp_path / "home"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)], tmp_path, env)
    wheel = next(dist.glob("specfit-*.whl"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python, specfit = venv / "bin" / "python", venv / "bin" / "specfit"
    try:
        _run([str(python), "-m", "pip", "install", "-q", TORCH, str(wheel)], tmp_path, env, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail("installing the wheel took over 15 minutes")
    work = tmp_path / "work"  # outside the source tree: nothing can come from it
    work.mkdir()
    where = _run([str(python), "-c", "import specfit; print(specfit.__file__)"], work, env)
    assert str(venv) in where and str(ROOT) not in where, where

    listed = _run([str(specfit), "plugins"], work, env)
    assert "eagle3" in listed and "lru" in listed
    out = _run([str(specfit), "generate", "model=demo", "prompt=The capital of France", "max_new_tokens=4",
                f"hydra.run.dir={work / 'gen'}"], work, env)
    assert "tokens=4" in out and (work / "gen" / "results.jsonl").is_file()
    out = _run([str(specfit), "bench", "model=demo", "workload.prompts=[Hello there]", "methods=[ar,eagle3]",
                "max_new_tokens=6", f"hydra.run.dir={work / 'bench'}"], work, env)
    assert "output tokens identical across methods: yes" in out
    api = ("import specfit\n"
           "cfg = specfit.compose(['model=demo', 'drafter=eagle3', 'selector=eagle3'])\n"
           "out = specfit.build(cfg).generate('Once upon a time', max_new_tokens=5)\n"
           "print(len(out.token_ids), repr(out.text))\n")
    assert _run([str(python), "-c", api], work, env).split()[0] == "5"
