"""GSM-style math problems generated from the GSM-Symbolic templates in ``gsm/eng``.

Each template (``NNNN.toml``) has a ``question_annotated`` with ``{var,default}`` placeholders
followed by ``#init:`` (how to sample the variables), ``#conditions:`` (python boolean
expressions that a valid sample satisfies) and ``#answer:`` (the final answer as an expression),
and an ``answer_annotated`` whose ``{expr}`` placeholders are python expressions. New variants
give the target model (and the draft head) arithmetic text in the GSM8K format without ever
training on the held-out templates.

Expressions are evaluated by :func:`safe_eval`: the expression is parsed, checked against a
whitelist of syntax (no attributes, no subscripted dunders, no lambdas or comprehensions, bounded
powers) and evaluated with no builtins except the handful of functions the templates use.

Init semantics (inferred from the templates; GSM-Symbolic's own generator is not available here):

* ``$x = range(a, b[, step])`` / ``arange(a, b, step)``: a uniform draw from that range
  (python's half-open ``range``; ``arange`` like numpy's, for floats);
* ``x = sample(list)`` one item, ``x, y = sample(list, 2)`` distinct items; ``list`` may be a
  literal or a name in ``replacements.json``; items that are tuples/pairs unpack over the targets;
* ``a, b = sample_sequential(list, k)``: ``k`` consecutive items (e.g. consecutive weekdays);
* ``t, v = range_str(a, b, step, numbers)``: a number ``v`` from the range and its word ``t``;
* ``range_list(a, b)``: ``list(range(a, b))`` (a population for ``sample``);
* anything else: a python expression over the variables drawn so far.

Strings drawn from lists that look like numbers (``"0.25"``, ``"1/2"``) become numbers that
still print as written, so ``{frac}`` renders ``1/2`` while ``n * frac`` computes.
"""

from __future__ import annotations

import ast
import fractions
import json
import math
import os
import random
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from specfit.data.paths import resolve_data_dir

#: Template ids used for training data (0000-0063).
TRAIN_TEMPLATES: tuple[int, ...] = tuple(range(0, 64))
#: Template ids kept out of all training data, for evaluation only (0064-0079).
HELDOUT_TEMPLATES: tuple[int, ...] = tuple(range(64, 80))

#: Training-text layout of one problem. Evaluation prompts end right after ``Answer:``.
PROBLEM_FORMAT = "Question: {question}\nAnswer: {answer}\n"


class TemplateError(ValueError):
    """A template that cannot be parsed or whose expressions use unsupported syntax."""


class SampleRejected(Exception):
    """A sampled assignment failed a condition or produced an inconsistent rendering."""


@dataclass
class Problem:
    """One generated problem: question, worked answer (with ``<<a*b=c>>`` steps and ``#### N``)
    and the final answer as it appears after ``####``."""

    template_id: int
    question: str
    answer: str
    final: str


@dataclass
class GenerationReport:
    """What happened while generating: per-template counts and the templates that were skipped."""

    generated: dict[int, int] = field(default_factory=dict)
    rejected_samples: dict[int, int] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# numbers and formatting


class Num(float):
    """A number drawn from a list of strings: computes as a float, prints as the original text."""

    text: str

    def __new__(cls, value: float, text: str) -> "Num":
        obj = super().__new__(cls, value)
        obj.text = text
        return obj

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        return self.text if not spec else format(float(self), spec)


_NUMERIC_STR = re.compile(r"^\s*-?\d+(\.\d+)?(\s*/\s*\d+)?\s*$")


def _numberify(value: Any) -> Any:
    """Turn numeric-looking strings into :class:`Num`; recurse into tuples/lists."""
    if isinstance(value, str) and _NUMERIC_STR.match(value):
        if "/" in value:
            num, den = value.split("/")
            return Num(float(num) / float(den), value.strip())
        return Num(float(value), value.strip())
    if isinstance(value, tuple):
        return tuple(_numberify(v) for v in value)
    if isinstance(value, list):
        return [_numberify(v) for v in value]
    return value


