"""Built-in expert predictors: history (per-token routing statistics) and router_probe."""

from specfit.interfaces import hookimpl


@hookimpl
def register_predictors(register):
    from specfit.plugins.predictors.history import HistoryPredictor
    from specfit.plugins.predictors.router_probe import RouterProbePredictor

    register(HistoryPredictor)
    register(RouterProbePredictor)
