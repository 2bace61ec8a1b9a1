"""Workloads: the prompts a job decodes.

Kinds (``workload.kind``):

- ``inline``: ``workload.prompts`` / ``workload.prompt_ids`` (or the job's ``prompt`` / ``prompt_ids``);
- ``prose``: continuation of passages from the held-out plays and books of ../shared/data;
- ``summary``: long held-out passages followed by a summary cue (long context);
- ``gsm``: GSM-style problems generated from the held-out templates (0064-0079);
- ``jsonl``: a user's file, one ``{"prompt": ...}`` or ``{"prompt_ids": [...]}`` per line;
- ``hf``: a Hugging Face dataset available locally (``cnn_dailymail``, ``gsm8k``), the paper's workloads.

Every prompt list is deterministic in ``workload.seed``; results name the workload and its split.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from specfit.errors import ConfigError

KINDS = ("inline", "prose", "summary", "gsm", "jsonl", "hf")
SUMMARY_CUE = "\n\nIn short,"


def load_workload(cfg: DictConfig) -> list[str | list[int]]:
    kind = cfg.kind
    if kind not in KINDS:
        raise ConfigError(f"workload.kind={kind!r} is not one of {', '.join(KINDS)}")
    prompts: list[str | list[int]] = [list(p) for p in cfg.prompt_ids] + [str(p) for p in cfg.prompts]
    if kind in ("prose", "summary", "gsm"):
        prompts += _held_out(cfg)
    elif kind == "jsonl":
        prompts += _jsonl(cfg)
    elif kind == "hf":
        prompts += _hf_dataset(cfg)
    if cfg.max_prompts is not None:
        prompts = prompts[: cfg.max_prompts]
    return prompts


def describe(cfg: DictConfig) -> dict[str, str]:
    """What results should say about the prompts: the workload's name, kind and split."""
    split = {"prose": "held-out documents", "summary": "held-out documents", "gsm": "held-out templates 0064-0079",
             "hf": cfg.split, "jsonl": str(cfg.path), "inline": "inline"}[cfg.kind]
    return {"workload": cfg.name, "workload_kind": cfg.kind, "workload_split": split}


def _held_out(cfg: DictConfig) -> list[str]:
    from specfit.data.gsm import TemplateError
    from specfit.data.paths import DataDirError
    from specfit.data.prompts import gsm_prompts, prose_prompts

    try:
        if cfg.kind == "gsm":
            return gsm_prompts(cfg.data_dir, cfg.num_prompts, cfg.seed)
        passages = prose_prompts(cfg.data_dir, cfg.num_prompts, cfg.prompt_chars, cfg.seed)
    except (DataDirError, FileNotFoundError, TemplateError) as exc:  # missing or malformed data files
        raise ConfigError(f"workload={cfg.name}: {exc}") from exc
    return [p.rstrip() + SUMMARY_CUE for p in passages] if cfg.kind == "summary" else passages


def _jsonl(cfg: DictConfig) -> list[str | list[int]]:
    if not cfg.path:
        raise ConfigError("workload.kind=jsonl needs workload.path=FILE")
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise ConfigError(f"workload.path={cfg.path}: no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"workload.path={cfg.path} line {line}: not UTF-8 text (byte {exc.start})") from exc
    prompts: list[str | list[int]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"workload.path={cfg.path} line {n}: not JSON ({exc.msg})") from exc
        prompts.append(prompt_of_row(row, f"workload.path={cfg.path} line {n}"))
    if not prompts:
        raise ConfigError(f"workload.path={cfg.path}: no prompts in the file (one {{\"prompt\": ...}} per line)")
    return prompts


def prompt_of_row(row: object, where: str) -> str | list[int]:
    """The prompt of one JSON line: a non-empty string, or a non-empty list of token ids (ints >= 0)."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a JSON {type(row).__name__}, not an object with a 'prompt' or 'prompt_ids' field")
    if "prompt_ids" in row and "prompt" in row:  # as on the command line: which one was meant cannot be told
        raise ConfigError(f"{where}: has both 'prompt' and 'prompt_ids'; give one of them")
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not isinstance(ids, list) or not ids:
            raise ConfigError(f"{where}: 'prompt_ids' must be a non-empty list of token ids, not {json.dumps(ids)[:40]}")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ConfigError(f"{where}: 'prompt_ids' holds {json.dumps(t)[:40]}, not a token id (an int >= 0)")
        return list(ids)
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{where}: 'prompt' must be a non-empty string, not {json.dumps(prompt)[:40]}")
        return prompt
    raise ConfigError(f"{where}: needs a 'prompt' or 'prompt_ids' field")


HF_DATASETS = {
    "cnn_dailymail": ("3.0.0", lambda row: row["article"] + "\nTL;DR:"),
    "gsm8k": ("main", lambda row: f"Question: {row['question']}\nAnswer:"),
}


def _hf_dataset(cfg: DictConfig) -> list[str]:
    name = cfg.dataset
    if name not in HF_DATASETS:
        raise ConfigError(f"workload.dataset={name!r}: known datasets are {', '.join(HF_DATASETS)}")
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"workload.dataset={name} needs the `datasets` package (pip install datasets) "
                          "and a local copy of the dataset") from None
    config, fmt = HF_DATASETS[name]
    try:
        data = datasets.load_dataset(name, config, split=cfg.split)
    except Exception as exc:  # offline or missing: datasets raises many types
        raise ConfigError(f"workload.dataset={name}: not available locally ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); download it where a hub is reachable "
                          "and set HF_DATASETS_OFFLINE=1") from exc
    rows = data.shuffle(seed=cfg.seed).select(range(min(cfg.num_prompts, len(data))))
    return [fmt(row) for row in rows]
