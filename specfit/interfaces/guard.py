"""The guard between the core and its plug-ins: no plug-in can corrupt a run.

Every value a plug-in hands back to the core (the nodes a selector chooses, the levels a drafter
grows, the experts a predictor writes into the tree, a cache's admissions) is checked before the
core uses it, and an exception raised inside a plug-in's hook becomes one :class:`PluginError`
line that names the plug-in, its kind and the hook, the original chained as its cause. Errors a
plug-in raises on purpose (any :class:`SpecfitError`) pass through unchanged.

The engine and the trace replay call plug-ins through the same helpers here, so both enforce the
same contract. The checks run thousands of times per generation: they are vectorised or O(level).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Iterator, Sequence

import numpy as np

from specfit.types.tree import subtree_problem
from specfit.errors import PluginError, SpecfitError
from specfit.validation import is_collection

_MAX_DETAIL = 300  # characters of a plug-in's own exception message kept in the one-line error


def plugin_name(part: Any) -> str:
    """The registered name of a plug-in (its class name when it has none)."""
    name = getattr(part, "name", None)
    return name if isinstance(name, str) else type(part).__qualname__


def violation(kind: str, part: Any, hook: str, message: str) -> PluginError:
    """A plug-in broke its contract: ``selector 'x' (select): <message>``."""
    name = plugin_name(part)
    return PluginError(f"{kind} '{name}' ({hook}): {message}", plugin=name, kind=kind, hook=hook)


def failure(kind: str, part: Any, hook: str, exc: BaseException) -> PluginError:
    """A plug-in's hook raised ``exc``: one line with its type and message (raise it ``from exc``)."""
    detail = " ".join(str(exc).split())
    if len(detail) > _MAX_DETAIL:
        detail = detail[: _MAX_DETAIL - 3] + "..."
    name = plugin_name(part)
    what = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    return PluginError(f"{kind} '{name}' ({hook}) raised {what}", plugin=name, kind=kind, hook=hook)


def call(kind: str, part: Any, hook: str, *args: Any) -> Any:
    """``part.<hook>(*args)``; an exception other than a SpecfitError becomes a PluginError."""
    try:
        return getattr(part, hook)(*args)
    except SpecfitError:
        raise
    except Exception as exc:
        raise failure(kind, part, hook, exc) from exc


def check_flag(kind: str, part: Any, hook: str, value: Any, what: str) -> bool:
    """A yes/no answer (``should_draft``, ``Selection.stop``) must be a bool, not any truthy value."""
    if not isinstance(value, (bool, np.bool_)):
        raise violation(kind, part, hook, f"{what} must be a bool, got {type(value).__name__} {value!r:.40}")
    return bool(value)


