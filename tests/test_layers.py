"""The package reads top to bottom: each module imports only modules of its own layer or
the layers below it, the imports form no cycle, and no module imports another's private
names. Read from the source (every ``import``, those inside functions too)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fusedkit"

#: fusedkit's layers, bottom first; a module belongs to the first prefix it matches.
LAYERS = (
    ("fusedkit.errors", "fusedkit.settings"),
    ("fusedkit.kernels",),
    ("fusedkit.registry",),
    ("fusedkit.runtime",),
    ("fusedkit.autograd", "fusedkit.sharding"),  # the custom ops and their DTensor rules
    ("fusedkit.dispatch",),
    ("fusedkit.library",),
    ("fusedkit.ops",),
    ("fusedkit.nn",),
    ("fusedkit.testing", "fusedkit.memory", "fusedkit.fusion", "fusedkit.fusion_call"),
    ("fusedkit",),  # the package's __init__: the public names
    ("fusedkit.bench", "fusedkit.__main__"),
)


def _module_name(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def _imports(name: str, tree: ast.Module, is_package: bool, modules: set[str]) -> list[tuple[str, str, int]]:
    """(imported module, name imported from it or "", line) for every fusedkit import."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fusedkit":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in modules else (target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "fusedkit"]
    return found


def _read(root: pathlib.Path = PACKAGE) -> dict[str, tuple[ast.Module, list]]:
    """Every module below ``root``: its syntax tree and its fusedkit imports."""
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    trees = {name: ast.parse(path.read_text()) for name, path in paths.items()}
    return {
        name: (tree, _imports(name, tree, paths[name].name == "__init__.py", set(paths)))
        for name, tree in trees.items()
    }


def upward_imports(modules) -> list[str]:
    return [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)}), line {line}"
        for name, (_, imports) in modules.items()
        for target, _, line in imports
        if _layer(target) > _layer(name)
    ]


def private_imports(modules) -> list[str]:
    """``from x import _name`` and ``x._name`` where ``x`` is another fusedkit module."""
    found = [
        f"{name} imports {target}.{what}, line {line}"
        for name, (_, imports) in modules.items()
        for target, what, line in imports
        if what.startswith("_") and not what.startswith("__")
    ]
    for name, (tree, imports) in modules.items():
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                aliases.update({a.asname or a.name: a for a in node.names})
        fusedkit_names = {
            alias for alias, a in aliases.items() if any(t.endswith("." + a.name) or w == a.name for t, w, _ in imports)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in fusedkit_names
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name}: {node.value.id}.{node.attr}, line {node.lineno}")
    return found


def cycles(modules) -> list[str]:
    edges = {
        name: sorted({t for t, _, _ in imports if t in modules and t != name}) for name, (_, imports) in modules.items()
    }
    found, state = [], {}

    def visit(node, trail):
        state[node] = 1
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                found.append(" -> ".join(trail[trail.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_every_import_points_down_or_across():
    assert not (bad := upward_imports(_read())), "\n".join(bad)


def test_no_module_imports_a_private_name_of_another():
    assert not (bad := private_imports(_read())), "\n".join(bad)


def test_the_import_graph_has_no_cycle():
    assert not (bad := cycles(_read())), "\n".join(bad)


def test_the_checks_find_an_upward_import_a_cycle_and_a_private_name(tmp_path):
    """The checks above, on a small package that breaks each rule once."""
    root = tmp_path / "fusedkit"
    (root / "runtime").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "errors.py": "",
        "ops.py": "from . import dispatch\n",
        "dispatch.py": "from .runtime import launch\n",
        "runtime/__init__.py": "",
        "runtime/launch.py": "from .. import ops\nfrom .layout import _plan\n",
        "runtime/layout.py": "from . import launch\n\ndef f():\n    return launch._cache\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    modules = _read(root)
    assert upward_imports(modules) == ["fusedkit.runtime.launch (layer 3) imports fusedkit.ops (layer 7), line 1"]
    assert sorted(private_imports(modules)) == [
        "fusedkit.runtime.launch imports fusedkit.runtime.layout._plan, line 2",
        "fusedkit.runtime.layout: launch._cache, line 4",
    ]
    assert cycles(modules) and all("fusedkit.runtime.launch" in c for c in cycles(modules))
