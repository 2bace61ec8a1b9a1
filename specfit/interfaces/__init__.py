"""Contracts between specfit's decode loop and its pluggable parts."""

from specfit.interfaces.hookspecs import hookimpl, hookspec
from specfit.interfaces.protocols import (
    KINDS,
    Admission,
    CostModel,
    Drafter,
    ExpertCache,
    ExpertPredictor,
    Selection,
    SelectionContext,
    Selector,
)

__all__ = [
    "KINDS",
    "Admission",
    "CostModel",
    "Drafter",
    "ExpertCache",
    "ExpertPredictor",
    "Selection",
    "SelectionContext",
    "Selector",
    "hookimpl",
    "hookspec",
]
