"""Bad API calls: specfit.compose, specfit.build, Engine(...) and Engine.generate raise ConfigError,
ModelError or PluginError with one line naming the argument or key, never a raw TypeError or
IndexError from deep inside. ConfigError is a ValueError too: callers may catch either."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch
from conftest import tiny_model
from omegaconf import OmegaConf

import specfit
from specfit.api import Engine
from specfit.decode.sampling import SamplingParams
from specfit.errors import ConfigError, ModelError, PluginError

LIMIT_S = 30


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(tiny_model(), max_new_tokens=2)


def _composed(*overrides: str, **changes: Any):
    """A composed config, then changed the way a user might change it before build()."""
    cfg = specfit.compose(["model=tiny", *overrides])
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def _engine(**kwargs: Any) -> Engine:
    return Engine(tiny_model(), **kwargs)


def _plugin(kind: str, cfg: Any) -> Any:
    from specfit.registry import get_plugins

    return get_plugins()[kind].create(cfg)


class _NotADrafter:
    name = "not_a_drafter"


# (id, call, exception type, substring of the message). Calls that need the shared engine take it.
CASES: list[tuple[str, Callable[..., Any], type[Exception], str]] = [
    # specfit.compose
    ("compose-a-string", lambda: specfit.compose("model=tiny"), ConfigError, "overrides"),
    ("compose-a-dict", lambda: specfit.compose({"model": "tiny"}), ConfigError, "list of 'key=value' strings"),
    ("compose-not-strings", lambda: specfit.compose(["model=tiny", 5]), ConfigError, "overrides"),
    ("compose-plus-key", lambda: specfit.compose(["model=tiny", "+foo=1"]), ConfigError, "'foo'"),
    ("compose-plus-nested", lambda: specfit.compose(["model=tiny", "+drafter.foo=1"]), ConfigError, "drafter.foo"),
    ("compose-removed", lambda: specfit.compose(["model=tiny", "~sampling"]), ConfigError, "sampling"),
    ("compose-top-p", lambda: specfit.compose(["sampling.top_p=0"]), ConfigError, "sampling.top_p"),
    ("compose-capacity", lambda: specfit.compose(["cache.capacity=0"]), ConfigError, "cache.capacity"),
    ("compose-depth", lambda: specfit.compose(["drafter=eagle3", "drafter.depth=0"]), ConfigError, "drafter.depth"),
    ("compose-float-id", lambda: specfit.compose(["prompt_ids=[1.5]"]), ConfigError, "prompt_ids"),
    ("compose-config-name", lambda: specfit.compose([], config_name="nope"), ConfigError, "nope"),
    # specfit.build
    ("build-a-dict", lambda: specfit.build({"model": {"builtin": "tiny-qwen3-moe"}}), ConfigError, "build()"),
    ("build-not-composed", lambda: specfit.build(OmegaConf.create({"model": {"builtin": "tiny-qwen3-moe"}})),
     ConfigError, "lacks sampling"),
    ("build-changed-length", lambda: specfit.build(_composed(max_new_tokens=0)), ConfigError, "max_new_tokens"),
    ("build-changed-ids", lambda: specfit.build(_composed(stop_token_ids=[-1])), ConfigError, "stop_token_ids"),
    ("build-added-key", lambda: specfit.build(_composed(**{"drafter.foo": 1})), ConfigError, "drafter.foo"),
    ("build-two-prompts", lambda: specfit.build(_composed(prompt="a", prompt_ids=[1])), ConfigError, "prompt_ids"),
    ("build-needs-cost-model", lambda: specfit.build(_composed("selector=specfit")), ConfigError, "cost_model"),
    ("build-dtype", lambda: specfit.build(_composed("model.dtype=int8")), ModelError, "model.dtype"),
    ("build-no-model-dir", lambda: specfit.build(_composed("model.path=/nope/m", "model.builtin=null")), ModelError,
     "model.path"),
    ("build-name-mismatch", lambda: specfit.build(_composed("cache.name=none")), PluginError, "cache.name"),
    ("build-top-k-limit", lambda: specfit.build(_composed("drafter=eagle3", "drafter.top_k=100000")), ConfigError,
     "drafter.top_k"),
    ("build-below-top-k", lambda: specfit.build(_composed("cache.capacity=1")), ConfigError, "cache.capacity"),
    # Engine(...)
    ("engine-not-a-model", lambda: Engine("model"), ModelError, "Engine needs"),
    ("engine-length-zero", lambda: _engine(max_new_tokens=0), ConfigError, "max_new_tokens"),
    ("engine-length-float", lambda: _engine(max_new_tokens=2.5), ConfigError, "max_new_tokens"),
    ("engine-stop-float", lambda: _engine(stop_token_ids=[1.5]), ConfigError, "stop_token_ids"),
    ("engine-stop-vocab", lambda: _engine(stop_token_ids=[10**9]), ConfigError, "stop_token_ids"),
    ("engine-stop-string", lambda: _engine(stop_token_ids="abc"), ConfigError, "stop_token_ids"),
    ("engine-sampling-dict", lambda: _engine(sampling={"temperature": 1.0}), ConfigError, "sampling"),
    ("engine-copy", lambda: _engine(copy="foo"), ConfigError, "cache.copy"),
    ("engine-device-name", lambda: _engine(device="tpu"), ConfigError, "device"),
    ("engine-device-int", lambda: _engine(device=3), ConfigError, "device"),
    ("engine-device-meta", lambda: _engine(device="meta"), ConfigError, "Engine runs on cpu or cuda"),
    ("engine-selector-requires", lambda: _engine(selector=_requires_a_string()), PluginError, "requires='cost_model'"),
    ("engine-cache-preload", lambda: _engine(cache=_preloads_none()), PluginError, "must return a list"),
    *([("engine-no-cuda", lambda: _engine(device="cuda:0"), ConfigError, "no CUDA device")]
      if not torch.cuda.is_available() else []),
    ("engine-context", lambda: _engine(max_model_len=1), ConfigError, "model.max_model_len"),
    ("engine-drafter", lambda: _engine(drafter=_NotADrafter()), PluginError, "drafter"),
    ("engine-selector-class", lambda: _engine(selector=_classes()["selector"]), PluginError, "pass an instance"),
    ("engine-prefetcher-class", lambda: _engine(prefetcher=_classes()["prefetch"]), PluginError, "pass an instance"),
    ("engine-copy-none", lambda: _engine(copy=None), ConfigError, "copy=None must be one of"),
    ("engine-link-name", lambda: _engine(copy="emulated", link="pcie4"), ConfigError, "link='pcie4'"),
    ("engine-tokenizer-name", lambda: _engine(tokenizer="gpt2"), ConfigError, "tokenizer='gpt2'"),
    ("engine-ignore-eos", lambda: _engine(ignore_eos="no"), ConfigError, "ignore_eos='no'"),
    ("engine-model-taken", lambda: _engine_on_a_taken_model(), ModelError, "held by another Engine"),
    ("engine-calibration-file", lambda e: _engine(**_specfit_parts(calibration="/nope/c.json")).generate([1, 2]),
     ConfigError, "cost_model.calibration=/nope/c.json: no such file"),
    # plug-ins built in code are checked as their configs are
    ("cache-capacity-string", lambda: _engine(cache=_classes()["cache"](capacity="16")), ConfigError,
     "cache.capacity='16'"),
    ("cache-capacity-float", lambda: _engine(cache=_classes()["cache"](capacity=4.5)), ConfigError, "cache.capacity=4.5"),
    ("predictor-prior", lambda: _classes()["predictor"](prior=-1), ConfigError, "predictor.prior"),
    ("cost-model-window", lambda: _classes()["cost_model"](window=-1), ConfigError, "window"),
    ("prefetch-min-benefit", lambda: _classes()["prefetch"](min_benefit="x"), ConfigError, "prefetch.min_benefit"),
    # Engine.generate(prompt, max_new_tokens, sampling)
    ("generate-float-ids", lambda e: e.generate([1.5, 2]), ConfigError, "prompt"),
    ("generate-bool-ids", lambda e: e.generate([True, 2]), ConfigError, "prompt"),
    ("generate-nested", lambda e: e.generate([[1, 2]]), ConfigError, "prompt"),
    ("generate-bytes", lambda e: e.generate(b"abc"), ConfigError, "prompt"),
    ("generate-string-ids", lambda e: e.generate(["1", "2"]), ConfigError, "prompt"),
    ("generate-empty", lambda e: e.generate([]), ConfigError, "prompt"),
    ("generate-vocab", lambda e: e.generate([10**9]), ConfigError, "prompt"),
    ("generate-negative", lambda e: e.generate([-1]), ConfigError, "prompt"),
    ("generate-int", lambda e: e.generate(5), ConfigError, "prompt"),
    ("generate-none", lambda e: e.generate(None), ConfigError, "prompt"),
    ("generate-2d-tensor", lambda e: e.generate(torch.tensor([[1, 2]])), ConfigError, "prompt"),
    ("generate-float-tensor", lambda e: e.generate(torch.tensor([1.0, 2.0])), ConfigError, "prompt"),
    ("generate-text", lambda e: e.generate("hello"), ConfigError, "tokenizer"),
    ("generate-length-zero", lambda e: e.generate([1], max_new_tokens=0), ConfigError, "max_new_tokens"),
    ("generate-length-float", lambda e: e.generate([1], max_new_tokens=1.5), ConfigError, "max_new_tokens"),
    ("generate-length-string", lambda e: e.generate([1], max_new_tokens="3"), ConfigError, "max_new_tokens"),
    ("generate-sampling-dict", lambda e: e.generate([1], sampling={"temperature": 0}), ConfigError, "sampling"),
    ("generate-accept-limit", lambda e: e.generate([1], accept_limit="2"), ConfigError, "accept_limit='2'"),
    ("generate-accept-limit-sampled", lambda e: e.generate([1], sampling=SamplingParams(temperature=1.0),
                                                          accept_limit=0), ConfigError, "needs greedy decoding"),
    ("generate-observers", lambda e: e.generate([1], observers=[object()]), ConfigError, "observers="),
    # SamplingParams and plugin configs built by hand
    ("sampling-nan", lambda: SamplingParams(temperature=float("nan")), ConfigError, "sampling.temperature"),
    ("sampling-negative", lambda: SamplingParams(temperature=-1.0), ConfigError, "sampling.temperature"),
    ("sampling-top-p", lambda: SamplingParams(top_p=0.0), ConfigError, "sampling.top_p"),
    ("sampling-top-k", lambda: SamplingParams(top_k=1.5), ConfigError, "sampling.top_k"),
    ("sampling-seed", lambda: SamplingParams(seed=1.5), ConfigError, "sampling.seed"),
    ("sampling-seed-bool", lambda: SamplingParams(seed=True), ConfigError, "sampling.seed"),
    ("drafter-config", lambda: _plugin("drafter", OmegaConf.structured(_eagle3_config(top_k=0))), ConfigError,
     "drafter.top_k"),
    ("cache-config", lambda: _plugin("cache", _cache_config(capacity=0)), ConfigError, "cache.capacity"),
    ("predictor-config", lambda: _plugin("predictor", _history_config(max_keys=0)), ConfigError, "predictor.max_keys"),
    ("unknown-plugin", lambda: _plugin("cache", OmegaConf.create({"name": "nope"})), PluginError, "cache"),
]


def _classes() -> dict[str, type]:
    from specfit.plugins.caches.lru import LRUCache
    from specfit.plugins.cost_models.union import UnionCostModel
    from specfit.plugins.predictors.history import HistoryPredictor
    from specfit.plugins.prefetchers.auto import AutoPrefetcher
    from specfit.plugins.selectors.specfit import SpecFitSelector

    return {"cache": LRUCache, "cost_model": UnionCostModel, "predictor": HistoryPredictor, "prefetch": AutoPrefetcher,
            "selector": SpecFitSelector}


def _specfit_parts(**cost_model: Any) -> dict[str, Any]:
    from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter

    c = _classes()
    return {"selector": c["selector"](), "predictor": c["predictor"](), "cost_model": c["cost_model"](**cost_model),
            "drafter": Eagle3Drafter()}


def _requires_a_string() -> Any:
    from specfit.plugins.selectors.specfit import SpecFitSelector

    selector = SpecFitSelector()
    selector.requires = "cost_model"  # a tuple of kinds; a string's letters are not kinds
    return selector


def _preloads_none() -> Any:
    from specfit.plugins.caches.lru import LRUCache

    class PreloadsNone(LRUCache):
        def preload(self):  # noqa: ANN202
            return None

    return PreloadsNone(capacity=3)


def _engine_on_a_taken_model() -> Engine:
    model = tiny_model()
    Engine(model)
    return Engine(model)


def _eagle3_config(**values: Any) -> Any:
    """A structured config with a bad value set afterwards (as an override would): checked in create()."""
    from specfit.plugins.drafters.eagle3.drafter import Eagle3DrafterConfig

    cfg = OmegaConf.structured(Eagle3DrafterConfig)
    for key, value in values.items():
        cfg[key] = value
    return cfg


def _cache_config(**values: Any) -> Any:
    from specfit.plugins.caches.lru import LRUCacheConfig

    return LRUCacheConfig(**values)


def _history_config(**values: Any) -> Any:
    from specfit.plugins.predictors.history import HistoryPredictorConfig

    return HistoryPredictorConfig(**values)


def test_the_table_is_large():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "call", "error", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_call_raises_a_clear_error(name, call, error, needle, request):
    args = [request.getfixturevalue("engine")] if call.__code__.co_argcount else []
    start = time.perf_counter()
    with pytest.raises(error) as info:
        call(*args)
    assert time.perf_counter() - start < LIMIT_S
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert needle in message and "\n" not in message, message
    if error is ConfigError:
        assert isinstance(info.value, ValueError)


def test_a_refused_engine_argument_leaves_the_model_to_another_engine():
    """Plain arguments are checked before the engine takes the model's experts."""
    model = tiny_model()
    for bad in ({"copy": None}, {"stop_token_ids": [10**9]}, {"tokenizer": "gpt2"}, {"max_model_len": 1}):
        with pytest.raises(ConfigError):
            Engine(model, **bad)
    assert Engine(model).generate([5, 17, 99], max_new_tokens=3).token_ids == \
        Engine(tiny_model()).generate([5, 17, 99], max_new_tokens=3).token_ids


