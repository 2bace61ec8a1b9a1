"""The arguments of ``Engine(...)`` and ``Engine.generate(...)`` that are plain values, each checked
with one line naming it before the engine changes the model."""

from __future__ import annotations

from typing import Any

from specfit.decode.sampling import SamplingParams
from specfit.errors import ConfigError, ModelError
from specfit.types.link_profiles import COPY_KINDS, LinkSettings
from specfit.validation import integer


def check_engine_args(model: Any, max_new_tokens: Any, sampling: Any) -> None:
    """The arguments of ``Engine(...)`` and ``Engine.generate(...)`` that are plain values."""
    from torch import nn

    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise ModelError(f"Engine needs a transformers MoE model (an nn.Module with a config), "
                         f"got {type(model).__name__}")
    integer("max_new_tokens", max_new_tokens, minimum=1)
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise ConfigError(f"sampling must be a specfit.decode.sampling.SamplingParams, got {type(sampling).__name__}")


def check_plain_engine_args(device: Any, copy: Any, link: Any, tokenizer: Any, ignore_eos: Any) -> None:
    """``Engine(device=, copy=, link=, tokenizer=, ignore_eos=)``: what each must be, named, before the
    engine changes the model (``device`` already a torch.device)."""
    from collections.abc import Mapping

    from specfit.offload.copy.base import CopyEngine

    if device.type not in ("cpu", "cuda"):  # the copy engines and expert kernels are written for these two
        raise ConfigError(f"device={str(device)!r}: an Engine runs on cpu or cuda devices")
    if not isinstance(copy, (str, CopyEngine)):
        raise ConfigError(f"copy={copy!r:.60} must be one of {', '.join(COPY_KINDS)} or a copy engine "
                          "(specfit.offload.copy)")
    if link is not None and not isinstance(link, (LinkSettings, Mapping)):
        raise ConfigError(f"link={link!r:.60} must be a LinkSettings or a mapping of its fields "
                          "(e.g. {'profile': 'qwen3-30b-a3b-pcie5'})")
    if tokenizer is not None and not (callable(tokenizer) and callable(getattr(tokenizer, "decode", None))):
        raise ConfigError(f"tokenizer={tokenizer!r:.60} must be a tokenizer object (e.g. AutoTokenizer.from_pretrained"
                          "(...)), not a name")
    if not isinstance(ignore_eos, bool):
        raise ConfigError(f"ignore_eos={ignore_eos!r:.60} must be True or False")
