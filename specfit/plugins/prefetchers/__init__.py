"""Built-in prefetchers: none (the default), lookahead (hidden states), draft (draft predictions), auto (both)."""

from specfit.interfaces import hookimpl


@hookimpl
def register_prefetchers(register):
    from specfit.plugins.prefetchers.auto import AutoPrefetcher
    from specfit.plugins.prefetchers.draft import DraftPrefetcher
    from specfit.plugins.prefetchers.lookahead import LookaheadPrefetcher
    from specfit.plugins.prefetchers.none import NoPrefetcher

    register(NoPrefetcher)
    register(LookaheadPrefetcher)
    register(DraftPrefetcher)
    register(AutoPrefetcher)
