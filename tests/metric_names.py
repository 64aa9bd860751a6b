"""The scanner behind tests/unit/test_docs_config.py's metrics-table checks: the metric names the
code can write (`written_metrics`, read from syntax trees), the names docs/recipes.md's table
holds (`metrics_table`), and the two comparisons. The rule each follows is that test module's
docstring.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("recipes", "hybridflow", "workers")
MATH = ("hybridflow", "algos")  # the pure functions that return (value, stats)
NAMESPACED = re.compile(r"[a-z][a-z0-9_]*/\S+")
PLACEHOLDER = re.compile(r"<[^<>]*>")
READ_ONLY = {"get", "items", "keys", "values", "pop", "copy"}  # a dict's methods that add no key
VALUES_ONLY = {"read_floats"}  # functions that change a dict's values in place, never its keys
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
COMPREHENSIONS = (ast.DictComp, ast.ListComp, ast.SetComp, ast.GeneratorExp)


# ---- what the code writes ------------------------------------------------------------------------


def repo_sources() -> dict[str, str]:
    """Path under the repository -> text, for every Python file of recipes/, hybridflow/, workers/."""
    return {str(p.relative_to(ROOT)): p.read_text() for top in SOURCES for p in sorted((ROOT / top).rglob("*.py"))}


def placeholder(node: ast.AST) -> str:
    return "<" + re.sub(r"[<>\s]", "", ast.unparse(node)) + ">"


def is_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def method_of(node: ast.AST, name: str) -> str | None:
    """`m` for a call `name.m(...)`, else None."""
    f = node.func if isinstance(node, ast.Call) else None
    return f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == name else None


class Scan:
    """The sources' syntax trees and what the rule follows through them: each node's parent and
    module, the functions by name, the functions each registry holds, the calls by callee name."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.trees = {rel: ast.parse(text, rel) for rel, text in sources.items()}
        self.parent: dict[ast.AST, ast.AST] = {}
        self.module: dict[ast.AST, str] = {}
        self.functions: dict[str, list[ast.FunctionDef]] = {}
        self.calls: dict[str, list[ast.Call]] = {}
        for rel, tree in self.trees.items():
            for node in ast.walk(tree):
                self.module[node] = rel
                self.parent.update(dict.fromkeys(ast.iter_child_nodes(node), node))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions.setdefault(node.name, []).append(node)
                elif isinstance(node, ast.Call):
                    f = node.func
                    self.calls.setdefault(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""), []).append(node)
        self.registered: dict[str, list[ast.FunctionDef]] = {}
        for fn in itertools.chain(*self.functions.values()):  # @REG.register("name")
            for d in fn.decorator_list:
                if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "register" \
                        and isinstance(d.func.value, ast.Name):
                    self.registered.setdefault(d.func.value.id, []).append(fn)
        for call in self.calls.get("add", []):  # REG.add("name", fn)
            if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name) and len(call.args) == 2 \
                    and isinstance(call.args[1], ast.Name):
                self.registered.setdefault(call.func.value.id, []).extend(self.functions.get(call.args[1].id, []))

    # -- scopes and calls ------------------------------------------------------------------------

    def scope_of(self, node: ast.AST) -> ast.AST:
        """The function whose local names `node` sees, or its module."""
        up = self.parent.get(node)
        while up is not None and not isinstance(up, FUNCTIONS):
            up = self.parent.get(up)
        return up if up is not None else self.trees[self.module[node]]

    def body(self, scope: ast.AST) -> list[ast.AST]:
        """Every node of `scope`, not of the functions and classes defined in it."""
        out, todo = [], list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            out.append(node)
            if not isinstance(node, (*FUNCTIONS, ast.ClassDef)):
                todo.extend(ast.iter_child_nodes(node))
        return out

    def params(self, scope: ast.AST) -> list[str]:
        if not isinstance(scope, FUNCTIONS):
            return []
        a = scope.args
        return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]]

    def callees(self, call: ast.Call) -> list[ast.FunctionDef]:
        """The functions a call may run, by name: for `self.f()` the caller's class's own `f` if it
        has one; for `f()` the module's own `f` if it has one; for `REG.get(name)(...)` every
        function registered in REG."""
        f = call.func
        if isinstance(f, ast.Call) and isinstance(f.func, ast.Attribute) and f.func.attr == "get" \
                and isinstance(f.func.value, ast.Name):
            return self.registered.get(f.func.value.id, [])
        if isinstance(f, ast.Name):
            top = [fn for fn in self.functions.get(f.id, []) if isinstance(self.parent[fn], ast.Module)]
            return [fn for fn in top if self.module[fn] == self.module[call]] or top
        if isinstance(f, ast.Attribute):
            named = self.functions.get(f.attr, [])
            if method_of(call, "self"):
                cls = self.parent.get(self.scope_of(call))
                return [fn for fn in named if self.parent[fn] is cls] or named
            return named
        return []

    def call_sites(self, fn: ast.AST) -> list[ast.Call]:
        return [c for c in self.calls.get(getattr(fn, "name", ""), []) if fn in self.callees(c)]

    # -- the keys a dict can hold ------------------------------------------------------------------

    def keys(self, expr: ast.AST, scope: ast.AST, seen: frozenset) -> set[str]:
        """The keys the dict `expr` evaluates to can hold (for a sequence: its items), with a
        placeholder for each part the scan cannot follow."""
        if isinstance(expr, ast.Dict):
            return set().union(*(self.keys(v, scope, seen) if k is None else self.patterns(k, scope, seen)
                                 for k, v in zip(expr.keys, expr.values)))
        if isinstance(expr, ast.DictComp):
            return self.patterns(expr.key, scope, seen)
        if isinstance(expr, ast.Name):
            return self.name_keys(expr.id, scope, seen)
        if isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
            return {e.value if is_str(e) else placeholder(e) for e in expr.elts}
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.BitOr):
            return self.keys(expr.left, scope, seen) | self.keys(expr.right, scope, seen)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict":
            return self.arguments_keys(expr, scope, seen)
        if isinstance(expr, ast.Call):
            return self.returned(expr, None, seen)
        return {placeholder(expr)}

    def arguments_keys(self, call: ast.Call, scope: ast.AST, seen: frozenset) -> set[str]:
        """The keys `dict(...)` or `d.update(...)` adds."""
        return set().union(*(self.keys(a, scope, seen) for a in call.args),
                           *({k.arg} if k.arg else self.keys(k.value, scope, seen) for k in call.keywords))

    def returned(self, call: ast.Call, index: int | None, seen: frozenset) -> set[str]:
        """The keys of what `call` returns (of element `index` of a returned tuple)."""
        fns = [fn for fn in self.callees(call) if (id(fn), index) not in seen]
        returns = [(fn, r.value) for fn in fns for r in self.body(fn) if isinstance(r, ast.Return) and r.value]
        if not returns:
            return {placeholder(call)}
        return set().union(*(self.element(v, index, fn, seen | {(id(fn), index)}) for fn, v in returns))

    def element(self, value: ast.AST, index: int | None, scope: ast.AST, seen: frozenset) -> set[str]:
        if index is None:
            return self.keys(value, scope, seen)
        if isinstance(value, (ast.Tuple, ast.List)):
            return self.keys(value.elts[index], scope, seen) if index < len(value.elts) else set()
        if isinstance(value, ast.Call):
            return self.returned(value, index, seen)
        return {placeholder(value)}

    def name_keys(self, name: str, scope: ast.AST, seen: frozenset) -> set[str]:
        """The keys of the dict a local (else module-level) name holds: what is assigned to it or
        stored in it; `<name>` where a parameter, a loop or a `with` binds it or a method the
        scan does not follow changes it."""
        if (id(scope), name) in seen:
            return set()
        seen |= {(id(scope), name)}
        bound = name in self.params(scope)
        out = {f"<{name}>"} if bound else set()
        for node in self.body(scope):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    unpacked = isinstance(target, (ast.Tuple, ast.List))
                    for i, t in enumerate(target.elts if unpacked else [target]):
                        if isinstance(t, ast.Name) and t.id == name:
                            out |= self.element(node.value, i if unpacked else None, scope, seen)
                            bound = True
                        elif isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name:
                            out |= self.patterns(t.slice, scope, seen)
            elif method_of(node, name) == "update":
                out |= self.arguments_keys(node, scope, seen)
            elif method_of(node, name) == "setdefault" and node.args:
                out |= self.patterns(node.args[0], scope, seen)
            elif method_of(node, name) not in READ_ONLY | {None}:
                out.add(placeholder(node))
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.withitem, ast.NamedExpr)):
                target = node.optional_vars if isinstance(node, ast.withitem) else node.target
                if target is not None and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target)):
                    out.add(f"<{name}>")
                    bound = True
        if not bound:
            out |= {f"<{name}>"} if isinstance(scope, ast.Module) else \
                self.name_keys(name, self.trees[self.module[scope]], seen)
        return out

    # -- the names a key expression can take ---------------------------------------------------------

    def patterns(self, key: ast.AST, scope: ast.AST, seen: frozenset = frozenset()) -> set[str]:
        if is_str(key):
            return {key.value}
        if isinstance(key, ast.JoinedStr):
            parts = [[v.value] if is_str(v) else sorted(self.values(v.value, scope, seen)) for v in key.values]
            return {"".join(p) for p in itertools.product(*parts)}
        if isinstance(key, ast.BinOp) and isinstance(key.op, ast.Add):
            return {a + b for a in self.patterns(key.left, scope, seen) for b in self.patterns(key.right, scope, seen)}
        return self.values(key, scope, seen)

    def values(self, expr: ast.AST, scope: ast.AST, seen: frozenset) -> set[str]:
        """The strings a formatted part can be: the keys of the dict a loop's key runs over, the
        arguments a parameter takes; else a placeholder."""
        if not isinstance(expr, ast.Name):
            return {placeholder(expr)}
        node = expr
        while node is not scope and node in self.parent:
            up = self.parent[node]
            for loop in up.generators if isinstance(up, COMPREHENSIONS) else [up] if isinstance(up, ast.For) else []:
                pair = isinstance(loop.target, ast.Tuple)
                key = loop.target.elts[0] if pair else loop.target
                if isinstance(key, ast.Name) and key.id == expr.id:
                    it = loop.iter
                    if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("items", "keys"):
                        it = it.func.value
                    elif pair:
                        return {f"<{expr.id}>"}
                    return {f"<{expr.id}>" if "<" in k else k for k in self.keys(it, self.scope_of(loop), seen)}
            node = up
        if expr.id in self.params(scope):
            return self.arguments(scope, expr.id)
        return {placeholder(expr)}

    def arguments(self, fn: ast.AST, name: str) -> set[str]:
        """What the callers pass for parameter `name` (literals; else a placeholder), and its default
        where a caller leaves it out."""
        a = fn.args
        positional = [p.arg for p in [*a.posonlyargs, *a.args]]
        defaults = {**dict(zip(reversed(positional), reversed(a.defaults))),
                    **{p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}}
        bound_self = isinstance(self.parent.get(fn), ast.ClassDef)  # called as obj.f(...): args start after self
        out, left_out = set(), False
        sites = self.call_sites(fn)
        for call in sites:
            given = [k.value for k in call.keywords if k.arg == name]
            if name in positional:
                i = positional.index(name) - int(bound_self and isinstance(call.func, ast.Attribute))
                given += call.args[i:i + 1] if i >= 0 else []
            out |= {g.value if is_str(g) else placeholder(g) for g in given}
            left_out |= not given
        if (left_out or not sites) and is_str(defaults.get(name)):
            out.add(defaults[name].value)
        return out or {f"<{name}>"}

    # -- where a stats dict goes ---------------------------------------------------------------------

    def passed_on(self, node: ast.AST, scope: ast.AST, index: int | None, seen: frozenset) -> bool:
        """Whether the dict `node` evaluates to (element `index` of it, a tuple) can reach a row
        with its keys unchanged."""
        up = self.parent.get(node)
        if isinstance(up, ast.Attribute) and up.attr in ("items", "keys") and getattr(self.parent[up], "func", 0) is up:
            return self.iterated(self.parent[up], scope, seen)
        if isinstance(up, (ast.For, ast.comprehension)) and up.iter is node:
            return self.iterated(node, scope, seen)
        if isinstance(up, (ast.Assign, ast.AnnAssign)) and up.value is node:
            for target in up.targets if isinstance(up, ast.Assign) else [up.target]:
                if index is not None and not isinstance(target, (ast.Tuple, ast.List)):
                    return True  # the tuple kept whole: not followed
                t = target.elts[index] if index is not None else target
                if isinstance(t, ast.Name) and self.reaches(t.id, scope, seen):
                    return True
            return False
        if isinstance(up, ast.Return):
            if (id(scope), index) in seen:
                return False
            sites = self.call_sites(scope)
            return not sites or any(self.passed_on(c, self.scope_of(c), index, seen | {(id(scope), index)})
                                    for c in sites)
        if isinstance(up, (ast.Tuple, ast.List)) and index is None:
            return self.passed_on(up, scope, up.elts.index(node), seen)
        if isinstance(up, ast.Dict):  # merged with **; a value under a key is nested, not a row
            return any(k is None and v is node for k, v in zip(up.keys, up.values)) and \
                self.passed_on(up, scope, None, seen)
        if isinstance(up, (ast.IfExp, ast.BoolOp, ast.Await, ast.Starred)):
            return self.passed_on(up, scope, index, seen)
        call = self.parent[up] if isinstance(up, ast.keyword) else up
        if isinstance(call, ast.Call) and call.func is not node:
            if isinstance(call.func, ast.Attribute) and call.func.attr == "update" \
                    and isinstance(call.func.value, ast.Name):
                return self.reaches(call.func.value.id, scope, seen)
            if isinstance(call.func, ast.Name) and call.func.id == "dict":
                return self.passed_on(call, scope, None, seen)
            if isinstance(call.func, ast.Name) and call.func.id in VALUES_ONLY:
                return False
            return True  # handed to a call the scan does not follow
        return False  # read: subscripted, compared, its own methods called

    def iterated(self, it: ast.AST, scope: ast.AST, seen: frozenset) -> bool:
        """A loop over a dict passes its keys on where it stores each under the same key, or
        builds a comprehension keyed by it."""
        loop = self.parent[it]
        if not isinstance(loop, (ast.For, ast.comprehension)) or loop.iter is not it:
            return self.passed_on(it, scope, None, seen)  # `sorted(d.items())` and the like
        key = loop.target.elts[0] if isinstance(loop.target, ast.Tuple) else loop.target
        if not isinstance(key, ast.Name):
            return False
        if isinstance(loop, ast.For):
            return any(isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                       and isinstance(n.slice, ast.Name) and n.slice.id == key.id
                       and self.reaches(n.value.id, scope, seen) for s in loop.body for n in ast.walk(s))
        comp = self.parent[loop]
        return isinstance(comp, ast.DictComp) and isinstance(comp.key, ast.Name) and comp.key.id == key.id \
            and self.passed_on(comp, scope, None, seen)

    def reaches(self, name: str, scope: ast.AST, seen: frozenset) -> bool:
        """Whether a local dict passes its keys on (see passed_on)."""
        if name == "_" or (id(scope), name) in seen:
            return False
        return any(self.passed_on(n, scope, None, seen | {(id(scope), name)}) for n in self.body(scope)
                   if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load))

    def bare_stats(self, call: ast.Call) -> set[str]:
        """The names without a namespace among the stats a hybridflow/algos function returns to
        this caller (`value, stats = f(...)` or `stats = f(...)`), if it passes them on unchanged."""
        up, scope = self.parent[call], self.scope_of(call)
        if not isinstance(up, ast.Assign) or len(up.targets) != 1:
            return set()
        target = up.targets[0]
        index = len(target.elts) - 1 if isinstance(target, (ast.Tuple, ast.List)) else None
        stats = target.elts[-1] if index is not None else target
        if not isinstance(stats, ast.Name):
            return set()
        keys = self.name_keys(stats.id, scope, frozenset())
        if all("<" in k for k in keys) or not self.passed_on(call, scope, index, frozenset()):
            return set()  # not a dict of stats (tensors), or its stats prefixed, read or dropped
        return {k for k in keys if "/" not in k}


