"""The package's structure read from its own imports: the engine's floors and who imports whom.

``python scripts/structure.py`` prints docs/structure.md as the code stands; ``--write`` writes it. The tests
(``tests/test_structure.py``) check the rules this picture states and that the committed picture is current.
"""
from __future__ import annotations

import argparse
import ast
import collections
import pathlib
from typing import Dict, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jvpreg"
DOC = ROOT / "docs" / "structure.md"
FLOORS = ("core", "eager", "rules", "program")
PUBLIC = "public"
FLOOR_JOBS = {
    "core": "the clone batch, errors, the handler registry, the session of a running forward",
    "eager": "dispatch to a rule, a fast path or the exact fallback; routes for code out of `__torch_function__`'s sight",
    "rules": "every rule, by kind, and the kernels they call",
    "program": "capture, graph passes, replay, and the guards re-checked before a replay",
    PUBLIC: "`jvp`, `jvp_params`, `pack`/`call`/`unpack`, callables, the shared forward",
}

Import = Tuple[str, "str | None", bool, int]  # (module imported from, name or None, inside a function, line)


def modules() -> Dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> List[Import]:
    """Each jvpreg import of ``module``: a submodule imported by name counts as that module."""
    tree = ast.parse(MODULES[module].read_text())
    in_function: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(sub) for sub in ast.walk(node))
    out: List[Import] = []
    for node in ast.walk(tree):
        inner = id(node) in in_function
        if isinstance(node, ast.Import):
            out += [(a.name, None, inner, node.lineno) for a in node.names if a.name.split(".")[0] == "jvpreg"]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.split(".")[0] != "jvpreg":
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                out.append((target, None, inner, node.lineno) if target in MODULES
                           else (source, alias.name, inner, node.lineno))
    return out


IMPORTS = {m: imports(m) for m in MODULES}


def private_reads(module: str) -> List[Tuple[str, str, int]]:
    """``(module read from, private name, line)`` for each ``alias._name`` where ``alias`` is a jvpreg module that
    ``module`` imported (a private name used across modules through the module object, not by an import)."""
    tree = ast.parse(MODULES[module].read_text())
    aliases: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for a in node.names:
                if f"{source}.{a.name}" in MODULES:
                    aliases[a.asname or a.name] = f"{source}.{a.name}"
    return [(aliases[n.value.id], n.attr, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
            and n.attr.startswith("_") and not n.attr.startswith("__") and aliases[n.value.id] != module]


def floor_of(module: str) -> str:
    """The engine floor of a module, ``public`` for the engine's public modules, or its top-level package."""
    parts = module.split(".")
    if parts[:2] == ["jvpreg", "clone"]:
        return parts[2] if len(parts) > 2 and parts[2] in FLOORS else PUBLIC
    return parts[1] if len(parts) > 1 else "jvpreg"


def level(module: str) -> int:
    """0-3 for the floors, 4 for the engine's public modules, 5 outside the engine."""
    f = floor_of(module)
    return FLOORS.index(f) if f in FLOORS else len(FLOORS) + (0 if f == PUBLIC else 1)


def edges(with_functions: bool) -> Dict[str, Set[str]]:
    """Module -> modules it imports (a package importing its own submodules left out: that is assembly)."""
    out: Dict[str, Set[str]] = {}
    for module, found in IMPORTS.items():
        for target, _, inner, _ in found:
            if target in MODULES and target != module and not target.startswith(module + ".") and (
                    with_functions or not inner):
                out.setdefault(module, set()).add(target)
    return out


def _summary(path: pathlib.Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def picture() -> str:
    """docs/structure.md: the floors as a diagram, the arrows between them counted, and every module's job."""
    engine = [m for m in MODULES if m.startswith("jvpreg.clone")]
    arrows: Dict[Tuple[str, str], int] = collections.Counter()
    for module, targets in edges(with_functions=True).items():
        for target in targets:
            if module.endswith(".__main__"):  # a command, imported by nothing
                continue
            a, b = floor_of(module), floor_of(target)
            if a != b and (module.startswith("jvpreg.clone") or target.startswith("jvpreg.clone")):
                arrows[(a, b)] += 1
    lines = [
        "# Structure",
        "",
        "Generated by `python scripts/structure.py --write` from the package's imports; `tests/test_structure.py` "
        "checks that it is current and that the code keeps its rules: no import circle (counting imports inside "
        "functions), no import inside the engine's functions, each floor of `jvpreg.clone` importing only its own "
        "floor and the floors below, and no private name imported across modules.",
        "",
        "```mermaid",
        "flowchart BT",
    ]
    for floor in FLOORS + (PUBLIC,):
        lines.append(f"  {floor}[\"clone/{'' if floor == PUBLIC else floor + '/'} ({floor}): {FLOOR_JOBS[floor]}\"]")
    outside = sorted({floor_of(m) for m in MODULES if not m.startswith("jvpreg.clone")}
                     & {a for a, _ in arrows} | {b for _, b in arrows if level(b) > len(FLOORS)} - set(FLOORS))
    for name in outside:
        if name not in FLOORS and name != PUBLIC:
            lines.append(f"  {name.replace('.', '_')}([{name}])")
    for (a, b), n in sorted(arrows.items()):
        lines.append(f"  {a.replace('.', '_')} -->|{n}| {b.replace('.', '_')}")
    lines += ["```", "",
              "An arrow `a -->|n| b`: n pairs of a module of `a` importing a module of `b` (a command's "
              "`__main__` left out). Outside the engine only the packages that import it are drawn.", ""]
    for floor in FLOORS + (PUBLIC,):
        lines += [f"## {'jvpreg.clone' if floor == PUBLIC else 'jvpreg.clone.' + floor}: {FLOOR_JOBS[floor]}", "",
                  "| module | what it is |", "|:---|:---|"]
        for m in engine:
            if floor_of(m) == floor and MODULES[m].name != "__init__.py":
                lines.append(f"| `{m.removeprefix('jvpreg.clone.')}` | {_summary(MODULES[m])} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
    text = picture()
    if parser.parse_args().write:
        DOC.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
