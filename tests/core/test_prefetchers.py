"""Prefetchers (issue 14): a plug-in kind; every built-in keeps greedy output identical to AR, issues
sensible prefetches, and a broken prefetcher is one PluginError that never corrupts a slot."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_model, tiny_model_with_scaled_norms
from drafters import ScriptedDrafter

import specfit
from specfit import Engine
from specfit.types.costs import CostConstants
from specfit.offload.copy.base import CopyTicket
from specfit.offload.copy.torch import TorchCopyEngine
from specfit.types.link_profiles import LinkSettings
from specfit.offload.prefetch import LiveSink, ModelledSink, check_request
from specfit.types.tree import DraftTree
from specfit.errors import PluginError
from specfit.interfaces import PrefetcherBase, PrefetcherConfig
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache
from specfit.plugins.cost_models.union import UnionCostModel
from specfit.plugins.predictors.history import HistoryPredictor
from specfit.plugins.prefetchers.auto import AutoPrefetcher
from specfit.plugins.prefetchers.draft import DraftPrefetcher, expected_use
from specfit.plugins._kit.router_probe import Router, fold_norm
from specfit.plugins.prefetchers.lookahead import BenefitGate, LookaheadPrefetcher
from specfit.plugins.prefetchers.none import NoPrefetcher
from specfit.plugins.selectors.eagle3 import TopByPathProbSelector
from specfit.plugins.selectors.none import NoDraftSelector
from specfit.plugins.selectors.specfit import SpecFitSelector
from specfit.registry import get_plugins

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
N = 24
CONSTANTS = CostConstants(c0=2e-3, c_tok=1e-4, c_miss=4e-4, c_hit=2e-5, c_level=5e-4, c_draft0=1e-4)
CACHES = {"lru": lambda: LRUCache(capacity=3), "full": FullCache, "none": NoCache}
PREFETCHERS = {"none": NoPrefetcher, "lookahead": LookaheadPrefetcher, "draft": DraftPrefetcher,
               "auto": AutoPrefetcher}
_REF: list[int] = []


def reference() -> list[int]:
    if not _REF:
        with torch.no_grad():
            out = tiny_model().generate(torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N, do_sample=False)
        _REF.extend(out[0].tolist())
    return _REF


def method_parts(method: str) -> dict:
    """ar, eagle3 (scripted tree, EAGLE's selector, a predictor) and specfit on the tiny model."""
    if method == "ar":
        return {"selector": NoDraftSelector()}
    drafter = ScriptedDrafter(reference(), vocab=256, branching=2, depth=3, total_tokens=8, miss=0.2, seed=1)
    if method == "eagle3":
        return {"drafter": drafter, "selector": TopByPathProbSelector(), "predictor": HistoryPredictor()}
    return {"drafter": drafter, "selector": SpecFitSelector(draft_time="modelled", draft_gate=False),
            "predictor": HistoryPredictor(), "cost_model": UnionCostModel(constants=CONSTANTS)}


# --------------------------------------------------------------------------- the plug-in kind


def test_builtins_are_registered_listed_and_a_config_group(capsys):
    names = {e.name for e in get_plugins().entries() if e.kind == "prefetch"}
    assert names == {"none", "lookahead", "draft", "auto"}
    from specfit.commands import plugins

    plugins.run()
    listed = [line.split()[:2] for line in capsys.readouterr().out.splitlines()]
    assert ["prefetch", "lookahead"] in listed and ["prefetch", "auto"] in listed
    assert specfit.compose([]).prefetch.name == "none"  # the default: today's runs
    cfg = specfit.compose(["prefetch=draft", "prefetch.min_benefit=0.5"])
    made = get_plugins()["prefetch"].create(cfg.prefetch)
    assert isinstance(made, DraftPrefetcher) and made.min_benefit == 0.5
    with pytest.raises(specfit.errors.ConfigError, match="prefetch.source"):
        get_plugins()["prefetch"].create(specfit.compose(["prefetch=lookahead", "prefetch.source=later"]).prefetch)
    for kind in ("draft", "auto"):  # auto's draft half is checked as draft's (0 once issued nothing, silently)
        for bad in ("prefetch.max_per_layer=0", "prefetch.max_per_layer=-3", "prefetch.min_benefit=1.5"):
            with pytest.raises(specfit.errors.ConfigError, match=bad.replace(".", r"\.")):
                get_plugins()["prefetch"].create(specfit.compose([f"prefetch={kind}", bad]).prefetch)
    with pytest.raises(specfit.errors.ConfigError, match="prefetch.max_per_layer=0"):
        DraftPrefetcher(max_per_layer=0)
    presets = specfit.compose([]).method_presets
    for method in ("ar_prefetch", "eagle3_prefetch", "specfit_prefetch"):
        assert "prefetch=auto" in presets[method]


# --------------------------------------------------------------------------- lossless and sensible


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("prefetcher", list(PREFETCHERS))
def test_output_is_ar_output_for_every_prefetcher_cache_and_method(prefetcher, cache):
    issued = {}
    for method in ("ar", "eagle3", "specfit"):
        engine = Engine(tiny_model(), cache=CACHES[cache](), prefetcher=PREFETCHERS[prefetcher](), device="cpu",
                        **method_parts(method))
        out = engine.generate(PROMPT, max_new_tokens=N)
        assert out.token_ids == reference()[len(PROMPT):], (method, prefetcher, cache)
        issued[method] = (out.stats["prefetch_issued"], out.stats["prefetch_used"])
        check_slots(engine)
    if prefetcher == "none" or cache != "lru":  # nothing to prefetch (full), or it cannot (none)
        assert all(i == 0 for i, _ in issued.values())
    elif prefetcher in ("lookahead", "auto"):  # every pass, AR included: issued and then used
        assert all(i > 0 and u > 0 for i, u in issued.values()), issued
    else:  # draft: only while drafting, with a predictor; EAGLE-3's trees are expected to use more
        # experts than the 3 slots hold in every layer, which it leaves alone
        assert issued["ar"] == (0, 0) and issued["specfit"][0] > 0, issued


@pytest.mark.parametrize("prefetcher", ["lookahead", "draft", "auto"])
def test_output_is_ar_output_with_copies_in_flight(prefetcher):
    """On the emulated link copies stay in flight until their charge has passed, so prefetches are
    still arriving when passes start (the protection and waiting paths the torch engine on a CPU,
    where every copy has landed when issued, never takes)."""
    for method in ("ar", "eagle3", "specfit"):
        engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=PREFETCHERS[prefetcher](), device="cpu",
                        copy="emulated", **method_parts(method))
        out = engine.generate(PROMPT, max_new_tokens=N)
        assert out.token_ids == reference()[len(PROMPT):], (method, prefetcher)
        assert out.stats["h2d_stall_seconds"] > 0  # some pass waited on a copy still on the link
        check_slots(engine)


