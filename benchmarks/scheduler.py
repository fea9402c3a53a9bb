"""The scheduler on synthetic graphs: makespan vs its lower bound, and vs verl's stage-by-stage order.

Run from the repository root::

    python benchmarks/scheduler.py              # sleeping operators, ~2.5 min
    python benchmarks/scheduler.py --quick      # shorter operators, fewer steps
    python benchmarks/scheduler.py --work cpu   # calibrated matmuls instead of sleeps
    python benchmarks/scheduler.py --smoke      # ppo-3pools and fan-out at 1/20 length, 1 step per variant

Four graph shapes (see :func:`shapes`), every node a ``bench.*`` operator (see
``benchmarks/ops.py``) doing a set amount of work on the Ray backend:

* ``ppo-3pools``: generate on a rollout pool; old log-probs, ref log-probs and
  the actor update on a train pool; values and the critic update on a critic
  pool; reward and advantage on the driver;
* ``fan-out``: one producer, six consumers over three pools and the driver,
  one join;
* ``chain``: twelve nodes, one after the other, round-robin over three pools;
* ``colocated``: the PPO nodes with actor, ref and rollout in one pool and the
  critic in another.

Each shape runs in flowrl's schedule (micro-batches 1 and/or 4) and in the
*baseline*, verl's stage-by-stage ``fit()``: the same graph with an ``after:``
edge from each node to the next and one micro-batch, run by the same runtime
on the same actors with the driver waiting for every node before it submits
the next (:class:`StageByStage`). What-if rows inject another per-pool order
into the plan (:func:`list_schedule`), and run the PPO shape with staleness 1.
All variants of one shape share one set of Ray actors (one start-up per shape)
and alternate step by step, so a noisy neighbour hits them alike; the first
step of each is a warm-up.

Printed per variant (medians over the measured steps): the step's makespan
(first task start → last task end, on the workers' clocks), the runtime's lower
bound max(critical path, tightest pool bound) from the measured task
durations, efficiency = bound / makespan, the same against a tighter bound
(:func:`tight_bound`), the plan's predicted makespan from the declared work,
the driver's wall time per step, and the speed-ups over the baseline.
benchmarks/README.md explains every column.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import SharedBackend, cpu_note, init_ray, median, one_step, print_table, timed  # noqa: E402

import benchmarks.ops as bench_ops
from flowrl.data import DataProto
from flowrl.graph import GraphBuilder
from flowrl.plan.planner import DRIVER, Plan, bounds_of, make_plan
from flowrl.runtime.scheduler import Runtime

BATCH = 16  # prompts per step; 4 micro-batches of 4
BIG = {"CPU": 64.0, "GPU": 0.0}


# ---------------------------------------------------------------------- shapes
@dataclass
class N:
    """A node: operator family, role (None: the driver), inputs, its output field, work in ms per step."""

    name: str
    op: str
    role: str | None
    inputs: list[str]
    out: str | None
    ms: float


@dataclass
class Shape:
    name: str
    about: str
    roles: dict[str, Any]
    pools: dict[str, Any]
    nodes: list[N]  # in verl's fit() order: the baseline runs them one after another
    micro_batches: list[int] = field(default_factory=lambda: [4])


def _actor() -> dict[str, Any]:
    return {"kind": "bench_actor"}


def _pool(*roles: str) -> dict[str, Any]:
    return {"workers": 1, "cpus": 1, "roles": list(roles)}


def _ppo_nodes() -> list[N]:
    # a verl-like step profile: generation dominates, then the actor update
    return [
        N("generate", "work", "rollout", ["prompts"], "responses", 1000),
        N("reward", "driver", None, ["responses"], "token_level_scores", 100),
        N("old_logprob", "work", "actor", ["responses"], "old_log_probs", 300),
        N("ref_logprob", "work", "ref", ["responses"], "ref_log_prob", 300),
        N("values", "work", "critic", ["responses"], "values", 300),
        N("advantage", "driver_batch", None, ["token_level_scores", "old_log_probs", "ref_log_prob", "values"],
          "advantages", 50),
        N("update_critic", "update", "critic", ["advantages", "values"], None, 400),
        N("update_actor", "update", "actor", ["advantages", "old_log_probs"], None, 600),
    ]


def _ppo_roles() -> dict[str, Any]:
    return {"actor": _actor(), "rollout": {"from": "actor"}, "ref": {"from": "actor", "frozen": True},
            "critic": _actor()}


def shapes() -> dict[str, Shape]:
    fan = [N("produce", "work", "a", ["prompts"], "produced", 300)]
    homes = ["a", "b", "b", "c", "c", None]  # six consumers: three pools and the driver
    for i, home in enumerate(homes):
        fan.append(N(f"consume{i}", "work" if home else "driver", home, ["produced"], f"c{i}", 300))
    fan.append(N("join", "batch_work", "a", [f"c{i}" for i in range(len(homes))], "joined", 200))
    chain = [N(f"n{i:02d}", "work", f"r{i % 3}", ["prompts" if i == 0 else f"f{i - 1}"], f"f{i}", 200)
             for i in range(12)]
    return {
        s.name: s
        for s in [
            Shape("ppo-3pools", "rollout | actor+ref | critic pools; reward, advantage on the driver",
                  _ppo_roles(), {"rollout": _pool("rollout"), "train": _pool("actor", "ref"),
                                 "critic": _pool("critic")}, _ppo_nodes(), [1, 4]),
            Shape("fan-out", "1 producer → 6 consumers (3 pools + driver) → 1 join",
                  {"a": _actor(), "b": _actor(), "c": _actor()},
                  {"pa": _pool("a"), "pb": _pool("b"), "pc": _pool("c")}, fan, [1, 4]),
            Shape("chain", "12 nodes in a row, round-robin over 3 pools",
                  {f"r{i}": _actor() for i in range(3)}, {f"p{i}": _pool(f"r{i}") for i in range(3)}, chain, [4]),
            Shape("colocated", "actor+ref+rollout in one pool, critic pool",
                  _ppo_roles(), {"train": _pool("actor", "ref", "rollout"), "critic": _pool("critic")},
                  _ppo_nodes(), [4]),
        ]
    }


def build(shape: Shape, micro_batches: int, *, baseline: bool, mode: str, iters_per_ms: float,
          scale: float, staleness: int = 0) -> Any:
    """The shape as a graph; ``baseline`` chains every node after the previous one."""
    b = GraphBuilder(f"{shape.name}-{'baseline' if baseline else f'mb{micro_batches}'}",
                     roles=shape.roles, pools=shape.pools, imports=["benchmarks.ops"],
                     data={"source": "bench:prompts", "batch_size": BATCH},
                     schedule={"micro_batches": 1 if baseline else micro_batches, "staleness": staleness})
    prev = None
    for n in shape.nodes:
        op = f"bench.{n.op}{len(n.inputs)}"
        b.node(n.name, op, role=n.role, inputs={f"x{i}": f for i, f in enumerate(n.inputs)},
               outputs={"y": n.out} if n.out else None, after=[prev] if baseline and prev else None,
               ms_per_row=n.ms * scale / BATCH, mode=mode, iters_per_ms=iters_per_ms, cost=n.ms * scale / 1e3)
        prev = n.name
    return b.build()


# ---------------------------------------------------------------------- bounds
def tight_bound(plan: Plan, durations: dict[Any, float]) -> float:
    """max over pools of (earliest possible start + its work + the least work that must follow it),
    and the critical path: a valid lower bound, never below the runtime's."""
    head: dict[Any, float] = {}
    for key in plan.order:
        head[key] = max((head[d] + durations.get(d, 0.0) for d in plan.tasks[key].deps), default=0.0)
    tail: dict[Any, float] = {key: 0.0 for key in plan.order}
    succ: dict[Any, list[Any]] = {key: [] for key in plan.order}
    for key in plan.order:
        for d in plan.tasks[key].deps:
            succ[d].append(key)
    for key in reversed(plan.order):
        tail[key] = max((durations.get(s, 0.0) + tail[s] for s in succ[key]), default=0.0)
    best = max((head[k] + durations.get(k, 0.0) + tail[k] for k in plan.order), default=0.0)
    for pool, keys in plan.pool_order.items():
        if pool == DRIVER:
            continue
        work = sum(durations.get(k, 0.0) for k in keys)
        best = max(best, min(head[k] for k in keys) + work + min(tail[k] for k in keys))
    return best


