"""EAGLE-3 heads in the layouts published on the hub, each built here in miniature.

Every layout either loads and drafts as its trainer meant (the shipped head re-saved in another
layout drafts exactly the same tokens; a head without lm_head drafts with the target's rows) and
stays lossless (greedy output equals autoregressive decoding), or is refused in one line naming
the config field, tensor or file.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from drafters import first_tree
from safetensors.torch import load_file, save_file

from specfit import Engine
from specfit.errors import ModelError
from specfit.plugins.drafters.eagle3.checkpoint import head_config_for, load_head, random_head, save_head
from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter

PROMPT = [5, 17, 99, 3, 42, 8, 120, 77]
DEMO = Path(__file__).resolve().parents[2] / "specfit" / "assets" / "demo"


# --------------------------------------------------------------------------- layouts, written as trainers do


def write_sharded(src: Path, dst: Path, shards: int = 3) -> Path:
    """``src`` re-saved as ``shards`` safetensors files and a model.safetensors.index.json."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k] for k in names[i::shards]}
        save_file(part, str(dst / file))
        weight_map.update({k: file for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def write_speculators(src: Path, dst: Path, **top: object) -> Path:
    """``src`` (HF layout) in RedHat speculators' layout: the decoder layer's config nested, EAGLE
    fields at the top, aux ids as HF hidden-state indices, ``layers.0.*`` tensors and the trainer's
    verifier tensors kept beside them."""
    raw = json.loads((src / "config.json").read_text())
    eagle = raw.pop("eagle_config", {}) or {}
    layer = {k: v for k, v in raw.items() if k not in ("architectures", "draft_vocab_size", "target_hidden_size",
                                                        "norm_before_residual", "fc_norm", "norm_output")}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids")
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": raw["draft_vocab_size"],
        "target_hidden_size": raw.get("target_hidden_size"),
        "norm_before_residual": raw.get("norm_before_residual", False),
        "norm_before_fc": False,
        "fc_norm": raw.get("fc_norm", False),
        "norm_output": False,
        "eagle_aux_hidden_state_layer_ids": None if aux is None else [i + 1 for i in aux],
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "demo", "architectures": ["Qwen3MoeForCausalLM"]}},
        **top,
    }
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    state = load_file(str(src / "model.safetensors"))
    state = {("layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v for k, v in state.items()}
    hidden = raw["hidden_size"]
    state["verifier_norm.weight"] = torch.ones(hidden)
    state["verifier_lm_head.weight"] = torch.zeros(raw["draft_vocab_size"], hidden)
    save_file(state, str(dst / "model.safetensors"))
    return dst


def edit(d: Path, drop: tuple[str, ...] = (), rename: dict[str, str] | None = None, **config: object) -> Path:
    """Drop or rename tensors of a head directory and set config.json fields."""
    state = load_file(str(d / "model.safetensors"))
    state = {(rename or {}).get(k, k): v for k, v in state.items() if k not in drop}
    save_file(state, str(d / "model.safetensors"))
    raw = json.loads((d / "config.json").read_text())
    raw.update(config)
    (d / "config.json").write_text(json.dumps(raw))
    return d


# --------------------------------------------------------------------------- what a head drafts


def trace(model: torch.nn.Module, head: object, new: int = 12) -> tuple[list, list]:
    """The first draft tree (tokens and path log-probabilities) and a greedy decode with its cycles.

    Each engine gets its own copy of ``model`` (an engine takes over the model's experts)."""
    drafter = Eagle3Drafter(top_k=3, depth=3, total_tokens=10, head=head)
    engine = Engine(copy.deepcopy(model), drafter=drafter, device="cpu")
    tree = first_tree(engine, drafter, PROMPT)[2]
    engine = Engine(copy.deepcopy(model), drafter=Eagle3Drafter(top_k=3, depth=3, total_tokens=10, head=head),
                    device="cpu")
    out = engine.generate(PROMPT, max_new_tokens=new)
    first = [list(tree.tokens), [round(p, 5) for p in tree.path_log_probs]]
    return first, [out.token_ids, [(c.drafted, c.verified, c.accepted) for c in out.cycles]]


_AR: dict[str, list[int]] = {}


def autoregressive(arch: str = "tiny-qwen3-moe", new: int = 12) -> list[int]:
    if arch not in _AR:
        _AR[arch] = Engine(tiny_model(arch), device="cpu").generate(PROMPT, max_new_tokens=new).token_ids
    return _AR[arch]


def lossless(path: Path, arch: str = "tiny-qwen3-moe") -> Engine:
    """A short greedy decode with the head at ``path`` equals autoregressive decoding."""
    engine = Engine(tiny_model(arch), drafter=Eagle3Drafter(path=str(path), top_k=3, depth=3, total_tokens=8),
                    device="cpu")
    assert engine.generate(PROMPT, max_new_tokens=12).token_ids == autoregressive(arch)
    return engine


def noisy(head: torch.nn.Module, seed: int = 7) -> torch.nn.Module:
    """Norm weights away from 1, so a norm applied or skipped changes the numbers."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return head


def tiny_head(tmp: Path, seed: int = 1, **changes: object) -> tuple[Path, object]:
    cfg = head_config_for(tiny_model())
    for key, value in changes.items():
        setattr(cfg, key, value)
    head = noisy(random_head(cfg, seed=seed, std=0.1))
    return save_head(head, tmp), head


# --------------------------------------------------------------------------- the shipped head, re-saved


@pytest.fixture(scope="module")
def demo_target():
    from specfit.model.checkpoint import load_checkpoint

    return load_checkpoint(str(DEMO / "target"), dtype="float32")


def test_shipped_head_drafts_the_same_tokens_sharded_and_in_the_speculators_layout(tmp_path, demo_target):
    original = trace(demo_target, load_head(DEMO / "eagle3"))
    sharded = write_sharded(DEMO / "eagle3", tmp_path / "sharded")
    speculators = write_speculators(DEMO / "eagle3", tmp_path / "speculators")
    assert not (sharded / "model.safetensors").exists()
    for d in (sharded, speculators):
        assert trace(demo_target, load_head(d)) == original
    assert sum(a for _, _, a in original[1][1]) > 0  # the trained head is accepted: the trace is not trivial
    ar = Engine(copy.deepcopy(demo_target), device="cpu").generate(PROMPT, max_new_tokens=12).token_ids
    assert original[1][0] == ar


# --------------------------------------------------------------------------- shared lm_head and embeddings


def test_head_without_lm_head_drafts_with_the_targets_rows(tmp_path):
    model = tiny_model()
    path, head = tiny_head(tmp_path / "own")
    with torch.no_grad():
        head.lm_head.weight.copy_(model.lm_head.weight)
    save_head(head, path)
    shared = edit(Path(shutil.copytree(path, tmp_path / "shared")), drop=("lm_head.weight",))
    loaded = load_head(shared)
    assert loaded.lm_head is None
    assert trace(tiny_model(), loaded) == trace(tiny_model(), load_head(path))
    lossless(shared)


def test_reduced_vocabulary_head_without_lm_head_takes_the_rows_d2t_names(tmp_path):
    model = tiny_model()
    path, head = tiny_head(tmp_path / "own", draft_vocab_size=40)
    ids = torch.arange(200, 240)
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(40))
        head.lm_head.weight.copy_(model.lm_head.weight[ids])
    save_head(head, path)
    shared = edit(Path(shutil.copytree(path, tmp_path / "shared")), drop=("lm_head.weight",))
    engine = lossless(shared)
    bound = engine.drafter.head
    h = torch.randn(2, bound.cfg.hidden_size)
    torch.testing.assert_close(bound.logits(h), F.linear(bound.norm(h), model.lm_head.weight[ids]))
    assert trace(tiny_model(), load_head(shared)) == trace(tiny_model(), load_head(path))


def test_a_head_keeps_its_own_lm_head_and_embeddings(tmp_path):
    model = tiny_model()
    path, head = tiny_head(tmp_path / "own")
    head.embed_tokens = torch.nn.Embedding(*model.get_input_embeddings().weight.shape)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(torch.randn(head.embed_tokens.weight.shape))
    save_head(head, path)
    loaded = load_head(path)
    assert loaded.embed_tokens is not None and loaded.lm_head is not None
    torch.testing.assert_close(loaded.embed_tokens.weight, head.embed_tokens.weight)
    torch.testing.assert_close(loaded.lm_head.weight, head.lm_head.weight)
    engine = lossless(path)
    assert engine.drafter.head.embed_tokens is not None  # not replaced by the target's
    no_embed = edit(Path(shutil.copytree(path, tmp_path / "no_embed")), drop=("embed_tokens.weight",))
    assert trace(tiny_model(), load_head(no_embed))[0] != trace(tiny_model(), loaded)[0]


# --------------------------------------------------------------------------- variant flags


def test_norm_output_false_applies_no_final_norm(tmp_path):
    path, _ = tiny_head(tmp_path / "h")
    edit(path, norm_output=False)
    head = load_head(path)
    h = torch.randn(3, head.cfg.hidden_size)
    torch.testing.assert_close(head.logits(h), head.lm_head(h))
    assert not torch.allclose(head.logits(h), head.lm_head(head.norm(h)))
    lossless(path)
    edit(path, drop=("norm.weight",))  # SpecForge keeps an unused norm; a head may also lack it
    lossless(path)


def test_fc_norm_normalises_each_fused_feature(tmp_path):
    path, head = tiny_head(tmp_path / "h", fc_norm=True)
    assert json.loads((path / "config.json").read_text())["fc_norm"] is True
    loaded = load_head(path)
    features = torch.randn(4, 3 * loaded.cfg.target_hidden_size)
    chunks = features.chunk(3, dim=-1)
    manual = torch.cat([head.fc_norm[i](chunks[i]) for i in range(3)], dim=-1)
    torch.testing.assert_close(loaded.project(features), F.linear(manual, head.fc.weight))
    assert not torch.allclose(loaded.project(features), head.fc(features))
    assert trace(tiny_model(), loaded) == trace(tiny_model(), head)
    lossless(path)
    edit(path, drop=("fc_norm.1.weight",))
    with pytest.raises(ModelError, match=r"missing tensors fc_norm\.1\.weight$"):
        load_head(path)


def test_use_aux_hidden_state_false_reads_the_last_hidden_state(tmp_path):
    path, head = tiny_head(tmp_path / "h", use_aux_hidden_state=False)
    config = json.loads((path / "config.json").read_text())
    assert config["eagle_config"] == {"use_aux_hidden_state": False}
    assert "fc.weight" not in load_file(str(path / "model.safetensors"))
    engine = lossless(path)
    assert engine.drafter.feature_layers() == (tiny_model().config.num_hidden_layers,)
    features = torch.randn(2, head.cfg.hidden_size)
    assert torch.equal(engine.drafter.head.project(features), features)
    # an fc the config says is unused is not loaded (as vLLM skips it)
    state = load_file(str(path / "model.safetensors"))
    state["fc.weight"] = torch.zeros(head.cfg.hidden_size, 3 * head.cfg.hidden_size)
    save_file(state, str(path / "model.safetensors"))
    assert load_head(path).fc is None


def test_two_layer_head_stacks_a_plain_decoder_layer(tmp_path):
    path, head = tiny_head(tmp_path / "h", num_hidden_layers=2)
    names = set(load_file(str(path / "model.safetensors")))
    assert "layers.1.self_attn.q_proj.weight" in names and "layers.1.hidden_norm.weight" not in names
    assert head.layers["1"].self_attn.q_proj.in_features == head.cfg.hidden_size  # later layers read H, not 2H
    lossless(path)
    loaded = load_head(path)
    assert trace(tiny_model(), loaded) == trace(tiny_model(), head)
    # with its second layer silenced (o_proj and down_proj zero) it is the one-layer head
    one_dir, one = tiny_head(tmp_path / "one")
    with torch.no_grad():
        for name, p in one.state_dict().items():
            if not name.startswith("rotary."):
                loaded.state_dict()[name].copy_(p)
        loaded.layers["1"].self_attn.o_proj.weight.zero_()
        loaded.layers["1"].mlp.down_proj.weight.zero_()
    # the same drafts; log-probabilities to float precision: the one-layer head catches up on the
    # prompt computing only the last position's attention (Eagle3Head.forward's last_only)
    (tree, decode), (one_tree, one_decode) = trace(tiny_model(), loaded), trace(tiny_model(), load_head(one_dir))
    assert tree[0] == one_tree[0] and decode == one_decode
    assert tree[1] == pytest.approx(one_tree[1], abs=2e-5)
    # vLLM names the first layer layers.0 instead of midlayer
    vllm = Path(shutil.copytree(path, tmp_path / "vllm"))
    edit(vllm, rename={k: "model.layers.0." + k.removeprefix("midlayer.") for k in names if k.startswith("midlayer.")})
    assert trace(tiny_model(), load_head(vllm)) == trace(tiny_model(), head)


def test_norm_before_residual_keeps_the_normed_hidden_as_residual(tmp_path):
    path, head = tiny_head(tmp_path / "h", norm_before_residual=True)
    lossless(path)
    # with attention and MLP outputs silenced the layer returns its residual: hidden_norm(h), not h
    loaded = load_head(path)
    loaded.set_target_embedding(tiny_model().get_input_embeddings())
    with torch.no_grad():
        loaded.midlayer.self_attn.o_proj.weight.zero_()
        loaded.midlayer.mlp.down_proj.weight.zero_()
        h = torch.randn(3, head.cfg.hidden_size)
        out = loaded(h, torch.tensor([1, 2, 3]), torch.arange(3))
        torch.testing.assert_close(out, loaded.midlayer.hidden_norm(h))
        loaded.cfg.norm_before_residual = False
        torch.testing.assert_close(loaded(h, torch.tensor([1, 2, 3]), torch.arange(3)), h)


def test_speculators_layout_maps_its_fields(tmp_path):
    src, head = tiny_head(tmp_path / "src", fc_norm=True)
    d = write_speculators(src, tmp_path / "spec")
    loaded = load_head(d)
    assert loaded.cfg.aux_layer_offset == 0 and not loaded.cfg.feed_normed and loaded.cfg.fc_norm
    assert trace(tiny_model(), loaded) == trace(tiny_model(), head)
    lossless(d)
    # its norm_output feeds the normed hidden to the next step (EAGLE-3.1), as vLLM reads it
    fed = load_head(write_speculators(src, tmp_path / "fed", norm_output=True))
    loaded.set_target_embedding(tiny_model().get_input_embeddings())
    fed.set_target_embedding(tiny_model().get_input_embeddings())
    h, tokens, pos = torch.randn(3, head.cfg.hidden_size), torch.tensor([1, 2, 3]), torch.arange(3)
    with torch.no_grad():
        torch.testing.assert_close(fed(h, tokens, pos), loaded.norm(loaded(h, tokens, pos)))
        torch.testing.assert_close(fed.logits(fed(h, tokens, pos)), loaded.logits(loaded(h, tokens, pos)))
    lossless(tmp_path / "fed")
    with pytest.raises(ModelError, match="norm_output=true feeds normed outputs back has no HF-layout"):
        save_head(fed, tmp_path / "fed_hf")
    # its norm_before_residual defaults to true when absent (vLLM's adapter)
    raw = json.loads((d / "config.json").read_text())
    del raw["norm_before_residual"]
    (d / "config.json").write_text(json.dumps(raw))
    assert load_head(d).cfg.norm_before_residual


def test_speculators_qwen3_layers_normalise_queries_and_keys(tmp_path):
    src, head = tiny_head(tmp_path / "src")
    d = _layer_type(write_speculators(src, tmp_path / "qwen3"), "qwen3")
    gen = torch.Generator().manual_seed(3)
    state = load_file(str(d / "model.safetensors"))
    for name in ("q_norm", "k_norm"):
        state[f"layers.0.self_attn.{name}.weight"] = 1 + 0.5 * torch.randn(head.cfg.head_dim, generator=gen)
    save_file(state, str(d / "model.safetensors"))
    loaded = load_head(d)
    assert loaded.cfg.qk_norm
    lossless(d)
    llama = load_head(write_speculators(src, tmp_path / "llama"))
    assert trace(tiny_model(), loaded)[0] != trace(tiny_model(), llama)[0]
    # normed per head, queries and keys no longer depend on the scale of q_proj / k_proj
    loaded.set_target_embedding(tiny_model().get_input_embeddings())
    h, tokens, pos = torch.randn(3, head.cfg.hidden_size), torch.tensor([1, 2, 3]), torch.arange(3)
    with torch.no_grad():
        before = loaded(h, tokens, pos)
        loaded.midlayer.self_attn.q_proj.weight.mul_(8.0)
        loaded.midlayer.self_attn.k_proj.weight.mul_(0.25)
        torch.testing.assert_close(loaded(h, tokens, pos), before, rtol=1e-4, atol=1e-5)
    edit(d, drop=("layers.0.self_attn.k_norm.weight",))
    with pytest.raises(ModelError, match=r"missing tensors midlayer.self_attn.k_norm.weight$"):
        load_head(d)


# --------------------------------------------------------------------------- refusals, one line each


def test_speculators_layer_ids_count_hidden_states_and_convert_back_to_sglangs(tmp_path):
    src, head = tiny_head(tmp_path / "src", aux_layer_ids=[0, 1, 2])
    d = write_speculators(src, tmp_path / "spec")
    assert json.loads((d / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    engine = lossless(d)
    assert engine.drafter.feature_layers() == (1, 2, 3)  # the outputs of layers 0, 1 and 2
    hf = save_head(load_head(d), tmp_path / "hf")
    assert json.loads((hf / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert trace(tiny_model(), load_head(hf)) == trace(tiny_model(), head)


def _spec(tmp: Path, **top: object) -> Path:
    return write_speculators(tiny_head(tmp / "src")[0], tmp / "spec", **top)


def _layer_type(d: Path, model_type: str) -> Path:
    raw = json.loads((d / "config.json").read_text())
    raw["transformer_layer_config"]["model_type"] = model_type
    (d / "config.json").write_text(json.dumps(raw))
    return d


def _shard_missing(tmp: Path) -> Path:
    d = write_sharded(tiny_head(tmp / "src")[0], tmp / "sharded")
    (d / "model-00002-of-00003.safetensors").unlink()
    return d


def _shard_misplaced(tmp: Path) -> Path:
    """The index places a tensor of shard 2 in shard 1."""
    d = write_sharded(tiny_head(tmp / "src")[0], tmp / "sharded")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(k for k, v in sorted(index["weight_map"].items()) if v == "model-00002-of-00003.safetensors")
    index["weight_map"][name] = "model-00001-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _narrow_head_without_lm_head(tmp: Path) -> Path:
    """A head of hidden size 32 with its own embeddings but no lm_head: the target's is 64 wide."""
    cfg = head_config_for(tiny_model())
    cfg.hidden_size, cfg.head_dim = 32, 8
    head = random_head(cfg)
    head.embed_tokens = torch.nn.Embedding(cfg.vocab_size, 32)
    return edit(save_head(head, tmp / "narrow"), drop=("lm_head.weight",))


def _first_layer_twice(d: Path) -> Path:
    state = load_file(str(d / "model.safetensors"))
    state["midlayer.norm_x.weight"], state["layers.0.norm_x.weight"] = torch.ones(3), torch.ones(3)
    save_file(state, str(d / "model.safetensors"))
    return d


def _tiny(tmp: Path, **config: object) -> Path:
    return edit(tiny_head(tmp / "h")[0], **config)


REFUSALS = {
    "parallel_drafting": (lambda t: _tiny(t, parallel_drafting=True),
                          r"config.json: EAGLE-3 variant flag parallel_drafting=True is not supported"),
    "attention_bias": (lambda t: _tiny(t, attention_bias=True), r"config.json: .*attention_bias=True is not supported"),
    "both_fc_norms": (lambda t: _tiny(t, fc_norm=True, norm_before_fc=True),
                      r"config.json: fc_norm and norm_before_fc are exclusive"),
    "fc_norm_without_fc": (lambda t: _tiny(t, fc_norm=True, eagle_config={"use_aux_hidden_state": False}),
                           r"config.json: fc_norm=true needs fused features, but use_aux_hidden_state=false"),
    "no_aux_wider_target": (lambda t: _tiny(t, target_hidden_size=96, eagle_config={"use_aux_hidden_state": False}),
                            r"config.json: use_aux_hidden_state=false .* needs target_hidden_size 96 == hidden_size 64"),
    "zero_layers": (lambda t: _tiny(t, num_hidden_layers=0), r"config.json: num_hidden_layers=0 must be an integer >= 1"),
    "norm_output_not_bool": (lambda t: _tiny(t, norm_output="yes"), r"config.json: norm_output='yes' must be true or false"),
    "missing_and_unexpected": (lambda t: edit(tiny_head(t / "h")[0], drop=("norm.weight",), rename={"fc.weight": "fc.kernel"}),
                               r"weights do not match config.json: missing tensors fc.weight, norm.weight; "
                               r"unexpected tensors fc.kernel$"),
    "no_lm_head_other_width": (_narrow_head_without_lm_head,
                               r"head has no lm_head and its hidden_size 32 differs from the target's 64"),
    "first_layer_twice": (lambda t: _first_layer_twice(tiny_head(t / "h")[0]),
                          r"h: tensor midlayer.norm_x.weight appears twice in the head's weights"),
    "speculators_type": (lambda t: _spec(t, speculators_model_type="mtp"), r"config.json: speculators_model_type='mtp'"),
    "speculators_layer_type": (lambda t: _layer_type(_spec(t), "mistral"),
                               r"config.json: transformer_layer_config.model_type='mistral'"),
    "shard_missing": (_shard_missing, r"index.json: names shard model-00002-of-00003.safetensors, which is not a file"),
    "shard_misplaced": (_shard_misplaced,
                        r"index.json: places tensors \S+ in model-00001-of-00003.safetensors, which does not hold them"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_or_broken_layouts_are_refused_in_one_line(tmp_path, case):
    make, pattern = REFUSALS[case]
    path = make(tmp_path)
    with pytest.raises(ModelError, match=pattern) as err:
        Engine(tiny_model(), drafter=Eagle3Drafter(path=str(path)), device="cpu")
    assert "\n" not in str(err.value)
