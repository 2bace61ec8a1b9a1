"""Plug-ins cannot corrupt a run (issue 11, item 3).

A table of misbehaving plug-ins, each a small subclass of a built-in (or of the test drafter) that
breaks one rule: a bad value handed back to the core, or an exception inside a hook. Every one
must end the run with a one-line PluginError naming the plug-in, its kind and the hook, the
original exception chained; none may reach the target with corrupted state. The trace replay
calls the same plug-ins through the same guard.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from conftest import tiny_model
from drafters import ScriptedDrafter

from specfit import Engine
from specfit.types.costs import CostConstants
from specfit.types.tree import DraftTree, verify_block
from specfit.errors import ConfigError, PluginError
from specfit.interfaces import Admission, Selection
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.cost_models.union import UnionCostModel
from specfit.plugins.predictors.history import HistoryPredictor
from specfit.plugins.selectors.eagle3 import TopByPathProbSelector
from specfit.trace.record import record
from specfit.trace.replay import replay

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
VOCAB, EXPERTS, LAYERS, TOP_K = 256, 16, 4, 2  # tiny-qwen3-moe
CONSTANTS = CostConstants(c0=2e-3, c_tok=1e-4, c_miss=4e-4, c_hit=2e-5, c_level=5e-4)


class Boom(Exception):
    """What a buggy plug-in raises: must come back chained, its type and message in the line."""


# --------------------------------------------------------------------------- misbehaving plug-ins


class BadSelector(TopByPathProbSelector):
    """Verifies everything, except in the one hook ``mode`` breaks."""

    name = "badsel"

    def __init__(self, mode: str) -> None:
        self.mode = mode
        if mode == "likeliest_not_bool":
            self.chooses_among_likeliest = "yes"

    def bind(self, spec):
        if self.mode == "bind_raises":
            raise Boom("cannot bind")

    def should_draft(self):
        if self.mode == "should_draft_raises":
            raise Boom("gate broke")
        return 1 if self.mode == "should_draft_int" else True

    def select(self, tree, ctx):
        n = len(tree)
        nodes = tree.top_by_path_prob(ctx.max_nodes)
        match self.mode:
            case "negative":
                return Selection(nodes=[-3])
            case "negative_with_parents":  # -1 indexes the last node: looked closed before the guard
                return Selection(nodes=nodes + [-1])
            case "too_large":
                return Selection(nodes=[0, n + 4])
            case "not_closed":
                return Selection(nodes=[v for v in range(n) if tree.parents[v] != -1][:1])
            case "floats":
                return Selection(nodes=[float(v) for v in nodes])
            case "stop_not_bool":
                return Selection(nodes=nodes, stop="yes")
            case "outside_likeliest":  # every node, more than ctx.max_nodes, though it says it keeps to them
                return Selection(nodes=list(range(n)))
            case "not_a_selection":
                return nodes
            case "nodes_none":
                return Selection(nodes=None)
            case "predicted_not_numbers":
                return Selection(nodes=nodes, predicted={"rho": "high"})
            case "select_raises":
                raise ZeroDivisionError("division by zero\n  in the selector")  # a two-line message
            case "config_error":
                raise ConfigError("selector.knob=3 is deliberate nonsense")
        return Selection(nodes=nodes)

    def observe(self, tree, verified, accepted):
        if self.mode == "observe_raises":
            raise KeyError(42)

    def observe_time(self, drafted, committed, seconds):
        if self.mode == "observe_time_raises":
            raise Boom("clock broke")


class BadDrafter(ScriptedDrafter):
    name = "baddraft"

    def __init__(self, mode: str) -> None:
        super().__init__(PROMPT, vocab=VOCAB, branching=2, depth=3)
        self.mode = mode
        if mode == "negative_depth":
            self.depth = -1

    def feature_layers(self):
        return (99,) if self.mode == "feature_layer" else ()

    def start(self, prompt_ids, features, next_token):
        if self.mode == "start_raises":
            raise Boom("start broke")
        super().start(prompt_ids, features, next_token)

    def commit(self, tokens, features, next_token):
        if self.mode == "commit_raises":
            raise Boom("commit broke")
        super().commit(tokens, features, next_token)

    def draft(self, tree):
        match self.mode:
            case "token_too_large":
                yield tree.add_level([-1, -1], [3, VOCAB + 7], [-0.1, -0.2])
            case "token_negative":
                yield tree.add_level([-1], [-4], [-0.1])
            case "log_prob_nan":
                yield tree.add_level([-1, -1], [3, 4], [-0.1, float("nan")])
            case "log_prob_positive":
                yield tree.add_level([-1], [3], [0.5])
            case "wrong_range":
                tree.add_level([-1, -1], [3, 4], [-0.1, -0.2])
                yield range(0, 1)
            case "bad_parent":  # grows level 2 by hand, hanging a node from the root
                yield tree.add_level([-1, -1], [3, 4], [-0.1, -0.2])
                tree.level_starts.append(2)
                tree.tokens.append(5), tree.parents.append(-1), tree.depths.append(2)
                tree.log_probs.append(-0.3), tree.path_log_probs.append(-0.3)
                yield range(2, 3)
            case "draft_raises":
                yield tree.add_level([-1], [3], [-0.1])
                raise RuntimeError("head exploded")
            case _:
                yield from super().draft(tree)


class BadPredictor(HistoryPredictor):
    name = "badpred"

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def predict(self, tree, nodes):
        if self.mode == "predict_raises":
            raise IndexError("list index out of range")
        super().predict(tree, nodes)
        match self.mode:
            case "expert_too_large":
                tree.experts[nodes[0], 1, 0] = EXPERTS
            case "root_expert_negative":
                tree.root_experts = tree.root_experts.copy()
                tree.root_experts[0, 0] = -5
            case "root_wrong_shape":
                tree.root_experts = np.zeros((LAYERS + 1, TOP_K), dtype=np.int32)
            case "float_experts":
                tree.experts = tree.experts.astype(np.float32)
            case "probability_above_one":
                tree.expert_probs[nodes[0], 0, 0] = 1.5
            case "probs_wrong_shape":
                tree.root_expert_probs = np.zeros((LAYERS, TOP_K), dtype=np.float32)

    def observe(self, tokens, routing):
        if self.mode == "observe_raises":
            raise Boom("observe broke")
        super().observe(tokens, routing)


class BadCache(LRUCache):
    name = "badcache"

    def __init__(self, mode: str) -> None:
        super().__init__(capacity=4)
        self.mode = mode

    def bind(self, spec):
        slots = super().bind(spec)
        return {"too_few_slots": 1, "float_slots": 4.0}.get(self.mode, slots)

    def preload(self):
        return [(0, 3, 9)] if self.mode == "preload_out_of_range" else []

    def begin_pass(self):
        if self.mode == "begin_pass_raises":
            raise Boom("pass broke")

    def resident(self):
        return np.zeros((1, 1), dtype=bool) if self.mode == "resident_shape" else super().resident()

    def admit(self, layer, wanted):
        e = wanted[0]
        match self.mode:
            case "slot_out_of_range":
                return Admission(slots={e: 99}, loads=[(e, 99)])
            case "slot_negative":
                return Admission(slots={e: -1}, loads=[(e, -1)])
            case "nothing":
                return Admission(slots={}, loads=[])
            case "two_in_one_slot" if len(wanted) > 1:
                return Admission(slots={e: 0, wanted[1]: 0}, loads=[(e, 0), (wanted[1], 0)])
            case "load_not_admitted":
                return Admission(slots={e: 0}, loads=[(e, 0), (wanted[-1] + 1, 1)])
            case "unwanted":
                return Admission(slots={EXPERTS + 3: 0}, loads=[(EXPERTS + 3, 0)])
            case "admit_raises":
                raise Boom("admit broke")
        return super().admit(layer, wanted)


class BadCostModel(UnionCostModel):
    name = "badcost"

    def __init__(self, mode: str) -> None:
        super().__init__(constants=CONSTANTS)
        self.mode = mode

    def observe(self, record):
        if self.mode == "observe_raises":
            raise Boom("observe broke")


# --------------------------------------------------------------------------- the table


def sel(mode):
    return dict(selector=BadSelector(mode), drafter=ScriptedDrafter(PROMPT, vocab=VOCAB, branching=2, depth=3))


def few(mode):  # the drafter lets the selector choose 3 of its 14 nodes; the predictor predicts those 3
    return dict(selector=BadSelector(mode), predictor=HistoryPredictor(),
                drafter=ScriptedDrafter(PROMPT, vocab=VOCAB, branching=2, depth=3, total_tokens=3))


def draft(mode):
    return dict(drafter=BadDrafter(mode))


def pred(mode):
    return dict(predictor=BadPredictor(mode), drafter=ScriptedDrafter(PROMPT, vocab=VOCAB, branching=2, depth=2))


def cache(mode):  # with a drafter, so the selector reads residency
    return dict(cache=BadCache(mode), drafter=ScriptedDrafter(PROMPT, vocab=VOCAB, branching=2, depth=2))


def cost(mode):
    return dict(cost_model=BadCostModel(mode))


# (plug-in kwargs, kind, name, hook, message fragment, chained exception type or None for a bad value)
CASES = {
    "selector_negative_id": (sel("negative"), "selector", "badsel", "select", "node id -3 is out of range (tree has", None),
    "selector_outside_likeliest": (few("outside_likeliest"), "selector", "badsel", "select",
                                   "which is not among the tree's 3 likeliest by path probability", None),
    "selector_likeliest_not_bool": (few("likeliest_not_bool"), "selector", "badsel", "chooses_among_likeliest",
                                    "the attribute must be a bool, got str", None),
    "selector_negative_id_hidden": (sel("negative_with_parents"), "selector", "badsel", "select", "node id -1 is out of range", None),
    "selector_id_too_large": (sel("too_large"), "selector", "badsel", "select", "is out of range (tree has", None),
    "selector_not_closed": (sel("not_closed"), "selector", "badsel", "select", "not closed under ancestors", None),
    "selector_float_ids": (sel("floats"), "selector", "badsel", "select", "node ids (ints)", None),
    "selector_stop_not_bool": (sel("stop_not_bool"), "selector", "badsel", "select", "Selection.stop must be a bool", None),
    "selector_not_a_selection": (sel("not_a_selection"), "selector", "badsel", "select", "expected a specfit.interfaces.Selection", None),
    "selector_nodes_none": (sel("nodes_none"), "selector", "badsel", "select", "Selection.nodes=None must be a list of node ids", None),
    "selector_predicted": (sel("predicted_not_numbers"), "selector", "badsel", "select", "Selection.predicted", None),
    "selector_select_raises": (sel("select_raises"), "selector", "badsel", "select", "raised ZeroDivisionError: division by zero in the selector", ZeroDivisionError),
    "selector_bind_raises": (sel("bind_raises"), "selector", "badsel", "bind", "raised Boom: cannot bind", Boom),
    "selector_should_draft_int": (sel("should_draft_int"), "selector", "badsel", "should_draft", "must be a bool", None),
    "selector_should_draft_raises": (sel("should_draft_raises"), "selector", "badsel", "should_draft", "raised Boom: gate broke", Boom),
    "selector_observe_raises": (sel("observe_raises"), "selector", "badsel", "observe", "raised KeyError: 42", KeyError),
    "selector_observe_time_raises": (sel("observe_time_raises"), "selector", "badsel", "observe_time", "raised Boom", Boom),
    "drafter_token_too_large": (draft("token_too_large"), "drafter", "baddraft", "draft", f"token {VOCAB + 7} is outside the vocabulary (size {VOCAB})", None),
    "drafter_token_negative": (draft("token_negative"), "drafter", "baddraft", "draft", "token -4 is outside the vocabulary", None),
    "drafter_log_prob_nan": (draft("log_prob_nan"), "drafter", "baddraft", "draft", "log-probability nan of node 1 is not finite", None),
    "drafter_log_prob_positive": (draft("log_prob_positive"), "drafter", "baddraft", "draft", "log-probability 0.5 of node 0 is above 0", None),
    "drafter_wrong_range": (draft("wrong_range"), "drafter", "baddraft", "draft", "yielded range(0, 1), but the new level is range(0, 2)", None),
    "drafter_bad_parent": (draft("bad_parent"), "drafter", "baddraft", "draft", "level 2: node 2 has parent -1, not one of nodes 0..1", None),
    "drafter_draft_raises": (draft("draft_raises"), "drafter", "baddraft", "draft", "raised RuntimeError: head exploded", RuntimeError),
    "drafter_start_raises": (draft("start_raises"), "drafter", "baddraft", "start", "raised Boom: start broke", Boom),
    "drafter_commit_raises": (draft("commit_raises"), "drafter", "baddraft", "commit", "raised Boom: commit broke", Boom),
    "drafter_feature_layer": (draft("feature_layer"), "drafter", "baddraft", "feature_layers", "hidden-state index 99 is out of range (0..4", None),
    "drafter_negative_depth": (draft("negative_depth"), "drafter", "baddraft", "bind", "drafter.depth must be an int >= 0", None),
    "predictor_expert_too_large": (pred("expert_too_large"), "predictor", "badpred", "predict", f"tree.experts holds expert id {EXPERTS}, outside -1..{EXPERTS - 1}", None),
    "predictor_root_expert_negative": (pred("root_expert_negative"), "predictor", "badpred", "predict", "tree.root_experts holds expert id -5", None),
    "predictor_root_wrong_shape": (pred("root_wrong_shape"), "predictor", "badpred", "predict", f"must be an int array [{LAYERS}, {TOP_K}]", None),
    "predictor_float_experts": (pred("float_experts"), "predictor", "badpred", "predict", "tree.experts must be an int array", None),
    "predictor_probability_above_one": (pred("probability_above_one"), "predictor", "badpred", "predict", "tree.expert_probs holds a probability outside 0..1", None),
    "predictor_probs_wrong_shape": (pred("probs_wrong_shape"), "predictor", "badpred", "predict", "tree.root_expert_probs must be a float array", None),
    "predictor_predict_raises": (pred("predict_raises"), "predictor", "badpred", "predict", "raised IndexError: list index out of range", IndexError),
    "predictor_observe_raises": (pred("observe_raises"), "predictor", "badpred", "observe", "raised Boom: observe broke", Boom),
    "cache_slot_out_of_range": (cache("slot_out_of_range"), "cache", "badcache", "admit", "to slot 99, outside 0..3", None),
    "cache_slot_negative": (cache("slot_negative"), "cache", "badcache", "admit", "to slot -1, outside 0..3", None),
    "cache_admits_nothing": (cache("nothing"), "cache", "badcache", "admit", "admitted none of the wanted experts", None),
    "cache_two_in_one_slot": (cache("two_in_one_slot"), "cache", "badcache", "admit", "two experts in one slot", None),
    "cache_load_not_admitted": (cache("load_not_admitted"), "cache", "badcache", "admit", "loads an expert it did not admit", None),
    "cache_unwanted_expert": (cache("unwanted"), "cache", "badcache", "admit", f"admitted expert {EXPERTS + 3}, which was not wanted", None),
    "cache_admit_raises": (cache("admit_raises"), "cache", "badcache", "admit", "raised Boom: admit broke", Boom),
    "cache_too_few_slots": (cache("too_few_slots"), "cache", "badcache", "bind", "asked for 1 slots per layer, below top-k 2", None),
    "cache_float_slots": (cache("float_slots"), "cache", "badcache", "bind", "the slots per layer must be an int", None),
    "cache_preload_out_of_range": (cache("preload_out_of_range"), "cache", "badcache", "preload", "(layer 0, expert 3, slot 9) is out of range", None),
    "cache_resident_shape": (cache("resident_shape"), "cache", "badcache", "resident", f"shape [{LAYERS}, {EXPERTS}]", None),
    "cache_begin_pass_raises": (cache("begin_pass_raises"), "cache", "badcache", "begin_pass", "raised Boom: pass broke", Boom),
    "cost_model_observe_raises": (cost("observe_raises"), "cost_model", "badcost", "observe", "raised Boom: observe broke", Boom),
}


def assert_names(err: PluginError, kind: str, name: str, hook: str, fragment: str, cause: type | None) -> None:
    message = str(err)
    assert message.startswith(f"{kind} '{name}' ({hook})"), message
    assert fragment in message, message
    assert "\n" not in message and len(message) < 400, message
    assert (err.plugin, err.kind, err.hook) == (name, kind, hook)
    if cause is None:  # a bad value: nothing to chain
        assert err.__cause__ is None, repr(err.__cause__)
    else:
        assert isinstance(err.__cause__, cause), repr(err.__cause__)
        assert type(err.__cause__).__name__ in message


@pytest.mark.parametrize("case", list(CASES))
def test_a_misbehaving_plugin_is_named_in_one_line(case):
    parts, kind, name, hook, fragment, cause = CASES[case]
    with pytest.raises(PluginError) as info:
        Engine(tiny_model(), device="cpu", **parts).generate(PROMPT, max_new_tokens=6)
    assert_names(info.value, kind, name, hook, fragment, cause)


def test_deliberate_specfit_errors_pass_through_unchanged():
    engine = Engine(tiny_model(), device="cpu", **sel("config_error"))
    with pytest.raises(ConfigError, match="^selector.knob=3 is deliberate nonsense$") as info:
        engine.generate(PROMPT, max_new_tokens=4)
    assert not isinstance(info.value, PluginError)


def test_a_plugin_error_survives_pickling_with_its_names():
    engine = Engine(tiny_model(), device="cpu", **sel("negative"))
    with pytest.raises(PluginError) as info:
        engine.generate(PROMPT, max_new_tokens=4)
    copy = pickle.loads(pickle.dumps(info.value))
    assert (str(copy), copy.plugin, copy.kind, copy.hook) == (str(info.value), "badsel", "selector", "select")


def test_a_failed_drafter_is_closed():
    """A level refused by the guard closes the drafter's generator (its cleanup runs at once)."""
    closed = []

    class Tidy(BadDrafter):
        def draft(self, tree):
            try:
                yield from super().draft(tree)
            finally:
                closed.append(True)

    with pytest.raises(PluginError):
        Engine(tiny_model(), device="cpu", drafter=Tidy("log_prob_nan")).generate(PROMPT, max_new_tokens=4)
    assert closed == [True]


