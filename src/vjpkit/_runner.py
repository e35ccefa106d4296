"""The user's methods, run on one static part of a call (``Runner``), as the class's ``Spec`` describes them.

They run while JAX traces, each with a ctx (``_ctx.py``), each named in
profiles and with JAX's errors about traced values turned into vjpkit's
(``run_user_method``). The program (``_program.py``) asks the runner for:

- ``run_forward``: arguments rebuilt from their array leaves, a ctx, the
  user's forward (and setup_context), outputs packed and checked, and what
  forward left on ctx split into residual arrays and static data;
- ``run_backward``: output cotangents as backward expects them, a ctx
  rebuilt from the residuals, the user's backward, its gradients checked;
- ``run_jvp``: input tangents as jvp expects them, a ctx rebuilt from the
  residuals, the user's jvp, its tangents checked.
"""

from __future__ import annotations

import linecache
import os
import traceback
from typing import Any, Callable, Sequence

import jax
import jax.custom_batching
import jax.numpy as jnp
import numpy as np
from jax.errors import (
    ConcretizationTypeError,
    TracerArrayConversionError,
    TracerBoolConversionError,
    TracerIntegerConversionError,
)

from . import _anomaly, _host, _jax_internals, _sharding
from ._args import as_arrays, as_jax_leaf, split_residuals
from ._ctx import Carried, FunctionCtx, call_forward, close, dirty_of, forwarded, method_of, rule_ctx
from ._once import call_without_derivative
from ._outputs import (
    Packed,
    ResidualMeta,
    Residuals,
    check_backward_outputs,
    check_jvp_outputs,
    differentiable_outputs,
    output_cotangents,
    pack_outputs,
)
from ._site import see_catalogue
from ._spec import Spec
from ._tree import (
    Lifted,
    Partition,
    find_tracers,
    is_array,
    is_differentiable_dtype,
    lifted_positions,
    partition,
)


def _leaf_path(tree: Any, position: int) -> str:
    """The key path of the leaf at ``position`` in ``tree``'s flattening."""
    return jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][position][0])


def profiled(owner: str, method: str) -> Any:
    """A named scope ``Owner.method`` around a user's method: its ops carry the name in profiles.

    JAX records the scope in each op's ``op_name`` metadata, which profilers
    (TensorBoard, Perfetto) and the compiled HLO show; it costs nothing at run time.
    """
    return _jax_internals.named_scope(f"{owner}.{method}")


# ---------------------------------------------------------------------------
# A traced array's value asked for in the user's methods: vjpkit's message.

_LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (jax, jnp, np) if m.__file__
) + (os.path.dirname(__file__) + os.sep,)


