"""Built-in expert predictors: history (per-token routing statistics), router_probe, and oracle
(the recorded routing, trace replay only)."""

from specfit.interfaces import hookimpl


@hookimpl
def register_predictors(register):
    from specfit.plugins.predictors.history import HistoryPredictor
    from specfit.plugins.predictors.oracle import OraclePredictor
    from specfit.plugins.predictors.router_probe import RouterProbePredictor

    register(HistoryPredictor)
    register(RouterProbePredictor)
    register(OraclePredictor)
