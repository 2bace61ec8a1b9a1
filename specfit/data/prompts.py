"""Held-out prompts, deterministic in their seed: prose passages and GSM-style questions.

Benchmarks (workloads ``prose``, ``summary``, ``gsm``) and the trainers' evaluations draw from the
same functions, so a figure in the model card and a benchmark run use prompts made the same way,
from documents and templates no model was trained on.
"""

from __future__ import annotations

import math
import os

import numpy as np

from specfit.data.corpus import load_corpus
from specfit.data.gsm import HELDOUT_TEMPLATES, TRAIN_TEMPLATES, format_prompt, generate_problems
from specfit.errors import ConfigError

#: The splits prompts are drawn from: ``heldout`` for benchmarks and evaluations, ``train`` for
#: training data made from prompts (``specfit distill-data``).
SPLITS = ("heldout", "train")


def check_split(split: str) -> None:
    """A :class:`ConfigError` naming ``split`` unless it is one of :data:`SPLITS`."""
    if split not in SPLITS:
        raise ConfigError(f"split={split!r} is not one of {', '.join(SPLITS)}")


def prose_prompts(data_dir: str | os.PathLike[str] | None, n: int, chars: int, seed: int = 0,
                  split: str = "heldout") -> list[str]:
    """``n`` passages of about ``chars`` characters from the split's documents (in turn), starting
    and ending on line boundaries at seeded positions."""
    check_split(split)
    corpus = load_corpus(data_dir)
    docs = [text for _, text in (corpus.heldout if split == "heldout" else corpus.train)]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = docs[i % len(docs)]
        start = text.find("\n", int(rng.integers(0, max(1, len(text) - chars)))) + 1
        end = text.rfind("\n", start, start + chars)
        passage = text[start : end + 1 if end > start else start + chars]
        out.append(passage.lstrip("\n"))
    return out


def gsm_prompts(data_dir: str | os.PathLike[str] | None, n: int, seed: int = 0, split: str = "heldout") -> list[str]:
    """``n`` questions generated from the split's templates (held out: 0064-0079), each ending in ``Answer:``."""
    check_split(split)
    if n <= 0:
        return []
    templates = HELDOUT_TEMPLATES if split == "heldout" else TRAIN_TEMPLATES
    per_template = math.ceil(n / len(templates))
    problems = generate_problems(data_dir, templates, per_template, seed=seed)
    order = np.random.default_rng(seed).permutation(len(problems))
    return [format_prompt(problems[i]) for i in order[:n]]