def is_int(x: Any, tol: float = 1e-9) -> bool:
    """True when ``x`` is (numerically) a whole number."""
    try:
        xf = float(x)
    except (TypeError, ValueError):
        return False
    return math.isfinite(xf) and abs(xf - round(xf)) <= tol * max(1.0, abs(xf))


def divides(a: Any, b: Any) -> bool:
    """GSM-Symbolic's ``divides(a, b)``: ``b`` divides ``a`` (``a / b`` is a whole number)."""
    if float(b) == 0:
        return False
    return is_int(float(a) / float(b))


def ensure_int(x: Any) -> Any:
    """``x`` as an int when it is whole; otherwise the sample is rejected (answers must be clean)."""
    if is_int(x):
        return int(round(float(x)))
    raise SampleRejected(f"ensure_int({x!r}) is not a whole number")


def _fraction(x: Any) -> fractions.Fraction:
    return fractions.Fraction(float(x)).limit_denominator(1000)


def format_number(x: Any) -> str:
    """Render a value the way GSM8K writes it: whole floats without ``.0``, no float noise."""
    if isinstance(x, Num):
        return x.text
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    if isinstance(x, fractions.Fraction):
        return str(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            raise SampleRejected(f"non-finite value {x}")
        if is_int(x, 1e-9) and abs(x) < 1e15:
            return str(int(round(x)))
        s = f"{x:.6f}".rstrip("0").rstrip(".")
        return "0" if s in ("-0", "") else s
    return str(x)


# --------------------------------------------------------------------------------------------
# restricted evaluation

_ALLOWED_NODES: tuple[type, ...] = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Call, ast.Name,
    ast.Load, ast.Constant, ast.Tuple, ast.List, ast.IfExp, ast.keyword, ast.Subscript,
    ast.Slice,
    ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd,
    ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In,
    ast.NotIn,
)

#: Functions available to template expressions (nothing else: no builtins).
SAFE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "int": int, "float": float, "round": round, "abs": abs, "min": min, "max": max, "sum": sum,
    "len": len, "range": range, "str": str, "bool": bool, "list": list, "tuple": tuple,
    "sorted": sorted, "math_floor": math.floor, "floor": math.floor, "ceil": math.ceil,
    "sqrt": math.sqrt,
    "is_int": is_int, "divides": divides, "ensure_int": ensure_int, "Fraction": _fraction,
}

_COMPILED: dict[str, Any] = {}


