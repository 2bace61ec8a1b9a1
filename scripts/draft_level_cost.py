"""Host time of SpecFit's work per draft level, by part, at the demo's and Qwen3-30B-A3B's dims.

After every draft level SpecFit predicts the new nodes' experts, estimates their acceptance,
builds the selection problem, searches it, and (``prefetch=draft``) plans copies. On a GPU a draft
level of the head takes about half a millisecond, so this host work decides whether drafting one
more level can pay at all. This runs the engine's own cycle (:class:`specfit.decode.cycle.Cycle`,
its guard checks included) on synthetic EAGLE-3-shaped trees (``--top-k`` children per expanded
node, a beam of ``--top-k``, ``--depth`` levels, the ``--total-tokens`` likeliest selectable), with
the history predictor (its tables warmed on a routing table of ``--vocab`` tokens), the learned
acceptance estimator, the union cost model with Qwen3-30B-A3B-on-PCIe-4.0 constants, the exact
search, and the draft prefetcher on a modelled link, and times each part with a wall clock.

The target is not run: a synthetic verifier answers (each token routes to fixed experts; a node
is accepted with probability ``--accept``), and the predictor's router probe (used for tokens it
has never seen) reads a small random Qwen3-MoE with the dims' layer and expert counts. Only the
sizes the selection path sees matter here: layers, experts, top-k, the tree's shape.

    python scripts/draft_level_cost.py [--dims demo|qwen3|both] [--cycles 60] [--all-nodes]

``--all-nodes`` predicts every drafted node, as before the cycle predicted only the nodes the
selector may verify (``chooses_among_likeliest``). Figures: docs/results.md. Compare versions by
running them alternately: the host's speed drifts.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import torch

from specfit.bench.method_timers import MethodTimers
from specfit.types.costs import CostConstants
from specfit.types.context import TokenContext
from specfit.decode.cycle import Cycle, CycleTimes, Verdict
from specfit.offload.discovery import moe_spec
from specfit.offload.admission import bind_cache, cache_resident
from specfit.offload.prefetch import ModelledSink
from specfit.decode.sampling import Sampler, SamplingParams
from specfit.search.synthetic import QWEN3_30B_PCIE4
from specfit.types.tree import ROOT, DraftTree
from specfit.plugins.caches.lru import LRUCache
from specfit.plugins.cost_models.union import UnionCostModel
from specfit.plugins.prefetchers.draft import DraftPrefetcher
from specfit.plugins.predictors.history import HistoryPredictor
from specfit.plugins.selectors.specfit import SpecFitSelector

DIMS = {"demo": dict(layers=6, experts=32, top_k=4, slots=8), "qwen3": dict(layers=48, experts=128, top_k=8, slots=32)}
PARTS = ("predict", "acceptance", "problem", "search", "prefetch plan")
TOTAL = ("predict", "select", "after_level")  # the cycle's host work per level: these three calls


def small_moe(layers: int, experts: int, top_k: int, vocab: int) -> torch.nn.Module:
    """A random Qwen3-MoE with these layer and expert counts and tiny widths: the router probe's model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=64, moe_intermediate_size=8,
                            num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3MoeForCausalLM(config).eval()


class SyntheticVerifier:
    """Grows EAGLE-shaped trees and answers for the target from a fixed routing table (see the module docstring)."""

    measured = True  # wall-clock: draft_seconds is the time spent, as live

    def __init__(self, spec: Any, cache: Any, rng: np.random.Generator, routing: np.ndarray, top_k: int, depth: int,
                 accept: float) -> None:
        self.spec, self.cache, self.rng, self.routing = spec, cache, rng, routing
        self.top_k, self.depth, self.accept = top_k, depth, accept
        self.extra: dict[str, Any] = {}
        self.now = time.perf_counter
        self.slots = bind_cache(cache, spec)
        self.slot_expert = np.full((spec.num_layers, self.slots), -1, dtype=np.int64)
        self.sink: ModelledSink | None = None
        self._accepted: dict[int, bool] = {}

    def levels(self, tree: DraftTree) -> Iterator[range]:
        vocab = len(self.routing)
        beam = [ROOT]
        for _ in range(self.depth):
            parents = [p for p in beam for _ in range(self.top_k)]
            q = self.rng.dirichlet(np.full(self.top_k, 0.3), size=len(beam)).ravel()
            tokens = self.rng.zipf(1.3, len(parents)) % vocab
            level = tree.add_level(parents, tokens.tolist(), np.log(np.maximum(q, 1e-9)).tolist())
            paths = np.asarray(tree.path_log_probs[level.start:level.stop])
            beam = [level.start + int(i) for i in np.argsort(-paths, kind="stable")[: self.top_k]]
            tree.set_entropy(list(level), self.rng.uniform(0.5, 3.0, len(level)).tolist())
            yield level

    def draft_seconds(self, levels: int, elapsed: float, overhead: float) -> float:
        return elapsed

    def resident(self) -> np.ndarray:
        return cache_resident(self.cache, self.spec)

    def arriving(self) -> np.ndarray | None:
        return self.sink.arriving() if self.sink is not None else None

    def verify(self, block: Any) -> Verdict:
        routing = self.routing[np.asarray(block.tokens)]
        if self.sink is not None:
            self.sink.settle(routing, len(routing), self.sink.now())
            self.sink.sweep()
        union = [len(np.unique(routing[:, layer])) for layer in range(self.spec.num_layers)]
        return Verdict(routing.astype(np.int64), misses=0, hits=0, union=union)

    def token_after(self, block: Any, pos: int, sampler: Sampler) -> int:
        """The block's likeliest child of ``pos`` with probability ``accept``, else a token no child has."""
        children = [i for i, p in enumerate(block.parents) if p == pos]
        if children and self.rng.random() < self.accept:
            return block.tokens[children[0]]
        return len(self.routing) - 1 - pos

    def token_prob(self, block: Any, pos: int, token: int, sampler: Sampler) -> float | None:
        return 0.9

    def keep(self, block: Any, path: list[int], bonus: int) -> list[int]:
        return path

    def commit(self, tokens: list[int], kept: list[int], bonus: int) -> None:
        pass

    def argmax(self) -> list[int]:
        return []

    def times(self, measured: CycleTimes, levels: int, verified: int, verdict: Verdict, overhead: float) -> CycleTimes:
        return measured