@pytest.mark.parametrize("source", ["own", "next", "both", "fitted"])
def test_lookahead_next_prefetches_queue_behind_the_layers_own_copies(source):
    """``next`` asks for layer l+1's experts once layer l has issued its own copies, so on the FIFO
    link they never delay the layer computing now; every source keeps AR's output."""
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=LookaheadPrefetcher(source=source),
                    device="cpu", selector=NoDraftSelector())
    runtime, order = engine.runtime, []
    issue = runtime._issue

    def recording_issue(layer, loads, prefetch=False, count=True):
        order.append((runtime.stats.passes, layer, prefetch))
        return issue(layer, loads, prefetch, count)

    runtime._issue = recording_issue
    out = engine.generate(PROMPT, max_new_tokens=N)
    assert out.token_ids == reference()[len(PROMPT):]
    assert out.stats["prefetch_issued"] > 0
    if source == "own":
        return
    for i, (pass_, layer, prefetch) in enumerate(order):
        if prefetch and layer > 0:  # asked for on layer l's input: no copy of layer l may follow it
            assert not [e for e in order[i + 1:] if e[:2] == (pass_, layer - 1)], (i, order[max(0, i - 6):i + 2])


@pytest.mark.parametrize("scaled", [False, True])
def test_lookahead_asks_for_the_first_layer_at_the_pass_start_when_its_input_is_the_embedding(scaled):
    """The first layer's picks come from the tokens' embedding as the model's forward starts (more
    lead than the layer's own pre-hook), once the first pass showed the embedding is that layer's
    input; a model whose first layer sees something else (here: a pre-hook scaling it) is caught
    there and prefetches from the layer's real input instead. AR output either way, and one
    request for the first layer per pass, not two."""
    model = tiny_model()
    if scaled:
        model.model.layers[0].register_forward_pre_hook(lambda _m, args: (args[0] * 3.0, *args[1:]))
    reference_ids = None
    if scaled:
        with torch.no_grad():
            reference_ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N,
                                           do_sample=False)[0].tolist()
    engine = Engine(model, cache=LRUCache(capacity=3), prefetcher=LookaheadPrefetcher(), device="cpu",
                    selector=NoDraftSelector())
    runtime, sink, first, preamble_ran = engine.runtime, engine.prefetch_sink, [], set()
    model.model.rotary_emb.register_forward_pre_hook(lambda *_: preamble_ran.add(runtime.stats.passes))
    prefetch = sink.prefetch

    def recording(layer, experts, keep=()):
        if layer == 0:
            first.append(runtime.stats.passes in preamble_ran)
        return prefetch(layer, experts, keep)

    sink.prefetch = recording
    out = engine.generate(PROMPT, max_new_tokens=N)
    assert out.token_ids == (reference_ids or reference())[len(PROMPT):]
    assert engine.prefetcher._early_state == ("off" if scaled else "checked")
    # one request a pass (the scaled model's first pass: the early one, then the layer's own)
    assert len(first) == runtime.stats.passes + scaled
    # unscaled: asked before the decoder's preamble; scaled: at the layer, after its first pass
    assert first == ([False] if scaled else []) + [scaled] * runtime.stats.passes


def test_a_prefetch_keeps_the_resident_experts_it_names_in_keep_and_copies_none_of_them():
    """``keep``: resident experts ranked just after the copies are protected from the request's
    evictions (the LRU evicts the next-oldest instead); one not resident is not copied; a bad id
    is a PluginError like any in the request."""
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=LookaheadPrefetcher(source="own"),
                    device="cpu", selector=NoDraftSelector())
    engine.generate(PROMPT, max_new_tokens=4)
    runtime, sink = engine.runtime, engine.prefetch_sink
    oldest, second, newest = list(runtime.policy._lru[0])  # what the LRU evicts first, then next
    absent = [e for e in range(engine.spec.num_experts) if e not in (oldest, second, newest)]
    issued = sink.prefetch(0, [absent[0]], keep=[oldest, absent[1]])
    held = set(runtime.slot_expert[0].tolist())
    assert issued == 1 and held == {oldest, newest, absent[0]}, (held, oldest, second, newest)
    with pytest.raises(PluginError, match="out of range"):
        sink.prefetch(0, [absent[2]], keep=[999])
    check_slots(engine)


@pytest.mark.parametrize(("keep", "capacity"), [(None, 6), (0, 6), (2, 6), (None, 3)])
def test_lookahead_keeps_the_experts_ranked_after_its_picks(keep, capacity):
    """By default each token's next top-k experts (here 2) go to ``keep``; ``prefetch.keep`` sets
    how many (0: none); never more than fit in the slots beside the picks (3 slots, 2 picks: 1).
    AR output either way."""
    engine = Engine(tiny_model(), cache=LRUCache(capacity=capacity), prefetcher=LookaheadPrefetcher(keep=keep),
                    device="cpu", selector=NoDraftSelector())
    sink, kept = engine.prefetch_sink, []
    prefetch = sink.prefetch
    sink.prefetch = lambda layer, experts, keep=(), _p=prefetch: (kept.append((len(experts), len(keep))),
                                                                  _p(layer, experts, keep))[1]
    out = engine.generate(PROMPT, max_new_tokens=N)
    assert out.token_ids == reference()[len(PROMPT):]
    k = engine.spec.top_k
    one_token = [n_keep for n_copy, n_keep in kept if n_copy == k]  # AR steps
    assert set(one_token) == {min(k if keep is None else keep, capacity - k)}
    assert all(n_copy + n_keep <= capacity or n_keep == 0 for n_copy, n_keep in kept)


def test_lookahead_picks_sets_how_many_experts_each_token_prefetches():
    """``picks`` above the model's top-k asks for the router's next experts too (AR output kept);
    a value that cannot work is one line naming prefetch.picks."""
    from specfit.errors import ConfigError

    asked = {}
    for picks in (None, 4):
        engine = Engine(tiny_model(), cache=LRUCache(capacity=6), prefetcher=LookaheadPrefetcher(picks=picks),
                        device="cpu", selector=NoDraftSelector())
        sizes = []
        sink = engine.prefetch_sink
        prefetch = sink.prefetch
        sink.prefetch = lambda layer, experts, keep=(), _p=prefetch: (sizes.append(len(list(experts))),
                                                                      _p(layer, experts, keep))[1]
        out = engine.generate(PROMPT, max_new_tokens=N)
        assert out.token_ids == reference()[len(PROMPT):]
        asked[picks] = min(sizes)  # a one-token (AR) pass: the picks of one token
    assert asked[None] == engine.spec.top_k < asked[4] == 4, asked
    with pytest.raises(ConfigError, match="prefetch.picks=0"):
        LookaheadPrefetcher(picks=0)
    with pytest.raises(ConfigError, match="prefetch.picks=99"):
        Engine(tiny_model(), prefetcher=LookaheadPrefetcher(picks=99), device="cpu", selector=NoDraftSelector())
    with pytest.raises(ConfigError, match="prefetch.keep=99 is more than the model's"):
        Engine(tiny_model(), prefetcher=LookaheadPrefetcher(keep=99), device="cpu", selector=NoDraftSelector())


