"""Built-in expert caches: lru (the baseline), none (vanilla offloading), full (no offloading)."""

from specfit.interfaces import hookimpl


@hookimpl
def register_expert_caches(register):
    from specfit.plugins.caches.full import FullCache
    from specfit.plugins.caches.lru import LRUCache
    from specfit.plugins.caches.none import NoCache

    register(LRUCache)
    register(NoCache)
    register(FullCache)