def _check_ast(tree: ast.AST, expr: str) -> None:
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise TemplateError(f"unsupported syntax {type(node).__name__} in {expr!r}")
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            raise TemplateError(f"dunder name in {expr!r}")
        if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name):
            raise TemplateError(f"only plain function calls are allowed: {expr!r}")
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            if not (isinstance(node.right, ast.Constant) and isinstance(node.right.value, (int, float))
                    and abs(node.right.value) <= 16):
                raise TemplateError(f"only small constant exponents are allowed: {expr!r}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 10_000:
            raise TemplateError("string constant too long")


def safe_eval(expr: str, variables: dict[str, Any],
              functions: dict[str, Callable[..., Any]] | None = None) -> Any:
    """Evaluate a template expression with whitelisted syntax and functions, no builtins.

    Raises :class:`TemplateError` for disallowed syntax or unknown names.
    """
    code = _COMPILED.get(expr)
    if code is None:
        try:
            tree = ast.parse(expr.strip(), mode="eval")
        except SyntaxError as exc:
            raise TemplateError(f"cannot parse {expr!r}: {exc.msg}") from None
        _check_ast(tree, expr)
        code = compile(tree, "<template>", "eval")
        _COMPILED[expr] = code
    env: dict[str, Any] = dict(SAFE_FUNCTIONS)
    if functions:
        env.update(functions)
    env.update(variables)
    try:
        return eval(code, {"__builtins__": {}}, env)  # noqa: S307 - syntax whitelisted above
    except NameError as exc:
        raise TemplateError(f"unknown name in {expr!r}: {exc}") from None
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as exc:
        raise SampleRejected(f"{expr!r}: {exc}") from None


# --------------------------------------------------------------------------------------------
# templates


@dataclass
class Template:
    """A parsed GSM-Symbolic template."""

    template_id: int
    question: str  # with {var,default} placeholders
    inits: list[tuple[list[str], str]]  # (targets, right-hand side)
    conditions: list[str]
    answer_expr: str
    answer: str  # with {expr} placeholders


_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_INIT = re.compile(r"^\s*-\s*(?P<targets>\$?\s*[A-Za-z_]\w*(?:\s*,\s*\$?\s*[A-Za-z_]\w*)*)\s*=(?!=)\s*(?P<rhs>.+?)\s*$")
_CALC = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def parse_template(template_id: int, data: dict[str, Any]) -> Template:
    """Split a template's TOML fields into question, init assignments, conditions and answer."""
    qa = data.get("question_annotated")
    aa = data.get("answer_annotated")
    if not isinstance(qa, str) or not isinstance(aa, str):
        raise TemplateError("missing question_annotated / answer_annotated")
    if "#init:" not in qa or "#answer:" not in qa:
        raise TemplateError("no #init: or #answer: block")
    question, rest = qa.split("#init:", 1)
    answer_expr = ""
    if "#answer:" in rest:
        rest, answer_expr = rest.split("#answer:", 1)
    answer_expr = answer_expr.strip()
    if "#conditions:" in rest:
        init_block, cond_block = rest.split("#conditions:", 1)
    else:
        init_block, cond_block = rest, ""
    inits: list[tuple[list[str], str]] = []
    for line in init_block.splitlines():
        if not line.strip():
            continue
        m = _INIT.match(line)
        if not m:
            raise TemplateError(f"cannot parse init line {line.strip()!r}")
        targets = [t.strip().lstrip("$").strip() for t in m.group("targets").split(",")]
        inits.append((targets, m.group("rhs")))
    conditions = []
    for line in cond_block.splitlines():
        s = line.strip()
        if s.startswith("-"):
            s = s[1:].strip()
            if s:
                conditions.append(s)
        elif s:
            raise TemplateError(f"cannot parse condition line {s!r}")
    if not answer_expr:
        raise TemplateError("empty #answer:")
    return Template(template_id, question.strip(), inits, conditions, answer_expr, aa.strip())


def template_path(data_dir: str | os.PathLike[str] | None, template_id: int) -> Path:
    root = resolve_data_dir(data_dir, "gsm/eng")
    return root / "gsm" / "eng" / f"{template_id:04d}.toml"


def load_template(data_dir: str | os.PathLike[str] | None, template_id: int) -> Template:
    """Read and parse ``gsm/eng/NNNN.toml``."""
    path = template_path(data_dir, template_id)
    try:
        with path.open("rb") as fh:
            return parse_template(template_id, tomllib.load(fh))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, KeyError, TypeError, TemplateError) as exc:
        raise TemplateError(f"{path}: not a usable template ({type(exc).__name__}: {exc})") from exc


def load_replacements(data_dir: str | os.PathLike[str] | None) -> dict[str, list[Any]]:
    """The name/value lists of ``gsm/replacements.json`` (JSON arrays of pairs become tuples)."""
    root = resolve_data_dir(data_dir, "gsm/replacements.json")
    path = root / "gsm" / "replacements.json"
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
        return {k: [tuple(v) if isinstance(v, list) else v for v in vals] for k, vals in raw.items()}
    except (ValueError, AttributeError, TypeError) as exc:  # bad JSON or bytes, or not an object of lists
        raise TemplateError(f"{path}: not a usable replacements file ({type(exc).__name__}: {exc})") from exc


# --------------------------------------------------------------------------------------------
# sampling