def test_lookahead_folds_the_rmsnorm_into_the_router_and_picks_the_same_experts():
    """``own`` computes top-k of x @ (router x norm scale).T: the same picks as norm then router."""
    model = tiny_model_with_scaled_norms()  # a fold that drops the norms' scales is caught
    engine = Engine(model, cache=LRUCache(capacity=3), prefetcher=LookaheadPrefetcher(source="own"), device="cpu",
                    selector=NoDraftSelector())
    routers = engine.prefetcher.routers
    assert all(r.folded is not None for r in routers)
    hidden = torch.randn(64, engine.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    k = engine.spec.top_k
    with torch.no_grad():
        for r in routers:
            want = torch.topk(r.norm(hidden) @ r.weight.T, k).indices
            got = torch.topk(hidden @ r.folded.T, k).indices
            assert torch.equal(got.sort(-1).values, want.sort(-1).values)


def test_lookahead_on_a_cpu_routes_a_bf16_model_in_float32_and_stays_lossless():
    """A CPU's bf16 matmul is ~3x slower than fp32's: the folded router is kept in float32 there."""
    prompt = [3, 14, 15, 92, 65, 35]
    outputs = []
    for prefetcher in (LookaheadPrefetcher(source="own"), LookaheadPrefetcher(), None):
        engine = Engine(tiny_model(dtype=torch.bfloat16), cache=LRUCache(capacity=3), prefetcher=prefetcher,
                        device="cpu", selector=NoDraftSelector())
        if prefetcher is not None:  # own folds every layer's router, fitted only the first layer's
            folded = engine.prefetcher.routers[:None if prefetcher.source == "own" else 1]
            assert all(r.folded is not None and r.folded.dtype == torch.float32 for r in folded)
        outputs.append(engine.generate(prompt, max_new_tokens=8).token_ids)
    assert outputs[0] == outputs[1] == outputs[2]


def test_lookahead_does_not_fold_a_norm_of_another_form_or_a_biased_router():
    hidden_size, experts = 16, 4
    weight = torch.randn(experts, hidden_size)
    rms = torch.nn.RMSNorm(hidden_size, eps=1e-6)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    assert fold_norm(Router(weight, None, rms), hidden_size) is not None
    assert fold_norm(Router(weight, torch.zeros(experts), rms), hidden_size) is None  # a bias: scaling changes top-k
    assert fold_norm(Router(weight, None, torch.nn.LayerNorm(hidden_size)), hidden_size) is None  # subtracts the mean


def test_a_request_of_plain_ints_and_one_of_numpy_values_are_checked_alike():
    assert check_request(None, "h", 1, [3, 1, 3], 2, 4) == (1, [3, 1])
    assert check_request(None, "h", np.int64(1), np.array([3, 1, 3]), 2, 4) == (1, [3, 1])
    for layer, experts in ((2, [0]), (True, [0]), (0, [4]), (0, [True]), (0, [-1])):
        with pytest.raises(PluginError, match="out of range"):
            check_request(None, "h", layer, experts, 2, 4)


def check_slots(engine: Engine) -> None:
    """Every slot holds exactly the expert the runtime says it holds (nothing corrupted)."""
    runtime = engine.runtime
    for layer, slots in enumerate(runtime.slots):
        host = runtime.store.layers[layer]
        if host is None:
            continue
        for slot, expert in enumerate(runtime.slot_expert[layer].tolist()):
            if expert >= 0:
                assert torch.equal(slots[slot], host[expert]), (layer, slot, expert)


def test_demo_pair_with_prefetch_auto_decodes_ar_tokens_and_uses_its_prefetches():
    demo = Path(specfit.__file__).parent / "assets" / "demo"
    prompt = json.loads((demo / "prompts.jsonl").read_text().splitlines()[0])["prompt"]
    presets = specfit.compose([]).method_presets
    constants = ["cost_model.c0=2e-3", "cost_model.c_tok=1e-4", "cost_model.c_miss=4e-4", "cost_model.c_hit=2e-5",
                 "cost_model.c_level=1e-4"]
    outs = {}
    for method in ("ar", "ar_prefetch", "specfit_prefetch"):
        overrides = ["model=demo", *presets[method], "cache.capacity=8", "model.device=cpu"]
        overrides += constants if "cost_model=union" in overrides else []
        outs[method] = specfit.build(specfit.compose(overrides)).generate(prompt, max_new_tokens=12)
    assert outs["specfit_prefetch"].token_ids == outs["ar_prefetch"].token_ids == outs["ar"].token_ids
    for method in ("ar_prefetch", "specfit_prefetch"):
        stats = outs[method].stats
        assert stats["prefetch"] == "auto" and stats["prefetch_used"] > 0, method
    # the same AR passes: experts prefetched ahead are hits, so the pass misses fewer
    assert outs["ar_prefetch"].stats["expert_cache_hit_rate"] > outs["ar"].stats["expert_cache_hit_rate"]


# --------------------------------------------------------------------------- the look-ahead's gate


def test_the_gate_pauses_a_window_that_does_not_pay_doubling_the_pause_until_one_pays():
    gate = BenefitGate(window=2, pause=2, longest=4)
    used, schedule = 0, []

    def run(passes: int, spent_per_pass: float, used_per_pass: int) -> None:
        nonlocal used
        for _ in range(passes):
            on = gate.next_pass(used, saves=1.0)
            schedule.append(int(on))
            if on:  # the hooks run: host time spent, prefetches the next passes use
                gate.spent += spent_per_pass
                used += used_per_pass

    run(2, 3.0, 1)  # a window: 2 experts used (2 s saved) for 6 s of host time
    run(2, 3.0, 1)  # paused 2 passes
    run(2, 3.0, 1)  # the probe loses again
    run(4, 3.0, 1)  # paused 4 (doubled)
    run(2, 3.0, 1)  # probe: loses, the pause stays at its longest (4)
    assert schedule == [1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1]
    assert gate.pause == 4
    run(4, 0.5, 1)  # paused 4; the probe then pays (2 s saved for 1 s)
    run(2, 0.5, 1)
    run(2, 0.5, 1)  # and stays on, the pause reset
    assert schedule[12:] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert gate.pause == 2 and (gate.passes_on, gate.passes_off) == (10, 10)


def test_one_losing_window_among_paying_ones_does_not_pause_the_gate():
    gate = BenefitGate(window=2, pause=2)
    assert gate.next_pass(0, saves=1.0) and gate.next_pass(2, saves=1.0)
    gate.spent = 1.0  # the first window: 4 s saved for 1 s
    assert gate.next_pass(4, saves=1.0) and gate.next_pass(5, saves=1.0)
    gate.spent = 3.0  # the second: 2 s for 3 s (the host preempted in a hook); over both, 4 for 3.5
    assert gate.next_pass(6, saves=1.0)


def test_the_gate_stays_on_while_what_a_prefetch_saves_is_unknown():
    gate = BenefitGate(window=1, pause=1)
    gate.spent = 1.0
    assert all(gate.next_pass(0, saves=0.0) for _ in range(5))


@pytest.mark.parametrize("source", ["fitted", "own"])
def test_a_paused_lookahead_prefetches_nothing_reports_its_passes_and_keeps_ar_output(source):
    runs = {}
    for gate in (True, False):
        prefetcher = LookaheadPrefetcher(source=source, gate=gate)
        if gate:  # a short window, and host time that never pays: paused after the first window
            prefetcher.gate = BenefitGate(window=4, pause=8, longest=8)
        engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=prefetcher, device="cpu",
                        selector=NoDraftSelector())
        engine.prefetch_sink.saved_per_use = lambda: 1e-12  # a used prefetch saves (next to) nothing
        out = engine.generate(PROMPT, max_new_tokens=N)
        assert out.token_ids == reference()[len(PROMPT):]
        check_slots(engine)
        runs[gate] = out.stats
    on, paused = runs[True]["prefetch_lookahead_passes"], runs[True]["prefetch_lookahead_paused_passes"]
    assert on + paused == N and paused >= 8 and on >= 4  # prefill and N - 1 steps, each one pass
    assert 0 < runs[True]["prefetch_issued"] < runs[False]["prefetch_issued"]
    assert "prefetch_lookahead_passes" not in runs[False]