def test_the_engine_still_works_after_bad_calls(engine):
    """A refused call changes nothing: the next good call decodes as usual."""
    for bad in ([1.5], [10**9], None):
        with pytest.raises(ConfigError):
            engine.generate(bad)
    out = engine.generate([5, 17, 99], max_new_tokens=3)
    assert len(out.token_ids) == 3


def test_top_k_wider_than_the_heads_draft_vocabulary_names_drafter_top_k():
    """A head with a 16-token draft vocabulary cannot rank a beam of 20: refused when the drafter binds."""
    import dataclasses

    from specfit.plugins.drafters.eagle3.checkpoint import head_config_for, random_head
    from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter

    model = tiny_model()
    head = random_head(dataclasses.replace(head_config_for(model), draft_vocab_size=16))
    with pytest.raises(ConfigError, match=r"drafter\.top_k=20 exceeds the EAGLE-3 head's draft vocabulary \(16"):
        Engine(model, drafter=Eagle3Drafter(top_k=20, head=head), device="cpu")


def test_engine_notes_a_link_no_copy_engine_reads(capsys: pytest.CaptureFixture[str]) -> None:
    """link= with copy='torch' changes nothing: said once on stderr (as the config's note does), not
    silently dropped; with copy='emulated', and from build() (which passes the link only to the
    emulated engine), nothing is said."""
    from specfit.types.link_profiles import LinkSettings

    Engine(tiny_model(), copy="torch", link=LinkSettings(latency_us=1.0))
    assert "link= sets the emulated link, which only copy='emulated' builds and charges" in capsys.readouterr().err
    Engine(tiny_model(), copy="emulated", link=LinkSettings(latency_us=1.0))
    specfit.build(specfit.compose(["model=tiny", "cache.copy=torch"]))
    assert "link=" not in capsys.readouterr().err


