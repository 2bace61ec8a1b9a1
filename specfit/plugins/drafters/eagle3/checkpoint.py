"""Reading and writing EAGLE-3 heads: config.json (see layouts.py) plus weights in one safetensors or
.bin file, or in shards named by a ``*.index.json``; tensors are matched strictly against the config."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specfit.interfaces import ModelError, missing_directory, read_json_object
from specfit.plugins.drafters.eagle3.head import Eagle3Config, Eagle3Head
from specfit.plugins.drafters.eagle3.layouts import config_from_json, config_to_hf, is_speculators, tensor_names

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
LISTED = 12  # tensor names an error lists before counting the rest


def head_config_for(target: nn.Module) -> Eagle3Config:
    """A head shaped for ``target``: same hidden size, heads and vocabulary (no reduced vocabulary)."""
    c = target.config
    hidden = c.hidden_size
    heads = c.num_attention_heads
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=getattr(c, "intermediate_size", 4 * hidden) or 4 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", heads) or heads,
        head_dim=getattr(c, "head_dim", None) or hidden // heads,
        vocab_size=c.vocab_size,
        draft_vocab_size=c.vocab_size,
        target_hidden_size=hidden,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(c, "max_position_embeddings", 4096),
        rope_parameters=rope,
    )


def random_head(cfg: Eagle3Config, seed: int = 0, std: float = 0.02) -> Eagle3Head:
    """A seeded, randomly initialised head (for tests and as a training start)."""
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return head


def save_head(head: Eagle3Head, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``head`` in the HF layout (``midlayer.*``, further layers ``layers.<i>.*``); the target's
    shared embedding or lm_head, which the head does not own, is not written. An acceptance probe
    in ``path`` is removed: it describes the weights being replaced."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(head.cfg)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    save_file(state, str(path / "model.safetensors"))
    from specfit.plugins.drafters.eagle3.probe import PROBE_FILE

    (path / PROBE_FILE).unlink(missing_ok=True)  # fit on the weights these replace: refit with specfit fit-probe
    config["torch_dtype"] = str(dtype or next(head.parameters()).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def load_head(path: str | Path, key: str = "drafter.path") -> Eagle3Head:
    """Load a head directory; every problem is reported with the file, field or tensor it concerns,
    or with the setting ``key`` that named the directory (kept as ``head.key`` for later checks)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelError(f"{key}={path}: {missing_directory(path)} (an EAGLE-3 head is a directory: config.json and weights)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{key}={path}: no config.json")
    raw = read_json_object(config_file, str(config_file), ModelError)
    try:
        cfg = config_from_json(raw, str(config_file))
    except (TypeError, ValueError, AttributeError) as exc:  # a value of the wrong type, e.g. "hidden_size": "big"
        raise ModelError(f"{config_file}: not an EAGLE-3 head config ({type(exc).__name__}: {exc})") from exc
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "vocab_size", "draft_vocab_size", "target_hidden_size"):
        if getattr(cfg, name) < 1:
            raise ModelError(f"{config_file}: {name}={getattr(cfg, name)} must be >= 1")
    # 0 or below: NaN drafts, blamed on the drafter mid-decode
    for name, value in (("rms_norm_eps", cfg.rms_norm_eps), ("rope_theta", cfg.rope_parameters.get("rope_theta", 1.0))):
        if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ModelError(f"{config_file}: {name}={value!r} must be a finite number > 0")
    state = tensor_names(_read_state(path, key), raw, str(path))
    try:
        head = Eagle3Head(cfg)
    except (KeyError, ValueError, TypeError) as exc:  # transformers' rotary embedding refused rope_scaling
        raise ModelError(f"{config_file}: rope_scaling / rope_parameters {dict(cfg.rope_parameters)} are not a rotary "
                         f"embedding transformers builds ({type(exc).__name__}: {exc})") from None
    if "embed_tokens.weight" in state:
        head.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    if "lm_head.weight" not in state:
        head.lm_head = None  # the target's rows of the draft vocabulary, given at bind
    if not cfg.use_aux_hidden_state:  # as vLLM: an fc the config says is unused is not loaded
        state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    expected = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    optional = {"t2d"} | ({"d2t"} if cfg.draft_vocab_size == cfg.vocab_size else set())
    if not cfg.norm_output and not cfg.feed_normed:
        optional.add("norm.weight")  # SpecForge's norm_output=false: the final norm is never applied
    try:
        _check_names(path, config_file, set(expected), set(state), optional)
    except ModelError:
        architectures = raw.get("architectures") or []
        # a whole model: no fc, which every EAGLE-3 head that fuses features has (a head named LlamaForCausalLM too)
        whole_model = "fc.weight" not in state and cfg.use_aux_hidden_state
        if whole_model and architectures and not any("eagle" in str(a).lower() for a in architectures) \
                and not is_speculators(raw):
            raise ModelError(f"{key}={path}: a {', '.join(map(str, architectures))} checkpoint, not an EAGLE-3 "
                             "head: name a head's directory (the weights of LlamaForCausalLMEagle3 or a speculators "
                             "eagle3 model)") from None
        raise
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected[name].shape)}")
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    head.to(dtype)
    state = {**{k: expected[k] for k in optional - set(state)}, **state}
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    if "t2d" in state:
        state["t2d"] = state["t2d"].bool()
    head.load_state_dict(state, strict=True)
    head.source, head.key = str(path), key  # named by errors about how the head fits its target
    return head.eval()