def test_the_gate_stays_on_where_the_lookahead_pays_and_auto_reports_it():
    """An emulated link of 1 ms an expert: a used prefetch can save that and its issue's host time.
    Where that pays for the hooks (here, saves set to 1 s each, so no host jitter decides), the gate
    never pauses."""
    link = LinkSettings(profile=None, bandwidth_gbps=0.1, latency_us=0.0, ref_expert_bytes=100_000)
    prefetcher = AutoPrefetcher()
    prefetcher.lookahead.gate = BenefitGate(window=4, pause=8)
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=prefetcher, device="cpu", copy="emulated",
                    link=link, selector=NoDraftSelector())
    sink = engine.prefetch_sink
    engine.generate(PROMPT, max_new_tokens=4)
    assert engine.runtime.stats.issue_seconds > 0
    assert sink.saved_per_use() > sink.expert_seconds() == pytest.approx(1e-3)
    sink.saved_per_use = lambda: 1.0
    out = engine.generate(PROMPT, max_new_tokens=N)
    assert out.token_ids == reference()[len(PROMPT):]
    assert out.stats["prefetch_lookahead_passes"] == N and out.stats["prefetch_lookahead_paused_passes"] == 0
    assert AutoPrefetcher(gate=False).lookahead.gate is None and AutoPrefetcher(gate=False).counters() == {}


def test_on_a_synchronous_link_a_used_prefetch_saves_only_its_issue():
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=LookaheadPrefetcher(), device="cpu",
                    selector=NoDraftSelector())  # cache.copy=torch on a CPU: each copy is a memcpy, no stall
    engine.generate(PROMPT, max_new_tokens=4)
    stats, sink = engine.runtime.stats, engine.prefetch_sink
    per_copy = stats.issue_seconds / (stats.h2d_bytes / engine.spec.expert_bytes)
    assert sink.saved_per_use() == pytest.approx(per_copy) and sink.expert_seconds() > 0


def test_on_a_device_link_one_copy_takes_what_the_waited_copies_were_timed_at():
    """CUDA's tickets hold their enqueue time until a pass waits for them (then the device's copy
    time); a prefetch evicted unused is never waited. The link time of one copy is taken from the
    waited copies alone, not diluted by the unwaited ones' enqueue times."""

    class DeviceLike(TorchCopyEngine):
        def issue(self, *args, **kwargs):  # noqa: ANN002, ANN003
            real = super().issue(*args, **kwargs)
            ticket = CopyTicket(real.experts, real.bytes, 1e-6 * real.experts, real.ready_at, _remaining=lambda: 0.0)

            def wait() -> float:
                ticket.seconds = 2e-3 * ticket.experts
                return 0.0

            ticket._wait = wait
            return ticket

    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=LookaheadPrefetcher(gate=False),
                    device="cpu", copy=DeviceLike("cpu"), selector=NoDraftSelector())
    out = engine.generate(PROMPT, max_new_tokens=N)
    stats = engine.runtime.stats
    assert out.stats["prefetch_wasted"] > 0 and stats.timed_copies > 0
    copied = stats.h2d_bytes / engine.spec.expert_bytes
    assert stats.h2d_seconds / copied < 2e-3 * 0.99  # the unwaited copies' enqueue times dilute it
    assert engine.prefetch_sink.expert_seconds() == pytest.approx(2e-3)


