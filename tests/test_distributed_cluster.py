"""Two Ray "nodes" (``ray.cluster_utils.Cluster`` on this machine): one FSDP2 step with a rank
on each, and a two-pool graph run by flowrl with each pool on its own node.

The cluster runs in a child process (this pytest process already holds the
session's local Ray, and a process joins one Ray at a time): it starts a head
and a second node with one CPU each. ``step``: rank 0 on the head and rank 1
on the other node by a custom resource, the pool's group formed, one
data-parallel step checked against one process. ``pools``: ``grpo_async``
(generation on pool ``gen``, training on pool ``train``, one CPU each) joined
with the trainer's ``address``, so each pool can only fit on its own node; the
weights cross nodes after every update.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_cluster(mode: str, tmp_path) -> dict:
    """Run ``mode`` of this module in a child process with its own two-node cluster; its result."""
    pytest.importorskip("ray")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "RAY_DEDUP_LOGS": "0"}
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run([sys.executable, "-m", "tests.test_distributed_cluster", mode, str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_two_nodes_train_one_step_like_one_process(tmp_path):
    result = in_cluster("step", tmp_path)
    assert result["nodes"][0] != result["nodes"][1]
    assert result["max_diff"] <= 1e-5


def test_two_pools_on_two_nodes_train_through_flowrl(tmp_path):
    result = in_cluster("pools", tmp_path)
    assert sorted(result["pools"]) == ["gen", "train"]
    assert result["pools"]["gen"] != result["pools"]["train"]  # each pool on its own node
    assert result["steps"] == [1, 2, 3]
    assert all(v == v for v in result["rewards"])  # finite
    assert result["versions"][-1] >= 1  # generation used weights the other node's update published


def start_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    return cluster


def pools(out: str) -> None:
    import tempfile

    import ray

    from flowrl.graph import load_graph
    from flowrl.run.trainer import Trainer

    cluster = start_cluster()
    placed: dict[str, str] = {}

    def where(step: int, row: dict) -> None:  # while the pools are up: the node of each pool's bundle
        for pg in ray.util.placement_group_table().values():
            name = pg.get("name", "")
            if name.startswith("flowrl-") and pg.get("state") == "CREATED":
                placed[name.split("-")[1]] = pg["bundles_to_node_id"][0]

    try:
        g = load_graph("grpo_async", overrides={"data.batch_size": 8, "nodes.generate.n": 4,
                                                "nodes.generate.max_new_tokens": 6, "trainer.checkpoint_every": 0})
        with tempfile.TemporaryDirectory() as run:
            rows = Trainer(g, backend="ray", address=cluster.address, steps=3, out=run, on_step=where,
                           say=lambda m: None).run()
        result = {"pools": placed, "steps": [r["step"] for r in rows], "rewards": [r["reward/mean"] for r in rows],
                  "versions": [r.get("scheduler/min_weight_version", 0) for r in rows]}
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        ray.shutdown()
        cluster.shutdown()


def step(out: str) -> None:
    import ray
    import torch

    from tests import test_distributed as td

    torch.set_num_threads(1)
    cluster = start_cluster()
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        td.ray = ray
        actors = [ray.remote(num_cpus=1, resources={node: 1})(td.Rank).remote(rank)
                  for rank, node in enumerate(("node_a", "node_b"))]
        td.form_group(actors)
        nodes = ray.get([a.run.remote(_node_id) for a in actors])
        (stepped, _), _ = td.on_ranks(actors, _step, td.rank_rows(99))
        engine = td.fresh(td.PoolGroup.single(td.POOL))
        td.train_one(engine, list(range(td.ROWS)))
        result = {"nodes": nodes, "max_diff": td.max_diff(stepped, engine.get_weights())}
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_id(state) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _step(state, rows):
    from tests import test_distributed as td

    engine = td.fresh(state["group"])
    td.train_one(engine, rows)
    return engine.get_weights(), None


if __name__ == "__main__":
    {"step": step, "pools": pools}[sys.argv[1]](sys.argv[2])
