"""Reading and writing EAGLE-3 heads in the public layout (config.json + safetensors or .bin)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specfit.errors import ModelError
from specfit.files import read_json_object
from specfit.plugins.drafters.eagle3.head import Eagle3Config, Eagle3Head

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


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
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    save_file(state, str(path / "model.safetensors"))
    config = head.cfg.to_hf()
    config["torch_dtype"] = str(dtype or next(head.parameters()).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def load_head(path: str | Path) -> Eagle3Head:
    """Load a head directory; every problem is reported with the file and tensor it concerns."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelError(f"drafter.path={path}: no such directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"drafter.path={path}: no config.json")
    raw = read_json_object(config_file, str(config_file), ModelError)
    try:
        cfg = Eagle3Config.from_hf(raw, str(config_file))
    except (TypeError, ValueError, AttributeError) as exc:  # a value of the wrong type, e.g. "hidden_size": "big"
        raise ModelError(f"{config_file}: not an EAGLE-3 head config ({type(exc).__name__}: {exc})") from exc
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "draft_vocab_size", "target_hidden_size"):
        if getattr(cfg, key) < 1:
            raise ModelError(f"{config_file}: {key}={getattr(cfg, key)} must be >= 1")
    state = _read_state(path)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    head = Eagle3Head(cfg)
    if "embed_tokens.weight" in state:
        head.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    expected = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    optional = {"t2d"} | ({"d2t"} if cfg.draft_vocab_size == cfg.vocab_size else set())
    missing = sorted(set(expected) - set(state) - optional)
    if missing:
        raise ModelError(f"{path}: missing tensors {', '.join(missing)}")
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise ModelError(f"{path}: unexpected tensors {', '.join(unknown[:6])} (not an EAGLE-3 head?)")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies {tuple(expected[name].shape)}")
    dtype = state["fc.weight"].dtype
    head.to(dtype)
    head.load_state_dict(state, strict=False)
    if "d2t" in state:
        head.d2t.copy_(state["d2t"].long())
    head.source = str(path)  # named by errors about how the head fits its target
    return head.eval()


def check_head_fits(head: Eagle3Head, target_config: object) -> None:
    """A head trained for another model fails here, naming the head and the mismatch, not mid-draft."""
    cfg, tc = head.cfg, target_config
    where = f"drafter.path={head.source}" if getattr(head, "source", None) else "the EAGLE-3 head"
    if cfg.vocab_size != tc.vocab_size:
        raise ModelError(f"{where}: head vocab_size {cfg.vocab_size} differs from the target's {tc.vocab_size}")
    if cfg.target_hidden_size != tc.hidden_size:
        raise ModelError(f"{where}: head expects target hidden size {cfg.target_hidden_size}, "
                         f"the target has {tc.hidden_size}")
    if head.embed_tokens is None and cfg.hidden_size != tc.hidden_size:
        raise ModelError(f"{where}: head has no embed_tokens and its hidden_size {cfg.hidden_size} differs from the "
                         f"target's {tc.hidden_size}, whose embeddings it would use")
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


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    from specfit.core.loading import check_safetensors

    for name in WEIGHT_FILES:
        file = path / name
        if not file.is_file():
            continue
        if name.endswith(".safetensors"):
            check_safetensors(file, f"drafter.path={path}")  # truncated or not safetensors: a clear line
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - corrupt or truncated files raise many types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ModelError(f"{file}: cannot read weights ({type(exc).__name__}: {first})") from exc
    raise ModelError(f"drafter.path={path}: no weights ({' or '.join(WEIGHT_FILES)})")
