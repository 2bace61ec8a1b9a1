"""Exact search for the draft subtree that maximises predicted throughput (docs/method.md section 3).

    problem = SearchProblem(parents, accept, node_experts, root_experts, resident,
                            c0=..., c_tok=..., c_miss=..., c_hit=..., draft_time=...)
    result = solve(problem)                 # result.mask, result.rho, result.max_depth, ...
    result = solve(problem, allowed=depth <= d, initial=previous.mask)
    result = solve_surplus(problem, rate=lam)  # max N - lam * T: the long-run-throughput choice
"""

from specfit.search.exact import TIE_RTOL, SearchResult, greedy, solve, solve_surplus
from specfit.search.problem import SearchProblem, evaluate, is_ancestor_closed, node_depths

__all__ = ["SearchProblem", "SearchResult", "TIE_RTOL", "evaluate", "is_ancestor_closed",
           "greedy", "node_depths", "solve", "solve_surplus"]