def _check_names(path: Path, config_file: Path, expected: set[str], found: set[str], optional: set[str]) -> None:
    """Missing and unexpected tensors, all in one line (a missing tensor is never left random)."""
    missing, unexpected = sorted(expected - found - optional), sorted(found - expected)
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"missing tensors {_listed(missing)}")
    if unexpected:
        parts.append(f"unexpected tensors {_listed(unexpected)}")
    raise ModelError(f"{path}: weights do not match {config_file.name}: {'; '.join(parts)}")


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:LISTED])
    return shown + (f" (and {len(names) - LISTED} more)" if len(names) > LISTED else "")


def check_head_fits(head: Eagle3Head, target_config: object) -> None:
    """A head trained for another model fails here, naming the head and the mismatch, not mid-draft."""
    cfg, tc = head.cfg, target_config
    key = getattr(head, "key", "drafter.path")  # model.draft_head where the head came from the model's config
    where = f"{key}={head.source}" if getattr(head, "source", None) else "the EAGLE-3 head"
    if cfg.vocab_size != tc.vocab_size:
        raise ModelError(f"{where}: head vocab_size {cfg.vocab_size} differs from the target's {tc.vocab_size}")
    if cfg.target_hidden_size != tc.hidden_size:
        raise ModelError(f"{where}: head expects target hidden size {cfg.target_hidden_size}, "
                         f"the target has {tc.hidden_size}")
    if head.embed_tokens is None and cfg.hidden_size != tc.hidden_size:
        raise ModelError(f"{where}: head has no embed_tokens and its hidden_size {cfg.hidden_size} differs from the "
                         f"target's {tc.hidden_size}, whose embeddings it would use")
    if head.lm_head is None and cfg.hidden_size != tc.hidden_size:
        raise ModelError(f"{where}: head has no lm_head and its hidden_size {cfg.hidden_size} differs from the "
                         f"target's {tc.hidden_size}, whose lm_head it would use")
    layers = getattr(tc, "num_hidden_layers", None)
    if cfg.aux_layer_ids and layers is not None and not all(0 <= i < layers for i in cfg.aux_layer_ids):
        raise ModelError(f"{where}: head eagle_aux_hidden_state_layer_ids {cfg.aux_layer_ids} do not fit the "
                         f"target's {layers} layers")
    if cfg.draft_vocab_size > tc.vocab_size:
        raise ModelError(f"{where}: head draft_vocab_size {cfg.draft_vocab_size} exceeds the target's vocabulary "
                         f"({tc.vocab_size})")
    target_ids = torch.arange(cfg.draft_vocab_size, device=head.d2t.device) + head.d2t
    if target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= tc.vocab_size):
        raise ModelError(f"{where}: head d2t maps draft tokens outside the target's vocabulary (0..{tc.vocab_size - 1})")


def _read_state(path: Path, key: str) -> dict[str, torch.Tensor]:
    """Every tensor of the head: one weight file, else the shards its index names."""
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return _read_file(path / name, path, key)
    for name in INDEX_FILES:
        if (path / name).is_file():
            return _read_shards(path / name, path, key)
    raise ModelError(f"{key}={path}: no weights ({' or '.join(WEIGHT_FILES)}) and no {INDEX_FILES[0]}")


def _read_shards(index: Path, path: Path, key: str) -> dict[str, torch.Tensor]:
    """The shards an index names; a tensor the index places in a shard that lacks it is an error."""
    weight_map = read_json_object(index, str(index), ModelError).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelError(f"{index}: no weight_map (tensor name -> shard file)")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        file = path / shard
        if Path(shard).name != shard or not file.is_file():
            raise ModelError(f"{index}: names shard {shard}, which is not a file in {path}")
        tensors = _read_file(file, path, key)
        listed = sorted(k for k, v in weight_map.items() if v == shard and k not in tensors)
        if listed:
            raise ModelError(f"{index}: places tensors {_listed(listed)} in {shard}, which does not hold them")
        state.update(tensors)
    return state


def _read_file(file: Path, path: Path, key: str) -> dict[str, torch.Tensor]:
    from specfit.interfaces import check_safetensors

    safetensors = file.name.endswith(".safetensors")
    if safetensors:
        check_safetensors(file, f"{key}={path}")  # truncated or not safetensors: a clear line
    try:
        if safetensors:
            from safetensors.torch import load_file

            return load_file(str(file))
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - corrupt or truncated files raise many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelError(f"{file}: cannot read weights ({type(exc).__name__}: {first})") from exc
