"""What an operator is, as data: its fields, role, scope, dispatch, expansion, state.

The bottom of :mod:`flowrl.graph`: imports nothing else from it, so the IR, the
registry, the checks and the runtime all read the same :class:`OperatorSpec`
without a cycle. Declaring one (the ``@operator`` decorator) lives in
:mod:`flowrl.graph.declare`.

Example::

    spec = REGISTRY.operator("rollout.generate")
    spec.expansion(spec.params(n=4))          # 4: each prompt becomes 4 rows
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict

from flowrl.errors import ConfigError, RunError
from flowrl.data.fields import Field
from flowrl.data.metrics import metric_value

if TYPE_CHECKING:  # torch-backed; imported where a batch is built, so declaring stays light
    from flowrl.data.proto import DataProto

#: the name of the pseudo-node producing the data source's columns
SOURCE = "data"

#: what a node's rows depend on: itself alone, its group (the rows of one prompt, which share a
#: key, verl's ``uid``: a group-scoped operator declares which input with ``group_key``), or the whole batch
Scope = Literal["row", "group", "batch"]

SCOPES: tuple[str, ...] = ("row", "group", "batch")


class Params(BaseModel):
    """Base class of operator parameters: typed, defaulted, no unknown keys."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True, arbitrary_types_allowed=True)


class NoParams(Params):
    """An operator without parameters."""


class OperatorDeclarationError(ConfigError, TypeError):
    """An operator was declared inconsistently (a programming error, raised at import)."""


class OperatorOutputError(RunError):
    """An operator returned something other than what it declared."""


@dataclass(frozen=True)
class StateSpec:
    """State an operator keeps across steps (the adaptive KL coefficient).

    ``init(params)`` builds the first state (a dict of JSON values: numbers, lists). The
    operator body reads and replaces it through ``batch.meta_info[key]``; the
    runtime keeps it per node, hands the same value to every rank, stores the
    value rank 0 returns, and checkpoints it with the run.
    """

    init: Callable[[Any], dict[str, Any]]
    key: str = "operator_state"


@dataclass(frozen=True)
class TokenMetrics:
    """Which of an operator's metrics count the tokens it generated per row, so that the core reads
    them without naming an RL metric: ``mean`` over the rows (a step's token throughput) and ``max``
    (the longest row, which a profile sizes a step by)."""

    mean: str
    max: str


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
    dispatch: str = "split"  # a registered dispatch mode (flowrl.data.dispatch)
    updates_role: bool = False
    node_name: str = ""
    doc: str = ""
    cost: float = 1.0
    module: str = ""
    optional_inputs: tuple[str, ...] = field(default=())
    expands: str | None = None
    aux_outputs: tuple[str, ...] = field(default=())  # outputs often unread: no warning when they are
    score: str | None = None  # the output validation scores responses by (a reward)
    val_params: Mapping[str, Any] = field(default_factory=dict, hash=False)  # parameters set when validating
    dumped: tuple[str, ...] = field(default=())  # fields it reads or writes worth a rollout dump
    state: "StateSpec | None" = None  # state kept across steps (checkpointed, same on every rank)
    balance_by: str | None = None  # the input whose ones are a row's real tokens: data-parallel balancing
    group_key: str | None = None  # the input whose equal values mark one group (rows kept on one rank)
    token_mask: str | None = None  # the input or output whose ones mark a row's real tokens (fingerprint statistics)
    headline: tuple[str, ...] = field(default=())  # metrics a person watches (the live view), in order
    tokens: "TokenMetrics | None" = None  # the metrics that count the tokens it generated per row
    #: the highest ``score`` can be, from the node's parameters and the graph's config dump (None: unknown)
    score_max: "Callable[[Any, Mapping[str, Any]], float | None] | None" = field(default=None, hash=False)

    def expansion(self, params: Params | None) -> int:
        """How many output rows each input row becomes (``n`` samples per prompt), else 1."""
        return int(getattr(params, self.expands)) if self.expands and params is not None else 1

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
            default = "required" if info.is_required() else repr(info.get_default(call_default_factory=True))
            ann = getattr(info.annotation, "__name__", str(info.annotation))
            rows.append((pname, ann, default, info.description or ""))
        return rows

    def run(self, role: Any, batch: DataProto, params: Params) -> tuple[DataProto, dict[str, float]]:
        """Call the operator body and check its outputs against the declaration.

        Returns ``(outputs as a DataProto, metrics)``. The body may return a dict of
        outputs, ``(outputs, metrics)``, a DataProto, or None when it declares no
        outputs.
        """
        import numpy as np
        import torch

        from flowrl.data.proto import DataProto

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
        return out, {k: metric_value(v) for k, v in metrics.items()}


__all__ = ["SOURCE", "NoParams", "OperatorDeclarationError", "OperatorOutputError", "OperatorSpec", "Params", "SCOPES",
           "Scope", "StateSpec", "TokenMetrics"]