class DeviceLikeCopy(TorchCopyEngine):
    """CPU copies whose tickets behave like a CUDA engine's: each holds an event, is charged its
    enqueue time (1 us an expert) until waited for or settled, then 2 ms an expert; ``landed``
    says whether an unwaited copy has landed."""

    def __init__(self, device: str = "cpu", landed: bool = True) -> None:
        super().__init__(device)
        self.landed = landed

    def _ticket(self, experts: int, nbytes: int, ready_at: float) -> CopyTicket:
        ticket = CopyTicket(experts, nbytes, 1e-6 * experts, ready_at,
                            _remaining=(lambda: 0.0) if self.landed else (lambda: 1e-6), event=object())

        def measure() -> float:
            ticket.seconds = 2e-3 * ticket.experts
            return 0.0

        ticket._wait, ticket._settle = measure, measure
        return ticket

    def issue(self, *args, **kwargs):  # noqa: ANN002, ANN003
        real = super().issue(*args, **kwargs)
        batch = self._ticket(real.experts, real.bytes, real.ready_at)
        rows = [self._ticket(1, real.bytes // real.experts, real.ready_at) for _ in range(real.experts)]
        batch._row = rows.__getitem__  # each expert's own ticket, as the torch engine's events on CUDA
        return batch


def test_copies_no_pass_waited_for_are_charged_their_own_time_in_their_own_phase():
    """A CUDA ticket holds its enqueue time until waited for; a prefetch evicted unused never is.
    The runtime settles such tickets (their event's time on the copy stream) after the prefill
    (the landed ones) and when the decode ends, so h2d_seconds and link_busy_seconds count every
    copy at its copy time, waited or not, in the phase that issued it."""
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=LookaheadPrefetcher(gate=False),
                    device="cpu", copy=DeviceLikeCopy(), selector=NoDraftSelector())
    out = engine.generate(PROMPT, max_new_tokens=N)
    stats, expert = engine.runtime.stats, engine.spec.expert_bytes
    assert out.stats["prefetch_wasted"] > 0
    copied = stats.h2d_bytes / expert
    assert stats.timed_copies == copied  # every copy's time measured: the unwaited ones' too
    assert stats.h2d_seconds == pytest.approx(2e-3 * copied) == stats.link_busy_seconds
    decoded = out.stats["h2d_bytes"] / expert
    assert 0 < decoded < copied
    assert out.stats["h2d_seconds"] == pytest.approx(2e-3 * decoded)
    assert out.stats["prefill_h2d_seconds"] == pytest.approx(2e-3 * (copied - decoded))
    out = engine.generate(PROMPT, max_new_tokens=N)  # waits for copies the first decode settled: not counted twice
    copied = stats.h2d_bytes / expert
    assert stats.timed_copies == copied and stats.h2d_seconds == pytest.approx(2e-3 * copied)
    assert out.stats["h2d_seconds"] == pytest.approx(2e-3 * out.stats["h2d_bytes"] / expert)


def test_a_decode_cut_short_leaves_no_copy_to_the_next_decodes_figures():
    """A decode an error ends never settles its unwaited copies; the next decode settles them
    before it starts, so they do not count in its figures."""
    class FailsLate(NoDraftSelector):
        def __init__(self) -> None:
            super().__init__()
            self.cycles = 0

        def observe(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            self.cycles += 1
            if self.cycles == 5:
                raise RuntimeError("late failure")

    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=LookaheadPrefetcher(gate=False),
                    device="cpu", copy=DeviceLikeCopy(landed=False), selector=FailsLate())
    with pytest.raises(PluginError, match="late failure"):
        engine.generate(PROMPT, max_new_tokens=N)
    assert engine.runtime._unsettled  # copies in flight when it failed
    before = engine.runtime.stats.h2d_bytes
    out = engine.generate(PROMPT, max_new_tokens=N)
    copied = (engine.runtime.stats.h2d_bytes - before) / engine.spec.expert_bytes  # this decode's, prefill's too
    assert out.stats["h2d_seconds"] + out.stats["prefill_h2d_seconds"] == pytest.approx(2e-3 * copied)


def test_a_copy_in_flight_whose_time_is_unknown_arrives_in_one_measured_copy_time():
    """arriving() tells the cost model when each expert is usable; a CUDA ticket in flight knows only
    its enqueue time, so the runtime charges it one copy's measured time."""
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), device="cpu", copy=DeviceLikeCopy(landed=False),
                    selector=NoDraftSelector())
    engine.generate(PROMPT, max_new_tokens=4)
    runtime = engine.runtime
    absent = [e for e in range(runtime.spec.num_experts) if not runtime.resident()[0, e]]
    assert runtime.prefetch(0, absent[:1]) == 1
    assert runtime.arriving()[0, absent[0]] == pytest.approx(2e-3)


def test_a_copy_engine_that_does_not_wait_for_compute_is_refused():
    """The runtime tracks no slot's last use: copies must queue behind the compute before them."""
    from specfit.offload.copy.emulated import EmulatedLinkEngine
    from specfit.errors import ConfigError

    for copy in (TorchCopyEngine("cpu", order_after_compute=False),
                 EmulatedLinkEngine(TorchCopyEngine("cpu", order_after_compute=False))):
        with pytest.raises(ConfigError, match="order_after_compute=False"):
            Engine(tiny_model(), cache=LRUCache(capacity=3), device="cpu", copy=copy, selector=NoDraftSelector())


def test_timing_on_cuda_waits_for_the_compute_stream_only(monkeypatch):
    """The engine's clock synchronises the compute stream, not the device: a device-wide sync would
    wait for the copy stream too, so prefetches issued during drafting would overlap nothing."""
    from specfit.decode.live import device_now
    synced = []

    class Stream:
        def synchronize(self) -> None:
            synced.append("stream")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append("device"))
    device_now(torch.device("cuda"))
    assert synced == ["stream"]


def test_the_gate_is_off_on_cuda_and_says_so(capsys, monkeypatch):
    """On CUDA a hook's host read waits for queued GPU work: its wall time is not the look-ahead's cost."""
    prefetcher = LookaheadPrefetcher()
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), device="cpu", selector=NoDraftSelector())
    monkeypatch.setattr(engine.runtime, "device", torch.device("cuda"))
    sink = LiveSink(prefetcher, engine.runtime)
    prefetcher.bind(engine.target, sink)
    assert prefetcher.gate is None and prefetcher.counters() == {}
    assert "prefetch.gate: off on CUDA" in capsys.readouterr().err


class NoBase:
    """A prefetcher written to the Protocol as it was before ``needs_predictions`` and ``counters``
    were declared on it, with a ``counters`` that is not a method."""

    name = "nobase"
    counters = {"passes": 1}

    def bind(self, target, sink) -> None:
        self.sink = sink

    def after_level(self, tree, predicted, resident) -> None:
        pass


def test_a_prefetcher_lacking_a_declared_member_is_refused_naming_it():
    with pytest.raises(PluginError, match=r"prefetch 'nobase' \(NoBase\) lacks needs_predictions \(subclass "
                                          r"specfit.interfaces.PrefetcherBase"):
        Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=NoBase(), device="cpu",
               selector=NoDraftSelector())


def test_a_prefetcher_written_to_the_protocol_alone_reports_its_counters():
    class Declared(NoBase):
        def needs_predictions(self, tree) -> bool:
            return True

        def counters(self) -> dict[str, int]:
            return {"passes": 1}

    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=Declared(), device="cpu",
                    selector=NoDraftSelector())
    stats = engine.generate(PROMPT, max_new_tokens=2).stats
    assert stats["prefetch_passes"] == 0  # the counts' growth over the run


