"""Hidden-state look-ahead (mixtral-offloading, "Speculating Experts"): routers applied early.

The predictors, all live (they read the pass's hidden states; a trace replay has none):

- ``fitted`` (the default): when MoE layer l has issued its own copies (the runtime's layer
  listener, with the experts' input, already normalised), predict layer l+1's router logits from
  it with :class:`specfit.plugins._kit.next_router.NextLayerRouter`, a linear map of the two routers'
  logits fitted online on the target's own passes (before any data: layer l+1's raw router, the
  mixtral-offloading predictor); the copies queue behind layer l's on the FIFO link and travel
  while layer l computes and layer l+1 attends. The first layer, which has no layer before it,
  uses ``own`` (as does a model with a single MoE layer);
- ``own`` on the first decoder layer reads the tokens' embedding, so its picks are asked for as
  the model's forward starts, before the decoder's preamble (masks, rotary tables, the cache:
  0.33 ms a pass on the demo target) instead of at the layer; the first pass checks that the
  embedding is the layer's input (a model that scales it falls back to the layer's pre-hook).
  Measured (AR, the setup below, one process): 1.123x -> 1.136x AR, stall 1.47 -> 1.39 ms a token;
- ``own``: when decoder layer l starts (before attention), apply layer l's own
  ``post_attention_layernorm`` and router to its input; the copies overlap layer l's attention;
- ``next``: layer l+1's raw router on layer l's expert input (nothing for the first layer);
- ``both``: ``next`` early, then ``own`` adds what it still misses.

Why ``fitted``: ``own`` picks well (top-4 recall 0.77-0.88 on the demo target) but its copies have
only one layer's attention to travel in; the raw ``next`` has a whole layer but recalls less
(0.75-0.84, and 0.21-0.26 on layer 1); fitted, it recalls about what ``own`` does (0.70-0.86
after a few hundred tokens) with the longer lead. Measured on the demo pair (AR, ``cache=lru
cache.capacity=8 cache.copy=emulated``, 4 held-out prompts per workload x 2 x 48 tokens, in one
process, interleaved, 2026-12-04): time per token 8.17-8.34 ms without prefetch, 7.78-7.88 with
``own`` (1.05x), 7.34-7.41 with ``fitted`` (1.11-1.13x); stall 2.95, 2.05, 1.45-1.51 ms per token.
The same predictor left unfitted (layer l+1's raw router, ``own`` on the first layer) ran at
1.04x, the raw ``next`` alone 1.04x: the fit is the gain. Taking fewer picks from the fitted
predictor (``picks=3``) moved within noise, adding ``own`` on every layer to ``fitted`` gave 1.06x
(more copies on a link that is already busy).

Earlier measurements of the other sources (same setup, 2026-12-03): ``own`` removed three quarters
of the demand misses with the fewest wasted copies; ``both`` cut the stall further than ``own``
(1.26 -> 0.96 ms per token on prose) but moved 27-36% more over the link at precision 0.70-0.72
against 0.81-0.82 and ran slower on this CPU, where every copy is a real memcpy. ``picks`` above
the model's top-k only hurt: stall per token 1.32 ms with the top 4 of ``own``, 1.53 / 2.18 / 2.89
with 5 / 6 / 8, since the extra copies evict experts the next tokens use and queue ahead of the
demand copies on the FIFO link.

Every token of the pass counts (AR steps, prefill and verification passes alike); each layer's
experts go to the link most-picked first, at most ``per_layer`` of them. The experts each token
ranks next (``keep``, by default as many as its picks; no more than fit in the slots beside the
picks, so a big tree's pass keeps none) are kept where resident: a prefetch's copy
then evicts an expert the predictor ranks lower rather than the least recently used, which may be
the next token's. Measured (AR, the setup above, one process): demand misses 2.77 -> 2.48 a token,
1.135x -> 1.158x AR; keeping 6 or 10 instead of 4 moved within noise (10 leaves too few slots:
fewer prefetches, and the misses back at 2.77). ``own`` folds an
RMSNorm's scale into the router weight (:func:`fold_norm`): a positive factor per token does not
change its top-k, so the hook is one matmul, a top-k and one host read.

In the first MoE layers the routing follows the token more than its context, so for the first
``token_table`` layers (default 2) a per-token table of the experts each layer chose before
(:mod:`specfit.plugins._kit.token_experts`) competes with the router: both are scored against the routing of
every one-token pass whose token the table has seen, and the table's picks are taken for a pass
whose tokens it has all seen while it has recalled that layer better lately. It learns from every
pass the look-ahead runs in (not while its gate pauses it). Live on the demo (8 held-out prompts, prose then GSM):
layer 0 0.91-0.99 against its router on the embedding's 0.79-0.89, layer 1 0.82-0.93 against the
fitted map's 0.49-0.82 (0.49-0.53 on GSM after prose), layer 2 0.63-0.87 against 0.74-0.90 (there the
router keeps it). AR + look-ahead, interleaved: misses 4.68 -> 4.04 a token, stall -0.22 to -0.24 ms
a token, 8.37 copies a token against 8.47; time per token within this host's noise (1.195x against
1.188x, 1.152x against 1.174x).

The look-ahead costs host time in every pass (on this CPU host 0.22-0.26 ms a layer for a decode
step, 0.27-0.31 before the fitted router's prediction became one matmul: the fitted router, the
top-k and its host read, the requests' checks and the copies' issue, a real memcpy of each expert
on the emulated link), and it saves only the stall of the copies it brings in time. Where few
copies remain (a cache holding most of what passes use) it can cost more than it saves. Its
:class:`BenefitGate` (``gate``, on by default) weighs the two over windows of passes and pauses it
while it does not pay. Measured on the demo (AR, held-out prompts, 8 per workload x 2, one bench,
paired, 2026-12-07): at ``cache.capacity=16`` AR + look-ahead ran at 0.92x AR without the gate
(stall 0.67 -> 0.06 ms a token) and 0.98x with it (paused in 75% of passes); at capacity 8 the
gate never paused (1.05x, and 1.04x without it); at capacity 4 it paused in 2% of passes (1.14x,
and 1.12x without it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specfit.plugins._kit.next_router import NextLayerRouter
from specfit.plugins._kit.router_probe import fold_norm, moe_routers
from specfit.plugins._kit.token_experts import TokenExperts
from specfit.interfaces import ConfigError, PrefetcherBase, PrefetcherConfig

SOURCES = ("fitted", "own", "next", "both")


@dataclass
class LookaheadPrefetcherConfig(PrefetcherConfig):
    name: str = "lookahead"
    source: str = "fitted"  # fitted | own | next | both (see specfit.plugins.prefetchers.lookahead)
    per_layer: int | None = None  # the most experts prefetched per layer and pass (null: all it picks)
    # experts each token takes from the early router (null: the model's top-k); more raises recall
    # at the cost of link time and slots
    picks: int | None = None
    # the experts ranked just after the picks (this many per token; null: the model's top-k, 0: none)
    # are kept if resident: the prefetch's copies evict experts the predictor ranks lower instead
    keep: int | None = None
    # measure whether the stall the look-ahead removes pays for its host time, and pause it while
    # it does not (probing again now and then); false: always on
    gate: bool = True
    # the first MoE layers that may take their picks from a per-token table of the experts they
    # chose before, where it has predicted them better lately (specfit.plugins._kit.token_experts); 0: none
    token_table: int = 2

    def __post_init__(self) -> None:
        check_lookahead_settings(self.source, self.per_layer, self.picks, self.keep, self.token_table)


def check_lookahead_settings(source: str, per_layer: int | None, picks: int | None, keep: int | None = None,
                             token_table: int = 0) -> None:
    """One line naming the ``prefetch.*`` key that cannot work."""
    if source not in SOURCES:
        raise ConfigError(f"prefetch.source={source!r} must be one of {', '.join(SOURCES)}")
    for key, value, least in (("per_layer", per_layer, 1), ("picks", picks, 1), ("keep", keep, 0),
                              ("token_table", token_table, 0)):
        nullable = key != "token_table"  # null: the default that key documents
        if value is None and nullable:
            continue
        if value is None or isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise ConfigError(f"prefetch.{key}={value!r} must be an integer >= {least}{' (or null)' if nullable else ''}")


class LookaheadPrefetcher(PrefetcherBase):
    """Prefetches each layer's experts from an earlier hidden state, during the pass."""

    name = "lookahead"
    Config = LookaheadPrefetcherConfig

    def __init__(self, source: str = "fitted", per_layer: int | None = None, picks: int | None = None,
                 keep: int | None = None, gate: bool = True, token_table: int = 2) -> None:
        check_lookahead_settings(source, per_layer, picks, keep, token_table)
        self.source, self.per_layer, self.picks, self.keep = source, per_layer, picks, keep
        self.token_table = token_table
        self.table: TokenExperts | None = None
        self.handles: list[Any] = []
        self.gate = BenefitGate() if gate else None
        self.active = True  # the look-ahead runs in this pass

    def bind(self, target: Any, sink: Any) -> None:
        super().bind(target, sink)
        if not sink.live:
            sink.note("prefetch=lookahead needs the target's live hidden states: it is not replayed")
            return
        model, spec = target.model, target.runtime.spec
        for key, value in (("picks", self.picks), ("keep", self.keep)):
            if value is not None and value > spec.num_experts:
                raise ConfigError(f"prefetch.{key}={value} is more than the model's {spec.num_experts} experts "
                                  "per layer")
        self.k = self.picks or spec.top_k
        self.kept = min(spec.top_k if self.keep is None else self.keep, spec.num_experts - self.k)
        # the token table's tie-break by the router's rank (first to last of k + kept), worth less than one count
        width = self.k + self.kept
        self._tiebreak = (width - torch.arange(width, dtype=torch.float32)) * (0.5 / width)
        layers, routers = moe_routers(model, spec, "prefetch=lookahead")
        fitted = self.source == "fitted" and len(routers) > 1  # one MoE layer: no layer before it, own
        own_layers = layers[:1] if fitted else layers if self.source in ("own", "both", "fitted") else []
        if self.gate is not None and target.runtime.device.type == "cuda":
            # a hook's host read of its picks waits for the GPU work queued before it (the layer
            # before's experts, an earlier round's), so its wall time is not the look-ahead's cost
            sink.note("prefetch.gate: off on CUDA (the hooks' wall time there holds GPU work they wait for, "
                      "not the look-ahead's own cost); the look-ahead stays on")
            self.gate = None
        if self.gate is not None:  # first: every other hook of a pass asks it whether to run
            self.handles.append(model.register_forward_pre_hook(self._pass_start))
        if self.token_table:  # the pass's token ids, before any hook predicts from them
            if self.token_table > len(routers):
                sink.note(f"prefetch.token_table={self.token_table} is more than the model's {len(routers)} MoE "
                          f"layers: the token table covers all {len(routers)}")
            self.table = TokenExperts(min(self.token_table, len(routers)), spec.num_experts)
            self._runtime, self._ids, self._judged = target.runtime, None, {}
            self.handles.append(model.register_forward_pre_hook(self._pass_ids, with_kwargs=True))
        for router in routers[:len(own_layers)]:
            router.folded = fold_norm(router, spec.hidden_size)
            if router.folded is not None and router.folded.device.type == "cpu":
                router.folded = router.folded.float()  # a CPU's bf16 matmul is ~3x slower than fp32's
        self.routers = routers
        if self.source in ("next", "both"):
            target.runtime.add_layer_listener(self._next)
        if fitted:
            self.fitted = NextLayerRouter(routers)
            target.runtime.add_layer_listener(self._fitted_next)
        if self.table is not None:  # after the next layer's prefetch: its copies need the lead, learning can wait
            target.runtime.add_layer_listener(self._table_learns)
        for index, layer in enumerate(own_layers):
            self.handles.append(layer.register_forward_pre_hook(self._own_hook(index), with_kwargs=True))
        self._early: torch.Tensor | None = None  # this pass's first-layer input, embedded early
        self._early_state = "off"  # off | unchecked | checked (the early input is the layer's input)
        decoder_layers = getattr(_decoder(model), "layers", None)
        if own_layers and isinstance(decoder_layers, nn.ModuleList) and len(decoder_layers) \
                and own_layers[0] is decoder_layers[0] and model.get_input_embeddings() is not None:
            self._embedding = model.get_input_embeddings()
            self._early_state = "unchecked"
            self.handles.append(model.register_forward_pre_hook(self._early_hook, with_kwargs=True))

    def counters(self) -> dict[str, int]:
        """Passes the look-ahead ran in and passes its gate paused it (none without a gate)."""
        if self.gate is None:
            return {}
        return {"lookahead_passes": self.gate.passes_on, "lookahead_paused_passes": self.gate.passes_off}

    def _pass_start(self, _module: nn.Module, _args: tuple) -> None:
        """The model's forward pre-hook: whether the look-ahead runs in this pass (the gate)."""
        self.active = self.gate.next_pass(self.sink.prefetches_used(), self.sink.saved_per_use())

    def _pass_ids(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The model's forward pre-hook: the pass's token ids, for the token table (none while the
        gate pauses the look-ahead; their host read is look-ahead time the gate weighs)."""
        self._ids = None
        self._judged.clear()
        if self.active:
            self._timed("lookahead (table)", self._read_ids, kwargs.get("input_ids", args[0] if args else None))

    def _read_ids(self, ids: Any) -> None:
        self._ids = ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else None

    def _table_learns(self, layer: int, _hidden: torch.Tensor) -> None:
        """The runtime's layer listener: the experts ``layer`` chose score the picks made for it (a
        one-token pass) and go into the token table (host time the gate weighs, as the hooks')."""
        if self.active and self._ids is not None and layer < self.table.layers:
            self._timed("lookahead (table)", self._learn_table, layer)

    def _learn_table(self, layer: int) -> None:
        table, ids = self.table, self._ids
        routed = self._runtime.routed(layer)
        if routed is None or routed.shape[0] != len(ids):
            return
        routed = routed.numpy()
        picks = self._judged.pop(layer, None)
        if picks is not None:
            table.judge(layer, routed[0].tolist(), *picks)
        table.learn(layer, ids, routed)

    def _table_or(self, layer: int, ranked: torch.Tensor) -> torch.Tensor:
        """The token table's ranking instead of the router's ``ranked`` [tokens, n] where every token
        of the pass has been seen and the table has recalled ``layer``'s picks better lately; a
        one-token pass keeps both top-k, scored when the layer routes (:meth:`_table_learns`)."""
        ids = self._ids
        counted = self.table.scores(layer, ids) if ids is not None and len(ids) == ranked.shape[0] else None
        if counted is None:
            return ranked
        # counts are whole numbers: the router's ranking, worth less than one count, breaks their ties,
        # so a token seen with fewer experts than asked for gets the router's next picks, not arbitrary ones
        router_order = ranked.cpu()
        tiebreak = self._tiebreak[: router_order.shape[1]]  # the whole k + kept in a pass (a test may ask fewer)
        counted = counted.scatter_add(1, router_order, tiebreak.expand(router_order.shape).contiguous())
        by_table = torch.topk(counted, ranked.shape[1], dim=-1).indices
        if len(ids) == 1:
            self._judged[layer] = (by_table[0, :self.k].tolist(), ranked[0, :self.k].tolist())
        return by_table if self.table.preferred(layer) else ranked

    def _next(self, layer: int, hidden: torch.Tensor) -> None:
        """The runtime's layer listener: layer l's expert input, after l's own copies were issued."""
        if self.active and layer + 1 < len(self.routers):
            self._timed("lookahead (next)", self._prefetch, layer + 1, hidden, False)

    def _fitted_next(self, layer: int, hidden: torch.Tensor) -> None:
        """The runtime's layer listener: learn from layer l's expert input, prefetch layer l+1's picks."""
        if self.active:
            self._timed("lookahead (fitted)", self._prefetch_fitted, layer, hidden)

    def _timed(self, hook: str, fn: Any, *args: Any) -> None:
        """``fn(*args)`` as ``hook``, its host time charged to the gate (where there is one)."""
        start = time.perf_counter()
        try:
            self.sink.run(hook, fn, *args)
        finally:
            if self.gate is not None:
                self.gate.spent += time.perf_counter() - start

    def _prefetch_fitted(self, layer: int, hidden: torch.Tensor) -> None:
        scores = self.fitted.observe(layer, hidden)
        if scores is not None:
            self._prefetch_scores(layer + 1, scores)

    def _own_hook(self, index: int):  # noqa: ANN202 - a forward pre-hook
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self.active:
                return
            hidden = _hidden(args, kwargs)
            if index == 0 and self._early_state != "off":
                early, self._early = self._early, None
                if early is not None and self._early_state == "checked":
                    return  # prefetched at the pass's start from the same input
                if early is not None:  # the first pass: is the embedding the layer's input (no scaling)?
                    if early.shape == hidden.shape and torch.equal(early, hidden):
                        self._early_state = "checked"
                        return
                    self._early_state = "off"  # another input (a scaled embedding): prefetch here from now on
            self._timed("lookahead (own)", self._prefetch, index, hidden, True)

        return hook

    def _early_hook(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The model's forward pre-hook: the first layer's input is the tokens' embedding, so its
        picks are known before the decoder's preamble (masks, rotary tables, the cache) runs; its
        copies get that much more lead. Checked against the layer's real input on the first pass."""
        self._early = None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not self.active or self._early_state == "off" or not isinstance(ids, torch.Tensor) \
                or kwargs.get("inputs_embeds") is not None:
            return
        self._early = early = self._embedding(ids)
        self._timed("lookahead (own)", self._prefetch, 0, early, True)

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
        self._prefetch_scores(layer, scores)

    def _prefetch_scores(self, layer: int, scores: torch.Tensor) -> None:
        """Prefetch the top-k of every token's ``scores`` [tokens, E] for ``layer``, most picked first;
        the next ``keep`` of each token are kept where resident (not copied)."""
        k = self.k
        ranked = torch.topk(scores, k + self.kept, dim=-1).indices
        if self.table is not None and layer < self.table.layers:
            ranked = self._table_or(layer, ranked)
        if ranked.shape[0] == 1:
            row = ranked[0].tolist()
            order, keep = row[:k], row[k:]
        else:
            order, keep = _most_picked(ranked[:, :k], scores.shape[-1]), _most_picked(ranked[:, k:], scores.shape[-1])
        if self.per_layer is not None:
            order = order[: self.per_layer]
        # only what fits beside the copies: a pass whose picks fill the slots (a big tree) keeps none
        self.sink.prefetch(layer, order, keep[: max(self.sink.capacity() - len(order), 0)])


class BenefitGate:
    """Keeps the look-ahead on while the stall it removes pays for the host time it costs.

    At the end of each window of ``window`` passes it weighs the host seconds the look-ahead's
    hooks took (prediction, requests, the copies' issue) against the most its used prefetches can
    have saved (the sink's ``saved_per_use``: one copy's link time, which a demand copy would have
    waited, and the host time of its issue, which the demand path would have spent). Cache
    pollution is not charged and a prefetch that landed late is credited in full, so the gate
    leans towards staying on. Both sums run over the windows since the look-ahead last resumed,
    each earlier window weighing half as much, so one noisy window (the host preempted inside a
    hook) does not decide. While it does not pay, the look-ahead is paused for ``pause`` passes,
    doubling (up to ``longest``) while the probes after a pause keep losing; a window that pays
    resets the pause. While paused, the fitted router does not learn either: a probe predicts
    with the fit it had. Used prefetches are counted over the whole run (``auto``'s draft
    prefetches included), which also leans towards staying on.
    """

    def __init__(self, window: int = 32, pause: int = 32, longest: int = 1024) -> None:
        self.window, self.first_pause, self.longest = window, pause, longest
        self.on, self.left, self.pause = True, window, pause
        self.spent = 0.0  # host seconds of the look-ahead in this window (its hooks add to it)
        self.used_at: int | None = None  # the used-prefetch count when the window started
        self.saved_sum = self.spent_sum = 0.0  # over the windows it ran in, halved each window
        self.passes_on = self.passes_off = 0

    def next_pass(self, used: int, saves: float) -> bool:
        """A pass starts (``used``: prefetched experts used so far; ``saves``: seconds one saves, 0.0
        unknown); whether the look-ahead runs in it."""
        if self.used_at is None:
            self.used_at = used
        if self.left == 0:  # a window or a pause is over
            if not self.on:  # probe again, on this window's figures alone
                self.on, self.left = True, self.window
                self.saved_sum = self.spent_sum = 0.0
            else:
                self.saved_sum = 0.5 * self.saved_sum + (used - self.used_at) * saves
                self.spent_sum = 0.5 * self.spent_sum + self.spent
                if saves > 0 and self.saved_sum < self.spent_sum:
                    self.on, self.left = False, self.pause
                    self.pause = min(2 * self.pause, self.longest)
                else:
                    self.left, self.pause = self.window, self.first_pause
            self.spent, self.used_at = 0.0, used
        self.left -= 1
        if self.on:
            self.passes_on += 1
        else:
            self.passes_off += 1
        return self.on


def _most_picked(picks: torch.Tensor, experts: int) -> list[int]:
    """The experts in ``picks`` [tokens, n], picked by more tokens first."""
    if picks.shape[1] == 0:
        return []
    counts = np.bincount(picks.cpu().reshape(-1).numpy(), minlength=experts)
    return np.argsort(-counts, kind="stable")[: np.count_nonzero(counts)].tolist()


def _decoder(model: nn.Module) -> nn.Module | None:
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]
