"""Per-node dispatch overhead: a no-op through flowrl's Runtime vs raw Ray, numpy and verl.

Run from the repository root::

    python benchmarks/dispatch.py            # ~1.5 min
    python benchmarks/dispatch.py --quick    # fewer repeats, fewer poll intervals
    python benchmarks/dispatch.py --smoke    # B=8, 2 rounds, one poll interval, no verl: one start-up

One no-op node (``bench.echo``: every column back, no copy) on a pool of 2
workers with ``dispatch="split"``; the time of a call is the driver's wall time
of one whole step (``Runtime.run`` for one step: put the batch, submit, wait,
collect the reports). Two payloads, both the schema of
``benchmarks/dataproto.py``: ``input_ids``, ``attention_mask``,
``position_ids`` int64[B, 2048], ``responses`` int64[B, 1024], two float32[B,
1024] columns, a ``uid`` string and a dict per row: B=8 (0.5 MiB) and B=1024
(64 MiB).

Every candidate runs the same payload on idle Ray actors of its own, in
alternation (one call each, round after round), and the median of the measured
rounds is printed with its ratio to the baselines:

* ``ray DataProto 1 actor``: ``actor.echo.remote(dp)`` then ``ray.get`` — a raw
  Ray call on flowrl's DataProto;
* ``ray DataProto 2 actors``: the same, hand-split in two (``dp.chunk(2)``) and
  concatenated back — what a split dispatch must do at least;
* ``ray numpy dict 1 actor``: the same bytes as a dict of numpy arrays (object
  columns as numpy object arrays);
* ``verl RayWorkerGroup``: a ``@register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)``
  no-op on 2 CPU workers (``RayResourcePool(use_gpu=False, max_colocate_count=1)``),
  on verl's own DataProto (when verl imports);
* ``flowrl``: the runtime with its default ``poll_s=0.05`` and smaller ones;
  the outputs stay in the object store as futures (flowrl's normal case);
  ``+fetch`` brings every output column back to the driver, as the Ray and
  verl calls do;
* ``before: one wait per report``: the runtime with the collection loop it had
  before issue 14.5 (one ``ray.wait`` per finished task, each report fetched on
  its own), on the same workers: the before/after of that change in one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import SharedBackend, cpu_note, init_ray, median, one_step, print_table  # noqa: E402

import torch

import benchmarks.ops as bench_ops
from benchmarks.dataproto import make_data, payload_bytes
from flowrl.data import DataProto
from flowrl.graph import GraphBuilder
from flowrl.runtime.backends import Backend
from flowrl.runtime.scheduler import Runtime

BIG = {"CPU": 64.0, "GPU": 0.0}
WORKERS = 2


def payload(rows: int) -> dict[str, Any]:
    """The first ``rows`` rows of benchmarks/dataproto.py's batch, in memory of their own."""
    full = make_data()
    return {k: (v[:rows].clone() if isinstance(v, torch.Tensor) else v[:rows].copy()) for k, v in full.items()}


def echo_graph(rows: int, workers: int = WORKERS) -> Any:
    """One no-op node split over a pool of ``workers`` (``rows`` only declares the batch size)."""
    b = GraphBuilder("dispatch", roles={"actor": {"kind": "bench_actor"}},
                     # one pool name per worker count: two live Runtimes may not share a pool name (placement group names)
                     pools={f"workers{workers}": {"workers": workers, "cpus": 1, "roles": ["actor"]}},
                     data={"source": "bench:ppo", "schema": "ppo", "batch_size": rows},
                     schedule={"micro_batches": 1}, imports=["benchmarks.ops"])
    b.node("echo", "bench.echo", role="actor")
    return b.build()


# ---------------------------------------------------------------------- candidates
class Echo:
    """A raw Ray actor: takes anything and returns it."""

    def echo(self, x: Any) -> Any:
        return x

    def ping(self) -> int:
        return os.getpid()


