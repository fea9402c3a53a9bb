"""DataProto operations, flowrl vs verl, on one 64 MiB PPO-sized batch.

Run from the repository root::

    python benchmarks/dataproto.py            # add --no-ray to skip the object-store rows
    python benchmarks/dataproto.py --smoke    # B=64 and no object-store rows: seconds

B=1024 rows: input_ids, attention_mask, position_ids int64[B, 2048], responses
int64[B, 1024], two float32[B, 1024] columns, a ``uid`` string and a dict per
row. Every operation is timed as the median of >= 5 runs for flowrl and, when
``verl`` is importable, for verl's DataProto on the same tensors in the same
process; the table prints the flowrl/verl ratio (< 1 is faster). Peak memory
of a serialisation round trip is measured in a fresh subprocess per
measurement (VmHWM after resetting it, so torch's allocations are seen) and
printed relative to the payload (1.00x = no extra copy).
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

B = 1024


# ---------------------------------------------------------------------- data
def make_data(seed: int = 0, rows: int = B) -> dict[str, Any]:
    """The benchmark batch (``rows`` rows) as one dict (tensors and object arrays)."""
    B = rows  # noqa: N806 - the shapes below read as the module's batch size
    g = torch.Generator().manual_seed(seed)
    data: dict[str, Any] = {
        "input_ids": torch.randint(0, 32000, (B, 2048), generator=g),
        "attention_mask": torch.randint(0, 2, (B, 2048), generator=g),
        "position_ids": torch.randint(0, 2048, (B, 2048), generator=g),
        "responses": torch.randint(0, 32000, (B, 1024), generator=g),
        "old_log_probs": torch.randn(B, 1024, generator=g),
        "advantages": torch.randn(B, 1024, generator=g),
    }
    data["uid"] = np.array([f"prompt-{i // 8}" for i in range(B)], dtype=object)
    data["extra_info"] = np.array([{"index": i, "split": "train"} for i in range(B)], dtype=object)
    return data


def payload_bytes(data: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in data.values() if isinstance(v, torch.Tensor))


def load_impl(name: str) -> Any:
    """The DataProto class of ``flowrl`` or ``verl`` (None when verl is missing)."""
    if name == "flowrl":
        from flowrl.data import DataProto

        return DataProto
    try:
        from verl.protocol import DataProto
    except Exception as exc:  # verl is optional: report and skip its column
        print(f"verl not importable ({type(exc).__name__}: {exc}); showing flowrl only")
        return None
    return DataProto


# ---------------------------------------------------------------------- timing
def median_ms(candidates: dict[str, tuple[Callable, Callable | None]], min_runs: int = 5) -> dict[str, float]:
    """Median wall time in ms of each ``fn(setup())``, >= ``min_runs`` runs each.

    The candidates run in alternation (flowrl, verl, flowrl, ...) so that a
    noisy neighbour or a drifting clock hits both sides alike.
    """
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn, setup in candidates.values():
        fn(setup() if setup else None)  # warm-up
    budget_end = time.perf_counter() + 0.5
    while min(map(len, times.values())) < min_runs or (
        time.perf_counter() < budget_end and min(map(len, times.values())) < 200
    ):
        for name, (fn, setup) in candidates.items():
            arg = setup() if setup else None
            gc.disable()  # as timeit does: a collection triggered by the other side's garbage is noise
            t0 = time.perf_counter()
            fn(arg)
            times[name].append(time.perf_counter() - t0)
            gc.enable()
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def pickle_roundtrip(dp: Any) -> Any:
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(dp, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(blob, buffers=buffers)


def operations(DataProto: Any, data: dict[str, Any], ray: Any) -> dict[str, tuple[Callable, Callable | None]]:
    """name -> (timed fn(arg), untimed setup() -> arg)."""
    dp = DataProto.from_single_dict(dict(data))
    tensor_keys = [k for k, v in data.items() if isinstance(v, torch.Tensor)]
    object_keys = [k for k, v in data.items() if not isinstance(v, torch.Tensor)]
    chunks8 = dp.chunk(8)
    perm = torch.randperm(len(data["uid"]), generator=torch.Generator().manual_seed(1))

    def fresh() -> Any:  # a new container over the same tensors (pop/union mutate)
        return dp.select(batch_keys=tensor_keys, non_tensor_batch_keys=object_keys)

    def halves() -> tuple[Any, Any]:
        return (
            dp.select(batch_keys=tensor_keys[:3], non_tensor_batch_keys=object_keys[:1]),
            dp.select(batch_keys=tensor_keys[3:], non_tensor_batch_keys=object_keys[1:]),
        )

    ops: dict[str, tuple[Callable, Callable | None]] = {
        "from_single_dict": (lambda _: DataProto.from_single_dict(dict(data)), None),
        "select(3 tensors, 1 object)": (
            lambda _: dp.select(batch_keys=tensor_keys[:3], non_tensor_batch_keys=object_keys[:1]), None
        ),
        "pop(2 tensors, 1 object)": (
            lambda d: d.pop(batch_keys=tensor_keys[:2], non_tensor_batch_keys=object_keys[:1]), fresh
        ),
        "union(disjoint halves)": (lambda ab: ab[0].union(ab[1]), halves),
        "concat(8 chunks)": (lambda _: DataProto.concat(chunks8), None),
        "chunk(8)": (lambda _: dp.chunk(8), None),
        "split(128)": (lambda _: dp.split(128), None),
        "repeat(5, interleave=True)": (lambda _: dp.repeat(5, interleave=True), None),
        "index by tensor (permutation)": (lambda _: dp[perm], None),
        "pickle round trip (protocol 5, buffers)": (lambda _: pickle_roundtrip(dp), None),
        "pickle round trip (default protocol)": (lambda _: pickle.loads(pickle.dumps(dp)), None),
    }
    if ray is not None:
        ops["ray.put + ray.get"] = (lambda _: ray.get(ray.put(dp)), None)
        if hasattr(dp, "to_writable"):  # flowrl: the same with private, writable tensors
            from flowrl.data import readonly_policy

            def copy_roundtrip(_: Any) -> Any:
                with readonly_policy("copy"):
                    return ray.get(ray.put(dp))

            ops["ray.put + ray.get, copy policy"] = (copy_roundtrip, None)
    return ops


def storage_sharing(DataProto: Any, data: dict[str, Any]) -> list[str]:
    """Which of select/pop/union return tensors on the source's memory (no copy)."""
    dp = DataProto.from_single_dict(dict(data))
    ptrs = {k: v.data_ptr() for k, v in data.items() if isinstance(v, torch.Tensor)}
    keys = list(ptrs)

    def shared(out: Any) -> str:
        same = [k for k in out.batch.keys() if out.batch[k].data_ptr() == ptrs[k]]
        return f"{len(same)}/{len(list(out.batch.keys()))} tensors share storage"

    sel = dp.select(batch_keys=keys[:3])
    popped = dp.select(batch_keys=keys).pop(batch_keys=keys[:2])
    a, b = dp.select(batch_keys=keys[:3]), dp.select(batch_keys=keys[3:])
    return [f"select: {shared(sel)}", f"pop: {shared(popped)}", f"union: {shared(a.union(b))}"]