@pytest.mark.parametrize(("counts", "message"), [
    ({"passes": 1.5}, "must return a dict of names to ints"),
    ({"used": 3}, r"names \['used'\] would replace the runtime's own prefetch_\* figures"),
])
def test_counters_that_are_not_names_to_ints_are_named(counts, message):
    class Counting(PrefetcherBase):
        name = "counting"

        def counters(self):
            return counts

    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=Counting(), device="cpu",
                    selector=NoDraftSelector())
    with pytest.raises(PluginError, match=rf"^prefetch 'counting' \(counters\): {message}"):
        engine.generate(PROMPT, max_new_tokens=2)


# --------------------------------------------------------------------------- a broken prefetcher


@dataclass
class BadConfig(PrefetcherConfig):
    name: str = "bad"


class BadPrefetcher(PrefetcherBase):
    """Misbehaves in one way, in after_level (drafting) or in a layer hook (every pass)."""

    name = "bad"
    Config = BadConfig

    def __init__(self, how: str, where: str = "after_level") -> None:
        self.how, self.where = how, where

    def bind(self, target, sink) -> None:
        super().bind(target, sink)
        if self.where == "hook":
            block = target.model.get_submodule(target.runtime.spec.module_names[1].rpartition(".")[0])
            block.register_forward_pre_hook(lambda *_: sink.run("layer hook", self.misbehave))

    def after_level(self, tree, predicted, resident) -> None:
        if self.where == "after_level":
            self.misbehave()

    def misbehave(self) -> None:
        spec = self.sink.spec
        self.sink.prefetch(0, [0])  # a good request first: it may be issued
        if self.how == "raise":
            raise KeyError("boom")
        if self.how == "layer":
            self.sink.prefetch(spec.num_layers, [0])
        if self.how == "expert":
            self.sink.prefetch(1, [1, spec.num_experts])
        if self.how == "type":
            self.sink.prefetch(1, [1.5])


@pytest.mark.parametrize("where", ["after_level", "hook"])
@pytest.mark.parametrize(("how", "message"), [
    ("raise", r"raised KeyError: 'boom'"),
    ("layer", r"prefetch layer \d+ is out of range"),
    ("expert", r"layer 1: expert \d+ is out of range"),
    ("type", r"layer 1: expert 1.5 is out of range"),
])
def test_a_broken_prefetcher_is_one_plugin_error_and_corrupts_no_slot(where, how, message):
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=BadPrefetcher(how, where), device="cpu",
                    **method_parts("specfit"))
    hook = "after_level" if where == "after_level" else "layer hook"
    with pytest.raises(PluginError, match=rf"^prefetch 'bad' \({hook}\):? .*{message}") as info:
        engine.generate(PROMPT, max_new_tokens=N)
    assert "\n" not in str(info.value) and info.value.plugin == "bad" and info.value.kind == "prefetch"
    check_slots(engine)


# --------------------------------------------------------------------------- the draft budget


class FakeSink:
    """A sink with set link and layer times, recording requests."""

    live = True

    def __init__(self, expert_s: float, layer_s: float, queued: float = 0.0, slots: int = 8) -> None:
        self.expert_s, self.layer_s, self.queued, self.slots = expert_s, layer_s, queued, slots
        self.clock = 0.0
        self.requests: list[tuple[int, list[int]]] = []

    def now(self):
        return self.clock

    def arriving(self):
        return None

    def expert_seconds(self):
        return self.expert_s

    def layer_seconds(self, tokens):
        return self.layer_s

    def link_free_in(self):
        return self.queued

    def capacity(self):
        return self.slots

    def prefetch(self, layer, experts, keep=()):
        self.requests.append((layer, list(experts), list(keep)))
        return len(experts)


def two_level_tree(layers: int = 3, k: int = 2) -> DraftTree:
    tree = DraftTree(root_token=1)
    tree.add_level([-1, -1], [2, 3], [np.log(0.9), np.log(0.1)])
    tree.root_experts = np.array([[0, 1]] * layers)
    rows = tree.expert_rows(layers, k)
    rows[0] = [[2, 3]] * layers  # the likely node
    rows[1] = [[4, 5]] * layers  # the unlikely one
    return tree


def test_draft_prefetch_orders_by_benefit_and_bounds_each_layer_by_the_link():
    resident = np.zeros((3, 8), dtype=bool)
    resident[:, 0] = True  # resident: never prefetched
    pf = DraftPrefetcher(min_benefit=0.05)
    pf.bind(None, FakeSink(expert_s=1.0, layer_s=2.0))
    tree = two_level_tree()
    plan = pf.plan(tree, [0, 1], resident)
    # layer 0 runs now (no drafting time measured yet): nothing lands in time; by layer 1 (2 s) two
    # copies, by layer 2 (4 s) two more; most likely first: the root's 1, then node 0's 2 and 3 (p 0.9)
    assert plan == [(1, [1, 2]), (2, [1, 2])]
    tree.add_level([0], [7], [np.log(0.5)])
    tree.expert_rows(3, 2)
    pf.sink.clock = 1.0  # the next level took 1 s: as long again of drafting may follow, one more copy each
    assert pf.plan(tree, [0, 1, 2], resident) == [(0, [1]), (1, [1, 2]), (2, [1, 2])]
    pf = DraftPrefetcher(min_benefit=0.05)
    pf.bind(None, FakeSink(expert_s=0.0, layer_s=2.0))  # link time unknown: benefit alone bounds it
    assert pf.plan(two_level_tree(), [0], resident) == [(layer, [1, 2, 3]) for layer in range(3)]
    pf = DraftPrefetcher(min_benefit=0.5)
    pf.bind(None, FakeSink(expert_s=1.0, layer_s=2.0, queued=3.0))  # 3 s of copies already queued
    assert pf.plan(two_level_tree(), [0, 1], resident) == [(2, [1])]
    pf = DraftPrefetcher(min_benefit=0.05)
    pf.bind(None, FakeSink(expert_s=0.0, layer_s=2.0, slots=4))  # 4 slots, one holds the root's expert 0
    assert pf.plan(two_level_tree(), [0], resident) == [(layer, [1, 2, 3]) for layer in range(3)]
    resident[:, 2] = True  # 2 resident and likely used (0.9) too: two slots left to overwrite
    assert pf.plan(two_level_tree(), [0], resident) == [(layer, [1, 3]) for layer in range(3)]
    pf.sink.slots = 3  # the pass is expected to use 3.8 experts per layer, more than its slots: no prefetch
    assert pf.plan(two_level_tree(), [0], resident) == []


