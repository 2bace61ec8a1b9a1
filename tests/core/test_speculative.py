"""Speculative decoding is lossless: greedy output equals autoregressive greedy decoding."""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from conftest import ARCHITECTURES, tiny_model
from drafters import ScriptedDrafter, first_tree

from specfit import Engine
from specfit.errors import ConfigError, ModelError
from specfit.plugins.caches.full import FullCache
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.caches.none import NoCache
from specfit.plugins.drafters.eagle3.checkpoint import head_config_for, load_head, random_head, save_head
from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter
from specfit.plugins.selectors.chain import ChainSelector

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
CACHES = {"lru": lambda: LRUCache(capacity=3), "none": lambda: NoCache(), "full": lambda: FullCache()}
_REFERENCE: dict[str, list[int]] = {}


def reference(arch: str, n: int = 40) -> list[int]:
    """HF generate's greedy continuation (prompt included), computed once per architecture."""
    if arch not in _REFERENCE:
        with torch.no_grad():
            out = tiny_model(arch).generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _REFERENCE[arch] = out[0].tolist()
    return _REFERENCE[arch]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("cache", list(CACHES))
def test_eagle3_random_head_matches_hf_generate(arch, cache):
    drafter = Eagle3Drafter(top_k=3, depth=3, total_tokens=8)
    engine = Engine(tiny_model(arch), cache=CACHES[cache](), drafter=drafter, device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=20)
    assert out.token_ids == reference(arch)[len(PROMPT):][:20]
    assert out.stats["verified_nodes_per_cycle"] == 8  # every cycle verifies total_tokens nodes
    assert len(out.stats["experts_per_layer_union_by_layer"]) == engine.spec.num_layers


