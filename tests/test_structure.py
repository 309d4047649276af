"""The package's structure, read from its imports (``scripts/structure.py``, drawn in docs/structure.md): the
engine's floors, no import circle, no import inside a function that would hide one, no private name imported across
modules, and a picture that is current.

The floors of ``jvpreg.clone``, lowest first: ``core`` < ``eager`` < ``rules`` < ``program`` < the public modules
(``api``, ``callables``, the package itself). A module imports its own floor and the floors below, never one above;
a ``__main__`` (a command, imported by nothing) may import the whole engine.
"""
from __future__ import annotations

import pathlib
import sys
from typing import Dict, List, Set

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import structure  # noqa: E402



def _cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import circle in ``graph`` (its modules, the first repeated last), or []."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(v: str) -> List[str]:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = 2
        stack.pop()
        return []

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


def test_the_module_graph_is_read():
    """The reader sees the engine's floors and their imports (a broken reader would pass every test below)."""
    assert {"jvpreg.clone.core.tensor", "jvpreg.clone.eager.dispatch", "jvpreg.clone.program.capture"} <= set(
        structure.MODULES)
    read = {m: [t[:3] for t in structure.IMPORTS[f"jvpreg.clone.eager.{m}"]] for m in ("dispatch", "checkpointing")}
    assert ("jvpreg.clone.core.tensor", "CloneTensor", False) in read["dispatch"]  # a name
    assert ("jvpreg.clone.eager.functions", None, False) in read["checkpointing"]  # a module
    assert structure.level("jvpreg.clone.core.tensor") < structure.level("jvpreg.clone.program.capture")
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_circle():
    assert _cycle(structure.edges(with_functions=False)) == []


def test_no_import_inside_a_function_hides_a_circle():
    """Counting the imports made inside functions too, the graph has no circle: a lazy import is for speed or an
    optional dependency, never to break a circle."""
    assert _cycle(structure.edges(with_functions=True)) == []


def test_the_engine_imports_at_module_level():
    inner = [f"{m}:{line} imports {t}" for m, found in structure.IMPORTS.items() if m.startswith("jvpreg.clone")
             for t, _, is_inner, line in found if is_inner]
    assert inner == []


@pytest.mark.parametrize("floor", structure.FLOORS + (structure.PUBLIC,))
def test_each_floor_imports_only_its_own_and_the_floors_below(floor):
    upward = [f"{m}:{line} imports {t}" for m, found in structure.IMPORTS.items()
              if m.startswith("jvpreg.clone") and structure.floor_of(m) == floor and not m.endswith(".__main__")
              for t, _, _, line in found if structure.level(t) > structure.level(m)]
    assert upward == []


def test_no_private_name_is_imported_across_modules():
    private = [f"{m}:{line} imports {name} from {t}" for m, found in structure.IMPORTS.items()
               for t, name, _, line in found if name and name.startswith("_") and not name.startswith("__") and t != m]
    assert private == []


def test_no_private_name_is_read_across_modules_through_the_module_object():
    reads = [f"{m}:{line} reads {t}.{name}" for m in structure.MODULES for t, name, line in structure.private_reads(m)]
    assert reads == []


def test_private_reads_are_seen(tmp_path, monkeypatch):
    """The reader catches ``alias._name`` on an imported jvpreg module (else the test above could not fail)."""
    source = tmp_path / "probe.py"
    source.write_text("from jvpreg.clone.core import tensor as _tensor\n\ndef f(t):\n    return _tensor._hidden(t)\n")
    monkeypatch.setitem(structure.MODULES, "jvpreg.probe", source)
    assert structure.private_reads("jvpreg.probe") == [("jvpreg.clone.core.tensor", "_hidden", 4)]


def test_the_picture_is_current():
    """docs/structure.md is what ``python scripts/structure.py --write`` writes from the code as it stands."""
    assert structure.DOC.read_text() == structure.picture(), "run: python scripts/structure.py --write"