# ---------------------------------------------------------------------- orders
class StageByStage(SharedBackend):
    """verl's ``fit()`` loop through the same runtime: the driver waits for every
    node (all its ranks) to finish before it submits the next one."""

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        self._node: str | None = None
        self._pending: list[Any] = []

    def submit(self, pool: str, rank: int, call: Any, inputs: list[Any]) -> tuple[Any, Any]:
        if call.node != self._node:
            for h in self._pending:
                self._backend.get(h)  # ray.get: the previous stage is done
            self._node, self._pending = call.node, []
        data, info = self._backend.submit(pool, rank, call, inputs)
        self._pending.append(info)
        return data, info


def list_schedule(plan: Plan, costs: dict[str, float]) -> tuple[list[Any], dict[str, list[Any]]]:
    """A what-if order: simulate the step task by task, always starting next the task
    that can start earliest (its inputs predicted done, its pool free), the longest
    remaining path first among equals. Unlike the plan's static priority order, it
    sees when each micro-batch's inputs arrive, so a pool interleaves the
    micro-batches of two nodes instead of finishing one node first."""
    def cost(key: Any) -> float:
        t = plan.tasks[key]
        return costs[t.node] / (plan.micro_batches if t.mb is not None else 1)

    topo = {k: i for i, k in enumerate(plan.order)}
    start: dict[Any, float] = {}
    end: dict[Any, float] = {}
    free: dict[str, float] = {}
    left = set(plan.tasks)
    while left:
        def earliest(k: Any) -> float:
            t = plan.tasks[k]
            ready = max((end[d] for d in t.deps), default=0.0)
            return ready if t.pool == DRIVER else max(ready, free.get(t.pool, 0.0))

        ready = [k for k in left if all(d in end for d in plan.tasks[k].deps)]
        key = min(ready, key=lambda k: (earliest(k), -plan.tasks[k].rank, topo[k]))
        start[key] = earliest(key)
        end[key] = start[key] + cost(key)
        if plan.tasks[key].pool != DRIVER:
            free[plan.tasks[key].pool] = end[key]
        left.remove(key)
    order = sorted(plan.tasks, key=lambda k: (start[k], topo[k]))
    pools: dict[str, list[Any]] = {}
    for k in order:
        pools.setdefault(plan.tasks[k].pool, []).append(k)
    return order, pools


