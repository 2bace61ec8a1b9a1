"""Named cost profiles: the cost model's constants of a machine you may not have, for replay.

``specfit replay trace.path=DIR replay.cost_profile=qwen3-30b-a3b-h200-pcie5`` charges every cycle
(and hands the cost-aware selectors, which plan with it) the constants derived below instead of
those measured where the trace was recorded: a trace recorded anywhere is replayed as if on that
machine. The time is then *modelled*, and results say so (``time: modelled``, the profile's name);
drafting is charged ``c_draft0 + c_level * levels`` (``replay.draft_time=modelled``). Explicit
``cost_model.c0=...`` values still override single constants. A trace of another model is charged
as if each of its experts, tokens and levels were the profile model's.

Derivation (the numbers are computed by :func:`derive` from the inputs listed, so the table and
the code cannot drift apart). Model: Qwen3-30B-A3B (published config: hidden 2048, 48 layers, 32
query / 4 KV heads of 128, 128 experts, top-8, expert intermediate 768, vocabulary 151,936, untied
embeddings), bf16 weights (2 bytes):

- dense weights read once per pass: attention (q 2048x4096 + k, v 2048x512 + o 4096x2048 =
  18,874,368 per layer) plus router (2048x128 = 262,144 per layer), times 48, plus the LM head
  (151,936 x 2048 = 311,164,928): 1,229,717,504 parameters = 2.459 GB;
- one expert: 3 x 2048 x 768 = 4,718,592 parameters = 9,437,184 bytes;
- per verified token: 2 FLOPs per dense weight (2.459 GFLOP) + its 8 experts in 48 layers
  (2 x 8 x 48 x 4,718,592 = 3.624 GFLOP) + attention over a 2,048-token context
  (4 x 2048 x 32 x 128 x 48 = 1.611 GFLOP) = 7.694 GFLOP;
- one EAGLE-3 draft level (a one-layer head on 2x2048 inputs, MLP 6144, draft vocabulary 32,000:
  fc 3x2048x2048 + qkv 4096x(4096+512+512) + o 4096x2048 + MLP 3x2048x6144 + head 2048x32000 =
  145,227,776 parameters = 0.290 GB), read once per level.

Machines (published peaks; efficiencies are assumptions, stated once here): H200 SXM, HBM3e
4.8 TB/s, 989 TFLOPS dense bf16; a 24 GB consumer GPU (RTX 4090), GDDR6X 1.008 TB/s, 165 TFLOPS
dense bf16 with fp32 accumulation. Memory reaches 80% of peak, small-batch GEMMs 40% of peak
FLOPs. Links: the effective pinned host-to-device rates of :mod:`specfit.types.link_profiles`
(PCIe 4.0 x16: 25 GB/s, PCIe 5.0 x16: 50 GB/s). Overheads: 2 us per kernel launch (a captured or
compiled step; eager PyTorch is several times slower), 10 kernels per layer outside the experts,
2 launches per expert, 25 per draft level plus 30 us for the host's top-k and tree update.

    c0       = dense bytes / (0.8 HBM) + 48 x 10 x 2 us
    c_tok    = 7.694 GFLOP / (0.4 peak FLOPs)
    c_hit    = expert bytes / (0.8 HBM) + 2 x 2 us
    c_miss   = c_hit + expert bytes / link
    c_level  = head bytes / (0.8 HBM) + 25 x 2 us + 30 us;   c_draft0 = c_level (catching up is one head pass)

=================================  ========  ========  ========  ========  ========
profile                            c0 ms     c_tok ms  c_hit ms  c_miss ms c_level ms
=================================  ========  ========  ========  ========  ========
qwen3-30b-a3b-h200-pcie4           1.600     0.019     0.0065    0.384     0.156
qwen3-30b-a3b-h200-pcie5           1.600     0.019     0.0065    0.195     0.156
qwen3-30b-a3b-24gb-pcie4           4.010     0.117     0.0157    0.393     0.440
gpu-like (issue 15's hand-set)     1.200     0.010     0.020     0.400     0.500
=================================  ========  ========  ========  ========  ========

Arithmetic, H200: c0 = 2.459e9 / 3.84e12 = 0.640 ms + 0.960 ms; c_tok = 7.694e9 / 395.6e12 =
0.019 ms; c_hit = 9.437e6 / 3.84e12 = 2.5 us + 4 us; c_miss = c_hit + 9.437e6 / 25e9 = 377.5 us
(PCIe 4.0) or / 50e9 = 188.7 us (PCIe 5.0); c_level = 0.290e9 / 3.84e12 = 75.6 us + 50 + 30 us.
24 GB GPU: c0 = 2.459e9 / 0.806e12 = 3.050 ms + 0.960 ms; c_tok = 7.694e9 / 66.0e12 = 0.117 ms;
c_hit = 9.437e6 / 0.806e12 = 11.7 us + 4 us; c_level = 0.290e9 / 0.806e12 = 360 us + 80 us.
``gpu-like`` is the hand-set constants issue 15's measurements used (c_draft0, not stated there,
is one level). The profiles are estimates to compare selectors on, not measurements: calibrate
on the machine itself (``specfit calibrate``) for its real constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from specfit.types.costs import CostConstants
from specfit.types.link_profiles import _PCIE4_GBPS, _PCIE5_GBPS
from specfit.errors import ConfigError

BF16 = 2
LAUNCH_S = 2e-6
MEMORY_EFFICIENCY, COMPUTE_EFFICIENCY = 0.8, 0.4
KERNELS_PER_LAYER, KERNELS_PER_EXPERT, KERNELS_PER_LEVEL, LEVEL_HOST_S = 10, 2, 25, 30e-6
CONTEXT = 2048  # tokens of context attention is charged for


@dataclass(frozen=True)
class ModelShape:
    """What the constants depend on: parameter counts (weights read, FLOPs) of target and head."""

    name: str
    layers: int
    dense_params: int  # read once per pass: attention, routers, LM head
    expert_params: int  # one expert
    active_experts: int  # per token per layer (top-k)
    attention_flops_per_token: float  # at CONTEXT tokens
    head_params: int  # one EAGLE-3 draft level reads these


@dataclass(frozen=True)
class Machine:
    name: str
    memory_gbps: float  # device memory, GB/s (1e9 bytes)
    bf16_tflops: float  # dense bf16 tensor throughput
    link_gbps: float  # effective pinned host-to-device


def _qwen3_30b_a3b() -> ModelShape:
    hidden, layers, heads, kv_heads, head_dim = 2048, 48, 32, 4, 128
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    router, lm_head = hidden * 128, 151_936 * hidden
    head = (3 * hidden * hidden + 2 * hidden * (heads * head_dim + 2 * kv_heads * head_dim)
            + heads * head_dim * hidden + 3 * hidden * 6144 + hidden * 32_000)
    return ModelShape("qwen3-30b-a3b", layers, layers * (attention + router) + lm_head, 3 * hidden * 768, 8,
                      4.0 * CONTEXT * heads * head_dim * layers, head)


QWEN3_30B_A3B = _qwen3_30b_a3b()
H200_PCIE4 = Machine("h200-pcie4", 4800.0, 989.0, _PCIE4_GBPS)
H200_PCIE5 = Machine("h200-pcie5", 4800.0, 989.0, _PCIE5_GBPS)
GPU24_PCIE4 = Machine("24gb-pcie4", 1008.0, 165.0, _PCIE4_GBPS)


def derive(model: ModelShape, machine: Machine) -> CostConstants:
    """The constants of ``model`` on ``machine`` by the formulas in the module docstring."""
    memory = MEMORY_EFFICIENCY * machine.memory_gbps * 1e9
    flops = COMPUTE_EFFICIENCY * machine.bf16_tflops * 1e12
    expert_bytes = model.expert_params * BF16
    token_flops = (2.0 * model.dense_params + 2.0 * model.active_experts * model.layers * model.expert_params
                   + model.attention_flops_per_token)
    c_hit = expert_bytes / memory + KERNELS_PER_EXPERT * LAUNCH_S
    c_level = model.head_params * BF16 / memory + KERNELS_PER_LEVEL * LAUNCH_S + LEVEL_HOST_S
    return CostConstants(
        c0=model.dense_params * BF16 / memory + model.layers * KERNELS_PER_LAYER * LAUNCH_S,
        c_tok=token_flops / flops,
        c_miss=c_hit + expert_bytes / (machine.link_gbps * 1e9),
        c_hit=c_hit,
        c_level=c_level,
        c_draft0=c_level,
        source=f"cost profile {model.name}-{machine.name} (modelled, specfit.types.cost_profiles)",
    )


@dataclass(frozen=True)
class CostProfile:
    name: str
    description: str
    constants: CostConstants


def _profiles() -> dict[str, CostProfile]:
    derived = [
        CostProfile(f"{QWEN3_30B_A3B.name}-{m.name}", description, derive(QWEN3_30B_A3B, m))
        for m, description in ((H200_PCIE4, "Qwen3-30B-A3B bf16 on an H200, experts over PCIe 4.0 x16"),
                               (H200_PCIE5, "Qwen3-30B-A3B bf16 on an H200, experts over PCIe 5.0 x16"),
                               (GPU24_PCIE4, "Qwen3-30B-A3B bf16 on a 24 GB consumer GPU, experts over PCIe 4.0 x16"))
    ]
    by_hand = CostProfile("gpu-like", "the hand-set GPU-like constants of issue 15",
                          CostConstants(c0=1.2e-3, c_tok=1e-5, c_miss=4e-4, c_hit=2e-5, c_level=5e-4, c_draft0=5e-4,
                                        source="cost profile gpu-like (modelled, hand-set)"))
    return {p.name: p for p in [*derived, by_hand]}


COST_PROFILES: dict[str, CostProfile] = _profiles()


def cost_profile(name: str, key: str = "replay.cost_profile") -> CostProfile:
    """The profile ``name``; an unknown name is a ConfigError naming ``key`` and the known ones."""
    try:
        return COST_PROFILES[name]
    except KeyError:
        raise ConfigError(f"{key}={name!r} is not a cost profile (known: {', '.join(COST_PROFILES)})") from None
