"""One owner per piece of state in the engine and the server: no module under ``hf_paged/engine`` or
``hf_paged/serve`` writes, or calls a method of, another object's private attribute (``x._name`` where ``x`` is not
``self`` / ``cls``); the engine thread and the manager share their state through ``Handoff``'s public methods."""

from __future__ import annotations

import ast
import pathlib

import hf_paged

PACKAGE = pathlib.Path(hf_paged.__file__).parent
ALLOWED_OWNERS = {"self", "cls", "os"}  # os._exit: the standard library's documented fast exit


def _private(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ALLOWED_OWNERS))


def _private_base(node: ast.AST) -> ast.AST | None:
    """The first private ``x._name`` on the way from ``node`` down its ``.attr`` / ``[key]`` chain (None if none)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if _private(node):
            return node
        node = node.value
    return None


def reaches_into_others(source: str) -> list[str]:
    """``"line: write|call expression"`` for each write into, or call of, another object's private attribute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call):
            base = _private_base(node.func)
            if base is not None:
                found.append(f"{node.lineno}: call {ast.unparse(node.func)}")
            continue
        else:
            continue
        for target in targets:
            for t in ast.walk(target) if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if _private_base(t) is not None:
                    found.append(f"{node.lineno}: write {ast.unparse(t)}")
    return found


def test_the_check_sees_writes_and_calls_into_another_objects_state():
    """The check finds what it is meant to find (so its silence below means something)."""
    source = ("manager._stopped = True\nmanager._live[rid] = req\nmanager._incoming.popleft()\ncore._end(req)\n"
              "self._own = 1\nself._own.append(2)\nos._exit(1)\nx.public = manager._error\n")
    assert [f.split(" ", 2)[1] for f in reaches_into_others(source)] == ["write", "write", "call", "call"]


def test_engine_and_server_modules_touch_only_their_own_private_state():
    """Every module of the engine and the server changes another object only through its public methods."""
    offenders = {}
    for folder in ("engine", "serve"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            found = reaches_into_others(path.read_text())
            if found:
                offenders[f"{folder}/{path.name}"] = found
    assert not offenders, offenders