# ---------------------------------------------------------------------- running
@dataclass
class Variant:
    label: str
    graph: Any
    backend: type = SharedBackend  # how it reaches the shape's actors
    order: tuple[list[Any], dict[str, list[Any]]] | None = None  # a what-if order replacing the plan's
    pipelined: bool = False  # staleness > 0: steps overlap, only the time per step is meaningful
    runtime: Runtime | None = None
    steps: list[dict[str, float]] = field(default_factory=list)


def prompts() -> DataProto:
    b = bench_ops.prompt_batch(BATCH)
    return DataProto.from_dict(tensors={"prompts": b["prompts"]}, non_tensors={"uid": b["uid"]})


def costs_of(shape: Shape, scale: float) -> dict[str, float]:
    return {n.name: n.ms * scale / 1e3 for n in shape.nodes}


def variants_of(shape: Shape, args: argparse.Namespace, iters_per_ms: float) -> list[Variant]:
    """The baseline first, then flowrl's schedules (and what-ifs)."""
    kw = {"mode": args.work, "iters_per_ms": iters_per_ms, "scale": args.scale}
    out = [Variant("stage-by-stage", build(shape, 1, baseline=True, **kw), backend=StageByStage)]
    for k in [1, 4] if args.all_micro_batches else shape.micro_batches:
        v = Variant(f"flowrl mb={k}", build(shape, k, baseline=False, **kw))
        out.append(v)
        plan = make_plan(v.graph)
        order = list_schedule(plan, costs_of(shape, args.scale))
        if args.what_if and order[1] != plan.pool_order:
            out.append(Variant(f"what-if mb={k} (list order)", v.graph, order=order))
    if args.what_if and shape.name == "ppo-3pools":
        k = max(shape.micro_batches)
        out.append(Variant(f"flowrl mb={k} staleness=1", build(shape, k, baseline=False, staleness=1, **kw),
                           pipelined=True))
    return out