def ray_candidates(actors: list[Any], data: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    import ray

    dp = DataProto.from_single_dict(dict(data))
    as_numpy = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in data.items()}

    def split_call() -> Any:
        return DataProto.concat(ray.get([a.echo.remote(c) for a, c in zip(actors, dp.chunk(WORKERS))]))

    return {
        "ray DataProto 1 actor": lambda: ray.get(actors[0].echo.remote(dp)),
        "ray DataProto 2 actors (chunk+concat)": split_call,
        "ray numpy dict 1 actor": lambda: ray.get(actors[0].echo.remote(as_numpy)),
    }


def verl_group(ray: Any) -> tuple[Any, Any, str]:
    """(verl's worker group on CPU, verl's DataProto class, ""), or (None, None, why not)."""
    try:
        from verl.protocol import DataProto as VerlDataProto
        from verl.single_controller.base import Worker
        from verl.single_controller.base.decorator import Dispatch, register
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    except Exception as exc:  # verl is optional
        return None, None, f"verl not importable ({type(exc).__name__}: {exc}); no verl row"

    class NoOpWorker(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def noop(self, data: Any) -> Any:
            return data

    pool = RayResourcePool([WORKERS], use_gpu=False, max_colocate_count=1)
    return RayWorkerGroup(pool, RayClassWithInitArgs(ray.remote(NoOpWorker)), device_name="cpu"), VerlDataProto, ""


def flowrl_runtimes(owner: Runtime, single: Runtime, polls: list[float]) -> dict[str, Runtime]:
    """One Runtime per (poll_s, fetch) on the owner's workers, and ``single`` (one worker)."""
    out: dict[str, Runtime] = {"flowrl 1 worker": single}
    fields = [f"out_{k}" for k in bench_ops.PPO_COLUMNS]
    for poll in polls:
        for fetch in ((), fields):
            label = f"flowrl poll_s={poll:g}" + (" +fetch" if fetch else "")
            out[label] = owner if (poll == polls[0] and not fetch) else Runtime(
                owner.graph, backend=SharedBackend(owner.backend), resources=BIG, fetch=fetch, poll_s=poll)
    out["before: one wait per report"] = Runtime(owner.graph, backend=OneWaitPerReport(owner.backend),
                                                   resources=BIG, poll_s=polls[0])
    return out


class OneWaitPerReport(SharedBackend):
    """The collection loop as it was before issue 14.5, for a before/after in one run:
    one ``ray.wait(num_returns=1)`` per finished report, each fetched on its own."""

    def wait(self, handles: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
        import ray

        return ray.wait(handles, num_returns=1, timeout=timeout, fetch_local=False)

    def get_many(self, handles: list[Any]) -> list[Any]:
        return [self._backend.get(h) for h in handles]

    def wait_reports(self, handles: list[Any], timeout: float) -> list[tuple[Any, Any]]:
        return Backend.wait_reports(self, handles, timeout)  # the base loop, with the waits above


# ---------------------------------------------------------------------- running
def alternate(candidates: dict[str, Callable[[], Any]], rounds: int, warmup: int) -> dict[str, float]:
    """Median seconds per call, the candidates called in turn, round after round."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for r in range(warmup + rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: median(ts) for name, ts in times.items()}


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 rounds, two poll intervals")
    parser.add_argument("--rounds", type=int, default=None, help="measured calls per candidate (default 20)")
    parser.add_argument("--rows", type=int, nargs="*", default=[8, 1024], help="batch sizes")
    parser.add_argument("--polls", type=float, nargs="*", default=None, help="Runtime poll_s values, default first")
    parser.add_argument("--no-verl", action="store_true", help="skip verl's worker group")
    parser.add_argument("--smoke", action="store_true", help="B=8, 2 rounds, one poll interval, no verl")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.rows, args.polls, args.no_verl = 2, [8], [0.05], True
    rounds = args.rounds or (10 if args.quick else 20)
    polls = args.polls or ([0.05, 0.001] if args.quick else [0.05, 0.005, 0.001])

    ray = init_ray(2 * WORKERS + 2)
    print(cpu_note(2 * WORKERS + 2) + "; every candidate has actors of its own, idle between its calls")
    owner = Runtime(echo_graph(max(args.rows)), backend="ray", resources=BIG, poll_s=polls[0]).start()
    single = Runtime(echo_graph(max(args.rows), workers=1), backend="ray", resources=BIG, poll_s=polls[0])
    try:
        single.start()
        actors = [ray.remote(num_cpus=0)(Echo).remote() for _ in range(WORKERS)]
        ray.get([a.ping.remote() for a in actors])
        wg, VerlDataProto, why = verl_group(ray) if not args.no_verl else (None, None, "")
        notes = [why] if why else []
        runtimes = flowrl_runtimes(owner, single, polls)
        default = f"flowrl poll_s={polls[0]:g}"
        steps = iter(range(10**9))
        rows: list[list[str]] = []
        for n in args.rows:
            data = payload(n)
            size = payload_bytes(data)
            candidates = ray_candidates(actors, data)
            if wg is not None:
                vdp = VerlDataProto.from_single_dict(dict(data))
                candidates["verl RayWorkerGroup DP_COMPUTE_PROTO"] = lambda vdp=vdp: wg.noop(vdp)
            batch = DataProto.from_single_dict(dict(data))
            executes: dict[str, list[float]] = {}  # the workers' own time (assemble + op + outputs)

            def flowrl_call(rt: Runtime, label: str, batch: DataProto = batch) -> None:
                r = one_step(rt, batch, next(steps))
                executes.setdefault(label, []).append(max(i.end - i.start for i in r.infos))

            for label, rt in runtimes.items():
                candidates[label] = lambda rt=rt, label=label: flowrl_call(rt, label)
            ms = {k: v * 1e3 for k, v in alternate(candidates, rounds, warmup=3).items()}
            notes.append(f"B={n}: time inside the workers' execute (assemble + op + outputs), the rest is transport "
                         "and driver: " + "; ".join(f"{k} {median(executes[k]) * 1e3:.2f} of {ms[k]:.2f} ms"
                                                   for k in ("flowrl 1 worker", default)))
            raw, np_ms = ms["ray DataProto 1 actor"], ms["ray numpy dict 1 actor"]
            split = ms["ray DataProto 2 actors (chunk+concat)"]
            verl_ms = ms.get("verl RayWorkerGroup DP_COMPUTE_PROTO")
            for name, t in ms.items():
                rows.append([f"B={n} ({size / 2**20:.1f} MiB)", name, f"{t:.2f}", f"{t / raw:.2f}x",
                             f"{t / split:.2f}x", f"{t / np_ms:.2f}x", f"{t / verl_ms:.2f}x" if verl_ms else "-"])
            best = min((t, k) for k, t in ms.items() if "flowrl" in k and "fetch" not in k)
            ours = ms[default]
            if n <= 64:
                notes.append(f"goal B={n}: flowrl <= 1.1x a raw Ray call: {default} {ours / raw:.2f}x "
                             f"({ours / split:.2f}x the hand-split 2-actor call), best ({best[1]}) "
                             f"{best[0] / raw:.2f}x -> {'met' if ours / raw <= 1.1 else 'missed'}")
            else:
                notes.append(f"goal B={n}: flowrl <= 2x the numpy-dict transfer: {default} {ours / np_ms:.2f}x, "
                             f"best ({best[1]}) {best[0] / np_ms:.2f}x -> {'met' if ours / np_ms <= 2 else 'missed'}")
    finally:
        single.close()
        owner.close()
    print_table(f"dispatch: one no-op node, {WORKERS} workers, median ms per call of {rounds} (after 3 warm-up)",
                ["payload", "candidate", "ms", "/ray 1 actor", "/ray 2 actors", "/numpy dict", "/verl"], rows,
                notes=notes)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
