"""``specfit generate``: decode one prompt, print the text and a stats line, append results.jsonl."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from specfit.api import build
from specfit.errors import ConfigError
from specfit.files import check_results_file
from specfit.results import append_jsonl, run_config, stats_line


def prompts_of(cfg: DictConfig) -> list[str | list[int]]:
    """The prompts a config asks for: ``prompt_ids`` / ``prompt`` / ``prompt_file``, else the workload's."""
    given = [k for k in ("prompt", "prompt_ids", "prompt_file") if cfg.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"give one of prompt, prompt_ids and prompt_file, not {' and '.join(given)}")
    if cfg.prompt_ids is not None:
        return [list(cfg.prompt_ids)]
    if cfg.prompt is not None:
        return [str(cfg.prompt)]
    if cfg.get("prompt_file") is not None:
        return [read_prompt_file(cfg.prompt_file)]
    from specfit.workloads import load_workload

    prompts = load_workload(cfg.workload)
    if not prompts:
        raise ConfigError("no prompt: set prompt=\"...\", prompt_ids=[...] or a workload with prompts")
    return prompts


def describe_prompts(cfg: DictConfig) -> dict[str, str]:
    """What results say of the prompts: the workload's name, kind and split, or, where a prompt given
    on the command line replaced the workload's (``specfit demo prompt=...``), ``inline`` and its key."""
    given = next((k for k in ("prompt", "prompt_ids", "prompt_file") if cfg.get(k) is not None), None)
    if given is None:
        from specfit.workloads import describe

        return describe(cfg.workload)
    split = f"prompt_file={cfg.prompt_file}" if given == "prompt_file" else given
    return {"workload": "inline", "workload_kind": "inline", "workload_split": split}


def read_prompt_file(path: str) -> str:
    """``prompt_file=PATH`` (``-``: standard input) as UTF-8 text: no shell quoting of the prompt needed.

    One final line break is dropped (editors and ``echo`` add it); everything else is kept as written.
    """
    where = f"prompt_file={path}" + (" (standard input)" if path == "-" else "")
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).expanduser().read_bytes()
    except (AttributeError, ValueError):  # no standard input to read (closed, or not a byte stream)
        raise ConfigError(f"{where}: there is no readable standard input") from None
    except FileNotFoundError:
        raise ConfigError(f"prompt_file={path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"prompt_file={path} is a directory, not a text file") from None
    except OSError as exc:
        raise ConfigError(f"prompt_file={path}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is not part of the prompt
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); "
                          f"convert it, e.g. with iconv -t utf-8") from None
    text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not text:
        raise ConfigError(f"{where} is empty")
    return text


def run(cfg: DictConfig, output_dir: Path) -> list[dict[str, Any]]:
    """Decode each prompt; its row goes to the results file as soon as it is done (checked writable first)."""
    path = check_results_file(output_dir / cfg.results_file)
    prompts = prompts_of(cfg)
    engine = build(cfg, check_prompts=prompts)
    rows = []
    config = run_config(cfg)  # plug-in aliases recorded with the values they set
    for prompt in prompts:
        out = engine.generate(prompt)
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
        print(stats_line(out.stats))
        made, asked = out.stats["num_output_tokens"], engine.max_new_tokens
        if out.stats["finish_reason"] == "length" and made < asked:  # not max_new_tokens: the context is full
            print(f"stopped after {made} of max_new_tokens={asked}: the prompt ({out.stats['num_prompt_tokens']} "
                  f"tokens) and output reached the context limit, {engine.context_source()}")
        rows.append({"command": "generate", "prompt": prompt, "output_ids": out.token_ids, "text": out.text,
                     **out.stats, "config": config})
        append_jsonl(path, rows[-1:])
    print(f"results: {path}")
    return rows
