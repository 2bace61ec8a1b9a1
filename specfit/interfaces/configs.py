"""The base config of each plug-in kind: a plug-in's ``Config`` dataclass subclasses one of these.

They live here, beside the contracts, so a plug-in package imports everything from
:mod:`specfit.interfaces`; :mod:`specfit.config` builds the main schema from them.

Every field of a plug-in's ``Config`` reaches the plug-in: the registry passes each one to its
constructor (or hands the whole config to its ``from_config``) and refuses a plug-in whose
constructor does not take them all. The exceptions are listed in :data:`CONSUMED_ELSEWHERE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from specfit.types.link_profiles import COPY_KINDS  # cache.copy: the engines it builds
from specfit.types.link_profiles import DEFAULT_PROFILE
from specfit.errors import ConfigError
from specfit.validation import optional_integer


@dataclass
class PluginConfig:
    """Every plugin config names its plugin; the registry, not ``_target_``, resolves it."""

    name: str = MISSING


@dataclass
class DrafterConfig(PluginConfig):
    pass


@dataclass
class SelectorConfig(PluginConfig):
    pass


@dataclass
class CostModelConfig(PluginConfig):
    pass


@dataclass
class PredictorConfig(PluginConfig):
    pass


@dataclass
class AcceptanceConfig(PluginConfig):
    pass


@dataclass
class PrefetcherConfig(PluginConfig):
    pass


@dataclass
class LinkConfig:
    """Emulated host-to-device link (``cache.copy=emulated``): explicit values override the profile."""

    profile: str | None = DEFAULT_PROFILE
    bandwidth_gbps: float | None = None
    latency_us: float | None = None
    ref_expert_bytes: int | None = None


@dataclass
class CacheConfig(PluginConfig):
    """Expert cache: a residency policy plus the slots and copy engine it runs on.

    ``copy`` and ``link`` configure the copy engine under the policy, not the policy: ``specfit.build``
    consumes them and the registry does not pass them to the cache's constructor.
    """

    # device slots per MoE layer (experts); more than the layer has is clamped to all of them (a full
    # cache), as one capacity can then be swept over models with different expert counts
    capacity: int | None = None
    capacity_bytes: int | None = None  # alternative: device bytes for all layers' slots
    copy: str = "torch"  # triton | torch | emulated (read by specfit.build: the copy engine)
    link: LinkConfig = field(default_factory=LinkConfig)  # read by specfit.build: the emulated link

    def __post_init__(self) -> None:
        """Runs when the registry builds the cache (OmegaConf.to_object): values the schema cannot check."""
        optional_integer("cache.capacity", self.capacity, minimum=1)
        optional_integer("cache.capacity_bytes", self.capacity_bytes, minimum=1)
        if self.copy not in COPY_KINDS:
            raise ConfigError(f"unknown copy engine cache.copy={self.copy!r}; valid values: {', '.join(COPY_KINDS)}")
        if self.capacity is not None and self.capacity_bytes is not None:
            raise ConfigError("set cache.capacity or cache.capacity_bytes, not both")
        if self.copy == "emulated":  # the link's settings only matter to the emulated engine
            from dataclasses import asdict

            from specfit.types.link_profiles import LinkSettings

            link = self.link if isinstance(self.link, LinkConfig) else LinkConfig(**dict(self.link))
            try:
                LinkSettings(**asdict(link)).resolve()
            except (KeyError, ValueError) as exc:  # an unknown profile, a bandwidth <= 0
                raise ConfigError(" ".join(str(exc).strip("'\"").split())) from None


PLUGIN_BASES: dict[str, type[PluginConfig]] = {
    "drafter": DrafterConfig,
    "selector": SelectorConfig,
    "cost_model": CostModelConfig,
    "cache": CacheConfig,
    "predictor": PredictorConfig,
    "acceptance": AcceptanceConfig,
    "prefetch": PrefetcherConfig,
}

# Config fields of a kind that something other than the plug-in reads (so the registry does not pass
# them to its constructor), and who: no key is silently ignored.
CONSUMED_ELSEWHERE: dict[str, dict[str, str]] = {
    "drafter": {},
    "selector": {},
    "cost_model": {},
    "cache": {"copy": "specfit.build (the copy engine)", "link": "specfit.build (the emulated link)"},
    "predictor": {},
    "acceptance": {},
    "prefetch": {},
}