def measure(dims: str, cycles: int, all_nodes: bool, args: argparse.Namespace) -> dict[str, float]:
    """Mean host milliseconds per draft level, by part and in all (the cycle's measured overhead)."""
    d = DIMS[dims]
    rng = np.random.default_rng(args.seed)
    model = small_moe(d["layers"], d["experts"], d["top_k"], args.vocab)
    spec = moe_spec(model)
    routing = np.stack([np.stack([rng.choice(d["experts"], d["top_k"], replace=False) for _ in range(d["layers"])])
                        for _ in range(args.vocab)]).astype(np.int32)
    constants = CostConstants(**QWEN3_30B_PCIE4, c_level=5e-4)
    selector = SpecFitSelector(acceptance="learned", draft_gate=False, early_stop=False)  # every level: its cost
    if all_nodes:
        selector.chooses_among_likeliest = False
    cost_model = UnionCostModel(constants=constants)
    predictor, cache, prefetcher = HistoryPredictor(), LRUCache(capacity=d["slots"]), DraftPrefetcher()
    target = SimpleNamespace(model=model, runtime=SimpleNamespace(spec=spec))
    selector.bind(spec)
    cost_model.bind(spec)
    predictor.bind(target)
    verifier = SyntheticVerifier(spec, cache, rng, routing, args.top_k, args.depth, args.accept)
    sink = verifier.sink = ModelledSink(prefetcher, spec, cache, verifier.slot_expert, constants)
    sink.call("bind", target, sink)
    prompt = (rng.zipf(1.3, 512) % args.vocab).tolist()
    predictor.observe(prompt, routing[prompt].astype(np.int64))  # the prefill's routing, as the engine gives it
    cycle = Cycle(verifier, spec, selector, predictor, cost_model, prefetcher=prefetcher, sink=sink)
    cycle.context = TokenContext(prompt)
    timers = MethodTimers()
    sampler = Sampler(SamplingParams())
    root, levels, selecting = prompt[-1], 0, 0.0
    for i in range(cycles + args.warmup):
        if i == args.warmup:  # compiled, warmed: start counting
            for label, (owner, name) in zip(PARTS, ((predictor, "predict"), (selector, "accept_estimates"),
                                                    (cost_model, "problem"), (selector, "choose"),
                                                    (prefetcher, "_plan"))):
                timers.wrap(owner, name, label)
            timers.wrap(selector, "select", "select")
            timers.wrap(prefetcher, "after_level", "after_level")
        sink.begin_cycle()
        record, tokens = cycle.run(root, sampler, args.depth, args.total_tokens)
        root = tokens[-1]
        if i >= args.warmup:
            levels += record.levels
            selecting += record.select_seconds  # the cycle's time from each level's select to the next level
    per_level = {label: 1e3 * timers.seconds[label] / max(levels, 1) for label in (*PARTS, *TOTAL[1:])}
    return {**per_level, "all": sum(per_level[label] for label in TOTAL), "levels": levels / cycles,
            "cycle": per_level["predict"] + 1e3 * selecting / max(levels, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", choices=["demo", "qwen3", "both"], default="both")
    parser.add_argument("--cycles", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--depth", type=int, default=7)
    parser.add_argument("--total-tokens", type=int, default=60)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--accept", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--all-nodes", action="store_true", help="predict every drafted node (the earlier cycle)")
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.warmup < 0:
        parser.error("--cycles must be >= 1 and --warmup >= 0")
    torch.set_num_threads(1)
    rows = [(dims, measure(dims, args.cycles, args.all_nodes, args)) for dims in
            (["demo", "qwen3"] if args.dims == "both" else [args.dims])]
    print(f"ms per draft level ({'every node predicted' if args.all_nodes else 'likeliest nodes predicted'}; "
          f"EAGLE-3 trees top_k {args.top_k}, depth {args.depth}, {args.total_tokens} selectable; gate off)")
    print(f"{'dims':>6}  " + "  ".join(f"{p:>13}" for p in (*PARTS, "all", "with checks")) + "  levels/cycle")
    for dims, r in rows:
        print(f"{dims:>6}  " + "  ".join(f"{r[p]:13.3f}" for p in (*PARTS, "all", "cycle")) + f"  {r['levels']:12.2f}")
    print("all: the predictor, the selector (acceptance, problem, search and the rest) and the prefetcher's "
          "after_level; with checks: the cycle's host work per level besides drafting, the residency it hands "
          "the selector and the guard's checks included")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
