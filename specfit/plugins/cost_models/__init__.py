"""Built-in cycle-time cost models: union (the submodular expert-union model)."""

from specfit.interfaces import hookimpl


@hookimpl
def register_cost_models(register):
    from specfit.plugins.cost_models.union import UnionCostModel

    register(UnionCostModel)