def test_eagle3_without_a_head_says_its_head_is_random(capsys: pytest.CaptureFixture[str]) -> None:
    """Eagle3Drafter() on a model with no draft head drafts with a random head: said, since its drafts
    are almost never accepted; drafter.path=random (asked for) is not remarked on."""
    from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter

    engine = Engine(tiny_model(), drafter=Eagle3Drafter(), max_new_tokens=2)
    assert "has no head" not in capsys.readouterr().err  # said when it drafts: a build that fails says one line
    engine.generate([1, 2])
    engine.generate([1, 2])
    assert capsys.readouterr().err.count("drafter=eagle3 has no head") == 1
    Engine(tiny_model(), drafter=Eagle3Drafter(path="random"), max_new_tokens=2).generate([1, 2])
    assert "has no head" not in capsys.readouterr().err


def test_a_failed_build_hands_the_model_to_the_next_engine() -> None:
    """An Engine whose plug-in fails to bind has already moved the model's experts into its store:
    the next Engine over that model takes them from there (a model of billions of parameters need
    not be loaded again), without the failed build's hooks, and decodes as a fresh model does. A
    model a working Engine holds is still refused."""
    from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher

    class FailsAfterHooking(LookaheadPrefetcher):  # the last plug-in bound, after hooking the model
        def bind(self, target: Any, sink: Any) -> None:
            super().bind(target, sink)
            raise RuntimeError("no room")

    model = tiny_model().to(torch.bfloat16)
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    with pytest.raises(PluginError, match="no room"):  # numerics=exact upcast the dense weights first
        Engine(model, prefetcher=FailsAfterHooking(), max_new_tokens=6, numerics="exact")
    assert {p.dtype for p in model.parameters() if not p.is_meta} == {torch.bfloat16}  # as loaded again
    engine = Engine(model, max_new_tokens=6, numerics="native")
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == hooks + 1  # its own
    assert engine.info["dense_dtype"] == "bfloat16"
    fresh = Engine(tiny_model().to(torch.bfloat16), max_new_tokens=6, numerics="native")
    assert engine.generate([5, 17, 99]).token_ids == fresh.generate([5, 17, 99]).token_ids
    with pytest.raises(ModelError, match="held by another Engine"):
        Engine(model)


