"""The Python front end: ``@graph`` tracing and a plain builder.

A step function written like verl's loop is called once with a traced batch;
every operator call records a node instead of running. Nothing runs until the
graph is placed. The result is the same :class:`~flowrl.graph.ir.Graph` a YAML
file builds.

Example::

    from flowrl import graph
    from operators import rollout, reward

    @graph(name="tiny", roles={"actor": {"model": "builtin:tiny"}},
           pools={"train": {"roles": ["actor"]}},
           data={"source": "builtin:copy", "batch_size": 8})
    def tiny(batch):
        batch = rollout.generate(batch, n=4)
        return reward.rule(batch)

    tiny.check().raise_if_errors()

Called with a real :class:`~flowrl.data.DataProto` instead, an operator runs
eagerly and returns the batch with its outputs added (handy in a notebook or
a unit test): ``gae(batch, gamma=1.0)``; role-bound operators take the role
object first: ``old_logprob(actor, batch)``.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Callable, Mapping

from pydantic import ValidationError

from flowrl.data.expand import check_rows, expand_rows
from flowrl.graph.config import GraphConfig, NODE_KEYS
from flowrl.graph.ir import Graph
from flowrl.graph.load import schema_problems
from flowrl.graph.problems import GraphError
from flowrl.graph.spec import OperatorSpec

_NODE_KWARGS = ("name",) + NODE_KEYS


class TracedBatch:
    """The stand-in batch a step function receives while being traced."""

    def __init__(self, builder: "GraphBuilder", after: str | None = None) -> None:
        self._builder = builder
        self._after = after

    def __repr__(self) -> str:
        return f"TracedBatch(after={self._after!r})"

    def __getitem__(self, key: Any) -> Any:
        raise TypeError(
            "a traced batch holds no values: inside @graph, pass the batch to operators; "
            "read values in an operator body instead"
        )


class GraphBuilder:
    """Build a graph node by node, with the same keys as YAML.

    Example::

        b = GraphBuilder("ppo", roles=..., pools=..., data=...)
        b.node("generate", "rollout.generate", role="actor", n=1)
        graph = b.build()
    """

    def __init__(
        self,
        name: str,
        *,
        roles: Mapping[str, Any] | None = None,
        pools: Mapping[str, Any] | None = None,
        data: Mapping[str, Any] | None = None,
        schedule: Mapping[str, Any] | None = None,
        trainer: Mapping[str, Any] | None = None,
        imports: list[str] | None = None,
        description: str = "",
    ) -> None:
        self.config: dict[str, Any] = {
            "name": name,
            "description": description,
            "imports": list(imports or []),
            "roles": dict(roles or {}),
            "pools": dict(pools or {}),
            "data": dict(data or {}),
            "nodes": {},
            "schedule": dict(schedule or {}),
            "trainer": dict(trainer or {}),
        }
        self.lines: dict[tuple[Any, ...], int] = {}
        self.source_file: str | None = None

    def node(self, name: str | None, op: OperatorSpec | str, *, line: int | None = None, **keys: Any) -> str:
        """Add a node; ``op`` is an operator (spec) or its registered name. Returns its name."""
        op_name = op if isinstance(op, str) else op.name
        if name is None:
            base = op.default_node_name() if not isinstance(op, str) else op.rsplit(".", 1)[-1]
            name, i = base, 2
            while name in self.config["nodes"]:
                name, i = f"{base}_{i}", i + 1
        elif name in self.config["nodes"]:
            raise ValueError(f"node {name!r} is added twice; give the second one another name=")
        self.config["nodes"][name] = {"op": op_name, **{k: v for k, v in keys.items() if v is not None}}
        if line is not None:
            self.lines[("nodes", name)] = line
        return name

    def build(self) -> Graph:
        """Validate the keys and build the IR (raises :class:`GraphError` on schema errors)."""
        try:
            config = GraphConfig.model_validate(self.config)
        except ValidationError as e:
            raise GraphError(schema_problems(e, self.lines, self.source_file)) from None
        return Graph.from_config(config, source_file=self.source_file, lines=self.lines)


_ACTIVE: list[GraphBuilder] = []


def graph(
    name: str | None = None,
    *,
    roles: Mapping[str, Any] | None = None,
    pools: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    schedule: Mapping[str, Any] | None = None,
    trainer: Mapping[str, Any] | None = None,
    imports: list[str] | None = None,
) -> Callable[[Callable[[Any], Any]], Graph]:
    """Trace a step function into a :class:`Graph` (see the module docstring)."""

    def wrap(fn: Callable[[Any], Any]) -> Graph:
        builder = GraphBuilder(
            name or fn.__name__, roles=roles, pools=pools, data=data, schedule=schedule,
            trainer=trainer, imports=imports, description=inspect.getdoc(fn) or "",
        )
        builder.source_file = _relative(inspect.getsourcefile(fn))
        builder.lines[()] = fn.__code__.co_firstlineno
        _ACTIVE.append(builder)
        try:
            fn(TracedBatch(builder))
        finally:
            _ACTIVE.pop()
        return builder.build()

    return wrap


def call_operator(spec: OperatorSpec, *args: Any, **kwargs: Any) -> Any:
    """What calling an operator does: record a node while tracing, else run it."""
    if args and isinstance(args[-1], TracedBatch) and len(args) == 1:
        return _record(spec, args[0], kwargs)
    return run_eager(spec, *args, **kwargs)


def _record(spec: OperatorSpec, batch: TracedBatch, kwargs: dict[str, Any]) -> TracedBatch:
    builder = batch._builder
    caller = sys._getframe(3)
    keys = {k: kwargs.pop(k) for k in list(kwargs) if k in _NODE_KWARGS}
    node_name = builder.node(keys.pop("name", None), spec, line=caller.f_lineno, **keys, **kwargs)
    return TracedBatch(builder, after=node_name)


def run_eager(spec: OperatorSpec, *args: Any, **params: Any) -> Any:
    """Run an operator on a real batch now; returns the batch with the outputs added."""
    from flowrl.data import DataProto

    if spec.role:
        if len(args) != 2:
            raise TypeError(f"operator {spec.name!r} runs on a role: call it as op(role, batch, **params)")
        role, batch = args
    else:
        if len(args) != 1:
            raise TypeError(f"operator {spec.name!r}: call it as op(batch, **params)")
        role, batch = None, args[0]
    if not isinstance(batch, DataProto):
        raise TypeError(f"operator {spec.name!r} takes a DataProto, got {type(batch).__name__}")
    p = spec.params.model_validate(params)
    state = None
    if spec.state is not None:  # carried in the batch's meta_info from one eager call to the next
        state = dict(batch.meta_info.get(spec.state.key) or spec.state.init(p))
        batch = batch.select()  # a new container: the caller's meta_info stays as it was
        batch.meta_info[spec.state.key] = state
    outputs, metrics = spec.run(role, batch, p)
    if outputs.batch is not None or outputs.non_tensor_batch:  # an output with rows (not only metadata)
        check_rows(spec.name, len(batch), spec.expansion(p), len(outputs))
    # a new container (sharing tensors): verl's union works in place, the caller's batch must not change
    result = expand_rows(batch, spec.expansion(p)).select()
    if len(outputs):
        result = result.union(outputs)
    if metrics:
        result.meta_info.setdefault("metrics", {}).update(metrics)
    if state is not None:
        result.meta_info[spec.state.key] = state
    return result


def _relative(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("..") else path
    except ValueError:
        return path
