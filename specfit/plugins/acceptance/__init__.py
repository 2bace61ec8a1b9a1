"""Built-in acceptance estimators (``acceptance=...``): path_prob (a_v = P_v, the default),
calibrated (P_v corrected per depth and probability bin from observed acceptances), learned (a
small online model over features known at selection time, siblings competing); oracle (the recorded
outcomes of a trace replay, for analysis)."""

from specfit.interfaces import hookimpl


@hookimpl
def register_acceptance_estimators(register):
    from specfit.plugins.acceptance.calibrated import CalibratedAcceptance
    from specfit.plugins.acceptance.learned import LearnedAcceptance
    from specfit.plugins.acceptance.oracle import OracleAcceptance
    from specfit.plugins.acceptance.path_prob import PathProbAcceptance

    register(PathProbAcceptance)
    register(CalibratedAcceptance)
    register(LearnedAcceptance)
    register(OracleAcceptance)