def test_a_model_whose_build_failed_says_so_when_run_alone() -> None:
    """Its experts live in the failed build's store, its slots are gone: running the model without a
    new Engine is one ModelError (not an IndexError deep in the runtime); a new Engine still works."""
    from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher

    class Fails(LookaheadPrefetcher):
        def bind(self, target: Any, sink: Any) -> None:
            raise RuntimeError("no room")

    model = tiny_model()
    with pytest.raises(PluginError, match="no room"):
        Engine(model, prefetcher=Fails())
    with pytest.raises(ModelError, match="Engine that failed to build"), torch.inference_mode():
        model(torch.tensor([[5, 17, 99]]))
    assert Engine(model, max_new_tokens=3).generate([5, 17, 99]).token_ids


def test_a_restore_that_fails_leaves_the_build_error_and_the_model_handed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restoring the model after a failed build can fail too (a device error): the build's error is
    what is raised, with the restore's as a note, and the runtime is orphaned all the same."""
    import specfit.decode.engine as engine_module
    from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher

    class Fails(LookaheadPrefetcher):
        def bind(self, target: Any, sink: Any) -> None:
            raise RuntimeError("no room")

    def broken(*_: Any) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine_module, "restore_dense_placement", broken)
    model = tiny_model()
    with pytest.raises(PluginError, match="no room") as caught:
        Engine(model, prefetcher=Fails())
    assert any("device lost" in note for note in getattr(caught.value, "__notes__", []))
    monkeypatch.undo()
    assert Engine(model, max_new_tokens=3).generate([5, 17, 99]).token_ids  # taken over, not "held"


