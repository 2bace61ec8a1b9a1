"""The drafter's features read by a tap on the producing layers equal transformers' own
``output_hidden_states`` exactly, for every built-in family, in prefill and tree passes."""

import pytest
import torch

from specfit.model.builtin import ATTENTION_ONLY, BUILTIN_CONFIGS, build_builtin
from specfit.model.features import tap_for


def _reference(model, ids, indices):
    out = model(input_ids=ids, output_hidden_states=sorted(set(indices)), use_cache=False)
    return torch.cat([out.hidden_states[i][0] for i in indices], dim=-1)


@pytest.mark.parametrize("name", sorted(BUILTIN_CONFIGS))
def test_tap_matches_output_hidden_states(name):
    model = build_builtin(name, attn_implementation=ATTENTION_ONLY.get(name, "sdpa"))
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    for indices in ((1, layers // 2, layers - 1), (0, layers), (layers - 1, 1)):
        tap = tap_for(model, indices)
        assert tap is not None, f"{name}: no tap for {indices}"
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
            got = tap.features()
        tap.remove()
        with torch.no_grad():
            want = _reference(model, ids, indices)
        assert torch.equal(got, want), f"{name} {indices}"


def test_no_tap_where_the_model_is_not_plain():
    model = build_builtin("tiny-qwen3-moe")
    assert tap_for(model, ()) is None
    assert tap_for(model, (model.config.num_hidden_layers + 1,)) is None  # out of range: transformers decides
    model.model.layers.append(torch.nn.Linear(2, 2))  # a layer of another class: not the recorded shape
    assert tap_for(model, (1,)) is None


def test_engine_features_are_unchanged_by_the_tap(monkeypatch):
    """A speculative decode hands the drafter the same features with the tap as with transformers'
    capture (every pass, bit for bit), so it drafts and commits the same."""
    import specfit
    from specfit.model import target as target_module
    overrides = ["model=demo", "drafter=eagle3", "selector=eagle3", "max_new_tokens=12", "cache=full"]
    prompt = "The king said to his people"

    def run():
        engine = specfit.build(specfit.compose(overrides))
        passes, forward = [], engine.target._forward

        def recorded(*args, **kwargs):
            out = forward(*args, **kwargs)
            passes.append(out.features.clone())
            return out

        engine.target._forward = recorded
        out = engine.generate(prompt)
        return engine, out, passes

    tapped, out, features = run()
    assert tapped.target._tap is not None
    monkeypatch.setattr(target_module, "tap_for", lambda model, indices: None)
    plain, plain_out, plain_features = run()
    assert plain.target._tap is None
    assert plain_out.token_ids == out.token_ids
    assert plain_out.stats["accepted_tokens"] == out.stats["accepted_tokens"]
    assert len(features) == len(plain_features) > 1
    assert all(torch.equal(a, b) for a, b in zip(features, plain_features))