def measure(v: Variant, r: Any, wall: float) -> dict[str, float]:
    durations = {(i.node, i.mb): 0.0 for i in r.infos}
    for i in r.infos:
        durations[(i.node, i.mb)] = max(durations[(i.node, i.mb)], i.end - i.start)
    critical, (_, busiest) = bounds_of(v.runtime.plan, durations)
    return {"makespan": r.makespan, "critical": critical, "busiest": busiest, "bound": r.lower_bound,
            "efficiency": r.efficiency, "tight": tight_bound(v.runtime.plan, durations) / r.makespan,
            "wall": wall}


def run_shape(shape: Shape, args: argparse.Namespace, iters_per_ms: float) -> list[Variant]:
    """Every variant of a shape on one set of actors, alternating step by step."""
    variants = variants_of(shape, args, iters_per_ms)
    # The actors' owner starts a driver worker only when its own plan has driver tasks,
    # and variants differ there (a light node moves into a pool unless the baseline's
    # ``after:`` edges pin it between pools): own them from a variant that needs one.
    home = next((v for v in variants if make_plan(v.graph).driver), variants[1])
    owner = Runtime(home.graph, backend="ray", resources=BIG).start()
    try:
        for v in variants:
            v.runtime = Runtime(v.graph, backend=v.backend(owner.backend), resources=BIG)
            # the variants take turns on one set of workers: no run's steps count their weight versions
            v.runtime.checks_versions = False
            if v.order is not None:
                v.runtime.plan.order, v.runtime.plan.pool_order = v.order
        batch = prompts()
        lockstep = [v for v in variants if not v.pipelined]
        for step in range(args.warmup + args.steps):
            for v in lockstep:  # alternate: drift and neighbours hit every variant alike
                wall, r = timed(one_step, v.runtime, batch, step)
                if step >= args.warmup:
                    v.steps.append(measure(v, r, wall))
        for v in variants:
            if v.pipelined:  # steady state: the time between consecutive results
                last = time.perf_counter()
                for r in v.runtime.run(itertools.repeat(batch), steps=args.warmup + args.steps + 1):
                    now = time.perf_counter()
                    if r.step > args.warmup:
                        v.steps.append({"wall": now - last})
                    last = now
    finally:
        owner.close()
    return variants


def report(shape: Shape, variants: list[Variant], scale: float) -> list[dict[str, Any]]:
    """Medians per variant, with the speed-up over the baseline (variants[0])."""
    base = {k: median(s[k] for s in variants[0].steps) for k in ("makespan", "wall")}
    out = []
    for v in variants:
        m = {k: median(s[k] for s in v.steps) for k in v.steps[0]}
        m.update(graph=shape.name, schedule=v.label, flowrl=not v.label.startswith(("stage", "what-if")),
                 predicted=None if v.pipelined else v.runtime.plan.simulate(costs_of(shape, scale)).makespan,
                 wall_speedup=base["wall"] / m["wall"])
        if "makespan" in m:
            m["speedup"] = base["makespan"] / m["makespan"]
        out.append(m)
    return out