def _sampling_functions(rng: random.Random) -> dict[str, Callable[..., Any]]:
    def sample(population: Iterable[Any], k: int | None = None) -> Any:
        pop = list(population)
        if not pop:
            raise SampleRejected("sample from an empty population")
        if k is None:
            return rng.choice(pop)
        if k > len(pop):
            raise TemplateError(f"sample of {k} from {len(pop)} items")
        return tuple(rng.sample(pop, k))

    def sample_sequential(population: Iterable[Any], k: int) -> tuple[Any, ...]:
        pop = list(population)
        if k > len(pop):
            raise TemplateError(f"sample_sequential of {k} from {len(pop)} items")
        start = rng.randrange(len(pop) - k + 1)
        return tuple(pop[start:start + k])

    def range_str(start: int, stop: int, step: int = 1, words: Sequence[str] | None = None) -> tuple[Any, int]:
        value = rng.choice(range(int(start), int(stop), int(step)))
        if words is None:
            return str(value), value
        if not 0 <= value - 1 < len(words):
            raise TemplateError(f"range_str value {value} has no word")
        return words[value - 1], value

    def range_list(start: int, stop: int, step: int = 1) -> list[int]:
        return list(range(int(start), int(stop), int(step)))

    return {"sample": sample, "sample_sequential": sample_sequential, "range_str": range_str,
            "range_list": range_list, "arange": _arange}


def _arange(start: float, stop: float, step: float = 1.0) -> list[float]:
    n = max(0, math.ceil((stop - start) / step - 1e-9))
    return [round(start + i * step, 10) for i in range(n)]


_DRAW = re.compile(r"^(range|arange)\s*\((.*)\)$")


def sample_assignment(template: Template, replacements: dict[str, list[Any]],
                      rng: random.Random) -> dict[str, Any]:
    """Draw one assignment of the template's variables (conditions not yet checked)."""
    funcs = _sampling_functions(rng)
    env: dict[str, Any] = {}
    for targets, rhs in template.inits:
        variables = {**replacements, **env}
        m = _DRAW.match(rhs.strip())
        if m:
            args = safe_eval(f"({m.group(2)},)", variables, funcs)
            pop = range(*(int(a) for a in args)) if m.group(1) == "range" else _arange(*args)
            if len(pop) == 0:
                raise TemplateError(f"empty range {rhs!r}")
            value: Any = rng.choice(pop)
        else:
            value = safe_eval(rhs, variables, funcs)
        value = _numberify(value)
        if len(targets) == 1:
            env[targets[0]] = value
        else:
            if not isinstance(value, (tuple, list)) or len(value) != len(targets):
                raise TemplateError(f"cannot unpack {rhs!r} into {len(targets)} variables")
            env.update(zip(targets, value))
    return env


def _placeholder_value(content: str, env: dict[str, Any]) -> str:
    """Render a question placeholder: ``{var,default}`` -> the variable, ``{expr}`` -> its value."""
    m = re.match(r"^\s*([A-Za-z_]\w*)\s*,", content)
    if m:
        name = m.group(1)
        if name not in env:
            raise TemplateError(f"placeholder variable {name!r} is never initialised")
        return format_number(env[name])
    return format_number(safe_eval(content, env))


def _check_calculations(text: str) -> None:
    """Every ``<<lhs=rhs>>`` annotation must hold (rejects samples that render wrong arithmetic).

    The tolerance allows for operands that were rendered rounded to six decimals."""
    for m in _CALC.finditer(text):
        lhs, rhs = m.group(1), m.group(2)
        try:
            left = safe_eval(lhs.replace("x", "*") if re.fullmatch(r"[\d.\sx()+\-*/]+", lhs) else lhs, {})
            right = safe_eval(rhs, {})
        except (TemplateError, SampleRejected):
            continue  # not pure arithmetic (units, words): nothing to check
        if not isinstance(left, (int, float)) or not isinstance(right, (int, float)):
            continue
        if not math.isclose(float(left), float(right), rel_tol=1e-4, abs_tol=1e-4):
            raise SampleRejected(f"calculator step <<{lhs}={rhs}>> is wrong")