# ---------------------------------------------------------------------- memory
_MEMORY_CHILD = r"""
import os, sys, pickle, gc
os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from benchmarks.dataproto import make_data, payload_bytes, load_impl, pickle_roundtrip

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

impl, mode, address, rows = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
data = make_data(rows=rows)
payload = payload_bytes(data)
ray = None
if mode == "ray":
    import ray
    ray.init(address=address, log_to_driver=False)  # the parent's cluster: no second start-up
if impl == "numpy-dict":
    obj = {{k: v.numpy() for k, v in data.items() if isinstance(v, torch.Tensor)}}
else:
    obj = load_impl(impl.split("-")[0]).from_single_dict(dict(data))
if impl == "flowrl-copy":
    from flowrl.data import set_readonly_policy
    set_readonly_policy("copy")
if mode == "ray":  # warm the object store (first touch of its shared memory)
    ray.get(ray.put(obj))
gc.collect()
before, shm_before = status("VmRSS"), status("RssShmem")
with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
    f.write("5")
out = pickle_roundtrip(obj) if mode == "pickle" else ray.get(ray.put(obj))
extra = max(0, status("VmHWM") - before)
shm = max(0, status("RssShmem") - shm_before)
print((payload + extra) / payload, (payload + max(0, extra - shm)) / payload)
"""