def test_draft_prefetch_weighs_each_pick_by_how_sure_the_predictor_is():
    """With ``tree.expert_probs`` a pick counts by the predictor's probability, and an expert it did
    not pick by its own: a sure pick of a selected node is copied first, an unsure one not at all,
    and a likely runner-up is."""
    layers, experts = 3, 8
    resident = np.zeros((layers, experts), dtype=bool)
    tree = two_level_tree(layers)
    tree.root_expert_probs = np.zeros((layers, experts), np.float32)
    tree.root_expert_probs[:, [0, 1]] = [0.95, 0.6]
    probs = tree.expert_prob_rows(layers, experts)
    probs[:] = 0.0
    probs[0][:, [2, 3, 6]] = [0.9, 0.15, 0.5]  # node 0: sure of 2, unsure of its pick 3, 6 is likely
    probs[1][:, [4, 5]] = [0.9, 0.9]
    use, weight = expected_use(tree, [0], 0, layers, experts)
    np.testing.assert_allclose(use[0], [0.95, 0.6, 0.9, 0.15, 0, 0, 0.5, 0], rtol=1e-6)
    pf = DraftPrefetcher(min_benefit=0.2)
    pf.bind(None, FakeSink(expert_s=0.0, layer_s=2.0, slots=8))
    assert pf.plan(tree, [0], resident) == [(layer, [0, 2, 1, 6]) for layer in range(layers)]
    tree.expert_probs = None  # without them the node's picks are certain: 3 is copied and 6 is not
    assert pf.plan(tree, [0], resident) == [(layer, [2, 3, 0, 1]) for layer in range(layers)]
    tree.expert_probs = probs[:1]  # shorter than the tree: node 1 falls back to its picks
    np.testing.assert_allclose(expected_use(tree, [1], 0, layers, experts)[0][0], [0.95, 0.6, 0, 0, 1, 1, 0, 0])
    tree.expert_probs = probs.copy()
    tree.expert_probs[1] = np.nan  # a NaN row (not predicted) too
    np.testing.assert_allclose(expected_use(tree, [1], 0, layers, experts)[0][0], [0.95, 0.6, 0, 0, 1, 1, 0, 0])
    # before the selector chose any node: the likeliest nodes, each by its path probability
    use, _ = expected_use(tree_with(probs), [], 2, layers, experts)
    np.testing.assert_allclose(use[0][[2, 6]], [0.9 * 0.9, 0.9 * 0.5], rtol=1e-6)


def tree_with(probs: np.ndarray) -> DraftTree:
    tree = two_level_tree()
    tree.expert_probs = probs
    return tree


def test_draft_prefetch_plans_nothing_for_the_rest_of_a_cycle_once_every_layer_overflows():
    """EAGLE-3's 60-node selections overflow every layer's slots, so no copy is planned; the deeper
    levels of that cycle then skip the planning, and the next cycle plans again."""
    resident = np.zeros((3, 8), dtype=bool)
    pf = DraftPrefetcher(min_benefit=0.05)
    pf.bind(None, FakeSink(expert_s=0.0, layer_s=2.0, slots=3))
    tree = two_level_tree()
    assert pf.plan(tree, [0], resident) == []  # 3.8 experts expected per layer, 3 slots
    tree.add_level([0], [7], [np.log(0.5)])
    tree.expert_rows(3, 2)
    pf.sink.slots = 8  # room now, but this cycle's pass is already known to overflow
    assert pf.plan(tree, [0, 2], resident) == []
    assert pf.plan(two_level_tree(), [0], resident) != []  # a new cycle (its first level) plans again


def test_draft_prefetch_stops_asking_for_predictions_in_a_cycle_it_plans_nothing_more_for():
    resident = np.zeros((3, 8), dtype=bool)
    pf = DraftPrefetcher(min_benefit=0.05)
    pf.bind(None, FakeSink(expert_s=0.0, layer_s=2.0, slots=3))
    tree = two_level_tree()
    assert pf.needs_predictions(tree)
    pf.plan(tree, [0], resident)  # overflows every layer
    assert not pf.needs_predictions(tree) and pf.needs_predictions(two_level_tree())  # the next cycle's tree
    auto = AutoPrefetcher()
    auto.draft = pf
    assert not auto.needs_predictions(tree)


class CountingPredictor(HistoryPredictor):
    def __init__(self) -> None:
        super().__init__()
        self.levels = 0

    def predict(self, tree, level) -> None:
        self.levels += 1
        super().predict(tree, level)


class Saturated(PrefetcherBase):
    """Wants the first level's predictions of each cycle only."""

    name = "saturated"

    def __init__(self, answer=False) -> None:
        self.answer = answer

    def needs_predictions(self, tree) -> bool:
        return tree.depth <= 1 or self.answer


@pytest.mark.parametrize("method", ["eagle3", "specfit"])
def test_levels_are_predicted_only_while_a_selector_or_the_prefetcher_reads_them(method):
    """EAGLE's selector reads no predictions: once the prefetcher says it needs none, the cycle's
    deeper levels are not predicted (the output is the same); SpecFit prices every level with them."""
    runs = {}
    for prefetcher in (None, Saturated()):
        parts = method_parts(method)
        predictor = parts["predictor"] = CountingPredictor()
        engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=prefetcher, device="cpu", **parts)
        out = engine.generate(PROMPT, max_new_tokens=N)
        runs[prefetcher is None] = (out.token_ids, predictor.levels, sum(c.levels > 0 for c in out.cycles))
    (plain, levels, drafted), (saved, fewer, _) = runs[True], runs[False]
    assert saved == plain == reference()[len(PROMPT):]
    if method == "eagle3":
        assert fewer == drafted < levels  # one level a drafted cycle
    else:
        assert fewer == levels


def test_a_needs_predictions_answer_that_is_not_a_bool_is_named():
    engine = Engine(tiny_model(), cache=LRUCache(capacity=3), prefetcher=Saturated(answer="yes"), device="cpu",
                    **method_parts("eagle3"))
    with pytest.raises(PluginError, match=r"^prefetch 'saturated' \(needs_predictions\):? .*must be a bool"):
        engine.generate(PROMPT, max_new_tokens=N)


# --------------------------------------------------------------------------- replay