def test_verify_block_refuses_ids_that_would_index_from_the_end():
    tree = DraftTree(root_token=1)
    tree.add_level([-1, -1], [3, 4], [-0.1, -0.2])
    tree.add_level([0], [5], [-0.3])
    assert not tree.is_ancestor_closed([-1])  # node -1 would be node 2, whose parent 0 is missing
    assert not tree.is_ancestor_closed([0, -1])  # before the guard this passed the closure check
    with pytest.raises(ValueError, match="node id -1 is out of range"):
        verify_block(tree, [0, -1])
    with pytest.raises(ValueError, match="node id 3 is out of range"):
        verify_block(tree, [3])
    assert verify_block(tree, [2, 0, 0]).nodes == [0, 2]  # duplicates are fine


def test_well_behaved_builtins_still_match_autoregressive():
    """The guard changes no decision: the built-ins through it give the target's greedy output."""
    with torch.no_grad():
        ref = tiny_model().generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0].tolist()
    engine = Engine(tiny_model(), device="cpu", cache=LRUCache(capacity=4), predictor=HistoryPredictor(),
                    drafter=ScriptedDrafter(ref, vocab=VOCAB, branching=2, depth=3), cost_model=UnionCostModel(constants=CONSTANTS))
    out = engine.generate(PROMPT, max_new_tokens=16)
    assert out.token_ids == ref[len(PROMPT):]
    assert out.stats["spec_decode_acceptance_length"] > 1.5


