"""Built-in selectors: eagle3 (EAGLE's reranked tree), chain (its most likely path), specfit (exact
throughput-maximising subtree), greedy and prefix (EcoSpec- and EVICT-style baselines on the same
cost model), oracle (the accepted path, trace replay only), none (never drafts: autoregressive)."""

from specfit.interfaces import hookimpl


@hookimpl
def register_selectors(register):
    from specfit.plugins.selectors.chain import ChainSelector
    from specfit.plugins.selectors.eagle3 import TopByPathProbSelector
    from specfit.plugins.selectors.greedy import GreedySelector
    from specfit.plugins.selectors.none import NoDraftSelector
    from specfit.plugins.selectors.oracle import OracleSelector
    from specfit.plugins.selectors.prefix import PrefixSelector
    from specfit.plugins.selectors.specfit import SpecFitSelector

    register(TopByPathProbSelector)
    register(ChainSelector)
    register(SpecFitSelector)
    register(GreedySelector)
    register(PrefixSelector)
    register(OracleSelector)
    register(NoDraftSelector)
