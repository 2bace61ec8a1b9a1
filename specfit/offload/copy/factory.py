"""Building the copy engine that ``cache.copy`` names; the one place that knows every engine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from specfit.offload.copy.base import CopyEngine
from specfit.offload.copy.emulated import EmulatedLinkEngine
from specfit.offload.copy.torch import TorchCopyEngine
from specfit.offload.copy.triton import TritonCopyEngine
from specfit.types.link_profiles import COPY_KINDS, LinkSettings


def make_copy_engine(
    kind: str,
    device: torch.device | str | None = None,
    link: LinkSettings | Mapping[str, Any] | None = None,
) -> CopyEngine:
    """Build the engine named by ``cache.copy`` (``triton``, ``torch`` or ``emulated``).

    ``link`` (``cache.link``) only applies to ``emulated``; it may be a :class:`LinkSettings` or a
    plain mapping of its fields. Settings that cannot work (an unknown engine or link profile, a
    zero bandwidth, Triton without a GPU or its interpreter) raise a ConfigError naming the key.
    """
    from specfit.errors import ConfigError

    try:
        if kind == "torch":
            return TorchCopyEngine(device)
        if kind == "triton":
            return TritonCopyEngine(device)
        if kind == "emulated":
            if link is not None and not isinstance(link, LinkSettings):
                link = LinkSettings.from_mapping(link)
            return EmulatedLinkEngine(TorchCopyEngine(device), link)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(str(exc).splitlines()[0]) from exc
    raise ConfigError(f"unknown copy engine cache.copy={kind!r}; valid values: {', '.join(COPY_KINDS)}")
