"""The shipped demo pair (specfit/assets/demo): it loads from the package, fits the size budget,
decodes losslessly, and its head is trained (it beats a random head by far)."""

import json
from pathlib import Path

import pytest

import specfit

ASSETS = Path(specfit.__file__).parent / "assets" / "demo"
PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"


def test_shipped_weights_fit_the_budget():
    total = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert total <= 30 * 2**20
    kinds = {json.loads(line)["kind"] for line in (ASSETS / "prompts.jsonl").read_text().splitlines()}
    assert kinds == {"prose", "gsm"}


@pytest.fixture(scope="module")
def outputs():
    runs = {}
    for name, overrides in {"ar": ["drafter=none"],
                            "eagle3": ["drafter=eagle3", "selector=eagle3"],
                            "random_head": ["drafter=eagle3", "selector=eagle3", "drafter.path=random"]}.items():
        engine = specfit.build(specfit.compose(["model=demo", "cache=lru", "cache.capacity=8", *overrides]))
        runs[name] = engine.generate(PROMPT, max_new_tokens=24)
    return runs


def test_demo_pair_decodes_losslessly_with_its_trained_head(outputs):
    assert outputs["eagle3"].token_ids == outputs["ar"].token_ids == outputs["random_head"].token_ids
    assert outputs["ar"].text.strip()
    trained = outputs["eagle3"].stats["spec_decode_acceptance_length"]
    assert trained >= 2.0 and trained > 1.5 * outputs["random_head"].stats["spec_decode_acceptance_length"]
