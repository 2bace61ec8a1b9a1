"""Hidden-state look-ahead (mixtral-offloading, "Speculating Experts"): routers applied early.

Two predictors, both live (they read the pass's hidden states; a trace replay has none):

- ``own`` (the default): when decoder layer l starts (before attention), apply layer l's own
  ``post_attention_layernorm`` and router to its input; the copies overlap layer l's attention;
- ``next``: when MoE layer l has issued its own copies (the runtime's layer listener, with the
  experts' input, already normalised), apply layer l+1's router to it; the copies queue behind
  layer l's on the FIFO link and overlap layer l's expert compute and layer l+1's attention;
- ``both``: ``next`` early, then ``own`` adds what it still misses.

Measured on the demo pair (AR, ``cache=lru cache.capacity=8 cache.copy=emulated``, 4 held-out
prompts x 32 tokens x 2, interleaved, a shared 2-core machine): no prefetch 1105 demand misses,
8.9 ms stall and 3.4 ms link time per token; ``next`` 730 misses (632 of 978 prefetches used),
7.4 ms stall, 5.3 ms link; ``own`` 268 misses (1021 of 1222 used), 4.9 ms stall, 4.6 ms link;
``both`` 314 misses (1181 of 1591 used), 4.6 ms stall, 5.9 ms link and the most hook time. ``own``
removes three quarters of the demand misses with the fewest wasted copies, hence the default.
(``next`` then asked before the layer's own copies, which it delayed; it now asks after them.
Re-measured so, ``specfit bench`` on prose and GSM, 4 prompts x 2 x 48 tokens, one run: ``both``
cuts the stall further than ``own``, 1.26 -> 0.96 and 1.09 -> 0.78 ms per token, but moves 27-36%
more over the link at precision 0.70-0.72 against 0.81-0.82, and ran at 1.02x / 1.05x AR against
``own``'s 1.05x / 1.09x on this CPU, where every copy is a real memcpy: ``own`` stays the default.)
On a quieter run (same setup, ``prefetch=auto``): stall 2.63 -> 1.09 ms per token, but time per
token 11.86 -> 11.90 ms: on a CPU the copies (the emulated link's real memcpy and its bookkeeping,
1224 prefetches for 1021 used) and the hooks (about 0.8 ms per token) cost the host the time the
hidden stall saved. Since then the hook folds the norm into the router (about 4x cheaper per call)
and a CPU copy is a plain memcpy: host CPU time per token of AR with ``prefetch=auto`` over AR
without, the same process and prompts, fell from 2.3-2.5 to 0.3-0.8 ms (two runs of 4 prompts x
48 tokens, with and without the link's waits; a loaded machine, so the figures are relative).
Every token of the pass counts (AR steps, prefill and verification passes alike); each layer's
experts go to the link most-picked first, at most ``per_layer`` of them. ``picks`` takes more than
the model's top-k per token: on the demo pair (AR, capacity 8, 4 prompts x 2 x 48 tokens in one
process, 2026-12-03) stall per token was 1.32 ms with the top 4, 1.53 / 2.18 / 2.89 with 5 / 6 / 8
(AR without prefetch 2.86) and speed fell with it: the extra copies evict experts the next tokens
use and queue ahead of the demand copies on the FIFO link. ``own`` folds an RMSNorm's
scale into the router weight (:func:`fold_norm`): a positive factor per token does not change its
top-k, so the hook is one matmul, a top-k and one host read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specfit.core.router_probe import fold_norm, moe_routers
from specfit.errors import ConfigError
from specfit.interfaces import PrefetcherBase, PrefetcherConfig

SOURCES = ("own", "next", "both")


@dataclass
class LookaheadPrefetcherConfig(PrefetcherConfig):
    name: str = "lookahead"
    source: str = "own"  # own | next | both (see specfit.plugins.prefetchers.lookahead)
    per_layer: int | None = None  # the most experts prefetched per layer and pass (null: all it picks)
    # experts each token takes from the early router (null: the model's top-k); more raises recall
    # at the cost of link time and slots
    picks: int | None = None

    def __post_init__(self) -> None:
        check_lookahead_settings(self.source, self.per_layer, self.picks)


def check_lookahead_settings(source: str, per_layer: int | None, picks: int | None) -> None:
    """One line naming the ``prefetch.*`` key that cannot work."""
    if source not in SOURCES:
        raise ConfigError(f"prefetch.source={source!r} must be one of {', '.join(SOURCES)}")
    for key, value in (("per_layer", per_layer), ("picks", picks)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ConfigError(f"prefetch.{key}={value!r} must be an integer >= 1 (or null)")


class LookaheadPrefetcher(PrefetcherBase):
    """Prefetches each layer's experts from an earlier hidden state, during the pass."""

    name = "lookahead"
    Config = LookaheadPrefetcherConfig

    def __init__(self, source: str = "own", per_layer: int | None = None, picks: int | None = None) -> None:
        check_lookahead_settings(source, per_layer, picks)
        self.source, self.per_layer, self.picks = source, per_layer, picks
        self.handles: list[Any] = []

    def bind(self, target: Any, sink: Any) -> None:
        super().bind(target, sink)
        if not sink.live:
            sink.note("prefetch=lookahead needs the target's live hidden states: it is not replayed")
            return
        model, spec = target.model, target.runtime.spec
        if self.picks is not None and self.picks > spec.num_experts:
            raise ConfigError(f"prefetch.picks={self.picks} is more than the model's {spec.num_experts} experts per layer")
        self.k = self.picks or spec.top_k
        layers, routers = moe_routers(model, spec, "prefetch=lookahead")
        if self.source in ("own", "both"):
            for router in routers:
                router.folded = fold_norm(router, spec.hidden_size)
                if router.folded is not None and router.folded.device.type == "cpu":
                    router.folded = router.folded.float()  # a CPU's bf16 matmul is ~3x slower than fp32's
        self.routers = routers
        if self.source in ("next", "both"):
            target.runtime.add_layer_listener(self._next)
        if self.source in ("own", "both"):
            for index, layer in enumerate(layers):
                self.handles.append(layer.register_forward_pre_hook(self._own_hook(index), with_kwargs=True))

    def _next(self, layer: int, hidden: torch.Tensor) -> None:
        """The runtime's layer listener: layer l's expert input, after l's own copies were issued."""
        if layer + 1 < len(self.routers):
            self.sink.run("lookahead (next)", self._prefetch, layer + 1, hidden, False)

    def _own_hook(self, index: int):  # noqa: ANN202 - a forward pre-hook
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = _hidden(args, kwargs)
            self.sink.run("lookahead (own)", self._prefetch, index, hidden, True)

        return hook

    def _prefetch(self, layer: int, hidden: torch.Tensor, normalise: bool) -> None:
        """The router's top-k for every token of the pass; experts picked by more tokens first (one
        token: in score order). Runs inside the target's forward (inference mode, no autograd).
        Reading the picks is the hook's one host sync."""
        router = self.routers[layer]
        x = hidden.reshape(-1, hidden.shape[-1])
        if normalise and router.folded is not None:  # one matmul: the norm's scale is in the weight
            scores = F.linear(x.to(router.folded.dtype), router.folded)
        else:
            if normalise:
                x = router.norm(x)
            scores = F.linear(x.to(router.weight.dtype), router.weight, router.bias)
        picks = torch.topk(scores, self.k, dim=-1).indices
        if picks.shape[0] == 1:
            order = picks[0].tolist()
        else:
            counts = np.bincount(picks.cpu().reshape(-1).numpy(), minlength=router.weight.shape[0])
            order = np.argsort(-counts, kind="stable")[: np.count_nonzero(counts)].tolist()
        if self.per_layer is not None:
            order = order[: self.per_layer]
        self.sink.prefetch(layer, order)


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]