def run_user_method(owner: str, ctx: FunctionCtx, fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, a user's method: named ``owner.<method>`` in profiles, ``ctx`` closed after.

    The user's methods run while JAX traces, so their arrays have no values
    yet: NumPy calls, ``.item()``/``float()``/``int()`` and a Python ``if``
    on one fail there, with JAX's errors turned into vjpkit's, naming the
    method (``method_of(ctx)``: forward, setup_context, backward or jvp).
    """
    try:
        with profiled(owner, method_of(ctx)):
            return fn(*args)
    except (TracerArrayConversionError, TracerBoolConversionError, ConcretizationTypeError,
            TracerIntegerConversionError) as e:
        raise _traced_value_error(owner, method_of(ctx), e) from e
    finally:
        close(ctx)


def _traced_value_error(owner: str, name: str, e: Exception) -> TypeError:
    """vjpkit's error for JAX's ``e``: a traced array used as a concrete value in ``owner.name``."""
    if isinstance(e, TracerArrayConversionError):
        return TypeError(
            f"{owner}.{name} converted a traced JAX array to NumPy. {name} runs while "
            "JAX traces, so its arrays are tracers, not concrete values: write it with jax.numpy, or "
            f"declare the Function host-side (@vjpkit.function(host=True)) to run NumPy code.{_user_line(e)} "
            f"{see_catalogue('numpy-in-forward')}"
        )
    if isinstance(e, TracerBoolConversionError):
        return TypeError(
            f"{owner}.{name} used a traced array as a Python bool (an if, while, and/or, or assert on "
            f"an array's value). {name} runs while JAX traces, so its arrays have no "
            "values yet: select values with jnp.where(condition, x, y), branch with jax.lax.cond, "
            f"loop with jax.lax.while_loop.{_user_line(e)} {see_catalogue('python-if-on-a-traced-array')}"
        )
    return TypeError(
        f"{owner}.{name} converted a traced array to a Python number (.item(), float(), int() or "
        f"an index). {name} runs while JAX traces, so its arrays have no values "
        "yet: keep the value an array (jnp.clip(x, -alpha, alpha) takes array bounds; jnp "
        f"functions and arithmetic take arrays), or select values with jnp.where.{_user_line(e)} "
        f"{see_catalogue('item-of-a-traced-array')}"
    )


def _user_line(e: BaseException) -> str:
    """Where in the user's code ``e`` was raised: the innermost frame outside JAX, NumPy and vjpkit."""
    users = [entry for entry in traceback.extract_tb(e.__traceback__) if not entry.filename.startswith(_LIBRARY_DIRS)]
    if not users:
        return ""
    filename, line = users[-1].filename, users[-1].lineno
    source = linecache.getline(filename, line or 0).strip()
    return f" At line {line} of {filename}" + (f": `{source}`" if source else ".")


def _forward_batched_by_rule(spec: Spec, layout: Partition, arrays: tuple) -> Callable:
    """``spec.forward`` of these arrays, which ``jax.vmap`` batches by the class's vmap staticmethod.

    Why ``jax.custom_batching.custom_vmap`` around forward alone: setup_context,
    backward and jvp still see the outputs as forward computes them, as in
    PyTorch, where the rule replaces forward under vmap and nothing else.
    Why a ``jax.custom_jvp`` around that: JAX differentiates a custom_vmap
    into one call giving values and tangents together, which reverse mode
    cannot split (grad of grad, ``jax.hessian`` raised). The custom_jvp
    takes the derivative of forward's code as written, so the rule runs
    only on values, innermost, at every order; the outputs' own derivative
    is the Function's rules anyway (``_tie.py``).
    """
    out_layouts: list[Partition] = []  # forward's output structure, found when custom_vmap traces it
    user_rule = spec.vmap
    assert user_rule is not None  # only a class with a rule gets here

    def forward(*arrays: Any) -> list:
        out = spec.signature.call(spec.forward, (), layout.combine(arrays))
        out_layout, leaves = partition(out, is_array)
        out_layouts.append(out_layout)
        return list(leaves)

    batched = jax.custom_batching.custom_vmap(forward)

    @batched.def_vmap
    def rule(axis_size: int, in_batched: Sequence[bool], *arrays: Any) -> tuple[list, list]:
        in_dims = tuple(layout.combine([0 if b else None for b in in_batched], keep_static=False))
        info = _host.VmapInfo(axis_size)
        with profiled(spec.name, "vmap"):
            result = spec.signature.call(user_rule, (info, in_dims), layout.combine(arrays))
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"{spec.name}.vmap returned {type(result).__name__}: expected a pair (outputs, out_dims), "
                "as torch.autograd.Function.vmap returns."
            )
        out, out_dims = result
        out_layout, leaves = partition(out, is_array)
        expected = out_layouts[-1]
        if out_layout.treedef != expected.treedef or out_layout.dynamic != expected.dynamic:
            raise TypeError(
                f"{spec.name}.vmap returned outputs of structure {out_layout.treedef}, expected forward's "
                f"structure {expected.treedef} (with arrays in the same places)."
            )
        dims = _output_dims(spec.name, out, out_dims, out_layout)
        moved = [leaf if d is None else jnp.moveaxis(leaf, d, 0) for leaf, d in zip(leaves, dims, strict=True)]
        return moved, [d is not None for d in dims]

    differentiable = jax.custom_jvp(batched)

    @differentiable.defjvp
    def derivative(primals: tuple, tangents: tuple) -> tuple[list, list]:
        # Zeros where JAX knows them (integer inputs' float0 included): symbolic zeros would be refused by an
        # eager shard_map before JAX 0.6, which runs forward directly (_dispatch._differentiable).
        _, tangents_out = jax.jvp(forward, primals, tangents)
        return batched(*primals), tangents_out

    def forward_by_rule(*values: Any, **keyword_values: Any) -> Any:
        leaves = differentiable(*arrays)
        return out_layouts[-1].combine(leaves)

    return forward_by_rule


