"""PyTorch's OpInfo database as ``from_torch``'s oracle (``tests/opinfo_oracle.py`` runs the cases).

Trace mode must give torch's values, dtypes and gradients on every sample
of every OpInfo it maps, or refuse (``Untraceable``, which ``mode="auto"``
turns into callbacks): never a silent difference, never a crash. A plain
``pytest`` runs a fixed slice of the database; CI runs all of it (``slow``)
and checks the table of ``docs/from_torch.md`` against the run.
"""

import pathlib

import pytest

torch = pytest.importorskip("torch")  # CI installs the torch extra; the test extra installs expecttest
pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest (the test extra has it)")

import opinfo_oracle as oracle  # noqa: E402

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "from_torch.md"
EVERY = 25  # the plain run's slice: every 25th OpInfo, its first float32 sample


def _failures(results):
    return [f"{o.kind} {case}: {o.detail}" for outcomes in results.values() for case, o in outcomes
            if o.kind in ("wrong", "crash")]


def test_a_slice_of_the_opinfo_database_traces_as_torch_computes_or_is_refused():
    ops = oracle.op_db()[::EVERY]
    results = {}
    for op in ops:
        cases = [c for c in oracle.cases(op, dtypes=(torch.float32,)) if c.index == 0]
        results[oracle.full_name(op)] = [(c.name, oracle.run_case(c)) for c in cases]
    assert not _failures(results)
    assert sum(o.kind == "agree" for outcomes in results.values() for _, o in outcomes) > 10


@pytest.mark.slow
def test_every_opinfo_traces_as_torch_computes_or_is_refused_and_the_docs_table_is_this_run():
    results = oracle.run_all()
    assert not _failures(results)
    text = DOC.read_text()
    if oracle.versions() in text:  # the table's own versions (CI's newest); the floor JAX checks the rest
        assert oracle.read_table(text) == oracle.table_rows(results), (
            "docs/from_torch.md's OpInfo table is not this run's: python scripts/opinfo_table.py rewrites it")


def test_the_docs_table_agrees_with_the_rules_trace_mode_has():
    mapped = oracle.mapped_names()
    rows = oracle.read_table(DOC.read_text())
    assert len(rows) == len(oracle.op_db())
    # A mapped function is never plainly refused, and "traced" or "refused by its rule" means it is mapped
    # (its method or in-place variant alone may make a row "partly").
    stale = [(op, name, status) for op, name, status, _ in rows if name != "-" and (
        (name in mapped and status == "refused") or (name not in mapped and status in ("traced",
                                                                                         "refused by its rule")))]
    assert not stale, f"rules added or removed since the table was written (python scripts/opinfo_table.py): {stale}"


# Callback mode on the same samples: a few ops, values. Ops whose output shape depends on values are
# refused (JAX fixes every shape when it traces), naming the op, never run with a guessed shape.
CALLBACK_OPS = ("add", "sum", "cumsum", "where", "index_select", "polar", "max.binary", "sort",
                "max.reduction_with_dim")
CALLBACK_REFUSED = ("masked_select", "nonzero", "argwhere")


@pytest.mark.parametrize("name", CALLBACK_OPS + CALLBACK_REFUSED)
def test_callback_mode_gives_torchs_values_on_opinfo_samples_or_refuses(name):
    (op,) = [op for op in oracle.op_db() if oracle.full_name(op) == name]
    cases = [c for c in oracle.cases(op, dtypes=(torch.float32,)) if c.variant == "function" and c.index < 2]
    outcomes = [(c.name, oracle.run_callback_case(c)) for c in cases]
    assert not _failures({name: outcomes})
    if name in CALLBACK_REFUSED:
        assert {o.kind for _, o in outcomes} <= {"refused", "skip"} and any(o.kind == "refused" for _, o in outcomes)
    else:
        assert any(o.kind == "agree" for _, o in outcomes)
