"""DataProtoFuture through a real (local) Ray: laziness, no driver waits, zero-copy."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from flowrl.data import DataProto, DataProtoError, DataProtoFuture, readonly_policy, resolve

pytestmark = pytest.mark.ray


def make(start: int, n: int) -> DataProto:
    """Rows start..start+n-1: y = row id, uid = 'r{id}', a bf16 column."""
    ids = torch.arange(start, start + n)
    uid = np.empty(n, dtype=object)
    uid[:] = [f"r{i}" for i in ids.tolist()]
    return DataProto.from_dict(
        {"y": ids, "h": ids.to(torch.bfloat16), "x": ids.view(n, 1).repeat(1, 4)}, {"uid": uid}, {"step": 1}
    )


def ids(dp: DataProto) -> list[int]:
    return dp.batch["y"].tolist()


@pytest.fixture(scope="module")
def import_probe():
    """``import flowrl.data`` in a fresh interpreter (the only place where "it does
    not import ray" can be seen); started early so that its torch import overlaps
    with the Ray tests instead of adding seconds to the run."""
    code = "import sys, flowrl.data; print('ray' in sys.modules)"
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def remote(ray_session, import_probe):
    ray = ray_session

    # Workers get the rows as an argument: they never import this test module.
    @ray.remote(num_cpus=0)
    def echo(batch: DataProto, delay: float) -> DataProto:
        time.sleep(delay)
        return batch

    def produce_remote(start: int, n: int, delay: float = 0.0):
        return echo.remote(make(start, n), delay)

    @ray.remote(num_cpus=0)
    def consume(batch: DataProtoFuture) -> tuple[list[int], list[str]]:
        data = resolve(batch)  # the worker resolves the future it received
        return data.batch["y"].tolist(), data.non_tensor_batch["uid"].tolist()

    @ray.remote(num_cpus=0)
    class Consumer:
        def rows(self, batch: DataProtoFuture) -> int:
            return len(batch.get())

    # started now so that its worker process boots while the first tests run
    return ray, produce_remote, consume, Consumer.remote()


def test_concat_of_refs_collects_in_order(remote):
    ray, produce, _, _ = remote
    fut = DataProtoFuture.concat([produce(0, 2), produce(2, 3)])
    out = fut.get()
    assert ids(out) == [0, 1, 2, 3, 4]
    assert out.non_tensor_batch["uid"].tolist() == ["r0", "r1", "r2", "r3", "r4"]
    assert out.meta_info == {"step": 1}
    assert len(fut.object_refs()) == 2


def test_chunk_hands_out_whole_shards_lazily(remote):
    ray, produce, _, _ = remote
    refs = [produce(2 * i, 2) for i in range(4)]
    fut = DataProtoFuture.concat(refs)
    parts = fut.chunk(2)
    assert [p.futures for p in parts] == [refs[:2], refs[2:]]  # no fetch, no dispatch function
    assert [ids(p.get()) for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [ids(p) for p in fut.get().chunk(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_chunk_falls_back_to_fetch_and_chunk(remote):
    ray, produce, _, _ = remote
    fut = DataProtoFuture.concat([produce(0, 4), produce(4, 4)])
    parts = fut.chunk(4)  # 2 shards do not divide into 4 parts
    assert "dispatch=chunk 3/4" in repr(parts[3])
    assert [ids(p.get()) for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # chunking a dispatched future composes: part 1 of 4, then its half 1 of 2
    assert ids(parts[1].chunk(2)[1].get()) == [3]


def test_concat_of_futures_keeps_each_futures_dispatch(remote):
    ray, produce, _, _ = remote
    whole = DataProtoFuture.concat([produce(0, 4)])
    second_half = DataProtoFuture([produce(10, 4)]).chunk(4)  # 1 shard into 4: dispatched
    fut = DataProtoFuture.concat([whole, second_half[1], DataProtoFuture([produce(20, 1)])])
    assert ids(fut.get()) == [0, 1, 2, 3, 11, 20]


def test_custom_collect_and_bad_shards(remote):
    ray, produce, _, _ = remote
    last = DataProtoFuture([produce(0, 2), produce(5, 2)], collect_fn=lambda parts: parts[-1])
    assert ids(last.get()) == [5, 6]
    bad = DataProtoFuture([produce(0, 1), ray.put({"not": "a batch"})])
    with pytest.raises(DataProtoError, match="shard 1 resolved to a dict, not a DataProto"):
        bad.get()
    with pytest.raises(DataProtoError, match="at least one shard"):
        DataProtoFuture([])


def test_a_task_s_read_is_collected_by_its_producer_s_mode_from_its_shape_and_values(remote):
    """What the runtime hands a task: the future's shape in the call, its handles as top-level
    arguments (resolved by Ray), collected in the worker by the producer's dispatch mode."""
    import functools

    from flowrl.data.dispatch import RowKeys, get_mode
    from flowrl.data.expand import take_rows

    ray, _, _, _ = remote
    balanced = get_mode("balanced")
    batch = make(0, 6)
    # a producer task of two balanced ranks: each returns its rows, tagged as a worker tags them
    outputs = []
    for r in (0, 1):
        part, tags = balanced.split(batch, r, 2, RowKeys())
        outputs.append(ray.put(balanced.tag(part, tags, 1)))
    task = DataProtoFuture(outputs, collect_fn=balanced.collect)
    # a consumer reads its y and uid, rows 2..4, each repeated twice
    read = DataProtoFuture([task.select(["y", "uid"])],
                           dispatch_fn=functools.partial(take_rows, rows=(2, 4), repeat=2))

    @ray.remote(num_cpus=0)
    def run(shape: DataProtoFuture, *values: DataProto) -> DataProto:
        assert shape.handles() == [None, None]  # nothing to fetch: the values came as arguments
        return shape.collect(values)

    out = ray.get(run.remote(read.shape(), *read.handles()))
    assert ids(out) == [2, 2, 3, 3] and out.non_tensor_batch["uid"].tolist() == ["r2", "r2", "r3", "r3"]
    assert set(out.batch.keys()) == {"y"} and "_dispatch_row" not in out.non_tensor_batch
    assert ids(read.get()) == [2, 2, 3, 3]  # the driver's get takes the same collect
    assert "columns=y, uid" in repr(task.select(["y", "uid"]))
    with pytest.raises(DataProtoError, match="fewer values"):
        read.shape().collect([])


def test_passing_a_future_does_not_make_the_driver_wait(remote):
    ray, produce, consume, actor = remote
    ray.get(actor.__ray_ready__.remote())
    t0 = time.perf_counter()
    fut = DataProtoFuture.concat([produce(0, 3, delay=2.0)])
    task = consume.remote(fut)
    call = actor.rows.remote(fut)
    submitted = time.perf_counter() - t0
    assert submitted < 0.5, f"submitting consumers of a pending future took {submitted:.2f}s"
    assert ray.get(task) == ([0, 1, 2], ["r0", "r1", "r2"])
    assert ray.get(call) == 3
    assert time.perf_counter() - t0 >= 1.9  # the consumers, not the driver, waited for the producer


def test_round_trip_through_the_object_store_is_zero_copy(remote):
    ray, _, _, _ = remote
    dp = make(0, 6)
    ref = ray.put(dp)
    back = ray.get(ref)
    assert ids(back) == list(range(6))
    assert back.batch["h"].dtype == torch.bfloat16 and back.batch["h"].tolist() == [float(i) for i in range(6)]
    assert back.batch["x"].tolist() == dp.batch["x"].tolist()
    assert back.non_tensor_batch["uid"].tolist() == [f"r{i}" for i in range(6)]
    # every tensor is a view of the store's (read-only) buffer: nothing was copied
    assert sorted(back.readonly_keys) == ["h", "x", "y"]
    back.to_writable().batch["y"].add_(100)
    assert ids(ray.get(ref)) == list(range(6))  # the stored object is intact
    with readonly_policy("copy"):
        private = ray.get(ref)
    assert private.readonly_keys == [] and ids(private) == list(range(6))


def test_future_get_follows_the_read_only_policy(remote):
    ray, produce, _, _ = remote
    single = DataProtoFuture([produce(0, 4)])
    assert sorted(single.get().readonly_keys) == ["h", "x", "y"]  # default: zero-copy views
    with readonly_policy("copy"):
        copied = single.get()
        concatenated = DataProtoFuture([produce(0, 2), produce(2, 2)]).get()
    assert copied.readonly_keys == [] and ids(copied) == [0, 1, 2, 3]
    assert concatenated.readonly_keys == [] and ids(concatenated) == [0, 1, 2, 3]


def test_put_splits_into_shards(remote):
    fut = DataProtoFuture.put(make(0, 6), chunks=3)
    assert len(fut.futures) == 3
    assert [ids(p.get()) for p in fut.chunk(3)] == [[0, 1], [2, 3], [4, 5]]


def test_import_does_not_import_ray(import_probe):
    out, err = import_probe.communicate(timeout=60)
    assert import_probe.returncode == 0, err
    assert out.strip() == "False"