TREES = {
    "total_tokens_1": dict(branching=3, depth=3, total_tokens=1),
    "chain": dict(branching=1, depth=6),
    "wide_shallow": dict(branching=12, depth=1),
    "binary_deep": dict(branching=2, depth=5, total_tokens=20),
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("shape", list(TREES))
def test_accepting_trees_match_hf_generate(arch, cache, shape):
    ref = reference(arch)
    drafter = ScriptedDrafter(ref, vocab=256, seed=zlib.crc32(f"{arch}-{cache}-{shape}".encode()) % 1000, **TREES[shape])
    engine = Engine(tiny_model(arch), cache=CACHES[cache](), drafter=drafter, device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=30)
    assert out.token_ids == ref[len(PROMPT):][:30]
    if shape not in ("total_tokens_1",):
        assert out.stats["spec_decode_acceptance_length"] > 1.5


def test_stop_token_inside_an_accepted_path():
    ref = reference("tiny-qwen3-moe")
    new = ref[len(PROMPT):]
    stop = new[9]
    expected = new[: new.index(stop) + 1]
    drafter = ScriptedDrafter(ref, vocab=256, branching=1, depth=8, miss=0.0)
    engine = Engine(tiny_model(), drafter=drafter, stop_token_ids=[stop], device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=30)
    assert out.token_ids == expected
    assert out.cycles[-1].accepted > out.cycles[-1].committed - 1  # the stop came before the path's end


def test_max_new_tokens_reached_mid_path():
    ref = reference("tiny-qwen3-moe")
    drafter = ScriptedDrafter(ref, vocab=256, branching=1, depth=8, miss=0.0)
    engine = Engine(tiny_model(), drafter=drafter, device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=6)  # 1 token from prefill, then a cycle accepting 8
    assert out.token_ids == ref[len(PROMPT):][:6]
    assert out.cycles[0].accepted == 8 and out.cycles[0].committed == 5


def test_chain_selector_verifies_one_path():
    ref = reference("tiny-qwen3-moe")
    drafter = ScriptedDrafter(ref, vocab=256, branching=3, depth=4)
    engine = Engine(tiny_model(), drafter=drafter, selector=ChainSelector(), device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=20)
    assert out.token_ids == ref[len(PROMPT):][:20]
    assert all(c.verified <= 4 for c in out.cycles)


def test_sglang_aliases_and_conflicts():
    import specfit

    cfg = specfit.compose(["model=tiny", "drafter=eagle3", "drafter.num_steps=4", "drafter.eagle_topk=2",
                           "drafter.num_draft_tokens=5"])
    drafter = Eagle3Drafter.from_config(cfg_obj(cfg.drafter))
    assert (drafter.depth, drafter.top_k, drafter.total_tokens) == (4, 2, 4)  # SGLang counts the root
    with pytest.raises(ConfigError, match="drafter.depth=3 and its alias drafter.num_steps=4 disagree"):
        Eagle3Drafter.from_config(cfg_obj(specfit.compose(["model=tiny", "drafter=eagle3", "drafter.depth=3",
                                                             "drafter.num_steps=4"]).drafter))


def cfg_obj(node):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(node)


# --------------------------------------------------------------------------- head checkpoints


def test_head_saved_in_the_public_layout_loads_back_identically(tmp_path):
    model = tiny_model()
    head = random_head(head_config_for(model), seed=3)
    save_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 256
    outputs = []
    for h in (head, load_head(tmp_path)):
        engine = Engine(tiny_model(), drafter=Eagle3Drafter(top_k=3, depth=2, total_tokens=5, head=h), device="cpu")
        out = engine.generate(PROMPT, max_new_tokens=8)
        outputs.append([(c.drafted, c.verified) for c in out.cycles] + [tuple(out.token_ids)])
    assert outputs[0] == outputs[1]


def test_reduced_draft_vocabulary_maps_through_d2t(tmp_path):
    model = tiny_model()
    cfg = head_config_for(model)
    cfg.draft_vocab_size = 32
    head = random_head(cfg, seed=1)
    hot = torch.arange(100, 132)  # draft id i is target id 100 + i
    head.d2t.copy_(hot - torch.arange(32))
    save_head(head, tmp_path)
    loaded = load_head(tmp_path)
    engine = Engine(tiny_model(), drafter=Eagle3Drafter(top_k=4, depth=2, total_tokens=6, head=loaded), device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=4)
    assert out.token_ids == reference("tiny-qwen3-moe")[len(PROMPT):][:4]
    drafter = engine.drafter
    from specfit.types.tree import DraftTree

    drafter.start(PROMPT, engine.target.prefill(PROMPT).features, 7)
    tree = DraftTree(root_token=7)
    for _ in drafter.draft(tree):
        pass
    assert all(100 <= t < 132 for t in tree.tokens)


def test_random_head_is_seeded():
    model = tiny_model()
    a, b = random_head(head_config_for(model), seed=5), random_head(head_config_for(model), seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize(
    ("breakage", "pattern"),
    [
        ("no_config", "no config.json"),
        ("bad_json", "not valid JSON"),
        ("no_weights", r"no weights \(model.safetensors or pytorch_model.bin\)"),
        ("missing_tensor", "missing tensors midlayer.self_attn.q_proj.weight"),
        ("wrong_shape", r"tensor fc.weight has shape \(64, 10\)"),
        ("variant_flag", "variant flag parallel_drafting=True is not supported"),
        ("two_layers", "missing tensors layers.1.input_layernorm.weight"),  # config: 2 layers, weights: 1
        ("wrong_vocab", "head vocab_size 300 differs from the target's 256"),
        # these drafted NaNs, blamed on the drafter mid-decode, or raised inside transformers
        ("rope_theta", "config.json: rope_theta=0.0 must be a finite number > 0"),
        ("rms_norm_eps", "config.json: rms_norm_eps=-1.0 must be a finite number > 0"),
        ("rope_scaling", r"config.json: rope_scaling / rope_parameters .*'warp'.* are not a rotary embedding"),
        ("a_target", "a Qwen3MoeForCausalLM checkpoint, not an EAGLE-3 head"),  # not a list of 1,000 tensor names
    ],
)
def test_malformed_head_directories_give_clear_errors(tmp_path, breakage, pattern):
    from safetensors.torch import load_file, save_file

    head = random_head(head_config_for(tiny_model()))
    save_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    weights = tmp_path / "model.safetensors"
    if breakage == "no_config":
        (tmp_path / "config.json").unlink()
    elif breakage == "bad_json":
        (tmp_path / "config.json").write_text("{not json")
    elif breakage == "no_weights":
        weights.unlink()
    elif breakage in ("missing_tensor", "wrong_shape"):
        state = load_file(str(weights))
        if breakage == "missing_tensor":
            del state["midlayer.self_attn.q_proj.weight"]
        else:
            state["fc.weight"] = torch.zeros(64, 10)
        save_file(state, str(weights))
    elif breakage == "variant_flag":
        config["parallel_drafting"] = True
    elif breakage == "two_layers":
        config["num_hidden_layers"] = 2
    elif breakage == "a_target":  # the target's own directory, named as the head
        tiny_model().save_pretrained(tmp_path)
        config = json.loads((tmp_path / "config.json").read_text())
    elif breakage == "rope_theta":
        config["rope_theta"] = 0
    elif breakage == "rms_norm_eps":
        config["rms_norm_eps"] = -1
    elif breakage == "rope_scaling":
        config["rope_scaling"] = {"rope_type": "warp", "factor": 2.0}
    elif breakage == "wrong_vocab":
        config["vocab_size"] = 300
        state = load_file(str(weights))
        state["t2d"] = torch.ones(300, dtype=torch.bool)
        save_file(state, str(weights))
    if breakage in ("variant_flag", "two_layers", "wrong_vocab", "rope_theta", "rms_norm_eps", "rope_scaling"):
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=pattern):
        Engine(tiny_model(), drafter=Eagle3Drafter(path=str(tmp_path)), device="cpu")


def sampled_like_ar(make_engine, seeds: range, n: int = 10) -> int:
    """Sampling is lossless seed for seed: for each seed, a tree engine whose drafter proposes AR's
    own sampled continuation (at a random rank among random siblings, left out one time in five)
    decodes exactly AR's tokens. Each output token is an inverse-CDF draw from the target's
    distribution with its position's uniform (test_sampling checks that law), so equality per seed
    is the distribution kept, and it fails on any changed token. Returns the drafted tokens the
    target accepted, which a test asserts are many (the tree path is exercised)."""
    from specfit.decode.sampling import SamplingParams

    ar, (tree, drafter) = Engine(tiny_model(), device="cpu"), make_engine()
    accepted = 0
    for seed in seeds:
        params = SamplingParams(temperature=1.5, top_k=6, seed=seed)
        expected = ar.generate(PROMPT[:3], n, params).token_ids
        drafter.reference = PROMPT[:3] + expected  # the drafter knows this seed's sampled continuation
        out = tree.generate(PROMPT[:3], n, params)
        assert out.token_ids == expected, f"seed {seed}"
        accepted += out.stats["accepted_tokens"]
    return accepted


@pytest.mark.parametrize("window", [None, 5])
def test_tree_drafting_equals_drafting_each_path_alone(window):
    """A node's path log-probability from the batched tree pass equals feeding its path to the head
    one token at a time (the tree mask and positions are right), also where the head attends to
    only its latest ``window`` positions (5, fewer than the prompt's 8)."""
    import torch.nn.functional as F

    from specfit.plugins.drafters.eagle3.head import KVBuffer

    drafter = Eagle3Drafter(top_k=3, depth=4, total_tokens=20, attention_window=window or 0)
    engine = Engine(tiny_model(), drafter=drafter, device="cpu")
    head = drafter.head
    assert drafter.window == window
    prefill, root, tree = first_tree(engine, drafter, PROMPT)
    assert drafter.kv.length == len(PROMPT)  # tree pairs dropped after drafting
    with torch.inference_mode():
        for v in range(len(tree)):
            kv = KVBuffer(head.cfg.num_key_value_heads, head.cfg.head_dim, drafter.dtype, drafter.device)
            tokens = torch.tensor(PROMPT[1:] + [root])
            h = head(head.project(prefill.features), tokens, torch.arange(len(tokens)), kv, window=window)[-1]
            logp = 0.0
            for node in tree.path_to(v):
                logp += float(F.log_softmax(head.logits(h[None]).float(), -1)[0, tree.tokens[node]])
                h = head(h[None], torch.tensor([tree.tokens[node]]), torch.tensor([kv.length]), kv, window=window)[0]
            assert logp == pytest.approx(tree.path_log_probs[v], abs=1e-4)


@pytest.mark.parametrize("window", [None, 5])
def test_a_long_prompt_caught_up_in_chunks_drafts_what_one_step_drafts(monkeypatch, window):
    """The head takes a long prompt CATCH_UP_CHUNK positions at a time (bounded attention scores);
    each chunk attends to the cache so far, so the drafts are those of one step over it all."""
    from specfit.types.tree import DraftTree
    from specfit.plugins.drafters.eagle3 import drafter as drafter_module

    def drafted(chunk: int) -> DraftTree:
        monkeypatch.setattr(drafter_module, "CATCH_UP_CHUNK", chunk)
        drafter = Eagle3Drafter(top_k=3, depth=3, total_tokens=12, attention_window=window or 0)
        tree = first_tree(Engine(tiny_model(), drafter=drafter, device="cpu"), drafter, PROMPT)[2]
        assert drafter.kv.length == len(PROMPT)
        return tree

    whole, chunked = drafted(512), drafted(3)  # the prompt's 8 pairs in one step, or in 3 + 3 + 2
    assert chunked.tokens == whole.tokens
    assert chunked.path_log_probs == pytest.approx(whole.path_log_probs, abs=1e-4)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_catching_up_computes_only_the_keys_of_all_but_the_last_position(window, qk_norm):
    """``last_only``: the earlier positions only add their keys and values to the cache, and the
    last position's output and the cache are those of the full step."""
    import dataclasses

    from specfit.plugins.drafters.eagle3.checkpoint import head_config_for, random_head
    from specfit.plugins.drafters.eagle3.head import KVBuffer

    target = tiny_model()
    config = dataclasses.replace(head_config_for(target), qk_norm=qk_norm)
    head = random_head(config, seed=1).eval()
    head.set_target_embedding(target.get_input_embeddings())
    cfg = vars(config)
    torch.manual_seed(0)
    hidden, tokens = torch.randn(9, cfg["hidden_size"]), torch.randint(0, 200, (9,))
    out, rows = {}, []
    head.midlayer.mlp.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    with torch.inference_mode():
        for last_only in (False, True):
            kv = KVBuffer(cfg["num_key_value_heads"], cfg["head_dim"], torch.float32, torch.device("cpu"))
            head(hidden[:4], tokens[:4], torch.arange(4), kv, window=window)  # a cache already holding 4
            h = head(hidden[4:], tokens[4:], torch.arange(4, 9), kv, window=window, last_only=last_only)
            out[last_only] = (h[-1:], kv.k[:, : kv.length].clone(), kv.v[:, : kv.length].clone())
    assert out[True][0].shape == (1, cfg["hidden_size"])
    assert rows == [4, 5, 4, 1]  # the MLP ran on the last new position alone
    assert torch.equal(out[False][1], out[True][1]) and torch.equal(out[False][2], out[True][2])  # the same cache
    assert torch.allclose(out[False][0], out[True][0], atol=1e-6)  # the output: one query's matmul


@pytest.mark.parametrize("queries,keys,window", [(1, 1, 1), (4, 4, 2), (3, 10, 4), (10, 10, 3), (2, 9, 20), (5, 8, None)])
def test_causal_mask_is_a_band_of_the_latest_window_positions(queries, keys, window):
    from specfit.plugins.drafters.eagle3.head import causal_mask

    mask, first = causal_mask(queries, keys, window, torch.device("cpu"))
    past = keys - queries
    expected = torch.tensor([[j <= past + i and (window is None or j > past + i - window) for j in range(keys)]
                             for i in range(queries)])
    assert not expected[:, :first].any()  # the cut keys are attended by no query
    assert torch.equal(mask, expected[:, first:])
    assert first == (0 if window is None else max(past - window + 1, 0))


def test_attention_window_comes_from_the_checkpoint_unless_set(tmp_path):
    cfg = head_config_for(tiny_model())
    cfg.attention_window = 6
    save_head(random_head(cfg), tmp_path / "head")
    assert json.loads((tmp_path / "head" / "config.json").read_text())["attention_window"] == 6
    for setting, window in ((None, 6), (0, None), (3, 3), (10**30, None)):  # past any context: every position
        drafter = Eagle3Drafter(path=str(tmp_path / "head"), top_k=3, depth=2, total_tokens=6, attention_window=setting)
        Engine(tiny_model(), drafter=drafter, device="cpu")
        assert drafter.window == window
    with pytest.raises(ConfigError, match="drafter.attention_window"):
        Eagle3Drafter(attention_window=-1)
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    for bad in (0, "256", True):
        (tmp_path / "head" / "config.json").write_text(json.dumps({**raw, "attention_window": bad}))
        with pytest.raises(ModelError, match="config.json: attention_window="):
            load_head(tmp_path / "head")


def test_committing_several_tokens_equals_starting_over():
    """After a cycle that accepts several tokens, the head drafts what it would from a fresh start
    on the longer sequence (its KV is kept in step with committed tokens)."""
    from specfit.types.tree import DraftTree

    ref = reference("tiny-qwen3-moe")
    engine = Engine(tiny_model(), drafter=Eagle3Drafter(top_k=3, depth=3, total_tokens=10), device="cpu")
    drafter = engine.drafter
    with torch.inference_mode():
        prefill = engine.target.prefill(PROMPT)
        drafter.start(PROMPT, prefill.features, ref[len(PROMPT)])
        for _ in drafter.draft(DraftTree(root_token=ref[len(PROMPT)])):
            pass
        # verify the next three true tokens as a chain and commit them
        from specfit.types.tree import VerifyBlock

        chain = ref[len(PROMPT) : len(PROMPT) + 4]
        block = VerifyBlock(tokens=chain, parents=[-1, 0, 1, 2], depths=[0, 1, 2, 3], nodes=[0, 1, 2])
        prefix = engine.target.kv_len
        result = engine.target.verify(block)
        engine.target.keep(prefix, [0, 1, 2, 3])
        drafter.commit(chain, result.features, ref[len(PROMPT) + 4])
        continued = DraftTree(root_token=ref[len(PROMPT) + 4])
        for _ in drafter.draft(continued):
            pass
        fresh_engine = Engine(tiny_model(), drafter=Eagle3Drafter(top_k=3, depth=3, total_tokens=10), device="cpu")
        longer = ref[: len(PROMPT) + 4]
        fresh = fresh_engine.target.prefill(longer)
        fresh_engine.drafter.start(longer, fresh.features, ref[len(PROMPT) + 4])
        restarted = DraftTree(root_token=ref[len(PROMPT) + 4])
        for _ in fresh_engine.drafter.draft(restarted):
            pass
    assert continued.tokens == restarted.tokens
    assert continued.path_log_probs == pytest.approx(restarted.path_log_probs, abs=1e-4)


def test_cycles_that_skip_drafting_leave_the_head_what_starting_over_would():
    """Plain cycles (the gate skipped drafting) only queue their features; the next draft catches
    up on all of them at once and drafts what a fresh start on the longer sequence drafts."""
    from specfit.types.tree import DraftTree, VerifyBlock

    ref = reference("tiny-qwen3-moe")
    n = len(PROMPT)
    engine = Engine(tiny_model(), drafter=Eagle3Drafter(top_k=3, depth=3, total_tokens=10), device="cpu")
    drafter = engine.drafter
    with torch.inference_mode():
        drafter.start(PROMPT, engine.target.prefill(PROMPT).features, ref[n])
        for i in range(4):  # four autoregressive steps, no drafting
            result = engine.target.verify(VerifyBlock(tokens=[ref[n + i]], parents=[-1], depths=[0], nodes=[]))
            drafter.commit([ref[n + i]], result.features, ref[n + i + 1])
        assert len(drafter.pending_features) == 5  # queued as chunks, not joined every cycle
        continued = DraftTree(root_token=ref[n + 4])
        for _ in drafter.draft(continued):
            pass
        fresh_engine = Engine(tiny_model(), drafter=Eagle3Drafter(top_k=3, depth=3, total_tokens=10), device="cpu")
        longer = ref[: n + 4]
        fresh_engine.drafter.start(longer, fresh_engine.target.prefill(longer).features, ref[n + 4])
        restarted = DraftTree(root_token=ref[n + 4])
        for _ in fresh_engine.drafter.draft(restarted):
            pass
    assert continued.tokens == restarted.tokens
    assert continued.path_log_probs == pytest.approx(restarted.path_log_probs, abs=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_eager_attention_tree_verification_matches_hf_generate(arch):
    ref = reference(arch)
    drafter = ScriptedDrafter(ref, vocab=256, branching=3, depth=3, seed=5)
    model = tiny_model(arch, attn_implementation="eager")
    engine = Engine(model, cache=LRUCache(capacity=3), drafter=drafter, device="cpu")
    assert engine.target.attn_implementation == "eager"
    out = engine.generate(PROMPT, max_new_tokens=20)
    assert out.token_ids == ref[len(PROMPT):][:20]
    assert out.stats["spec_decode_acceptance_length"] > 1.5


@pytest.mark.parametrize("selector", ["eagle3", "chain", "specfit"])
@pytest.mark.parametrize("cache", list(CACHES))
def test_sampling_is_lossless_for_every_selector_and_cache(selector, cache):
    """Seed for seed, every selector and cache samples AR's tokens, accepting many drafts."""
    from specfit.types.costs import CostConstants
    from specfit.plugins.cost_models.union import UnionCostModel
    from specfit.plugins.predictors.history import HistoryPredictor
    from specfit.plugins.selectors.eagle3 import TopByPathProbSelector
    from specfit.plugins.selectors.specfit import SpecFitSelector

    def make():
        parts = {"eagle3": dict(selector=TopByPathProbSelector()), "chain": dict(selector=ChainSelector()),
                 "specfit": dict(selector=SpecFitSelector(), predictor=HistoryPredictor(),
                                 cost_model=UnionCostModel(constants=CostConstants(1e-3, 1e-5, 1e-5, 1e-6)))}[selector]
        drafter = ScriptedDrafter([], vocab=256, branching=4, depth=2, miss=0.2)
        return Engine(tiny_model(), cache=CACHES[cache](), device="cpu", drafter=drafter, **parts), drafter

    assert sampled_like_ar(make, range(20)) > 4, "too few drafts accepted to exercise the tree"