def check_count(kind: str, part: Any, hook: str, value: Any, what: str, minimum: int = 0) -> int:
    """An integer the core sizes things by (slots per layer, a drafter's depth)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise violation(kind, part, hook, f"{what} must be an int >= {minimum}, got {value!r:.40}")
    return int(value)


# --------------------------------------------------------------------------- selectors


def check_selection(selector: Any, tree: Any, selection: Any) -> Any:
    """``selection`` as the engine may use it: node ids are ints in ``0..len(tree)-1`` whose
    ancestors are all chosen too (duplicates are harmless: verification dedupes), ``stop`` is a
    bool and ``predicted`` maps names to numbers. Returns ``selection``."""
    hook = "select"
    if not all(hasattr(selection, a) for a in ("nodes", "stop", "predicted")):
        raise violation("selector", selector, hook, f"returned {type(selection).__name__}, "
                        "expected a specfit.interfaces.Selection(nodes, stop, predicted)")
    nodes = selection.nodes
    if not is_collection(nodes):
        raise violation("selector", selector, hook, f"Selection.nodes={nodes!r:.40} must be a list of node ids")
    check_flag("selector", selector, hook, selection.stop, "Selection.stop")
    predicted = selection.predicted
    if not isinstance(predicted, dict) or not all(
            isinstance(k, str) and isinstance(v, Real) for k, v in predicted.items()):
        raise violation("selector", selector, hook, "Selection.predicted must map names (str) to numbers")
    problem = subtree_problem(tree, nodes)
    if problem:
        raise violation("selector", selector, hook, problem)
    return selection


def check_among_likeliest(selector: Any, selection: Any, likeliest: Sequence[int], max_nodes: int) -> None:
    """A selector that says it chooses among the tree's ``max_nodes`` likeliest nodes
    (``chooses_among_likeliest``) did: experts were predicted for those alone."""
    outside = set(map(int, selection.nodes)) - set(likeliest)
    if outside:
        raise violation("selector", selector, "select",
                        f"chose node {min(outside)}, which is not among the tree's {max_nodes} likeliest by path "
                        "probability, yet the selector says chooses_among_likeliest=True (experts are predicted "
                        "for those alone): set it False, or choose among tree.top_by_path_prob(ctx.max_nodes)")


# --------------------------------------------------------------------------- drafters


def drafted_levels(drafter: Any, tree: Any, vocab: int) -> Iterator[range]:
    """The drafter's levels, each checked before the engine sees it; closing this closes the drafter's."""
    levels = call("drafter", drafter, "draft", tree)
    try:
        steps = iter(levels)
    except TypeError as exc:
        raise violation("drafter", drafter, "draft", f"must return an iterator of levels, got {type(levels).__name__}") from exc
    try:
        depth = 0
        while True:
            try:
                level = next(steps)
            except StopIteration:
                return
            except SpecfitError:
                raise
            except Exception as exc:
                raise failure("drafter", drafter, "draft", exc) from exc
            depth += 1
            check_level(drafter, tree, level, depth, vocab)
            yield level
    finally:
        close = getattr(levels, "close", None)
        if close is not None:
            _close(drafter, close)


def _close(drafter: Any, close: Any) -> None:
    try:
        close()
    except SpecfitError:
        raise
    except Exception as exc:
        raise failure("drafter", drafter, "draft", exc) from exc


def check_level(drafter: Any, tree: Any, level: Any, depth: int, vocab: int) -> None:
    """Level ``depth`` just yielded: the tree's newest level, consistent, tokens in the vocabulary,
    parents in the level above, log-probabilities finite and <= 0."""
    def bad(message: str) -> PluginError:
        return violation("drafter", drafter, "draft", f"level {depth}: {message}")

    if not isinstance(level, range) or level.step != 1:
        raise bad(f"must yield the new level's node range, got {type(level).__name__} {level!r:.40}")
    n = len(tree.tokens)
    if tree.depth != depth or not (len(tree.parents) == len(tree.depths) == len(tree.log_probs) == len(tree.path_log_probs) == n):
        raise bad("the tree was not grown by exactly one level with DraftTree.add_level")
    if level.start != tree.level_starts[-1] or level.stop != n:
        raise bad(f"yielded {level}, but the new level is {range(tree.level_starts[-1], n)}")
    if not len(level):
        return
    part = slice(level.start, level.stop)
    tokens = np.asarray(tree.tokens[part])
    if tokens.dtype.kind not in "iu" or int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
        t = next((t for t in tree.tokens[part] if not (isinstance(t, (int, np.integer)) and 0 <= t < vocab)), tokens.dtype)
        raise bad(f"token {t!r:.40} is outside the vocabulary (size {vocab})")
    parents = np.asarray(tree.parents[part], dtype=np.int64)
    low, high = (-1, -1) if depth == 1 else (tree.level_starts[-2], level.start - 1)
    outside = (parents < low) | (parents > high)
    if outside.any():
        where = "the root (-1)" if depth == 1 else f"nodes {low}..{high} of level {depth - 1}"
        raise bad(f"node {level.start + int(np.argmax(outside))} has parent {int(parents[outside][0])}, not one of {where}")
    log_probs = np.asarray(tree.log_probs[part], dtype=np.float64)
    wrong = ~np.isfinite(log_probs) | (log_probs > 0.0)
    if wrong.any():
        i = int(np.argmax(wrong))
        value = float(log_probs[i])
        reason = "not finite" if not math.isfinite(value) else "above 0"
        raise bad(f"log-probability {value} of node {level.start + i} is {reason}")

# --------------------------------------------------------------------------- predictors


def check_predicted_experts(predictor: Any, tree: Any, nodes: Sequence[int], layers: int, top_k: int,
                            experts: int) -> None:
    """After ``predict(tree, nodes)``: ``tree.experts`` ([>= len(tree), layers, top_k]) and
    ``tree.root_experts`` ([layers, top_k]), where set, are integer arrays whose rows for ``nodes``
    and the root hold expert ids in ``-1..experts-1`` (earlier rows were checked when filled); the
    optional ``tree.expert_probs`` ([>= len(tree), layers, experts]) and ``tree.root_expert_probs``
    ([layers, experts]) are float arrays of probabilities (NaN: not predicted)."""
    # (the tree's attribute, its rows: None for the root's, its last axis, whether it holds expert ids)
    fields = (("root_experts", None, top_k, True), ("experts", len(tree), top_k, True),
              ("root_expert_probs", None, experts, False), ("expert_probs", len(tree), experts, False))
    for name, rows, width, ids in fields:
        arr, field = getattr(tree, name), f"tree.{name}"
        if arr is None:
            continue
        kinds, what = ("iu", "an int") if ids else ("f", "a float")
        if not isinstance(arr, np.ndarray) or arr.dtype.kind not in kinds or arr.ndim != (2 if rows is None else 3) \
                or arr.shape[-2:] != (layers, width) or (rows is not None and arr.shape[0] < rows):
            got = f"{arr.dtype} array of shape {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
            want = f"[{layers}, {width}]" if rows is None else f"[>= {rows}, {layers}, {width}]"
            raise violation("predictor", predictor, "predict", f"{field} must be {what} array {want}, got {got}")
        used = arr if rows is None else (arr[nodes.start:nodes.stop] if isinstance(nodes, range)  # a view
                                         else arr[np.asarray(nodes, dtype=np.int64)])
        if not used.size:
            continue
        if ids and (int(used.min()) < -1 or int(used.max()) >= experts):
            value = int(used.min()) if int(used.min()) < -1 else int(used.max())
            raise violation("predictor", predictor, "predict",
                            f"{field} holds expert id {value}, outside -1..{experts - 1}")
        if not ids and ((used < 0) | (used > 1)).any():  # NaN (not predicted) passes
            raise violation("predictor", predictor, "predict", f"{field} holds a probability outside 0..1")


def feature_layers(drafter: Any, layers: int | None) -> tuple[int, ...]:
    """The drafter's ``feature_layers()``: HF ``hidden_states`` indices, 0 (embeddings) to ``layers``."""
    wanted = call("drafter", drafter, "feature_layers")
    try:
        wanted = tuple(wanted)
    except TypeError:
        raise violation("drafter", drafter, "feature_layers", f"must return a sequence of ints, got {wanted!r:.40}") from None
    for i in wanted:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)) or i < 0 or (layers is not None and i > layers):
            span = f"0..{layers}" if layers is not None else "ints >= 0"
            raise violation("drafter", drafter, "feature_layers",
                            f"hidden-state index {i!r:.40} is out of range ({span}: the embeddings, then each layer)")
    return tuple(int(i) for i in wanted)