def key_expressions(node: ast.AST) -> list[ast.AST]:
    """The keys `node` writes into a dict, if it builds one (not a table of names)."""
    if isinstance(node, ast.Dict) and not (node.values and all(map(is_str, node.values))):
        return [k for k in node.keys if k is not None]
    if isinstance(node, ast.DictComp):
        return [node.key]
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [t.slice for target in targets for t in (target.elts if isinstance(target, (ast.Tuple, ast.List))
                                                        else [target]) if isinstance(t, ast.Subscript)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault" \
            and node.args:
        return [node.args[0]]
    return []


def written_metrics(sources: dict[str, str]) -> dict[str, str]:
    """Every metric name the code in `sources` (path -> text) can write -> where it is written."""
    scan = Scan(sources)
    out: dict[str, str] = {}
    for rel, tree in scan.trees.items():
        for node in ast.walk(tree):
            for key in key_expressions(node):
                for name in sorted(scan.patterns(key, scan.scope_of(node))):
                    if NAMESPACED.fullmatch(name):
                        out.setdefault(name, f"{rel}:{node.lineno}")
            if isinstance(node, ast.Call) and Path(rel).parts[:2] != MATH and \
                    any(Path(scan.module[f]).parts[:2] == MATH for f in scan.callees(node)):
                for name in sorted(scan.bare_stats(node)):
                    out.setdefault(name, f"{rel}:{node.lineno}")
    return out


@functools.cache
def repo_metrics() -> dict[str, str]:
    return written_metrics(repo_sources())


# ---- what docs/recipes.md says ---------------------------------------------------------------------


def metrics_table(doc: str) -> dict[str, set[str]]:
    """Each name in the first cell of a row of the "## Metrics" table -> the identifiers the row lists."""
    section = doc[doc.index("## Metrics"):]
    section = section[:section.index("\n## ")]
    table = {}
    for line in [line for line in section.splitlines() if line.startswith("|")][2:]:  # after the header
        first, *rest = line.strip().strip("|").split("|")
        listed = set(re.findall(r"`([a-z][a-z0-9_]*)`", "|".join(rest)))
        table.update(dict.fromkeys(re.findall(r"`([^`]+)`", first), listed))
    return table


def shape(name: str) -> str:
    return PLACEHOLDER.sub("<>", name)


def matches(pattern: str, name: str) -> bool:
    """Whether `name` is one of the names `pattern` stands for (a placeholder: any text)."""
    return re.fullmatch(".+".join(map(re.escape, PLACEHOLDER.split(pattern))), name) is not None


def undocumented(written: dict[str, str], table: dict[str, set[str]]) -> list[str]:
    """The names written that the table lacks, each with where it is written."""
    concrete = {n for n in table if "<" not in n}
    for name, listed in table.items():
        parts = PLACEHOLDER.split(name)
        concrete |= {parts[0] + "".join(v + p for v, p in zip(values, parts[1:]))
                     for values in itertools.product(sorted(listed), repeat=len(parts) - 1) if values}
    shapes = {shape(n) for n in table if "<" in n}
    return sorted(f"{n} ({where})" for n, where in written.items()
                  if (shape(n) not in shapes if "<" in n else n not in concrete))


def unwritten(written: dict[str, str], table: dict[str, set[str]]) -> list[str]:
    """The names in the table that nothing writes."""
    return sorted(t for t in table if not any(shape(w) == shape(t) or matches(w, t) or matches(t, w) for w in written))