def peak_ratio(impl: str, mode: str, address: str = "", rows: int = B) -> tuple[float, float] | None:
    """(peak RSS, peak RSS less the object store's shared pages) of one round trip / payload,
    measured in a fresh interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _MEMORY_CHILD.format(root=root)
    proc = subprocess.run(
        [sys.executable, "-c", code, impl, mode, address, str(rows)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        print(f"memory measurement {impl}/{mode} failed:\n{proc.stderr[-2000:]}")
        return None
    total, private = proc.stdout.strip().splitlines()[-1].split()
    return float(total), float(private)


# ---------------------------------------------------------------------- report
def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(header))
        for row in rows:
            print(" | ".join(row))
        return
    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=120).print(table)


def main() -> None:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-ray", action="store_true", help="skip the ray.put/ray.get rows")
    parser.add_argument("--smoke", action="store_true", help="B=64 rows, no ray rows")
    args = parser.parse_args()
    rows = 64 if args.smoke else B
    args.no_ray = args.no_ray or args.smoke

    ray = None
    if not args.no_ray:
        import ray as ray_module

        ray_module.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        ray = ray_module

    data = make_data(rows=rows)
    payload = payload_bytes(data)
    print(f"batch: B={rows}, {payload / 2**20:.0f} MiB of tensors, 2 object columns; torch threads=1")

    impls = {name: load_impl(name) for name in ("flowrl", "verl")}
    impls = {k: v for k, v in impls.items() if v is not None}
    per_impl = {name: operations(DataProto, data, ray) for name, DataProto in impls.items()}
    verl_ms: dict[str, float] = {}
    rows = []
    for op in per_impl["flowrl"]:
        candidates = {name: ops[op] for name, ops in per_impl.items() if op in ops}
        if op.startswith("ray."):  # warm the object store's pages for both sides
            for fn, _ in candidates.values():
                fn(None)
        ms = median_ms(candidates)
        row = [op, f"{ms['flowrl']:.3f}"]
        if "verl" in per_impl:
            # a flowrl-only variant (the copy policy) is compared with verl's default round trip
            base = ms["verl"] if "verl" in ms else verl_ms.get("ray.put + ray.get", float("nan"))
            verl_ms[op] = base
            row += [f"{base:.3f}", f"{ms['flowrl'] / base:.2f}"]
        rows.append(row)
    header = ["operation", "flowrl ms"] + (["verl ms", "flowrl/verl"] if "verl" in per_impl else [])
    print_table("DataProto operations (median)", header, rows)

    for name, DataProto in impls.items():
        print(f"{name}: " + "; ".join(storage_sharing(DataProto, data)))

    address = ray.get_runtime_context().gcs_address if ray is not None else ""
    mem_rows = []
    runs = [("pickle protocol 5 + buffers", "pickle", list(impls))]
    if not args.no_ray:
        runs.append(("ray.put + ray.get", "ray", list(impls) + ["flowrl-copy", "numpy-dict"]))
    for label, mode, names in runs:
        for impl in names:
            ratio = peak_ratio(impl, mode, address, rows)
            shown = ["failed", "failed"] if ratio is None else [f"{ratio[0]:.2f}x", f"{ratio[1]:.2f}x"]
            mem_rows.append([label, impl, *shown])
    print_table(
        "peak memory of one round trip / payload (fresh process each)",
        ["round trip", "impl", "peak RSS", "without object store pages"],
        mem_rows,
    )
    print("flowrl-copy: the copy read-only policy; numpy-dict: the same tensors as a dict of numpy arrays")
    print(f"total {time.perf_counter() - started:.0f} s")

if __name__ == "__main__":
    main()
