"""``python -m jvpreg.clone.rules``: the op -> rule -> module table of the registry (Markdown)."""
from __future__ import annotations

import sys

import jvpreg.clone  # noqa: F401  (registers everything)
from jvpreg.clone.core.registry import HANDLERS, REENTRANT, op_name, rule_for


def registry_rows() -> list:
    """``(op name, rule name, module, kind)`` for every registered torch function, sorted by op name.

    ``kind``: the kind a rule was registered as (:mod:`jvpreg.clone.rules.kinds`: ``smooth``, ``slope``, ``linear``,
    ``bilinear``, ``composite``, ``state``, or ``rule`` for any other rule on blocks), ``shape`` (a shape, indexing or
    whole-tensor fast path), ``query`` (answered on the primal) or ``engine`` (bookkeeping outside the rules).
    """
    rows = {}
    for func in list(HANDLERS):
        fn = rule_for(func)
        mod = getattr(fn, "__module__", "?") or "?"
        name = getattr(fn, "__name__", repr(fn))
        kind = getattr(fn, "__jvpreg_kind__", None)
        if name == "state_eval":
            kind = "state"
        elif kind is None and name == "_query":
            kind = "query"
        elif kind is None and mod == "jvpreg.clone.rules.shape":
            kind = "shape"
        elif kind is None and mod == "jvpreg.clone.rules.linear":
            kind = "linear"
        elif kind is None:
            kind = "rule" if mod.startswith("jvpreg.clone.rules.") else "engine"
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