# --------------------------------------------------------------------------- the replay, same guard


@pytest.fixture(scope="module")
def trace():
    with torch.no_grad():
        ref = tiny_model().generate(torch.tensor([PROMPT]), max_new_tokens=10, min_new_tokens=10, do_sample=False)[0].tolist()
    engine = Engine(tiny_model(), device="cpu", drafter=ScriptedDrafter(ref, vocab=VOCAB, branching=2, depth=2),
                    cost_model=UnionCostModel(constants=CONSTANTS))
    return record(engine, [PROMPT], max_new_tokens=10)


class BadConstants(UnionCostModel):
    name = "badcost"

    @property
    def constants(self):
        return CostConstants(c0=float("nan"), c_tok=1e-4, c_miss=4e-4, c_hit=2e-5)


REPLAY_CASES = {
    "selector_negative_id": (dict(selector=BadSelector("negative")), "selector", "badsel", "select", "node id -3 is out of range", None),
    "selector_observe_raises": (dict(selector=BadSelector("observe_raises")), "selector", "badsel", "observe", "raised KeyError", KeyError),
    "predictor_expert_too_large": (dict(predictor=BadPredictor("expert_too_large")), "predictor", "badpred", "predict", "outside -1..15", None),
    "cache_preload_out_of_range": (dict(cache=BadCache("preload_out_of_range")), "cache", "badcache", "preload", "is out of range", None),
    "cache_slot_out_of_range": (dict(cache=BadCache("slot_out_of_range")), "cache", "badcache", "admit", "to slot 99", None),
    "cost_model_constants": (dict(cost_model=BadConstants()), "cost_model", "badcost", "constants", "non-finite", None),
}


@pytest.mark.parametrize("case", list(REPLAY_CASES))
def test_the_replay_guards_plugins_the_same_way(trace, case):
    parts, kind, name, hook, fragment, cause = REPLAY_CASES[case]
    kwargs = dict(selector=TopByPathProbSelector(), cache=LRUCache(capacity=4), cost_model=UnionCostModel(constants=CONSTANTS),
                  predictor=None) | parts
    with pytest.raises(PluginError) as info:
        replay(trace, kwargs["selector"], kwargs["cache"], kwargs["cost_model"], kwargs["predictor"], model=tiny_model())
    assert_names(info.value, kind, name, hook, fragment, cause)
