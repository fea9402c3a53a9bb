"""Two Ray "nodes" (``ray.cluster_utils.Cluster`` on this machine), one rank on each, one FSDP2 step.

The cluster runs in a child process (this pytest process already holds the
session's local Ray, and a process joins one Ray at a time): it starts a head
and a second node with one CPU each, places rank 0 on the head and rank 1 on
the other node by a custom resource, forms the pool's group, takes one
data-parallel step and checks it against one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_nodes_train_one_step_like_one_process(tmp_path):
    pytest.importorskip("ray")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "RAY_DEDUP_LOGS": "0"}
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "tests.test_distributed_cluster", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["nodes"][0] != result["nodes"][1]
    assert result["max_diff"] <= 1e-5


def main(out: str) -> None:
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from tests import test_distributed as td

    torch.set_num_threads(1)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                            "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        td.ray = ray
        actors = [ray.remote(num_cpus=1, resources={node: 1})(td.Rank).remote(rank)
                  for rank, node in enumerate(("node_a", "node_b"))]
        td.form_group(actors)
        nodes = ray.get([a.run.remote(_node_id) for a in actors])
        (stepped, _), _ = td.on_ranks(actors, _step, td.rank_rows(99))
        model, optimizer = td.fresh()
        td.train_one(model, optimizer, td.PoolGroup.single(td.POOL), list(range(td.ROWS)))
        result = {"nodes": nodes, "max_diff": td.max_diff(stepped, model.state_dict())}
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

    group = state["group"]
    model, optimizer = td.fresh(group)
    td.train_one(model, optimizer, group, rows)
    return td.full_state_dict(model, group), None


if __name__ == "__main__":
    main(sys.argv[1])
