"""Walking a jaxpr: its equations, and those of the jaxprs nested in their parameters."""


def equations(jaxpr):
    """Every equation of a jaxpr, and of the jaxprs nested in its parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in jaxprs_in(list(eqn.params.values())):
            yield from equations(inner)


def jaxprs_in(value):
    """The jaxprs in an equation's parameter (closed or open, alone or in a sequence)."""
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from jaxprs_in(v)