def render(template: Template, env: dict[str, Any]) -> Problem:
    """Render question and worked answer for an assignment; verify the final answer.

    Raises :class:`SampleRejected` when a condition fails or the rendered ``#### N`` differs from
    the ``#answer`` expression's value, :class:`TemplateError` when the template is unusable.
    """
    for cond in template.conditions:
        if not safe_eval(cond, env):
            raise SampleRejected(f"condition {cond!r} failed")
    question = _PLACEHOLDER.sub(lambda m: _placeholder_value(m.group(1), env), template.question)
    answer = _PLACEHOLDER.sub(lambda m: format_number(safe_eval(m.group(1), env)), template.answer)
    expected = safe_eval(template.answer_expr, env)
    fm = re.search(r"####\s*(.+?)\s*$", answer)
    if not fm:
        raise TemplateError("answer has no final '#### N' line")
    final = fm.group(1).replace(",", "").strip()
    try:
        final_value = float(final)
    except ValueError:
        raise SampleRejected(f"final answer {final!r} is not a number") from None
    if not is_int(final_value):
        raise SampleRejected(f"final answer {final!r} is not a whole number")
    if not math.isclose(final_value, float(expected), rel_tol=1e-9, abs_tol=1e-6):
        raise SampleRejected(f"rendered final {final} != #answer {expected}")
    if final_value < 0:
        raise SampleRejected("negative final answer")
    _check_calculations(answer)
    return Problem(template.template_id, question, answer, final)


def generate_from_template(template: Template, replacements: dict[str, list[Any]], n: int,
                           rng: random.Random, max_attempts: int = 20_000,
                           distinct: bool = True) -> tuple[list[Problem], int]:
    """Up to ``n`` variants of one template (distinct questions when ``distinct``); returns
    (problems, rejected samples). Stops after ``max_attempts`` draws."""
    problems: list[Problem] = []
    seen: set[str] = set()
    rejected = 0
    for _ in range(max_attempts):
        if len(problems) >= n:
            break
        try:
            problem = render(template, sample_assignment(template, replacements, rng))
        except SampleRejected:
            rejected += 1
            continue
        if distinct and problem.question in seen:
            rejected += 1
            continue
        seen.add(problem.question)
        problems.append(problem)
    return problems, rejected


def generate_problems(data_dir: str | os.PathLike[str] | None, templates: Iterable[int],
                      n_per_template: int, seed: int = 0, *, max_attempts: int = 20_000,
                      report: GenerationReport | None = None) -> list[Problem]:
    """Generate ``n_per_template`` verified variants of each template id (fewer when a template
    has few distinct variants). Templates that cannot be parsed or evaluated are skipped and
    listed in ``report.skipped``. Deterministic in ``seed`` (each template gets its own RNG, so
    adding a template does not change the others' problems)."""
    replacements = load_replacements(data_dir)
    report = report if report is not None else GenerationReport()
    out: list[Problem] = []
    for tid in templates:
        rng = random.Random(f"{seed}:{tid}")
        try:
            template = load_template(data_dir, tid)
            problems, rejected = generate_from_template(template, replacements, n_per_template, rng,
                                                        max_attempts=max_attempts)
        except (TemplateError, OSError, tomllib.TOMLDecodeError) as exc:
            report.skipped[tid] = str(exc)
            continue
        if not problems:
            report.skipped[tid] = f"no valid sample in {max_attempts} attempts"
            continue
        report.generated[tid] = len(problems)
        report.rejected_samples[tid] = rejected
        out.extend(problems)
    return out


def format_problem(problem: Problem) -> str:
    """Training text of one problem (:data:`PROBLEM_FORMAT`)."""
    return PROBLEM_FORMAT.format(question=problem.question, answer=problem.answer)


def format_prompt(problem: Problem) -> str:
    """Evaluation prompt: the question and ``Answer:``; the model writes the worked answer."""
    return f"Question: {problem.question}\nAnswer:"


def load_original_problems(data_dir: str | os.PathLike[str] | None,
                           templates: Iterable[int]) -> list[Problem]:
    """The original GSM8K problems (``question`` / ``answer`` fields) of the given templates."""
    out = []
    for tid in templates:
        path = template_path(data_dir, tid)
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
            answer = data["answer"].strip()
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, KeyError, AttributeError) as exc:
            raise TemplateError(f"{path}: not a usable template ({type(exc).__name__}: {exc})") from exc
        fm = re.search(r"####\s*(.+?)\s*$", answer)
        out.append(Problem(tid, data["question"].strip(), answer, fm.group(1).strip() if fm else ""))
    return out
