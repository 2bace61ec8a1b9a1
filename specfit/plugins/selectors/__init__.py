"""Built-in selectors: eagle3 (verify the whole drafted tree), chain (its most likely path)."""

from specfit.interfaces import hookimpl


@hookimpl
def register_selectors(register):
    from specfit.plugins.selectors.chain import ChainSelector
    from specfit.plugins.selectors.eagle3 import VerifyAllSelector

    register(VerifyAllSelector)
    register(ChainSelector)
