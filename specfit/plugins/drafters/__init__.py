"""Built-in drafters: none (autoregressive decoding), eagle3 and ngram (prompt lookup)."""

from specfit.interfaces import hookimpl


@hookimpl
def register_drafters(register):
    from specfit.plugins.drafters.eagle3.drafter import Eagle3Drafter
    from specfit.plugins.drafters.ngram import NgramDrafter
    from specfit.plugins.drafters.none import NoDrafter

    register(NoDrafter)
    register(Eagle3Drafter)
    register(NgramDrafter)
