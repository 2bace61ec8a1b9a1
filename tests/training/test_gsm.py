"""GSM generator: rendered answers are consistent with the templates' ``#answer`` and with their
own calculator steps, generation is deterministic, and the held-out split stays out of training."""

from __future__ import annotations

import math
import re

import pytest

from specfit.data import gsm
from specfit.data.paths import DataDirError, resolve_data_dir
from specfit.data.gsm import (
    HELDOUT_TEMPLATES, TRAIN_TEMPLATES, GenerationReport, SampleRejected, TemplateError,
    format_number, format_problem, generate_problems, parse_template, safe_eval,
)


def _data_dir():
    try:
        return resolve_data_dir(None, "gsm/eng", "gsm/replacements.json")
    except DataDirError as exc:
        pytest.skip(f"shared data absent: {exc}")


def test_split_is_disjoint_and_complete():
    assert set(TRAIN_TEMPLATES).isdisjoint(HELDOUT_TEMPLATES)
    assert sorted(TRAIN_TEMPLATES + HELDOUT_TEMPLATES) == list(range(80))
    assert HELDOUT_TEMPLATES == tuple(range(64, 80))


def test_safe_eval_whitelist():
    assert safe_eval("int(x * 2.5) + max(1, y)", {"x": 4, "y": 3}) == 13
    assert safe_eval("divides(12, 4) and is_int(3.0)", {}) is True
    for bad in ("__import__('os')", "().__class__", "(lambda: 1)()", "[i for i in range(3)]",
                "open('x')", "2 ** n"):
        with pytest.raises(TemplateError):
            safe_eval(bad, {"n": 5})
    with pytest.raises(SampleRejected):
        safe_eval("1 / 0", {})


def test_format_number():
    assert format_number(3.0) == "3"
    assert format_number(0.1 + 0.2) == "0.3"
    assert format_number(12) == "12"
    assert format_number(gsm.Num(0.5, "1/2")) == "1/2"


def test_inline_template_renders_and_verifies():
    data = {
        "question_annotated": (
            "{name,Ann} buys {n,3} {fruit,apples} at ${p,2} each. How much?\n\n#init:\n"
            "- name = sample(['Ann', 'Bo'])\n- fruit = sample(fruits)\n- $n = range(2, 9)\n"
            "- $p = range(1, 5)\n\n#conditions:\n- n * p > 3\n\n#answer: n * p\n"),
        "answer_annotated": "{n} * {p} = <<{n}*{p}={n*p}>>{n*p}\n#### {n*p}\n",
    }
    tpl = parse_template(999, data)
    import random

    probs, _ = gsm.generate_from_template(tpl, {"fruits": ["pears", "plums"]}, 5, random.Random(0))
    assert len(probs) == 5
    for p in probs:
        n, price = map(int, re.search(r"buys (\d+) \w+ at \$(\d+)", p.question).groups())
        assert p.final == str(n * price) and n * price > 3
        assert p.answer.endswith(f"#### {n * price}")


def test_generated_problems_are_consistent_and_deterministic():
    data_dir = _data_dir()
    report = GenerationReport()
    templates = list(range(0, 80, 5))
    probs = generate_problems(data_dir, templates, 3, seed=7, report=report)
    assert probs and not report.skipped, report.skipped
    again = generate_problems(data_dir, templates, 3, seed=7)
    assert [(p.question, p.answer) for p in probs] == [(p.question, p.answer) for p in again]
    for p in probs:
        assert p.template_id in templates
        assert "{" not in p.question and "}" not in p.answer
        final = re.search(r"####\s*(\S+)\s*$", p.answer).group(1)
        assert final == p.final and float(final) == int(float(final))
        for lhs, rhs in re.findall(r"<<([^<>=]*)=([^<>]*)>>", p.answer):
            try:
                left = safe_eval(lhs, {})
            except (TemplateError, SampleRejected):
                continue
            assert math.isclose(float(left), float(rhs), rel_tol=1e-4, abs_tol=1e-4), (lhs, rhs)
        text = format_problem(p)
        assert text.startswith("Question: ") and "\nAnswer: " in text


def test_all_templates_parse_and_generate():
    data_dir = _data_dir()
    report = GenerationReport()
    probs = generate_problems(data_dir, range(80), 1, seed=0, max_attempts=20_000, report=report)
    assert len(report.skipped) <= 4, report.skipped  # at most a few unusable templates
    assert len({p.template_id for p in probs}) >= 76


def test_training_documents_hold_no_heldout_template():
    data_dir = _data_dir()
    from specfit.training.tokenizer import training_documents

    pytest.importorskip("tokenizers")
    try:
        _, gsm_docs = training_documents(data_dir, gsm_per_template=1)
    except DataDirError as exc:  # corpus missing
        pytest.skip(str(exc))
    ids = {int(name.split("/")[1]) for name, _ in gsm_docs}
    assert ids and ids <= set(TRAIN_TEMPLATES)


def test_missing_data_dir_error_names_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataDirError, match=str(missing)):
        generate_problems(missing, [0], 1)
