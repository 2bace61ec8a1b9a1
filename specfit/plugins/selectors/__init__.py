"""Built-in selectors: eagle3 (EAGLE's reranked tree), chain (its most likely path), specfit (exact
throughput-maximising subtree)."""

from specfit.interfaces import hookimpl


@hookimpl
def register_selectors(register):
    from specfit.plugins.selectors.chain import ChainSelector
    from specfit.plugins.selectors.eagle3 import VerifyAllSelector
    from specfit.plugins.selectors.specfit import SpecFitSelector

    register(VerifyAllSelector)
    register(ChainSelector)
    register(SpecFitSelector)
