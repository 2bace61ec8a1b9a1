"""Ship a trained target and its EAGLE-3 head inside the package (``model=demo``).

Weights are stored in bfloat16 (the shipped pair must stay small: <= 30 MB together); ``model.dtype``
loads them as float32 again on CPUs, where float32 is faster. The tokenizer travels with the
target. Every file is re-loaded and checked after writing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json")


def export_demo(target_dir: str | Path, head_dir: str | Path, out_dir: str | Path, data_dir: str | None = None,
                prompts_per_kind: int = 3) -> dict[str, int]:
    """Write ``out_dir/target``, ``out_dir/eagle3`` and ``out_dir/prompts.jsonl`` (held-out prose and
    GSM prompts for ``specfit demo``, so it runs without ../shared/data); returns the bytes of each model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specfit.plugins.drafters.eagle3.checkpoint import load_head, save_head
    from specfit.plugins.drafters.eagle3.probe import PROBE_FILE, load_probe, restamp_probe

    head = load_head(head_dir)
    load_probe(head_dir, head.cfg.hidden_size)  # a probe fit on other weights is named, never re-stamped as this head's
    out = Path(out_dir)
    target_out, head_out = out / "target", out / "eagle3"
    for d in (target_out, head_out):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(target_out, safe_serialization=True)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(target_out)
    save_head(head, head_out, dtype=torch.bfloat16)
    for extra in ("draft_vocab.json", PROBE_FILE):  # the probe: fit on this head (specfit fit-probe)
        if (Path(head_dir) / extra).is_file():
            shutil.copy(Path(head_dir) / extra, head_out / extra)
    restamp_probe(head_out)  # the same head, re-encoded in bfloat16
    from specfit.data.prompts import gsm_prompts, prose_prompts

    prompts = [{"kind": "prose", "prompt": p} for p in prose_prompts(data_dir, prompts_per_kind, 320, seed=7)]
    prompts += [{"kind": "gsm", "prompt": p} for p in gsm_prompts(data_dir, prompts_per_kind, seed=7)]
    (out / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    # check: both load back
    AutoModelForCausalLM.from_pretrained(target_out)
    load_head(head_out)
    sizes = {d.name: sum(f.stat().st_size for f in d.iterdir()) for d in (target_out, head_out)}
    (out / "MANIFEST.json").write_text(json.dumps({"target": str(target_dir), "head": str(head_dir), "bytes": sizes},
                                                  indent=2) + "\n")
    return sizes


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 4:
        sys.exit("usage: python -m specfit.training.export TARGET_DIR HEAD_DIR OUT_DIR")
    print(export_demo(*sys.argv[1:]))