def _output_dims(name: str, out: Any, out_dims: Any, out_layout: Partition) -> list:
    """The batch axis (or None) of each array output, from the vmap rule's ``out_dims``."""
    if out_dims is None or isinstance(out_dims, int):
        return [out_dims] * len(out_layout.dynamic)
    incompatible = TypeError(
        f"{name}.vmap returned out_dims {out_dims!r}, incompatible with its outputs: expected an int or None, "
        f"or one per output in the outputs' structure {jax.tree_util.tree_structure(out)}."
    )
    try:
        per_leaf = jax.tree_util.tree_structure(out).flatten_up_to(out_dims)  # type: ignore[attr-defined]
    except (ValueError, TypeError):
        raise incompatible from None
    dims = [per_leaf[k] for k in out_layout.dynamic]
    if not all(d is None or isinstance(d, int) for d in dims):
        raise incompatible
    return dims


# ---------------------------------------------------------------------------
# What forward left on ctx, as residuals: arrays as pytree children, everything else as static data.


def _kind(x: Any) -> tuple:
    return (tuple(x.shape), x.dtype)


# Layouts of what forward left when that is only saved arrays (and None):
# keyed by where the Nones are, built once each.
_SAVED_ONLY_LAYOUTS: dict[tuple, Partition] = {}
_SAVED_ONLY_NONES: dict[Partition, tuple] = {}  # the reverse


def _split_carried(carried: Carried) -> tuple[Partition, tuple]:
    """``split_residuals(carried)``, without flattening it in the common case (saved arrays only)."""
    if carried.attributes or carried.host is not None or carried.saved_forward:
        return split_residuals(carried)
    nones = tuple(x is None for x in carried.saved)
    layout = _SAVED_ONLY_LAYOUTS.get(nones)
    if layout is None:
        layout = _SAVED_ONLY_LAYOUTS[nones] = split_residuals(carried)[0]
        _SAVED_ONLY_NONES[layout] = nones
    return layout, tuple(as_jax_leaf(x) for x in carried.saved if x is not None)


_NOTHING_SAVED = _split_carried(Carried((), (), {}, None))[0]


def _combine_carried(layout: Partition, arrays: Sequence[Any]) -> Carried:
    """``layout.combine(arrays)``: what forward left, rebuilt from its arrays (directly for saved arrays only)."""
    nones = _SAVED_ONLY_NONES.get(layout)
    if nones is None:
        return layout.combine(arrays)
    it = iter(arrays)
    return Carried(tuple(None if none else next(it) for none in nones), (), {}, None)


