"""Named host-to-device link profiles for the emulated copy engine.

A profile pairs a reference model's expert size with a link's effective bandwidth and per-launch
latency, so CPU runs (where "host" and "device" are the same RAM and copies cost nothing real)
pay the H2D time a GPU deployment of that reference model would pay.

Expert sizes come from the published Hugging Face configs; every MoE expert here is a SwiGLU MLP
with three projection matrices (gate and up [I, H], down [H, I]) stored in bf16 (2 bytes):
``expert_bytes = 3 * I * H * 2``.

Link numbers are *effective* pinned-host-to-device rates for large (MB-sized) transfers, not the
raw signalling rates:

- PCIe 3.0 x16: 8 GT/s * 16 lanes * 128/130 encoding = 15.75 GB/s raw per direction; measured
  ``cudaMemcpy`` H2D from pinned memory tops out around 12-13 GB/s -> 12 GB/s.
- PCIe 4.0 x16: 31.5 GB/s raw; measured pinned H2D is typically 24-26 GB/s (A100 PCIe/SXM hosts,
  ``bandwidthTest``) -> 25 GB/s.
- PCIe 5.0 x16: 63 GB/s raw; measured pinned H2D on H100/H200 hosts is about 50-55 GB/s -> 50 GB/s.

Latency: one batched transfer launch (``cudaMemcpyAsync`` or a copy-kernel launch, plus DMA
set-up and PCIe round trip) costs on the order of 5-10 us before the first byte lands; we charge
10 us per call (the conservative end), independent of the PCIe generation, because it is dominated
by driver/launch overhead rather than the link.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

BF16_BYTES = 2


def swiglu_expert_bytes(hidden: int, intermediate: int, elem_bytes: int = BF16_BYTES) -> int:
    """Bytes of one SwiGLU expert: gate_up_proj [2I, H] plus down_proj [H, I]."""
    return 3 * intermediate * hidden * elem_bytes


@dataclass(frozen=True)
class LinkProfile:
    """A reference model's expert size over a reference link (plain data, JSON-able via asdict)."""

    name: str
    bandwidth_gbps: float  # effective GB/s (1e9 bytes/s)
    latency_us: float  # per transfer launch (one call of a copy engine)
    ref_expert_bytes: int  # bytes of one expert of the reference model
    description: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


# Published config shapes (hidden_size, moe/expert intermediate_size).
_QWEN3_30B_A3B = swiglu_expert_bytes(2048, 768)  # 9,437,184 B  (Qwen/Qwen3-30B-A3B)
_OLMOE_1B_7B = swiglu_expert_bytes(2048, 1024)  # 12,582,912 B (allenai/OLMoE-1B-7B-0924)
_MIXTRAL_8X7B = swiglu_expert_bytes(4096, 14336)  # 352,321,536 B (mistralai/Mixtral-8x7B-v0.1)

_PCIE3_GBPS, _PCIE4_GBPS, _PCIE5_GBPS = 12.0, 25.0, 50.0
_LAUNCH_US = 10.0

PROFILES: dict[str, LinkProfile] = {
    p.name: p
    for p in (
        LinkProfile("qwen3-30b-a3b-pcie4", _PCIE4_GBPS, _LAUNCH_US, _QWEN3_30B_A3B,
                    "Qwen3-30B-A3B bf16 expert (H=2048, I=768) over PCIe 4.0 x16"),
        LinkProfile("qwen3-30b-a3b-pcie5", _PCIE5_GBPS, _LAUNCH_US, _QWEN3_30B_A3B,
                    "Qwen3-30B-A3B bf16 expert (H=2048, I=768) over PCIe 5.0 x16"),
        LinkProfile("qwen3-30b-a3b-pcie3", _PCIE3_GBPS, _LAUNCH_US, _QWEN3_30B_A3B,
                    "Qwen3-30B-A3B bf16 expert (H=2048, I=768) over PCIe 3.0 x16"),
        LinkProfile("olmoe-1b-7b-pcie4", _PCIE4_GBPS, _LAUNCH_US, _OLMOE_1B_7B,
                    "OLMoE-1B-7B bf16 expert (H=2048, I=1024) over PCIe 4.0 x16"),
        LinkProfile("mixtral-8x7b-pcie4", _PCIE4_GBPS, _LAUNCH_US, _MIXTRAL_8X7B,
                    "Mixtral-8x7B bf16 expert (H=4096, I=14336) over PCIe 4.0 x16"),
    )
}

DEFAULT_PROFILE = "qwen3-30b-a3b-pcie4"


class UnknownLinkProfileError(ValueError):
    """Raised for a profile name not in PROFILES (a ValueError, so its message prints unquoted)."""


def get_profile(name: str) -> LinkProfile:
    """Look a profile up by name; an unknown name is an error that lists the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise UnknownLinkProfileError(
            f"unknown link profile {name!r} (cache.link.profile); known profiles: {known}"
        ) from None


COPY_KINDS = ("triton", "torch", "emulated")


MIN_LINK_GBPS = 1e-3


MAX_LINK_LATENCY_US = 1e6


@dataclass
class LinkSettings:
    """Emulated-link settings (``cache.link``): a named profile, with explicit values overriding it.

    ``bandwidth_gbps`` is in GB/s (1e9 bytes/s), ``latency_us`` in microseconds per call (one
    batched transfer launch), ``ref_expert_bytes`` the reference model's expert size; when it
    resolves to None the real expert bytes are charged.
    """

    profile: str | None = DEFAULT_PROFILE
    bandwidth_gbps: float | None = None
    latency_us: float | None = None
    ref_expert_bytes: int | None = None

    def resolve(self) -> tuple[float, float, int | None]:
        """Return ``(bandwidth_gbps, latency_us, ref_expert_bytes)`` after applying the profile."""
        prof = get_profile(self.profile) if self.profile else None
        bw = self.bandwidth_gbps if self.bandwidth_gbps is not None else (prof.bandwidth_gbps if prof else None)
        lat = self.latency_us if self.latency_us is not None else (prof.latency_us if prof else 0.0)
        ref = self.ref_expert_bytes if self.ref_expert_bytes is not None else (prof.ref_expert_bytes if prof else None)
        if bw is None:
            raise ValueError("cache.link.bandwidth_gbps is required when cache.link.profile is null")
        if not 0 < bw < math.inf:
            raise ValueError(f"cache.link.bandwidth_gbps must be a finite number > 0, got {bw}")
        if bw < MIN_LINK_GBPS:  # the emulated link waits in wall-clock time: a run would seem to hang
            raise ValueError(f"cache.link.bandwidth_gbps={bw:g} is below {MIN_LINK_GBPS} GB/s (1 MB/s): one expert "
                             "copy would take seconds to hours, waited in wall-clock time")
        if not 0 <= lat < math.inf:
            raise ValueError(f"cache.link.latency_us must be a finite number >= 0, got {lat}")
        if lat > MAX_LINK_LATENCY_US:
            raise ValueError(f"cache.link.latency_us={lat:g} is above {MAX_LINK_LATENCY_US:g} (1 s) per copy, waited in "
                             "wall-clock time")
        if ref is not None and ref <= 0:
            raise ValueError(f"cache.link.ref_expert_bytes must be > 0 (or null), got {ref}")
        return float(bw), float(lat), (int(ref) if ref is not None else None)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LinkSettings:
        """Build from a config mapping (e.g. a Hydra ``cache.link`` node); unknown keys are errors."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown cache.link key(s) {unknown}; valid keys: {sorted(known)}")
        return cls(**dict(data))