def test_modelled_link_is_fifo_and_charges_the_wait_of_a_layer():
    spec = tiny_model_spec()
    cache = LRUCache(capacity=3)
    slots = cache.bind(spec)
    slot_expert = np.full((spec.num_layers, slots), -1, dtype=np.int64)
    sink = ModelledSink(DraftPrefetcher(), spec, cache, slot_expert, CONSTANTS)
    sink.begin_cycle()
    copy = CONSTANTS.c_miss - CONSTANTS.c_hit
    sink.at(0.0)
    assert sink.prefetch(0, [1, 2]) == 2  # land at 1 and 2 copies
    sink.at(0.5 * copy)
    assert sink.prefetch(1, [3]) == 1  # queued behind them: lands at 3 copies
    arriving = sink.arriving()
    assert arriving[0, 1] == pytest.approx(0.5 * copy) and arriving[1, 3] == pytest.approx(2.5 * copy)
    assert np.isinf(arriving[0, 3])
    routing = np.zeros((1, spec.num_layers, spec.top_k), dtype=np.int64)
    routing[0, 0, :2] = [1, 2]
    routing[0, 1, :2] = [3, 0]
    layer_s = sink.layer_seconds(1)
    stall = sink.settle(routing, 1, start=copy)  # layer 0 runs at 1 copy: waits 1 for expert 2
    wait0 = copy
    wait1 = max(3 * copy - (copy + layer_s + wait0), 0.0)
    assert stall == pytest.approx(wait0 + wait1) and sink.used == 3


def test_draft_prefetch_names_the_useful_resident_experts_so_no_copy_evicts_them():
    """after_level asks for the copies and keeps the resident experts the pass is likely to use:
    the cache may not evict them for the copies (live and modelled alike: an LRU's oldest slot may
    hold one)."""
    resident = np.zeros((3, 8), dtype=bool)
    resident[:, 2] = True  # likely used (0.9): not copied, but named
    resident[:, 5] = True  # resident and unused: fair game
    pf = DraftPrefetcher(min_benefit=0.05)
    pf.bind(None, FakeSink(expert_s=0.0, layer_s=2.0, slots=4))
    pf.after_level(two_level_tree(), [0], resident)
    assert pf.sink.requests == [(layer, [0, 1, 3], [2]) for layer in range(3)]  # 3 slots free of likely experts
    assert pf.plan(two_level_tree(), [0], resident) == [(layer, [0, 1, 3]) for layer in range(3)]  # copies only

    spec = tiny_model_spec()
    cache = LRUCache(capacity=3)
    slots = cache.bind(spec)
    slot_expert = np.full((spec.num_layers, slots), -1, dtype=np.int64)
    for slot, expert in enumerate([4, 5, 6]):  # 4 is the least recently used
        assert cache.admit(0, [expert]).loads == [(expert, slot)]
        slot_expert[0, slot] = expert
    sink = ModelledSink(DraftPrefetcher(), spec, cache, slot_expert, CONSTANTS)
    sink.begin_cycle()
    assert sink.prefetch(0, [7, 4]) == 1  # 7 is copied, and not over 4: asked for, so kept
    assert sorted(slot_expert[0].tolist()) == [4, 6, 7]
    assert sink.prefetch(0, [1], keep=[4, 2]) == 1  # the oldest, 4, kept (2 is not resident: nothing): 6 goes
    assert sorted(slot_expert[0].tolist()) == [1, 4, 7]


def test_modelled_link_says_once_that_cache_none_cannot_prefetch():
    """Replay decides as the live runtime does: a cache without its own admit_prefetch (none, whose
    base hook admits nothing) copies nothing ahead, and the run's notes say so once."""
    spec = tiny_model_spec()
    cache = NoCache()
    slot_expert = np.full((spec.num_layers, cache.bind(spec)), -1, dtype=np.int64)
    sink = ModelledSink(DraftPrefetcher(), spec, cache, slot_expert, CONSTANTS)
    sink.begin_cycle()
    assert sink.prefetch(0, [1, 2]) == 0 and sink.prefetch(1, [3]) == 0
    assert [n for n in sink.notes if "cannot prefetch" in n] == ["cache 'none' cannot prefetch (no admit_prefetch)"]
    assert (slot_expert == -1).all()


def tiny_model_spec():
    from specfit.offload.discovery import find_experts, moe_spec

    model = tiny_model()
    return moe_spec(model, find_experts(model))


def test_replay_models_draft_prefetch_and_says_lookahead_is_not_replayed():
    from specfit.trace.record import record
    from specfit.trace.replay import replay

    ref = reference()
    drafter = ScriptedDrafter(ref, vocab=256, branching=2, depth=3, total_tokens=8, miss=0.2, seed=1)
    trace = record(Engine(tiny_model(), cache=LRUCache(capacity=3), drafter=drafter, device="cpu"), [PROMPT],
                   max_new_tokens=N)

    def run(prefetcher):
        return replay(trace, SpecFitSelector(draft_time="modelled", draft_gate=False), LRUCache(capacity=3),
                      UnionCostModel(constants=CONSTANTS), HistoryPredictor(), draft_time="modelled",
                      model=tiny_model(), prefetcher=prefetcher)

    plain, drafted = run(None), run(DraftPrefetcher()).summary()
    assert drafted["prefetch_time"] == "modelled" and "modelled" in drafted["prefetch_note"]
    assert drafted["prefetch_issued"] > 0 and drafted["prefetch_used"] > 0
    assert drafted["decode_tokens"] == plain.summary()["decode_tokens"]
    assert "prefetch" not in plain.summary()
    auto = run(AutoPrefetcher()).summary()
    assert "lookahead needs the target's live hidden states: it is not replayed" in auto["prefetch_note"]
    alone = run(LookaheadPrefetcher()).summary()  # nothing of it replays: its note alone, no "modelled"
    assert alone["prefetch_issued"] == 0 and "modelled" not in alone["prefetch_note"]
    assert "it is not replayed" in alone["prefetch_note"]


def test_specfit_replay_prints_that_prefetch_is_modelled(tmp_path, capsys):
    from specfit.cli import main

    costs = ["cost_model.c0=0.002", "cost_model.c_tok=0.0001", "cost_model.c_miss=0.0004",
             "cost_model.c_hit=0.00002", "cost_model.c_level=0.0005"]
    drafter = ["drafter=eagle3", "drafter.top_k=3", "drafter.depth=3", "drafter.total_tokens=6"]
    main(["record", "model=tiny", *drafter, "~cost_model", "prompt_ids=[5,17,99,3,42]", "max_new_tokens=8",
          f"trace.path={tmp_path / 'trace'}", f"hydra.run.dir={tmp_path / 'rec'}"])
    main(["replay", f"trace.path={tmp_path / 'trace'}", "methods=[specfit_prefetch]", "cache.capacity=4", *costs,
          "replay.draft_time=modelled", "replay.oracle=false", f"hydra.run.dir={tmp_path / 'run'}"])
    out = capsys.readouterr().out
    assert "prefetch=auto (specfit_prefetch): prefetch modelled on the replay's link" in out
    assert "lookahead needs the target's live hidden states: it is not replayed" in out
    row = json.loads((tmp_path / "run" / "results.jsonl").read_text())
    assert row["prefetch"] == "auto" and row["prefetch_time"] == "modelled"
