"""Configuration: composition, and one clear line for every kind of mistake."""

from __future__ import annotations

import pytest

import specfit
from specfit.errors import ConfigError


def test_defaults_compose_and_are_typed():
    cfg = specfit.compose(["model=tiny"])
    assert cfg.cache.name == "lru" and cfg.drafter.name == "none" and cfg.selector.name == "eagle3"
    assert cfg.cache["copy"] == "torch" and cfg.cache.link.profile == "qwen3-30b-a3b-pcie4"
    assert cfg.cost_model is None and cfg.predictor is None


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("cache.capacit=3", r"Key 'capacit' not in 'LRUCacheConfig'"),
        ("cache.capacity=abc", r"Value 'abc' of type 'str' could not be converted to Integer"),
        ("cache=bogus", r"Could not find 'cache/bogus'.*Available options.*full.*lru.*none"),
        ("max_new_tokens=many", r"max_new_tokens"),
        ("sampling.temprature=1", r"Key 'temprature' not in 'SamplingConfig'"),
    ],
)
def test_mistakes_are_one_line_errors(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        specfit.compose(["model=tiny", override])
    assert "\n" not in str(info.value)


def test_plugin_name_and_config_must_agree():
    cfg = specfit.compose(["model=tiny", "cache=lru", "cache.name=none"])
    with pytest.raises(specfit.errors.PluginError, match="cache.name='none' but the cache config is LRUCacheConfig"):
        specfit.build(cfg)


def test_bad_model_paths(tmp_path):
    from specfit.errors import ModelError

    with pytest.raises(ModelError, match=r"model.path=/does/not/exist: no such directory"):
        specfit.build(specfit.compose(["model.path=/does/not/exist"]))
    with pytest.raises(ModelError, match="no config.json there"):
        specfit.build(specfit.compose([f"model.path={tmp_path}"]))
    with pytest.raises(ModelError, match="set model.path=DIR"):
        specfit.build(specfit.compose([]))


def test_sampling_values_are_checked():
    from specfit.decode.sampling import SamplingParams

    with pytest.raises(ConfigError, match="sampling.top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)


def test_a_command_line_group_choice_wins_over_a_method_preset(capsys):
    """``methods=[specfit] predictor=oracle`` runs SpecFit with the oracle predictor (the preset names
    history): the command line is applied after the preset, as in any Hydra command line. A key a
    method does not have still leaves that method alone (``drafter.top_k`` and ``ar``)."""
    from specfit.commands.bench import method_config

    cfg = specfit.compose(["model=tiny", "methods=[ar,specfit]"])
    spec = method_config(cfg, "specfit", None, ["predictor=oracle", "drafter.top_k=4"])
    assert spec.predictor.name == "oracle" and spec.drafter.top_k == 4 and spec.selector.name == "specfit"
    ar = method_config(cfg, "ar", "gsm", ["drafter.top_k=4", "workload=prose"])
    assert ar.drafter.name == "none" and ar.workload.kind == "gsm"  # the run's workload is the bench's
    assert method_config(cfg, "specfit", None, []).predictor.name == "history"
    assert "predictor=oracle replaces method specfit's predictor=history" in capsys.readouterr().err


def test_the_command_line_changing_a_methods_preset_is_noted(capsys):
    """A key the preset sets otherwise, or a part group it leaves to the base config, is changed for
    that method too: said, since the row keeps the method's name (``specfit_nogate`` with its gate on,
    ``ar`` prefetching beside ``ar_prefetch``)."""
    from specfit.commands.bench import method_config

    cfg = specfit.compose(["model=tiny", "methods=[ar,ar_prefetch,specfit_nogate]"])
    gated = method_config(cfg, "specfit_nogate", None, ["selector.draft_gate=true"])
    assert gated.selector.draft_gate is True
    ar = method_config(cfg, "ar", None, ["prefetch=lookahead"])
    assert ar.prefetch.name == "lookahead"
    err = capsys.readouterr().err
    assert "selector.draft_gate=true replaces method specfit_nogate's selector.draft_gate=false" in err
    assert "prefetch=lookahead applies to method ar too (its preset leaves prefetch to the base config)" in err
    method_config(cfg, "specfit_nogate", None, ["selector.draft_gate=false", "model=demo"])  # as the preset: silent
    assert "specfit_nogate" not in capsys.readouterr().err
    # only where another method of the run sets the group: alone, specfit simply takes what was asked
    alone = specfit.compose(["model=tiny", "methods=[specfit]"])
    method_config(alone, "specfit", None, ["prefetch=draft", "acceptance=learned"])
    assert "applies to method" not in capsys.readouterr().err


@pytest.mark.parametrize(("overrides", "note"), [
    (["cache.copy=torch", "cache.link.bandwidth_gbps=10"], "cache.copy=torch copies over the real link, so cache.link"),
    (["cache=full", "cache.capacity=4"], "cache=full gives every expert a slot, so cache.capacity is unused"),
    (["cache=full", "prefetch=lookahead"], "cache=full holds every expert, so prefetch=lookahead has nothing to copy"),
    (["prefetch=draft"], "prefetch=draft prefetches while drafting, and this run drafts nothing"),
    (["prefetch=draft", "drafter=eagle3", "selector=eagle3"], "no predictor is set: it prefetches nothing"),
    (["prefetch=auto", "drafter=eagle3", "selector=eagle3"], "no predictor is set: its draft half prefetches nothing"),
    (["drafter=eagle3", "selector=none"], "selector=none never drafts, so drafter=eagle3 is unused"),
    (["sampling.top_k=5", "sampling.top_p=0.9"], "sampling.top_k and sampling.top_p shape sampling"),
])
def test_a_setting_that_changes_nothing_is_noted(overrides, note):
    from specfit.config import unused_setting_notes

    assert [n for n in unused_setting_notes(specfit.compose(["model=tiny", *overrides])) if note in n]


def test_the_default_configs_note_nothing():
    from specfit.config import unused_setting_notes

    for overrides in ([], ["cache.copy=emulated", "cache.link.bandwidth_gbps=10"], ["sampling.temperature=0.7",
                                                                                      "sampling.top_k=5"]):
        assert unused_setting_notes(specfit.compose(["model=tiny", *overrides])) == []


def test_workload_keys_given_must_fit_the_workload_and_a_relabel_is_fine(tmp_path) -> None:
    """Only keys given are judged: a workload relabelled (workload.name) or a config file's own keys
    pass; workload.kind against the workload named beside it, and a key its kind does not read, fail."""
    import specfit
    from specfit.errors import ConfigError

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    specfit.compose(["model=tiny", "workload=jsonl", f"workload.path={prompts}", "workload.name=gsm"])
    specfit.compose(["model=tiny", "workload=prose", "workload.name=jsonl"])
    with pytest.raises(ConfigError, match="workload.kind=gsm contradicts workload=prose"):
        specfit.compose(["model=tiny", "workload=prose", "workload.kind=gsm"])
    with pytest.raises(ConfigError, match="workload.split=train does not apply to workload=prose"):
        specfit.compose(["model=tiny", "workload=prose", "workload.split=train"])
    with pytest.raises(ConfigError, match=r"^prefetch=null: prefetch is a group of options"):  # not the other null
        specfit.compose(["model=tiny", "model.max_model_len=null", "prefetch=null"])
