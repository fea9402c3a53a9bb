"""The schema of a graph definition: roles, pools, data, nodes, schedule, trainer.

YAML files and ``@graph`` calls both produce a :class:`GraphConfig`. Keys are
checked here for shape (types, unknown keys); what they *mean* (an operator's
parameters, a role kind's settings, a data source's options) is checked by
:mod:`flowrl.graph.checks` against what the registered operators declare.

Example YAML::

    name: grpo
    roles:
      actor: {model: builtin:tiny, optim: {lr: 5.0e-4}}
    pools:
      train: {workers: 1, cpus: 1, roles: [actor]}
    data: {source: builtin:copy, batch_size: 32}
    nodes:
      generate: {op: rollout.generate, role: actor, n: 8}
    schedule: {micro_batches: 1, staleness: 0}
    trainer: {steps: 300}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flowrl.errors import ConfigError
from flowrl.timeouts import COLLECTIVE_S, STUCK_FACTOR, STUCK_MIN_S, TASK_S

#: keys of a node that are not operator parameters
NODE_KEYS = ("op", "role", "inputs", "outputs", "after", "timeout_s", "cost", "on_error")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class RoleConfig(BaseModel):
    """A role: ``kind`` (default inferred), ``from``/``frozen`` to derive one role from
    another, and the kind's own settings (``model``, ``optim``...) as extra keys."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    kind: str | None = None
    from_: str | None = Field(None, alias="from")
    frozen: bool = False

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def dump(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.kind is not None:
            out["kind"] = self.kind
        if self.from_ is not None:
            out["from"] = self.from_
        if self.frozen:
            out["frozen"] = True
        out.update(self.settings)
        return out


class PoolConfig(_Strict):
    """A resource pool: ``workers`` processes, each with ``cpus`` and ``gpus``; the
    roles it hosts share those processes (colocation)."""

    workers: int = Field(1, ge=1)
    cpus: float = Field(1.0, ge=0)
    gpus: float = Field(0.0, ge=0)
    roles: list[str] = Field(default_factory=list)
    backend: str = Field("cpu:gloo,cuda:nccl", description="torch.distributed backend per device type, "
                         "for a pool of more than one worker")
    timeout_s: float = Field(COLLECTIVE_S, gt=0, description="how long one collective of the pool's group may wait")
    max_restarts: int = Field(0, ge=0, le=1000, description="dead workers replaced during the run (a pool of one "
                              "worker whose roles no node updates: one that generates or scores)")


class DataConfig(BaseModel):
    """The prompt source: ``source`` (``builtin:<task>`` or a parquet/jsonl path),
    ``batch_size`` prompts per step, and the source's own options as extra keys."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    source: str
    batch_size: int = Field(16, ge=1)

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def dump(self) -> dict[str, Any]:
        return {"source": self.source, "batch_size": self.batch_size, **self.settings}


class OnErrorConfig(_Strict):
    """What a node does when its operator raises: ``retries`` more attempts on the same rows,
    ``backoff_s`` before the first (doubling after each), then ``then``: ``fail`` the step
    (the default), ``drop_group``: leave out of this step every group (the rows of one
    prompt: one ``uid``) the operator still fails on, and go on with the complete groups, or
    ``refill``: run the step again with those groups' prompts replaced by fresh ones."""

    retries: int = Field(0, ge=0, le=100)
    backoff_s: float = Field(0.0, ge=0, le=3600)
    then: Literal["fail", "drop_group", "refill"] = "fail"

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        # ``on_error: drop_group`` reads as ``on_error: {then: drop_group}``
        return {"then": v} if isinstance(v, str) else v


#: what a fault does when it fires: raise an error, hang forever, or kill the worker's process
FAULT_KINDS = ("raise", "hang", "kill")
#: moments of a step the fault switch can fire in besides a node's task: a worker's state being taken for
#: the checkpoint of that step (``node=checkpoint``), any task of the validation run after it (``node=validation``),
#: weights from another pool being loaded for a task of that step (``node=sync``)
FAULT_WINDOWS = ("checkpoint", "validation", "sync")


class FaultSpecError(ConfigError, ValueError):
    """A fault spec (``trainer.fault``, ``flowrl run --fault``) does not parse."""


@dataclass(frozen=True)
class Fault:
    """Where the fault switch fires: ``node`` at ``step`` (1-based), optionally one ``rank`` / ``mb``;
    ``times``: on the first N attempts only (None: every attempt)."""

    node: str
    step: int
    kind: str = "raise"
    rank: int | None = None
    mb: int | None = None
    times: int | None = None

    def matches(self, node: str, step: int, rank: int, mb: int | None) -> bool:
        """Whether a task of ``node`` at (0-based) ``step`` on ``rank``, micro-batch ``mb``, is the one."""
        return (node == self.node and step + 1 == self.step and self.rank in (None, rank)
                and self.mb in (None, mb))


def parse_fault(text: str) -> Fault:
    """``node=reward,step=3,rank=0,kind=raise`` as a :class:`Fault` (a :class:`FaultSpecError` naming the bad part).

    Example::

        parse_fault("node=reward,step=3,kind=hang,times=1")   # Fault('reward', 3, 'hang', times=1)
    """
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("node", "step", "rank", "mb", "kind", "times"):
            raise FaultSpecError(f"fault {text!r}: {part!r} is not one of node=, step=, rank=, mb=, kind=, times= "
                                 "(e.g. 'node=reward,step=3,kind=raise')")
        fields[key.strip()] = value.strip()
    if "node" not in fields or "step" not in fields:
        raise FaultSpecError(f"fault {text!r}: name the node and the step (node=reward,step=3)")
    kind = fields.get("kind", "raise")
    if kind not in FAULT_KINDS:
        raise FaultSpecError(f"fault {text!r}: kind={kind!r} is not one of {', '.join(FAULT_KINDS)}")
    try:
        ints = {k: int(fields[k]) for k in ("step", "rank", "mb", "times") if k in fields}
    except ValueError as e:
        raise FaultSpecError(f"fault {text!r}: step, rank, mb and times are whole numbers ({e})") from None
    if ints["step"] < 1:
        raise FaultSpecError(f"fault {text!r}: steps count from 1")
    return Fault(fields["node"], ints["step"], kind, ints.get("rank"), ints.get("mb"), ints.get("times"))


class ScheduleConfig(_Strict):
    """How the step runs: micro-batches for streaming, the staleness bound of the
    weight edge (one number, or one per role), and the per-pool order policy."""

    micro_batches: int = Field(1, ge=1)
    staleness: int | dict[str, int] = 0
    order: Literal["critical_path", "declared"] = Field(
        "critical_path", description="per-pool order: list-scheduled critical path first, or as written")
    timeout_s: float | None = Field(TASK_S, gt=0, description="how long a node's task may run when the node sets "
                                     "no timeout_s of its own (null: no limit); past it the step fails with "
                                     "the stuck worker's stack")
    colocate_light_nodes: bool = Field(
        True, description="run stateless nodes whose neighbours all share one pool in that pool's process")

    @field_validator("staleness")
    @classmethod
    def _non_negative(cls, v: int | dict[str, int]) -> int | dict[str, int]:
        values = v.values() if isinstance(v, dict) else [v]
        if any(s < 0 for s in values):
            raise ValueError("staleness must be >= 0 (0 is the synchronous step)")
        return v

    def staleness_of(self, role: str) -> int:
        if isinstance(self.staleness, dict):
            return self.staleness.get(role, 0)
        return self.staleness


class RecordConfig(_Strict):
    """``trainer.record``: the outputs of ``nodes`` saved every ``every`` steps (safetensors and
    JSON, under ``<out>/records``), the oldest steps removed past ``max_gb``; what ``flowrl
    replay`` rebuilds a step from (:mod:`flowrl.provenance.record`)."""

    nodes: list[str] = Field(min_length=1, description="the nodes whose outputs are saved (the step's data "
                             "batch is saved with them)")
    every: int = Field(1, ge=1, description="save every K-th step (1: every step)")
    max_gb: float = Field(5.0, gt=0, description="disk budget of the records; past it the oldest steps go")


class TrainerConfig(_Strict):
    """The outer loop: steps, seed, where the run writes, checkpoints, validation."""

    steps: int = Field(100, ge=1)
    seed: int = 0
    out: str | None = None
    checkpoint_every: int = Field(0, ge=0)
    keep_checkpoints: int = Field(3, ge=1)
    val_every: int = Field(0, ge=0, description="greedy validation every N steps (0: never)")
    dump_rollouts: bool = Field(False, description="write each step's prompts, responses, rewards to JSONL")
    log_every: int = Field(1, ge=1)
    wandb_project: str | None = Field(None, description="also log to this wandb project (needs wandb)")
    # finding where a run went wrong (flowrl diff; flowrl.provenance.invariants)
    fingerprints: bool = Field(True, description="write a digest and statistics of every node output per step "
                               "to fingerprints.jsonl")
    invariants: Literal["warn", "fatal", "off"] = Field(
        "warn", description="the per-step checks on fingerprints (weights changed, arrived, as planned; NaN): "
        "warn, stop the run (fatal), or off")
    record: RecordConfig | None = Field(None, description="save chosen nodes' outputs per step for flowrl replay")
    stuck_factor: float | None = Field(
        STUCK_FACTOR, gt=1, description="report a task with its stacks as stuck once it has run this many times its "
        "predicted seconds (from costs.json or the steps measured so far; null: never); schedule.timeout_s still fails it")
    stuck_min_s: float = Field(STUCK_MIN_S, gt=0, description="... and at least this many seconds")
    fault: str | None = Field(None, description="inject a failure, for tests and rehearsals: "
                              "'node=reward,step=3,rank=0,kind=raise|hang|kill,mb=0,times=1' (flowrl run --fault)")

    @field_validator("fault")
    @classmethod
    def _fault_parses(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        parse_fault(v)
        return v.strip()


class NodeConfig(BaseModel):
    """One node: ``op`` (a registered name or ``module:function``), an optional
    ``role``, field renames, explicit ``after`` dependencies, a ``timeout_s``,
    an ``on_error`` policy, and the operator's parameters as the remaining keys."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    op: str
    role: str | None = None
    inputs: dict[str, str] = Field(default_factory=dict)
    outputs: dict[str, str] = Field(default_factory=dict)
    after: list[str] = Field(default_factory=list)
    timeout_s: float | None = Field(None, gt=0)
    cost: float | None = Field(None, gt=0)
    on_error: OnErrorConfig | None = None

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def dump(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op}
        for key in ("role", "timeout_s", "cost"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        for key in ("inputs", "outputs", "after"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.on_error is not None:
            out["on_error"] = self.on_error.model_dump()
        out.update(self.params)
        return out


class GraphConfig(_Strict):
    """A whole graph definition, as read from YAML or built by ``@graph``."""

    name: str
    description: str = ""
    imports: list[str] = Field(default_factory=list)
    roles: dict[str, RoleConfig] = Field(default_factory=dict)
    pools: dict[str, PoolConfig] = Field(default_factory=dict)
    data: DataConfig
    nodes: dict[str, NodeConfig]
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        # the name becomes the default run directory runs/<name>: it must not climb out of runs/
        if not v or v in (".", "..") or "/" in v or "\\" in v or v.startswith(".") or v.strip() != v:
            raise ValueError("a graph name is one plain word (letters, digits, '-', '_', '.'), not a path; "
                             "set where the run writes with trainer.out or --out")
        return v

    @model_validator(mode="after")
    def _has_nodes(self) -> "GraphConfig":
        if not self.nodes:
            raise ValueError("a graph needs at least one node under 'nodes'")
        return self

    def dump(self) -> dict[str, Any]:
        """A canonical plain-dict form (two front ends building one graph dump equal)."""
        return {
            "name": self.name,
            "imports": list(self.imports),
            "roles": {k: v.dump() for k, v in self.roles.items()},
            "pools": {k: v.model_dump() for k, v in self.pools.items()},
            "data": self.data.dump(),
            "nodes": {k: v.dump() for k, v in self.nodes.items()},
            "schedule": self.schedule.model_dump(),
            "trainer": self.trainer.model_dump(),
        }
