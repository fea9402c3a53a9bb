"""Declaring operators: typed functions from fields to fields.

An operator is a plain function plus a declaration — its dotted name, the fields
it reads and writes, the role it runs against, its scope, its dispatch mode and
its parameters (a pydantic model). Declaring one registers it, so graphs can
name it (``op: advantage.gae``).

Example::

    from flowrl.graph import operator, Params

    class GAE(Params):
        gamma: float = 1.0
        lam: float = 0.95

    @operator("advantage.gae",
              inputs={"token_level_rewards": "float32[B, R]", "values": "float32[B, R]",
                      "response_mask": "int64[B, R]"},
              outputs={"advantages": "float32[B, R]", "returns": "float32[B, R]"},
              params=GAE, scope="batch")
    def gae(batch, p: GAE):
        adv, ret = compute_gae(batch["token_level_rewards"], batch["values"],
                               batch["response_mask"], p.gamma, p.lam)
        return {"advantages": adv, "returns": ret}

The function receives the batch (a :class:`~flowrl.data.DataProto` holding at
least the declared inputs) and the validated parameters; an operator bound to a
role receives the role object first: ``def old(actor, batch, p)``. It returns a
dict of its outputs, or ``(outputs, metrics)``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict

from flowrl.data.fields import Field

Scope = Literal["row", "group", "batch"]
Dispatch = Literal["split", "all", "driver"]

SCOPES: tuple[str, ...] = ("row", "group", "batch")
DISPATCHES: tuple[str, ...] = ("split", "all", "driver")


class Params(BaseModel):
    """Base class of operator parameters: typed, defaulted, no unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)


class NoParams(Params):
    """An operator without parameters."""


class OperatorDeclarationError(TypeError):
    """An operator was declared inconsistently (a programming error, raised at import)."""


class OperatorOutputError(RuntimeError):
    """An operator returned something other than what it declared."""


