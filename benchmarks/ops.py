"""Benchmark-only operators, a role kind and a data source, all under ``bench``.

Graphs name them like any operator (``imports: [benchmarks.ops]``). They do
calibrated, synthetic work so that a benchmark controls exactly how long each
node takes:

* ``mode="sleep"`` (default): ``time.sleep`` — isolates the scheduler from CPU
  contention, so a 2-core machine can host more pools than cores;
* ``mode="cpu"``: a fixed number of 64×64 float32 matmuls, calibrated on an idle
  core by :func:`calibrate` (``iters_per_ms``), so the *amount* of work is fixed
  and contention shows as longer tasks.

Work is ``ms_per_row × rows``: a micro-batch or a rank's shard does its share,
so streaming and data parallelism divide it as they would divide real work.

Operator families, one per shape of node, each with ``k`` = 1..8 inputs
``x0..x{k-1}`` (any tensor with a leading batch dim) and, unless it updates, one
output ``y: float32[B]`` (rename it per node with ``outputs: {y: name}``):

==========================  ===========  =======  ====================
name                        runs on      scope    note
==========================  ===========  =======  ====================
``bench.work{k}``           a role       row      streams
``bench.batch_work{k}``     a role       batch    a barrier
``bench.update{k}``         a role       batch    ``updates_role``, no output
``bench.driver{k}``         the driver   row      stateless
``bench.driver_batch{k}``   the driver   batch    stateless barrier
==========================  ===========  =======  ====================

``bench.echo`` is the no-op of the dispatch benchmark: it returns its inputs
(the PPO-sized payload's columns) as ``out_<column>``, without copying them.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from flowrl.graph import Params, Role, operator, role_kind, source

MAX_INPUTS = 8
ANY_ROWS = "*[B, ...]"  # any dtype, any trailing dims: whatever the upstream wrote


# ---------------------------------------------------------------- work
class Work(Params):
    ms_per_row: float = Field(0.0, ge=0, description="milliseconds of work per input row")
    mode: Literal["sleep", "cpu"] = Field("sleep", description="sleep, or calibrated matmuls (cpu)")
    iters_per_ms: float = Field(0.0, ge=0, description="matmuls per millisecond on an idle core (cpu mode)")


_A = torch.randn(64, 64)


def calibrate(target_s: float = 0.3) -> float:
    """64×64 matmuls per millisecond on this (idle, single-threaded) core."""
    torch.set_num_threads(1)
    for _ in range(200):  # warm-up
        _A @ _A
    n, elapsed = 0, 0.0
    t0 = time.perf_counter()
    while elapsed < target_s:
        for _ in range(500):
            _A @ _A
        n += 500
        elapsed = time.perf_counter() - t0
    return n / (elapsed * 1e3)


def spend(p: Work, rows: int) -> None:
    """Do ``p.ms_per_row × rows`` milliseconds of work (see the module docstring)."""
    ms = p.ms_per_row * rows
    if ms <= 0:
        return
    if p.mode == "sleep":
        time.sleep(ms / 1e3)
        return
    if p.iters_per_ms <= 0:
        raise ValueError("mode='cpu' needs iters_per_ms (benchmarks.ops.calibrate())")
    for _ in range(int(round(ms * p.iters_per_ms))):
        _A @ _A


def _work(batch: Any, p: Work) -> dict[str, torch.Tensor]:
    spend(p, len(batch))
    return {"y": torch.zeros(len(batch))}


def _work_on(role: Any, batch: Any, p: Work) -> dict[str, torch.Tensor]:
    return _work(batch, p)


def _update(role: Any, batch: Any, p: Work) -> tuple[dict, dict[str, float]]:
    spend(p, len(batch))
    return {}, {f"bench/{type(role).__name__}_rows": float(len(batch))}


def _inputs(k: int) -> dict[str, str]:
    return {f"x{i}": ANY_ROWS for i in range(k)}


for _k in range(1, MAX_INPUTS + 1):
    _role = {"role": "actor", "role_kinds": ("bench_actor",), "params": Work, "inputs": _inputs(_k)}
    operator(f"bench.work{_k}", scope="row", outputs={"y": "float32[B]"}, **_role)(_work_on)
    operator(f"bench.batch_work{_k}", scope="batch", outputs={"y": "float32[B]"}, **_role)(_work_on)
    operator(f"bench.update{_k}", scope="batch", updates_role=True, **_role)(_update)
    operator(f"bench.driver{_k}", scope="row", inputs=_inputs(_k), outputs={"y": "float32[B]"},
             params=Work)(_work)
    operator(f"bench.driver_batch{_k}", scope="batch", inputs=_inputs(_k), outputs={"y": "float32[B]"},
             params=Work)(_work)


# ---------------------------------------------------------------- role
class BenchRole(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weights: int = Field(16, ge=1, description="float32 weights moved by a cross-pool weight sync")


@role_kind("bench_actor", config=BenchRole)
class BenchActor(Role):
    """A stand-in model: a weight vector (moved by weight syncs); its version is the worker's."""

    def __init__(self, cfg: BenchRole, ctx: Any = None) -> None:
        self.w = torch.zeros(cfg.weights)

    def get_weights(self) -> torch.Tensor:
        return self.w.clone()

    def set_weights(self, w: torch.Tensor) -> None:
        self.w = w.clone()


# ---------------------------------------------------------------- data
#: the PPO-sized payload of benchmarks/dataproto.py: column → spec
PPO_COLUMNS = {
    "input_ids": "int64[B, S]", "attention_mask": "int64[B, S]", "position_ids": "int64[B, S]",
    "responses": "int64[B, R]", "old_log_probs": "float32[B, R]", "advantages": "float32[B, R]",
    "uid": "object[B]", "extra_info": "object[B]",
}


class BenchData(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str
    batch_size: int = Field(16, ge=1)
    schema_: Literal["prompts", "ppo"] = Field("prompts", alias="schema")
    prompt_len: int = Field(4, ge=1)


def _source_fields(cfg: BenchData) -> dict[str, str]:
    if cfg.schema_ == "ppo":
        return dict(PPO_COLUMNS)
    return {"prompts": "int64[B, P]", "uid": "object[B]"}


@source("bench", config=BenchData, fields=_source_fields)
class BenchSource:
    """``bench:prompts`` yields small prompt batches; ``schema: ppo`` the
    dispatch benchmark's payload (built by the benchmark itself)."""

    def __init__(self, cfg: BenchData, seed: int = 0) -> None:
        self.cfg = cfg

    def next_batch(self) -> dict[str, Any]:
        return prompt_batch(self.cfg.batch_size, self.cfg.prompt_len)


def prompt_batch(batch_size: int, prompt_len: int = 4) -> dict[str, Any]:
    return {
        "prompts": torch.arange(prompt_len).repeat(batch_size, 1),
        "uid": np.array([f"p{i}" for i in range(batch_size)], dtype=object),
    }


@operator(
    "bench.echo", role="actor", role_kinds=("bench_actor",), scope="row",
    inputs={k: (ANY_ROWS if s != "object[B]" else s) for k, s in PPO_COLUMNS.items()},
    outputs={f"out_{k}": (ANY_ROWS if s != "object[B]" else s) for k, s in PPO_COLUMNS.items()},
)
def echo(role: Any, batch: Any, p: Any) -> dict[str, Any]:
    """The no-op: every input column back, under ``out_<name>`` (no copy)."""
    return {f"out_{k}": batch[k] for k in PPO_COLUMNS}
