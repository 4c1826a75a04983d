"""Index arithmetic for CheckpointManifest rules: the `let` and `where` fields.

Some upstream layouts flatten what the canonical layout nests, with a stride that depends on the config (the
original Wan2.1 VAE decoder: `decoder.upsamples.{k}` with `num_res_blocks + 1` residual blocks and one resample per
stage -> `decoder.up_blocks.{k // (num_res_blocks + 2)}.resnets.{k % (num_res_blocks + 2)}`). A plain regex
template cannot compute that, so a rule may carry

    "let":   {"stage": "g1 // (num_res_blocks + 2)", "r": "g1 % (num_res_blocks + 2)"}
                 integer values, evaluated in order (a later one may use an earlier one), substituted into the
                 rule's `to` template(s) as {stage}, {r} (after the usual \\1 group references)
    "where": "g1 % (num_res_blocks + 2) == num_res_blocks + 1"
                 the rule matches a key only when its regex matches AND this is true (else the next rule is
                 tried, and a key no rule matches is an error as always)

An expression is a small, side-effect-free subset of Python, evaluated by walking its syntax tree (never
`eval`): integer (and true/false) literals; names; + - * // %; unary - and `not`; comparisons (== != < <= > >=,
chained); `and` / `or`; `a if cond else b`; parentheses. Names are:

    g1, g2, ...      the regex's numbered groups, as integers (a group that is not a decimal integer is an error)
    <group name>     a named group (?P<name>...), as an integer
    <let name>       an earlier `let` value of the same rule
    anything else    a field of the family config the conversion uses (an int or bool; e.g. num_res_blocks,
                     is_residual), checked against the family when the manifest is loaded

Rules without `let` keep their templates byte for byte (a literal `{` stays literal): the ops are additive.
"""

from __future__ import annotations

import ast
import operator
from typing import Any, Mapping

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge}


class Unresolved(Exception):
    """A name the environment does not hold (a config field when no config is given)."""


class ExprError(ValueError):
    """An expression that cannot be evaluated (bad operand, division by zero, non-integer group)."""


class Expr:
    """One parsed expression. `names`: every name it reads. `eval(env)` -> int | bool."""

    def __init__(self, source: str):
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"expression must be a non-empty string, got {source!r}")
        self.source = source
        try:
            tree = ast.parse(source.strip(), mode="eval")
        except SyntaxError as e:
            raise ValueError(f"expression {source!r} does not parse ({e.msg})") from None
        self.names: set[str] = set()
        self._check(tree.body)
        self._tree = tree.body

    def _check(self, n: ast.AST) -> None:
        bad = lambda what: ValueError(f"expression {self.source!r}: {what} is not allowed (integer arithmetic "
                                      f"+ - * // %, comparisons, and/or/not, `a if c else b` only)")
        if isinstance(n, ast.Constant):
            if not isinstance(n.value, int):   # bool is an int
                raise bad(f"the literal {n.value!r}")
        elif isinstance(n, ast.Name):
            self.names.add(n.id)
        elif isinstance(n, ast.BinOp):
            if type(n.op) not in _BINOPS:
                raise bad(f"operator {type(n.op).__name__}")
            self._check(n.left)
            self._check(n.right)
        elif isinstance(n, ast.UnaryOp):
            if not isinstance(n.op, (ast.USub, ast.Not)):
                raise bad(f"operator {type(n.op).__name__}")
            self._check(n.operand)
        elif isinstance(n, ast.Compare):
            if any(type(o) not in _CMPOPS for o in n.ops):
                raise bad("that comparison")
            for c in (n.left, *n.comparators):
                self._check(c)
        elif isinstance(n, ast.BoolOp):
            for v in n.values:
                self._check(v)
        elif isinstance(n, ast.IfExp):
            for c in (n.test, n.body, n.orelse):
                self._check(c)
        else:
            raise bad(type(n).__name__)

    def eval(self, env: Mapping[str, Any]) -> int:
        return self._eval(self._tree, env)

    def _eval(self, n: ast.AST, env: Mapping[str, Any]):
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.Name):
            if n.id not in env:
                raise Unresolved(n.id)
            v = env[n.id]
            if not isinstance(v, int):
                raise ExprError(f"{n.id} is {v!r}, not an integer")
            return v
        if isinstance(n, ast.BinOp):
            a, b = self._eval(n.left, env), self._eval(n.right, env)
            if isinstance(n.op, (ast.FloorDiv, ast.Mod)) and b == 0:
                raise ExprError(f"division by zero in {self.source!r}")
            return _BINOPS[type(n.op)](a, b)
        if isinstance(n, ast.UnaryOp):
            v = self._eval(n.operand, env)
            return -v if isinstance(n.op, ast.USub) else (not v)
        if isinstance(n, ast.Compare):
            left = self._eval(n.left, env)
            for op, c in zip(n.ops, n.comparators):
                right = self._eval(c, env)
                if not _CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(n, ast.BoolOp):
            if isinstance(n.op, ast.And):
                for v in n.values:
                    if not self._eval(v, env):
                        return False
                return True
            for v in n.values:
                if self._eval(v, env):
                    return True
            return False
        if isinstance(n, ast.IfExp):
            return self._eval(n.body if self._eval(n.test, env) else n.orelse, env)
        raise ExprError(f"cannot evaluate {type(n).__name__}")  # pragma: no cover - _check refuses it

    def __repr__(self) -> str:
        return f"Expr({self.source!r})"


def group_env(m, key: str) -> dict[str, int]:
    """g1..gN and named groups of a match, as integers; a group that is not a decimal integer (or did not take
    part in the match) is left out, and the rule reports an expression that reads it."""
    env: dict[str, int] = {}
    for i, v in enumerate(m.groups(), start=1):
        if v is not None and v.isdecimal():
            env[f"g{i}"] = int(v)
    for name, v in m.groupdict().items():
        if v is not None and v.isdecimal():
            env[name] = int(v)
    return env
