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
from specfit.data.gsm import HELDOUT_TEMPLATES, format_prompt, generate_problems


def prose_prompts(data_dir: str | os.PathLike[str] | None, n: int, chars: int, seed: int = 0) -> list[str]:
    """``n`` passages of about ``chars`` characters from the held-out documents (in turn), starting
    and ending on line boundaries at seeded positions."""
    docs = [text for _, text in load_corpus(data_dir).heldout]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = docs[i % len(docs)]
        start = text.find("\n", int(rng.integers(0, max(1, len(text) - chars)))) + 1
        end = text.rfind("\n", start, start + chars)
        passage = text[start : end + 1 if end > start else start + chars]
        out.append(passage.lstrip("\n"))
    return out


def gsm_prompts(data_dir: str | os.PathLike[str] | None, n: int, seed: int = 0) -> list[str]:
    """``n`` questions generated from the held-out templates (0064-0079), each ending in ``Answer:``."""
    if n <= 0:
        return []
    per_template = math.ceil(n / len(HELDOUT_TEMPLATES))
    problems = generate_problems(data_dir, HELDOUT_TEMPLATES, per_template, seed=seed)
    order = np.random.default_rng(seed).permutation(len(problems))
    return [format_prompt(problems[i]) for i in order[:n]]