COLUMNS = [  # (header, key, format)
    ("graph", "graph", "{}"), ("schedule", "schedule", "{}"), ("makespan s", "makespan", "{:.3f}"),
    ("crit.path s", "critical", "{:.3f}"), ("pool bound s", "busiest", "{:.3f}"), ("bound s", "bound", "{:.3f}"),
    ("efficiency", "efficiency", "{:.3f}"), ("eff. (tight)", "tight", "{:.3f}"), ("predicted s", "predicted", "{:.3f}"),
    ("wall s/step", "wall", "{:.3f}"), ("speed-up", "speedup", "{:.2f}x"), ("wall speed-up", "wall_speedup", "{:.2f}x"),
]


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="half-length operators, 2 measured steps")
    parser.add_argument("--work", choices=["sleep", "cpu"], default="sleep", help="what operators do")
    parser.add_argument("--shapes", nargs="*", default=None, help="subset of: " + ", ".join(shapes()))
    parser.add_argument("--steps", type=int, default=None, help="measured steps per variant (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per variant, not measured")
    parser.add_argument("--all-micro-batches", action="store_true", help="run micro-batches 1 and 4 everywhere")
    parser.add_argument("--no-what-if", dest="what_if", action="store_false",
                        help="skip the what-if rows (another per-pool order; staleness=1)")
    parser.add_argument("--cpus", type=int, default=8, help="Ray's logical CPUs")
    parser.add_argument("--smoke", action="store_true",
                        help="ppo-3pools (every kind of variant) and fan-out (variants that differ in needing a "
                             "driver worker), operators at 1/20 length, 1 step, no warm-up")
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.quick else 3)
    args.scale = 0.5 if args.quick else 1.0
    if args.smoke:
        args.shapes, args.steps, args.warmup, args.scale = ["ppo-3pools", "fan-out"], 1, 0, 0.05

    iters_per_ms = bench_ops.calibrate() if args.work == "cpu" else 0.0
    init_ray(args.cpus)
    print(cpu_note(args.cpus))
    print(f"operators: {args.work}" + (f" (calibrated: {iters_per_ms:.0f} 64x64 matmuls/ms on an idle core)"
                                       if args.work == "cpu" else "")
          + f"; {BATCH} prompts/step; {args.warmup} warm-up + {args.steps} measured steps per variant; medians")
    results: list[dict[str, Any]] = []
    for name, shape in shapes().items():
        if args.shapes and name not in args.shapes:
            continue
        t0 = time.perf_counter()
        results += report(shape, run_shape(shape, args, iters_per_ms), args.scale)
        print(f"  {name}: {shape.about} ({time.perf_counter() - t0:.0f} s incl. start-up)")
    rows = [[fmt.format(m[key]) if m.get(key) is not None else "-" for _, key, fmt in COLUMNS] for m in results]
    print_table("scheduler: makespan vs lower bound, and vs stage-by-stage (medians)", [c[0] for c in COLUMNS], rows,
                notes=[
                    "bound = max(critical path, pool bound: a pool's earliest start + its work + least work after), measured;",
                    "eff. (tight) = a tighter valid bound / makespan: per pool, earliest start + work + least work after;",
                    "predicted = the plan's simulate() with the declared work; speed-up = baseline makespan / makespan;",
                    "what-if rows inject another per-pool order into the plan; staleness=1: time per step in steady state.",
                ])

    ours = [m for m in results if m["flowrl"] and "efficiency" in m]
    for key, name in (("efficiency", "the runtime's bound"), ("tight", "the tight bound")):
        missed = [f"{m['graph']} {m['schedule']} ({m[key]:.3f})" for m in ours if m[key] < 0.9]
        print(f"goal efficiency >= 0.9 on every graph, vs {name}: "
              + ("met" if not missed else "missed on " + ", ".join(missed)))
    ppo = [m for m in ours if m["graph"] == "ppo-3pools"]
    if ppo:
        best = max(ppo, key=lambda m: m["speedup"])
        print(f"goal >= 1.5x over stage-by-stage on ppo-3pools: {'met' if best['speedup'] >= 1.5 else 'missed'} ("
              + ", ".join(f"{m['schedule']}: {m['speedup']:.2f}x" for m in ppo) + ")")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