def test_a_failed_full_cache_build_says_the_model_must_be_loaded_again() -> None:
    """cache=full drops the host copy once every expert is in a slot: a build that fails after that
    leaves nothing to take over, and the next Engine says so."""
    from specfit.plugins.caches.full import FullCache
    from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher

    class Fails(LookaheadPrefetcher):
        def bind(self, target: Any, sink: Any) -> None:
            raise RuntimeError("no room")

    model = tiny_model()
    with pytest.raises(PluginError, match="no room"):
        Engine(model, cache=FullCache(), prefetcher=Fails())
    with pytest.raises(ModelError, match="cache=full drops their host copy"):
        Engine(model)


def test_a_model_head_that_does_not_fit_the_target_names_model_draft_head_at_bind() -> None:
    """model.draft_head becomes the drafter's path; the head's errors when it binds to the target
    name the key the user set, as those when it is loaded do (the drafter is not patched for it)."""
    from pathlib import Path

    head = Path(specfit.__file__).parent / "assets" / "demo" / "eagle3"
    cfg = specfit.compose(["model=tiny", "drafter=eagle3", f"model.draft_head={head}"])
    with pytest.raises(ModelError, match=rf"^model.draft_head={head}: head vocab_size \d+ differs from the target's"):
        specfit.build(cfg, calibrate_now=False)
