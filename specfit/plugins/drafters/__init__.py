"""Built-in drafters: none (autoregressive decoding)."""

from specfit.interfaces import hookimpl


@hookimpl
def register_drafters(register):
    from specfit.plugins.drafters.none import NoDrafter

    register(NoDrafter)
