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
              params=GAE, scope="batch", token_mask="response_mask")
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

import importlib
import inspect
from typing import Any, Callable, Mapping

from flowrl.data.fields import Field
from flowrl.data.dispatch import DISPATCH_MODES
from flowrl.graph import trace
from flowrl.graph.registry import REGISTRY
from flowrl.graph.spec import (
    SCOPES,
    NoParams,
    OperatorDeclarationError,
    OperatorOutputError,
    OperatorSpec,
    Params,
    Scope,
    StateSpec,
    TokenMetrics,
)

#: top-level packages whose operators are pickled by name (importable wherever flowrl is installed)
BY_REFERENCE = {"operators", "flowrl"}


class Operator(OperatorSpec):
    """A declared operator: its spec, callable like the function it wraps.

    Called with a traced batch it records a node; with a real batch it runs
    eagerly (see :mod:`flowrl.graph.trace`).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Trace into a graph when given a traced batch; otherwise run eagerly."""
        return trace.call_operator(self, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # Operators of installed packages travel by name: the receiving worker
        # imports the module, which registers the same spec. Anything else (a
        # graph file's own operator) travels by value.
        top = self.module.split(".", 1)[0]
        if top in BY_REFERENCE:
            return (find_operator, (self.name, self.module))
        return (Operator, tuple(getattr(self, f) for f in self.__dataclass_fields__))


def find_operator(name: str, module: str) -> OperatorSpec:
    """The registered spec ``name``, importing ``module`` (which declares it) first."""
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
    dispatch: str | None = None,
    updates_role: bool = False,
    node_name: str = "",
    cost: float = 1.0,
    optional_inputs: tuple[str, ...] = (),
    expands: str | None = None,
    aux_outputs: tuple[str, ...] = (),
    score: str | None = None,
    val_params: Mapping[str, Any] | None = None,
    dumped: tuple[str, ...] = (),
    state: StateSpec | None = None,
    balance_by: str | None = None,
    group_key: str | None = None,
    token_mask: str | None = None,
    headline: tuple[str, ...] = (),
    tokens: TokenMetrics | None = None,
    score_max: Callable[[Any, Mapping[str, Any]], float | None] | None = None,
    register: bool = True,
) -> Callable[[Callable[..., Any]], Operator]:
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
    ``score`` names the output validation scores responses by (a reward's);
    ``val_params`` are parameters set when the node runs in validation
    (``{"greedy": True}``); ``dumped`` are fields it reads or writes that belong in a rollout dump.
    ``state`` declares state kept across steps (see :class:`StateSpec`).
    ``balance_by`` names the input whose ones count a row's real tokens
    (``attention_mask``): on a pool whose ranks form a process group, the plan
    runs the node data parallel with rows balanced by it. ``group_key`` names
    the input whose equal values mark one group (``uid``): a group-scoped node
    run data parallel keeps each group on one rank. ``token_mask`` names the input or
    output whose ones mark a row's real tokens (``response_mask``): the fingerprints of
    its float fields of that shape summarise those tokens only. ``headline`` names the
    metrics it reports that a person watches during a run (the live view shows
    them, in the graph's order); ``tokens`` which of them count the tokens it
    generated per row (:class:`TokenMetrics`: throughput, profiles). ``score_max(params, graph)`` says
    the highest its ``score`` can be, given its parameters and the graph's config dump (the tools another
    node calls), or None where it cannot know (a user's reward function): what a run's summary measures
    held-out scores against.
    """
    if scope not in SCOPES:
        raise OperatorDeclarationError(f"operator {name!r}: scope must be one of {SCOPES}, not {scope!r}")
    dispatch = dispatch or ("split" if role else "driver")
    if dispatch not in DISPATCH_MODES:
        raise OperatorDeclarationError(
            f"operator {name!r}: dispatch must be a registered mode ({', '.join(DISPATCH_MODES)}), "
            f"not {dispatch!r}"
        )
    if not (isinstance(params, type) and issubclass(params, Params)):
        raise OperatorDeclarationError(f"operator {name!r}: params must be a subclass of flowrl.graph.Params")
    if expands is not None and expands not in params.model_fields:
        raise OperatorDeclarationError(f"operator {name!r}: expands={expands!r} is not one of its parameters")
    if score is not None and score not in (outputs or {}):
        raise OperatorDeclarationError(f"operator {name!r}: score={score!r} is not one of its outputs")
    unknown_dumped = [n for n in dumped if n not in (outputs or {}) and n not in (inputs or {})]
    if unknown_dumped:
        raise OperatorDeclarationError(f"operator {name!r}: dumped names {', '.join(unknown_dumped)}, "
                                       f"which it neither reads nor writes")
    unknown_val = [k for k in (val_params or {}) if k not in params.model_fields]
    if unknown_val:
        raise OperatorDeclarationError(f"operator {name!r}: val_params names {', '.join(unknown_val)}, "
                                       f"which are not its parameters")
    for what, key in (("balance_by", balance_by), ("group_key", group_key)):
        if key is not None and key not in (inputs or {}):
            raise OperatorDeclarationError(f"operator {name!r}: {what}={key!r} is not one of its inputs")
    if token_mask is not None and token_mask not in (inputs or {}) and token_mask not in (outputs or {}):
        raise OperatorDeclarationError(f"operator {name!r}: token_mask={token_mask!r} is neither an input nor an "
                                       f"output")
    if not isinstance(headline, (tuple, list)) or not all(isinstance(m, str) and m for m in headline):
        raise OperatorDeclarationError(f"operator {name!r}: headline is a tuple of metric names, not {headline!r}")
    if tokens is not None and not isinstance(tokens, TokenMetrics):
        raise OperatorDeclarationError(f"operator {name!r}: tokens is a TokenMetrics(mean=..., max=...), "
                                       f"not {tokens!r}")
    if score_max is not None and (score is None or not callable(score_max)):
        raise OperatorDeclarationError(f"operator {name!r}: score_max is a function (params, graph) -> float "
                                       f"or None, declared with score=")
    if updates_role and not role:
        raise OperatorDeclarationError(f"operator {name!r}: updates_role needs a role")

    def wrap(fn: Callable[..., Any]) -> Operator:
        n_args = len(inspect.signature(fn).parameters)
        want = 3 if role else 2
        if n_args != want:
            shape = "(role, batch, params)" if role else "(batch, params)"
            raise OperatorDeclarationError(
                f"operator {name!r}: {fn.__qualname__} takes {n_args} arguments; "
                f"an operator {'with' if role else 'without'} a role is called as fn{shape}"
            )
        spec = Operator(
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
            module=fn.__module__,
            optional_inputs=tuple(optional_inputs),
            expands=expands,
            aux_outputs=tuple(aux_outputs),
            score=score,
            val_params=dict(val_params or {}),
            dumped=tuple(dumped),
            state=state,
            balance_by=balance_by,
            group_key=group_key,
            token_mask=token_mask,
            headline=tuple(headline),
            tokens=tokens,
            score_max=score_max,
        )
        if register:
            REGISTRY.add_operator(spec)
        return spec

    return wrap


__all__ = ["BY_REFERENCE", "NoParams", "Operator", "OperatorDeclarationError", "OperatorOutputError", "OperatorSpec",
           "Params", "StateSpec", "TokenMetrics", "find_operator", "operator"]
