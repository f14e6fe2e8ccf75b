"""Whether a class defines a name, read from its source: the installed release's, or another
release's unpacked sources (`python -m kvbridge.connector._vllm_check /path/to/src`).

A class "defines" a name when the name is a method or class attribute of it or of one of its
bases, or when one of their methods assigns `self.<name>`: vLLM's NIXL worker and scheduler
set most of their state as instance attributes in `__init__` or later setup methods, which no
class-level look-up can see. Only the source says whether a rename happened.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ClassScan:
    """What one class statement defines (not its bases), and its bases as written."""

    names: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


def scan_class(tree: ast.Module, class_name: str) -> ClassScan | None:
    """The names `class_name`, a top-level class of `tree`, defines itself; None if absent."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return _scan(node)
    return None


def _scan(node: ast.ClassDef) -> ClassScan:
    scan = ClassScan(bases=[ast.unparse(base) for base in node.bases])
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scan.names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            scan.names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            scan.names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(sub, ast.Assign):
            targets = list(sub.targets)
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for target in targets:
            for leaf in ast.walk(target):  # also `self.a, self.b = ...`
                if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                        and leaf.value.id == "self"):
                    scan.names.add(leaf.attr)
    return scan


# ---- the installed release ------------------------------------------------------------------


@functools.cache
def installed_names(owner: str) -> frozenset[str] | None:
    """Every name the installed class `owner` ("package.module.Class") defines, its bases'
    included; None when it cannot be imported (then every name of it counts as missing)."""
    module_name, _, class_name = owner.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except Exception:  # an import error of any kind: the class is not there to use
        return None
    names = set(dir(cls))
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source (a builtin, a compiled module)
            continue
        scan = scan_class(ast.parse(source), klass.__name__)
        if scan is not None:
            names |= scan.names
    return frozenset(names)


# ---- a source tree ----------------------------------------------------------------------------


def tree_names(root: Path, owner: str) -> frozenset[str] | None:
    """Every name class `owner` defines in the source tree `root` (a folder holding `vllm/`),
    bases found through the module's own imports included; None when the module or the class
    is not there."""
    module_name, _, class_name = owner.rpartition(".")
    return _tree_class(root, module_name, class_name, 0)


def _module_file(root: Path, module_name: str) -> Path | None:
    base = root.joinpath(*module_name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _tree_class(root: Path, module_name: str, class_name: str,
                depth: int) -> frozenset[str] | None:
    path = _module_file(root, module_name)
    if path is None or depth > 20:
        return None
    tree = _parse(path)
    # The package relative imports start from: the module itself for a package's __init__.
    package = module_name if path.name == "__init__.py" else module_name.rpartition(".")[0]
    scan = scan_class(tree, class_name)
    if scan is None:  # re-exported from another module
        where = _imported(tree, package, class_name)
        return None if where is None else _tree_class(root, *where, depth + 1)
    names = set(scan.names)
    for base in scan.bases:
        base_name = base.split("[")[0].rsplit(".", 1)[-1]
        where = ((module_name, base_name) if scan_class(tree, base_name) is not None
                 else _imported(tree, package, base_name))
        inherited = None if where is None else _tree_class(root, *where, depth + 1)
        names |= inherited or set()  # a base outside the tree (ABC, Generic): nothing of ours
    return frozenset(names)


def _imported(tree: ast.Module, package: str, name: str) -> tuple[str, str] | None:
    """(the module, the name there) `name` is imported as in `tree` (`from x import y as
    name`), if it is."""
    parts = package.split(".")
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            if node.level:  # relative: from the module's own package
                prefix = parts[:len(parts) - node.level + 1]
                return ".".join([*prefix, *([node.module] if node.module else [])]), alias.name
            return (node.module, alias.name) if node.module else None
    return None


def main(argv: list[str]) -> int:
    """Check the connector's names against a source tree: exit 1 if any is missing."""
    from kvbridge.connector._vllm import NAMES

    if len(argv) != 1:
        print("usage: python -m kvbridge.connector._vllm_check SOURCE_ROOT", file=sys.stderr)
        return 2
    root = Path(argv[0])
    missing = 0
    for name in NAMES:
        if not name.owner.startswith("vllm."):
            continue  # NIXL's own package is not part of vLLM's sources
        found = tree_names(root, name.owner)
        ok = found is not None and name.attr in found
        missing += not ok
        print(f"{'ok     ' if ok else 'MISSING'} {name.owner}.{name.attr}  "
              f"[{', '.join(name.features)}]")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
