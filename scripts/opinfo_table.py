"""Writes the OpInfo table of docs/from_torch.md: runs every OpInfo through trace mode (tests/opinfo_oracle.py).

Usage (about 3 CPU-minutes; needs torch, and expecttest from the test extra):

    python scripts/opinfo_table.py            # rewrites the table in docs/from_torch.md
    python scripts/opinfo_table.py --check    # exits 1 if the table differs from a fresh run
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import opinfo_oracle  # noqa: E402

DOC = ROOT / "docs" / "from_torch.md"


def main() -> int:
    if "--only" in sys.argv:  # rerun these OpInfos; the other rows stay as the table has them
        names = sys.argv[sys.argv.index("--only") + 1:]
        return _update(names)
    results = opinfo_oracle.run_all()
    rows = opinfo_oracle.table_rows(results)
    bad = [r for r in rows if r[2] in ("WRONG", "CRASH")]
    for outcomes in results.values():
        for case_name, o in outcomes:
            if o.kind in ("wrong", "crash"):
                print(o.kind, case_name, o.detail, file=sys.stderr)
    text = DOC.read_text()
    start, end = text.index(opinfo_oracle.TABLE_START), text.index(opinfo_oracle.TABLE_END)
    new = text[:start] + opinfo_oracle.table_markdown(rows) + text[end + len(opinfo_oracle.TABLE_END):]
    if "--check" in sys.argv:
        return int(new != text or bool(bad))
    DOC.write_text(new)
    print(opinfo_oracle.summary(results), f"{len(bad)} OpInfos with a silent difference or a crash")
    return int(bool(bad))


def _update(names: list) -> int:
    text = DOC.read_text()
    ops = [op for op in opinfo_oracle.op_db() if opinfo_oracle.full_name(op) in names]
    results = opinfo_oracle.run_all(ops)
    fresh = {r[0]: r for r in opinfo_oracle.table_rows(results)}
    mapped = opinfo_oracle.mapped_names()
    current = {opinfo_oracle.full_name(op): opinfo_oracle.torch_name(op) for op in opinfo_oracle.op_db()}
    rows = []
    for op_name, _, status, counts in opinfo_oracle.read_table(text):
        if op_name in fresh:
            rows.append(fresh[op_name])
            continue
        name = current[op_name]
        if status.startswith("refused"):
            status = "refused by its rule" if name in mapped else "refused"
        rows.append((op_name, name, status, counts))
    start, end = text.index(opinfo_oracle.TABLE_START), text.index(opinfo_oracle.TABLE_END)
    DOC.write_text(text[:start] + opinfo_oracle.table_markdown(rows) + text[end + len(opinfo_oracle.TABLE_END):])
    bad = [r for r in rows if r[2] in ("WRONG", "CRASH")]
    print(opinfo_oracle.summary(results), bad)
    return int(bool(bad))


if __name__ == "__main__":
    sys.exit(main())
