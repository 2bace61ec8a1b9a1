"""The public layouts of an EAGLE-3 head's config.json, read into (and written from) one Eagle3Config.

Two layouts are read:

- the HF layout (EAGLE-3, SpecForge, SGLang; ``LlamaForCausalLMEagle3``): a Llama config plus
  ``draft_vocab_size``, ``target_hidden_size``, ``eagle_config`` (``eagle_aux_hidden_state_layer_ids``
  counting layer outputs as SGLang does, ``use_aux_hidden_state``) and the variant flags
  ``norm_before_residual``, ``fc_norm``, ``norm_before_fc`` and ``norm_output`` (SpecForge's: false
  = no final norm before ``lm_head``);
- RedHat's ``speculators`` layout (``"speculators_model_type": "eagle3"``): the decoder layer in
  ``transformer_layer_config``, the EAGLE fields at the top level, mapped as vLLM's speculators
  adapter does (``norm_before_residual`` defaults to true there; ``eagle_aux_hidden_state_layer_ids``
  count HF hidden-state indices, as vLLM captures them; its ``norm_output`` means the normed hidden
  is fed back to the next step, EAGLE-3.1; a ``qwen3`` layer config adds ``q_norm`` / ``k_norm``),
  tensors ``layers.0.*`` for the first layer and the trainer-only ``verifier_norm`` /
  ``verifier_lm_head`` left out.

A value this head does not implement is refused in one line naming the field.
"""

from __future__ import annotations

from typing import Any

import torch

from specfit.interfaces import ModelError
from specfit.plugins.drafters.eagle3.head import Eagle3Config

# flags of EAGLE-3 variants with no implementation here (a head trained with them would draft wrongly)
UNSUPPORTED_FLAGS = ("use_aux_norm", "parallel_drafting", "attention_bias", "mlp_bias")
SPECULATORS_TRAINER_TENSORS = ("verifier_norm.weight", "verifier_lm_head.weight")


def is_speculators(raw: dict[str, Any]) -> bool:
    return "speculators_model_type" in raw


def config_from_json(raw: dict[str, Any], source: str) -> Eagle3Config:
    """The head's config from its config.json (either layout); ``source`` names the file in errors."""
    if is_speculators(raw):
        return _from_speculators(raw, source)
    return _from_hf(raw, source)


def _from_hf(raw: dict[str, Any], source: str, where: str = "") -> Eagle3Config:
    """The HF layout; ``where`` prefixes field names (``transformer_layer_config.``) in errors."""
    for flag in UNSUPPORTED_FLAGS:
        if raw.get(flag):
            raise ModelError(f"{source}: EAGLE-3 variant flag {where}{flag}={raw[flag]!r} is not supported")
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in raw]
    if missing:
        raise ModelError(f"{source}: missing {', '.join(where + k for k in missing)}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{source}: {where}hidden_act={raw['hidden_act']!r}; the EAGLE-3 head implements silu only")
    layers = raw.get("num_hidden_layers", 1)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ModelError(f"{source}: {where}num_hidden_layers={layers!r} must be an integer >= 1")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ModelError(f"{source}: eagle_config must be an object, not {type(eagle).__name__}")
    aux = raw.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
    if aux is not None and (not isinstance(aux, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux)):
        raise ModelError(f"{source}: eagle_aux_hidden_state_layer_ids={aux!r} must be a list of layer numbers")
    use_aux = eagle.get("use_aux_hidden_state", raw.get("use_aux_hidden_state", True))
    norm_before_fc = eagle.get("norm_before_fc", raw.get("norm_before_fc", False))
    flags = {"use_aux_hidden_state": use_aux, "norm_before_fc": norm_before_fc}
    flags.update({k: raw.get(k, d) for k, d in (("fc_norm", False), ("norm_before_residual", False),
                                                ("norm_output", True))})
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ModelError(f"{source}: {name}={value!r} must be true or false")
    target_hidden = int(raw.get("target_hidden_size") or hidden)
    if not use_aux:
        for name in ("fc_norm", "norm_before_fc"):
            if flags[name]:
                raise ModelError(f"{source}: {name}=true needs fused features, but use_aux_hidden_state=false")
        if target_hidden != hidden:
            raise ModelError(f"{source}: use_aux_hidden_state=false (the head reads the target's last hidden state "
                             f"without fc) needs target_hidden_size {target_hidden} == hidden_size {hidden}")
    if flags["fc_norm"] and flags["norm_before_fc"]:
        raise ModelError(f"{source}: fc_norm and norm_before_fc are exclusive (one norm per feature, or one over all)")
    window = raw.get("attention_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ModelError(f"{source}: {where}attention_window={window!r} must be a number of positions >= 1 (or absent)")
    rope = raw.get("rope_parameters")
    if not rope:
        rope = dict(raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = float(raw.get("rope_theta", 10000.0))
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),  # honour head_dim (Qwen3 heads set it)
        vocab_size=int(raw["vocab_size"]),
        draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
        target_hidden_size=target_hidden,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        rope_parameters=rope,
        hidden_act=str(raw.get("hidden_act", "silu")),
        fc_bias=bool(raw.get("bias", False)),
        aux_layer_ids=list(aux) if aux and use_aux else None,
        num_hidden_layers=layers,
        use_aux_hidden_state=use_aux,
        fc_norm=flags["fc_norm"],
        norm_before_fc=norm_before_fc,
        norm_before_residual=flags["norm_before_residual"],
        norm_output=flags["norm_output"],
        attention_window=window,
    )


