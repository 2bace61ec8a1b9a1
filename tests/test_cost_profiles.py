"""Named cost profiles: the derivation the docstring shows is the one the code computes (a replay
with a profile: tests/trace/test_estimator_commands.py)."""

from __future__ import annotations

import re

import pytest

from specfit.config import compose
from specfit.types import cost_profiles
from specfit.types.cost_profiles import COST_PROFILES, QWEN3_30B_A3B, cost_profile
from specfit.errors import ConfigError


def test_the_docstring_table_is_what_the_code_derives():
    rows = re.findall(r"^(\S+)(?: \([^)]*\))?\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$",
                      cost_profiles.__doc__, flags=re.M)
    assert {r[0] for r in rows} == set(COST_PROFILES)
    for name, *values in rows:
        c = COST_PROFILES[name].constants
        for shown, value in zip(values, (c.c0, c.c_tok, c.c_hit, c.c_miss, c.c_level)):
            decimals = len(shown.split(".")[1])
            assert round(value * 1e3, decimals) == pytest.approx(float(shown)), (name, shown)


def test_the_arithmetic_from_published_numbers():
    assert QWEN3_30B_A3B.expert_params * 2 == 9_437_184  # 3 x 2048 x 768 bf16
    assert QWEN3_30B_A3B.dense_params == 1_229_717_504
    pcie4, pcie5 = (COST_PROFILES[f"qwen3-30b-a3b-h200-{link}"].constants for link in ("pcie4", "pcie5"))
    assert pcie4.c_miss - pcie4.c_hit == pytest.approx(9_437_184 / 25e9)
    assert pcie5.c_miss - pcie5.c_hit == pytest.approx(9_437_184 / 50e9)
    assert pcie4.c0 == pcie5.c0 and pcie4.c_hit == pcie5.c_hit  # the link changes misses only
    consumer = COST_PROFILES["qwen3-30b-a3b-24gb-pcie4"].constants
    assert consumer.c0 > pcie4.c0 and consumer.c_tok > pcie4.c_tok and consumer.c_level > pcie4.c_level
    assert COST_PROFILES["gpu-like"].constants.c_miss == 4e-4


def test_an_unknown_profile_names_the_key_and_the_known_ones():
    with pytest.raises(ConfigError, match=r"replay.cost_profile='h100' is not a cost profile \(known: qwen3-30b"):
        compose(["replay.cost_profile=h100"], config_name="replay")
    with pytest.raises(ConfigError, match="gpu-like"):
        cost_profile("nope")