@dataclass(frozen=True)
class OperatorSpec:
    """Everything the graph layer knows about an operator, without running it."""

    name: str
    fn: Callable[..., Any]
    inputs: tuple[Field, ...]
    outputs: tuple[Field, ...]
    params: type[Params] = NoParams
    role: str | None = None
    role_kinds: tuple[str, ...] = ()
    scope: Scope = "row"
    dispatch: Dispatch = "split"
    updates_role: bool = False
    node_name: str = ""
    doc: str = ""
    cost: float = 1.0
    group_key: str = "uid"
    module: str = ""
    optional_inputs: tuple[str, ...] = field(default=())
    expands: str | None = None
    aux_outputs: tuple[str, ...] = field(default=())  # outputs often unread: no warning when they are

    def expansion(self, params: "Params") -> int:
        """How many output rows each input row becomes (``n`` samples per prompt), else 1."""
        return int(getattr(params, self.expands)) if self.expands else 1

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.outputs)

    def input(self, name: str) -> Field:
        return next(f for f in self.inputs if f.name == name)

    def output(self, name: str) -> Field:
        return next(f for f in self.outputs if f.name == name)

    def default_node_name(self) -> str:
        return self.node_name or self.name.rsplit(".", 1)[-1]

    def param_table(self) -> list[tuple[str, str, str, str]]:
        """``(name, type, default, description)`` for each parameter (for docs and errors)."""
        rows = []
        for pname, info in self.params.model_fields.items():
            default = "required" if info.is_required() else repr(info.default)
            ann = getattr(info.annotation, "__name__", str(info.annotation))
            rows.append((pname, ann, default, info.description or ""))
        return rows

    def run(self, role: Any, batch: Any, params: Params) -> tuple[Any, dict[str, float]]:
        """Call the operator body and check its outputs against the declaration.

        Returns ``(outputs as a DataProto, metrics)``. The body may return a dict of
        outputs, ``(outputs, metrics)``, a DataProto, or None when it declares no
        outputs.
        """
        import numpy as np
        import torch

        from flowrl.data import DataProto

        result = self.fn(role, batch, params) if self.role else self.fn(batch, params)
        metrics: dict[str, float] = {}
        if isinstance(result, tuple):
            if len(result) != 2:
                raise OperatorOutputError(f"operator {self.name!r} returned a tuple of {len(result)}; "
                                          f"return outputs or (outputs, metrics)")
            result, metrics = result
            metrics = dict(metrics or {})
        if result is None:
            result = {}
        if isinstance(result, DataProto):
            cols: dict[str, Any] = {**{k: result.batch[k] for k in (result.batch.keys() if result.batch is not None else [])},
                                    **result.non_tensor_batch}
        elif isinstance(result, dict):
            cols = dict(result)
        else:
            raise OperatorOutputError(f"operator {self.name!r} returned {type(result).__name__}; "
                                      f"return a dict of its outputs")
        declared = {f.name: f for f in self.outputs}
        missing = [n for n in declared if n not in cols and declared[n].kind != "meta"]
        extra = [n for n in cols if n not in declared]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"did not return {', '.join(missing)}")
            if extra:
                parts.append(f"returned undeclared {', '.join(extra)}")
            raise OperatorOutputError(
                f"operator {self.name!r} {' and '.join(parts)}; it declares outputs "
                f"{', '.join(declared) or '(none)'}"
            )
        tensors, non_tensors, meta = {}, {}, {}
        for name, value in cols.items():
            f = declared[name]
            if f.kind == "meta":
                meta[name] = value
            elif f.kind == "non_tensor":
                arr = value if isinstance(value, np.ndarray) else np.array(list(value), dtype=object)
                non_tensors[name] = arr.astype(object, copy=False)
            else:
                if not isinstance(value, torch.Tensor):
                    raise OperatorOutputError(f"operator {self.name!r}: output {name!r} must be a tensor "
                                              f"({f.spec}), got {type(value).__name__}")
                dtype = str(value.dtype).removeprefix("torch.")
                if f.dtype not in ("*", dtype):
                    raise OperatorOutputError(f"operator {self.name!r}: output {name!r} is {dtype}, "
                                              f"declared {f.spec}")
                tensors[name] = value
        out = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta) if (tensors or non_tensors) \
            else DataProto(meta_info=meta)
        problems = out.check_fields(self.outputs)  # shapes agree with the declaration (R is one R)
        if problems:
            raise OperatorOutputError(f"operator {self.name!r} returned outputs that do not match its "
                                      f"declaration: {'; '.join(problems)}")
        return out, {k: float(v) for k, v in metrics.items()}

    def __reduce__(self) -> tuple[Any, ...]:
        # Operators of installed packages travel by name: the receiving worker
        # imports the module, which registers the same spec. Anything else (a
        # graph file's own operator) travels by value.
        top = self.module.split(".", 1)[0]
        if top in BY_REFERENCE:
            return (find_operator, (self.name, self.module))
        return (OperatorSpec, tuple(getattr(self, f) for f in self.__dataclass_fields__))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Trace into a graph when given a traced batch; otherwise run eagerly."""
        from flowrl.graph import trace

        return trace.call_operator(self, *args, **kwargs)


#: top-level packages whose operators are pickled by name (importable wherever flowrl is installed)
BY_REFERENCE = {"operators", "flowrl"}


def find_operator(name: str, module: str) -> OperatorSpec:
    """The registered spec ``name``, importing ``module`` (which declares it) first."""
    import importlib

    from flowrl.graph.registry import REGISTRY

    importlib.import_module(module)
    return REGISTRY.operators[name]


def _fields(decl: Mapping[str, str | Field] | None, what: str, op: str) -> tuple[Field, ...]:
    out = []
    for fname, spec in (decl or {}).items():
        if isinstance(spec, Field):
            out.append(spec.renamed(fname))
        elif isinstance(spec, str):
            out.append(Field.parse(fname, spec))
        else:
            raise OperatorDeclarationError(
                f"operator {op!r}: {what} {fname!r} must be a spec string like 'int64[B, R]' or a Field"
            )
    return tuple(out)


def operator(
    name: str,
    *,
    inputs: Mapping[str, str | Field] | None = None,
    outputs: Mapping[str, str | Field] | None = None,
    params: type[Params] = NoParams,
    role: str | None = None,
    role_kinds: tuple[str, ...] | None = None,
    scope: Scope = "row",
    dispatch: Dispatch | None = None,
    updates_role: bool = False,
    node_name: str = "",
    cost: float = 1.0,
    group_key: str = "uid",
    optional_inputs: tuple[str, ...] = (),
    expands: str | None = None,
    aux_outputs: tuple[str, ...] = (),
    register: bool = True,
) -> Callable[[Callable[..., Any]], OperatorSpec]:
    """Declare (and register) an operator; see the module docstring.

    ``role`` is the role a node binds to unless the graph says otherwise;
    ``role_kinds`` the kinds of role it accepts (default: the role's own name).
    ``dispatch`` defaults to ``split`` for role-bound operators and ``driver``
    for stateless ones. ``updates_role`` marks an operator that changes its
    role's state (an optimizer step): it creates the graph's state edges.
    ``cost`` is a relative cost used to predict timelines before measuring.
    ``expands`` names the parameter giving how many output rows each input row
    becomes (``"n"`` for sampling n responses per prompt); the runtime repeats
    earlier columns to match, as verl's ``repeat(n, interleave=True)``.
    ``aux_outputs`` are by-products a graph often leaves unread (a sample's
    weight version): no "unused output" warning for them.
    """
    if scope not in SCOPES:
        raise OperatorDeclarationError(f"operator {name!r}: scope must be one of {SCOPES}, not {scope!r}")
    dispatch = dispatch or ("split" if role else "driver")
    if dispatch not in DISPATCHES:
        raise OperatorDeclarationError(
            f"operator {name!r}: dispatch must be one of {DISPATCHES}, not {dispatch!r}"
        )
    if not (isinstance(params, type) and issubclass(params, Params)):
        raise OperatorDeclarationError(f"operator {name!r}: params must be a subclass of flowrl.graph.Params")
    if expands is not None and expands not in params.model_fields:
        raise OperatorDeclarationError(f"operator {name!r}: expands={expands!r} is not one of its parameters")
    if updates_role and not role:
        raise OperatorDeclarationError(f"operator {name!r}: updates_role needs a role")

    def wrap(fn: Callable[..., Any]) -> OperatorSpec:
        n_args = len(inspect.signature(fn).parameters)
        want = 3 if role else 2
        if n_args != want:
            shape = "(role, batch, params)" if role else "(batch, params)"
            raise OperatorDeclarationError(
                f"operator {name!r}: {fn.__qualname__} takes {n_args} arguments; "
                f"an operator {'with' if role else 'without'} a role is called as fn{shape}"
            )
        spec = OperatorSpec(
            name=name,
            fn=fn,
            inputs=_fields(inputs, "input", name),
            outputs=_fields(outputs, "output", name),
            params=params,
            role=role,
            role_kinds=tuple(role_kinds) if role_kinds is not None else ((role,) if role else ()),
            scope=scope,
            dispatch=dispatch,
            updates_role=updates_role,
            node_name=node_name,
            doc=inspect.getdoc(fn) or "",
            cost=cost,
            group_key=group_key,
            module=fn.__module__,
            optional_inputs=tuple(optional_inputs),
            expands=expands,
            aux_outputs=tuple(aux_outputs),
        )
        if register:
            from flowrl.graph.registry import REGISTRY

            REGISTRY.add_operator(spec)
        return spec

    return wrap