class Runner:
    """The user's methods for one static part of a call (``layout``), and their checks."""

    def __init__(self, spec: Spec, layout: Partition, n_values: int, anomaly: bool = False):
        self.spec = spec
        self.layout = layout.snapshot()  # unhashable static arguments copied: they are keyed by contents
        self.anomaly = anomaly  # traced under vjpkit.detect_anomaly: NaN/Inf checks
        self.names = spec.signature.names(n_values)
        self.param_treedefs = tuple(layout.treedef.children())
        owners = layout.owners()
        self.param_of_dynamic = tuple(owners[k][0] for k in layout.dynamic)
        self.n_params = n_values
        # The arrays that static arguments held (tracers of an enclosing transformation, lifted out by
        # ``_tree.lift_static_tracers``), by their index among the arrays: forward gets the values rebuilt.
        lifted = lifted_positions(layout.treedef)
        self.lifted = tuple(k for k, position in enumerate(layout.dynamic) if position in lifted)
        # Every argument an array: the arguments are the arrays themselves, no rebuilding.
        self.all_arrays = not layout.static and all(len(owner) == 2 and owner[1] == 0 for owner in owners) and all(
            child.num_leaves == 1 and not child.children() for child in self.param_treedefs
        )

    def needs_input_grad(self, perturbed: Any, arrays: Any) -> tuple[bool, ...]:
        """One flag per parameter: whether JAX differentiates any of its float leaves."""
        needs = [False] * self.n_params
        for param, p, x in zip(self.param_of_dynamic, perturbed, arrays, strict=True):
            if p and is_differentiable_dtype(x.dtype):
                needs[param] = True
        if self.lifted and any(perturbed[k] and is_differentiable_dtype(arrays[k].dtype) for k in self.lifted):
            raise self._static_argument_differentiated()
        return tuple(needs)

    def _static_argument_differentiated(self) -> TypeError:
        # What _dispatch says of a class closing over a differentiated value, for a closure passed in.
        name = self.spec.name
        return TypeError(
            f"{name}.forward uses a value that JAX is differentiating but that is not an argument of "
            f"{name}.apply: {name} holds it in a closure passed in (a function argument closing over "
            f"parameters, {name}.apply(lambda x: f(x, w), x) under jax.grad with respect to w). {name}'s "
            f"derivative covers apply's arguments only, so pass the value as an argument of its own "
            f"({name}.apply(f, x, w), with f taking it) and return its gradient from {name}.backward "
            f"(its tangent from jvp). {see_catalogue('closure-over-a-differentiated-value')}"
        )

    def input_kinds(self, arrays: Any) -> tuple:
        """Per leaf of the bound arguments: None (static) or the array's type."""
        kinds = []
        for x in arrays:
            aval = _jax_internals.typeof(x)  # read once for all four
            kinds.append((
                tuple(aval.shape), aval.dtype, _jax_internals.varying_axes_of_type(aval),
                _sharding.explicit_sharding_of_type(aval),
            ))
        return tuple(self.layout.leaves(kinds, keep_static=False))

    # -- forward -----------------------------------------------------------

    def primal(self, *arrays: Any) -> Packed:
        """forward's outputs when nothing is differentiated."""
        packed, _, _ = self._forward(as_arrays(arrays), (False,) * self.n_params)
        return packed

    def run_primal(self, arrays: tuple) -> tuple[Packed, Residuals]:
        """forward's outputs when nothing is differentiated, with what a tie of them needs: no residual.

        No rule runs from them: a tie's derivative runs forward again,
        knowing the inputs it moves (``Program.tie_tangents``), so nothing
        forward saved is kept or checked here.
        """
        needs = (False,) * self.n_params
        packed, out, ctx = self._forward(arrays, needs)
        left = forwarded(ctx)
        meta = ResidualMeta(
            _NOTHING_SAVED, needs, differentiable_outputs(out, left.non_differentiable),
            tuple(_kind(a) for a in packed.arrays), left.materialize, self.input_kinds(arrays),
        )
        return packed, Residuals((), meta)

    def run_forward(self, arrays: tuple, needs: tuple, forward_mode: bool = False) -> tuple[Packed, Residuals]:
        """forward's outputs, and what backward (and, in ``forward_mode``, jvp) needs of it (``arrays``: JAX arrays)."""
        packed, out, ctx = self._forward(arrays, needs)
        left = forwarded(ctx, forward_mode)
        carried = left.carried
        if carried.attributes:
            lifted = frozenset(id(arrays[k]) for k in self.lifted)
            carried = carried._replace(
                attributes=self._static_attributes(carried.attributes, method_of(ctx), lifted)
            )
        layout, res_arrays = _split_carried(carried)
        meta = ResidualMeta(
            layout, needs, differentiable_outputs(out, left.non_differentiable),
            tuple(_kind(a) for a in packed.arrays), left.materialize, self.input_kinds(arrays),
        )
        return packed, Residuals(res_arrays, meta)

    def _static_attributes(self, attributes: dict, method: str, lifted: frozenset) -> dict:
        """ctx attributes, checked: those that travel as static data hold no array of the trace.

        Two kinds of tracer may sit in one: an array a static argument held
        (``lifted``: ids of forward's inputs, a ``functools.partial(layer,
        key=key)`` rebuilt around its key), and a tracer of an enclosing
        transformation that the class's methods close over too. They travel
        to backward and jvp as residuals, the value rebuilt around them there
        (``_tree.Lifted``): backward may run where the tracer no longer lives
        (reverse mode of a ``jax.vmap``).
        """
        enclosing = self.spec.closure_tracers | lifted
        checked = {}
        for name, value in attributes.items():
            layout, arrays = partition(value, is_array)
            leaves = None
            for position, leaf in layout.static:
                found = list(find_tracers(leaf))
                if not found:
                    continue
                own = [(inner, tracer) for inner, tracer in found if id(tracer) not in enclosing]
                if own:
                    inner, tracer = own[0]
                    leaf_path = _leaf_path(value, position)
                    owner = type(leaf).__name__
                    raise TypeError(
                        f"{self.spec.name}.{method}: ctx.{name}{leaf_path} is a {owner} holding an array of "
                        f"shape {tuple(tracer.shape)} and dtype {tracer.dtype} (at ctx.{name}{leaf_path}{inner}). "
                        f"A ctx attribute that is not an array or a pytree of arrays travels to backward as "
                        "static data, fixed when JAX traces, so the arrays inside it do not. Store the array "
                        f"itself on ctx (ctx.{name}_array = ...) or save it with ctx.save_for_backward, and "
                        f"rebuild the {owner} in backward. {see_catalogue('ctx-attribute-object-holding-an-array')}"
                    )
                tracers = tuple({id(t): t for _, t in found}.values())
                if leaves is None:
                    leaves = layout.leaves(arrays)
                leaves[position] = Lifted(leaf, tracers)
            checked[name] = value if leaves is None else jax.tree_util.tree_unflatten(layout.treedef, leaves)
        return checked

    def _forward(self, arrays: tuple, needs: tuple) -> tuple[Packed, Any, FunctionCtx]:
        spec = self.spec
        values = tuple(arrays) if self.all_arrays else self.layout.combine(arrays)
        ctx = FunctionCtx(spec.name, needs, values)
        forward = spec.forward if spec.vmap is None else _forward_batched_by_rule(spec, self.layout, arrays)
        try:
            out = run_user_method(
                spec.name, ctx, call_forward, ctx, spec.signature, forward, spec.setup_context, values
            )
        except _sharding.sharding_type_errors() as e:
            raise _sharding.forward_sharding_error(spec.name, method_of(ctx), e) from None
        dirty = dirty_of(ctx)
        if dirty and not {id(x) for x in dirty}.isdisjoint(map(id, jax.tree_util.tree_leaves(out))):
            raise ValueError(
                f"{spec.name}.forward marked an input dirty (ctx.mark_dirty) and "
                "returned that same input object unchanged. JAX arrays are "
                "immutable: compute the new value (e.g. x = x.at[i].set(v)) and "
                f"return it. {see_catalogue('dirty-input-returned-unchanged')}"
            )
        packed = pack_outputs(spec.name, out)
        if self.anomaly:
            self.check_outputs(packed)
        return packed, out, ctx

    # -- backward ----------------------------------------------------------

    def run_backward(self, residuals: Residuals, out_layout: Partition, cotangents: Sequence[Any]) -> list:
        """backward's checked gradients: one cotangent (or None) per array input leaf.

        ``cotangents`` has one entry per array output, a ``SymbolicZero``
        where JAX passes none; backward receives zeros there, or None when
        forward turned materialization off (PyTorch's rule). The caller
        (``OwnDerivative.apply_backward``) switches Explicit mesh axes to Auto.
        """
        meta = residuals.meta
        if not any(meta.differentiable):
            # No output carries a gradient, so none flows back: PyTorch never calls
            # backward then (and real backward methods raise in that case).
            return [None] * len(self.layout.dynamic)
        grads = output_cotangents(out_layout, cotangents, meta.out_avals, meta.differentiable, meta.materialize)
        if not self.spec.once_differentiable:
            return self._backward(meta, residuals.arrays, grads)
        grad_leaves, grad_treedef = jax.tree_util.tree_flatten(grads)
        n_res = len(residuals.arrays)

        def backward_of_arrays(*xs: Any) -> list:
            return self._backward(meta, xs[:n_res], jax.tree_util.tree_unflatten(grad_treedef, xs[n_res:]))

        return call_without_derivative(backward_of_arrays, (*residuals.arrays, *grad_leaves), self.once_message())

    def _backward(self, meta: ResidualMeta, res_arrays: Sequence[Any], grads: tuple) -> list:
        spec = self.spec
        assert spec.backward is not None  # run_backward is reached only when backward exists
        ctx = rule_ctx(spec.name, "backward", meta.needs, _combine_carried(meta.layout, res_arrays), meta.materialize)
        result = run_user_method(spec.name, ctx, spec.backward, ctx, *grads)
        cotangents = check_backward_outputs(
            spec.name, result, self.param_treedefs, self.names, meta.in_kinds, meta.needs
        )
        if self.anomaly:
            self.check_gradients(cotangents)
        return cotangents

    # -- jvp ---------------------------------------------------------------

    def run_jvp(self, meta: ResidualMeta, residuals: Sequence[Any], out_layout: Partition, in_avals: list,
                linear: list, tangents: Sequence[Any]) -> list:
        """jvp's checked tangents, one per differentiable output (``tangents``: those of the input leaves ``linear``).

        The other inputs' tangents reach jvp as zeros, or None when forward
        turned materialization off (PyTorch's rule).
        """
        spec = self.spec
        assert spec.jvp is not None  # the program asks for jvp only for a class with one
        tangent_leaves: list = [None] * len(in_avals)
        # Evaluated eagerly (jax.linearize of a jaxpr), a tangent may be JAX's weakly typed Python scalar.
        for d, t in zip(linear, as_arrays(tangents), strict=True):
            tangent_leaves[d] = t
        for d, t in enumerate(tangent_leaves):
            if t is None and meta.materialize and is_differentiable_dtype(in_avals[d][1]):
                tangent_leaves[d] = jnp.zeros(*in_avals[d])
        ctx = rule_ctx(spec.name, "jvp", meta.needs, meta.layout.combine(residuals), meta.materialize)
        try:
            result = run_user_method(
                spec.name, ctx, spec.jvp, ctx, *self.layout.combine(tangent_leaves, keep_static=False)
            )
        except _sharding.sharding_type_errors() as e:
            raise _sharding.forward_sharding_error(spec.name, "jvp", e) from None
        tangents_out = check_jvp_outputs(spec.name, result, out_layout, meta.differentiable, meta.out_avals)
        if self.anomaly:
            outputs = [j for j, diff in enumerate(meta.differentiable) if diff]
            labelled = [(f"the tangent of output {j}", t) for j, t in zip(outputs, tangents_out, strict=True)]
            _anomaly.check_finite(spec.name, "jvp", labelled)
        return tangents_out

    # -- messages ----------------------------------------------------------

    def once_message(self) -> str:
        return (
            f"{self.spec.name}.backward is decorated with @once_differentiable, so it "
            "cannot be differentiated (a second derivative such as jax.hessian or "
            "grad of grad was asked for). Remove the decorator if backward is "
            f"written in differentiable JAX operations. {see_catalogue('once-differentiable-differentiated-twice')}"
        )

    # -- vjpkit.detect_anomaly ----------------------------------------------

    def check_outputs(self, packed: Packed) -> None:
        labelled = [(f"output {j}", a) for j, a in enumerate(packed.arrays)]
        _anomaly.check_finite(self.spec.name, "forward", labelled)

    def check_gradients(self, grads: list, method: str = "backward") -> None:
        """``grads``: one per array input leaf, as ``check_backward_outputs`` returns them."""
        labels = _anomaly.input_labels(self.names, self.layout)
        _anomaly.check_finite(self.spec.name, method, list(zip(labels, grads, strict=True)))
