"""``python -m jvpreg.clone.rules``: the op -> rule -> module table of the registry (Markdown)."""
from __future__ import annotations

import sys

import jvpreg.clone  # noqa: F401  (registers everything)
from jvpreg.clone.core.registry import HANDLERS, REENTRANT, op_name, rule_for


def registry_rows() -> list:
    """``(op name, rule name, module, kind)`` for every registered torch function, sorted by op name.

    ``kind``: ``rule`` (a rule module under ``jvpreg/clone/rules``), ``structural`` (affine/shape fast
    path), ``state`` (piecewise-constant output, evaluated on the primal), ``query`` or ``engine``.
    """
    rows = {}
    for func in list(HANDLERS):
        fn = rule_for(func)
        mod = getattr(fn, "__module__", "?") or "?"
        name = getattr(fn, "__name__", repr(fn))
        if name == "state_eval":
            kind = "state"
        elif mod.startswith("jvpreg.clone.rules."):
            kind = "rule"
        elif name == "_query" or name.endswith("_query"):
            kind = "query"
        elif mod == "jvpreg.clone.rules.structural":
            kind = "structural"
        else:
            kind = "engine"
        if func in REENTRANT:
            name += " (composed)"
        rows[op_name(func)] = (op_name(func), name, mod, kind)
    return [rows[k] for k in sorted(rows)]


def main(argv=None) -> int:
    rows = registry_rows()
    print("| op | rule | module | kind |")
    print("|---|---|---|---|")
    for op, rule, mod, kind in rows:
        print(f"| `{op}` | `{rule}` | `{mod}` | {kind} |")
    print(f"\n{len(rows)} registered torch functions.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