def _from_speculators(raw: dict[str, Any], source: str) -> Eagle3Config:
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        raise ModelError(f"{source}: speculators_model_type={kind!r}; specfit reads eagle3 speculators only")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ModelError(f"{source}: transformer_layer_config must be an object (the draft decoder layer's config)")
    model_type = layer.get("model_type", "llama")
    if model_type not in ("llama", "qwen3"):
        raise ModelError(f"{source}: transformer_layer_config.model_type={model_type!r}; the EAGLE-3 head implements "
                         "llama and qwen3 decoder layers only")
    norm_output = raw.get("norm_output", False)
    if not isinstance(norm_output, bool):
        raise ModelError(f"{source}: norm_output={norm_output!r} must be true or false")
    flat = {k: v for k, v in layer.items() if k not in ("eagle_config", "norm_output", "use_aux_hidden_state")}
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "fc_norm",
                "norm_before_fc", "attention_window"):
        if raw.get(key) is not None:
            flat[key] = raw[key]
    flat["norm_before_residual"] = raw.get("norm_before_residual", True)  # vLLM's default for this layout
    cfg = _from_hf(flat, source, where="transformer_layer_config.")
    cfg.aux_layer_offset = 0  # speculators / vLLM ids are HF hidden-state indices
    cfg.feed_normed = norm_output
    cfg.qk_norm = model_type == "qwen3"  # Qwen3 layers: q_norm / k_norm
    return cfg


def tensor_names(state: dict[str, torch.Tensor], raw: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the head's own names (``midlayer.*`` for the first layer);
    ``where`` (the head's directory) names errors."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        if is_speculators(raw) and name in SPECULATORS_TRAINER_TENSORS:
            continue  # the verifier's norm and lm_head, kept by the trainer for its loss only
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        if name in out:
            raise ModelError(f"{where}: tensor {name} appears twice in the head's weights (as midlayer.* and layers.0.*, "
                             "or with and without the model. prefix)")
        out[name] = tensor
    return out


def config_to_hf(cfg: Eagle3Config) -> dict[str, Any]:
    """config.json in the HF layout (loadable by SGLang / vLLM as LlamaForCausalLMEagle3).

    A head read from the speculators layout that feeds normed outputs back (its ``norm_output``)
    has no HF-layout equivalent (SpecForge's ``norm_output`` means something else) and is refused."""
    if cfg.feed_normed:
        raise ModelError("a head whose speculators norm_output=true feeds normed outputs back has no HF-layout "
                         "config (SpecForge's norm_output means another thing); keep it in the speculators layout")
    if cfg.qk_norm:
        raise ModelError("a head of qwen3 decoder layers (q_norm / k_norm) has no HF-layout (LlamaForCausalLMEagle3) "
                         "config; keep it in the speculators layout")
    aux = cfg.aux_layer_ids
    if aux and cfg.aux_layer_offset != 1:
        aux = [i + cfg.aux_layer_offset - 1 for i in aux]  # to SGLang's count of layer outputs
        if min(aux) < 0:
            raise ModelError(f"eagle_aux_hidden_state_layer_ids {cfg.aux_layer_ids} include the embeddings, which the "
                             "HF layout (layer outputs) cannot name")
    rope = dict(cfg.rope_parameters)
    eagle: dict[str, Any] = {}
    if aux:
        eagle["eagle_aux_hidden_state_layer_ids"] = aux
    if not cfg.use_aux_hidden_state:
        eagle["use_aux_hidden_state"] = False
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": cfg.num_hidden_layers,
        "tie_word_embeddings": False,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": cfg.hidden_act,
        "bias": cfg.fc_bias,
    }
    for name, default in (("norm_before_residual", False), ("fc_norm", False), ("norm_before_fc", False),
                          ("norm_output", True)):
        if getattr(cfg, name) != default:
            config[name] = getattr(cfg, name)
    if cfg.attention_window is not None:  # specfit's own key (other loaders ignore it): the training window
        config["attention_window"] = cfg.attention_window
    if eagle:
        config["eagle_config"] = eagle
    return config
