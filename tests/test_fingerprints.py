"""Fingerprints: every node output of every step as digests and statistics, in fingerprints.jsonl."""

from __future__ import annotations

import json
import pytest
import torch

from flowrl.graph import load_graph
from flowrl.provenance.digest import combine_digests, weights_digest
from flowrl.provenance.fingerprints import field_print, step_record
from flowrl.provenance.rundiff import FORMAT, FingerprintFileError, read_prints, row_digests
from flowrl.runtime.scheduler import Runtime
from flowrl.run.trainer import Trainer
from tests.test_runtime import BIG, batches, graph_from

TINY = {"data.batch_size": 4, "nodes.generate.n": 2, "nodes.generate.max_new_tokens": 4}


def test_a_field_print_counts_real_tokens_only_and_names_the_first_bad_row():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), 5.0], [float("inf"), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0]])
    fp = field_print(values, mask)
    # real tokens: 1, 2 | 3, nan, 5 | inf, 0 → finite ones 1, 2, 3, 5, 0
    assert (fp["n"], fp["sum"], fp["min"], fp["max"]) == (5, 11.0, 0.0, 5.0)
    assert (fp["nan"], fp["inf"], fp["first_bad"]) == (1, 1, 1)
    assert fp["shape"] == [3, 3] and fp["dtype"] == "float32"
    # one digest per row, of its exact bytes: a change in one row changes that row's digest only
    other = values.clone()
    other[2, 2] = 1e-7
    changed = row_digests(field_print(other, mask))
    assert [a == b for a, b in zip(row_digests(fp), changed)] == [True, True, False]


def test_weights_digest_sees_one_changed_element_and_names():
    w = {"a": torch.zeros(3), "b": torch.ones(2, 2)}
    base = weights_digest(w.items())
    assert base == weights_digest({k: v.clone() for k, v in w.items()}.items())
    w2 = {"a": torch.zeros(3), "b": torch.ones(2, 2)}
    w2["b"][1, 1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))  # one float32 ulp
    assert weights_digest(w2.items()) != base
    assert weights_digest({"a2": w["a"], "b": w["b"]}.items()) != base


def _records(g, steps=2):
    with Runtime(g, backend="local", resources=BIG) as rt:
        return [step_record(r.step, rt.plan, r.infos) for r in rt.run(batches(4), steps=steps)]


def test_digests_do_not_depend_on_micro_batches_or_worker_counts(tmp_path):
    one = _records(graph_from("ppo.yaml", tmp_path, schedule__micro_batches=1))
    two = _records(graph_from("ppo.yaml", tmp_path, schedule__micro_batches=2,
                              pools__critic__workers=2))
    strip = [{n: {f: (fp["hash"], fp["shape"], fp.get("mean")) for f, fp in v["fields"].items()}
              for n, v in r["nodes"].items()} for r in one]
    assert strip == [{n: {f: (fp["hash"], fp["shape"], fp.get("mean")) for f, fp in v["fields"].items()}
                      for n, v in r["nodes"].items()} for r in two]
    # every node of the graph and the data source is there, with real values
    assert set(one[0]["nodes"]) >= {"<data>", "generate", "reward", "values", "advantage"}
    assert one[0]["nodes"]["generate"]["fields"]["responses"]["shape"] == [4, 4]
    assert one[0]["nodes"]["<data>"]["fields"]["prompts"]["shape"] == [4, 3]


def test_a_run_writes_fingerprints_per_step_with_the_weights_each_node_ran_on(tmp_path):
    g = load_graph("grpo", overrides={**TINY, "trainer.checkpoint_every": 1})
    Trainer(g, backend="local", steps=2, out=tmp_path, say=lambda m: None).run()
    header, records = read_prints(tmp_path)
    assert header["order"][:2] == ["<data>", "generate"] and header["nodes"]["generate"]["role"] == "actor"
    assert [r["step"] for r in records] == [1, 2]
    gen = records[0]["nodes"]["generate"]
    assert gen["fields"]["responses"]["shape"] == [8, 4]
    assert gen["fields"]["rollout_log_probs"]["max"] <= 0.0 and gen["fields"]["rollout_log_probs"]["nan"] == 0
    upd1, upd2 = records[0]["nodes"]["update_actor"]["weights"], records[1]["nodes"]["update_actor"]["weights"]
    # step 2 generated on exactly the weights step 1's update left, and its update started there
    assert records[1]["nodes"]["generate"]["weights"]["used"] == upd1["after"] == upd2["used"]
    assert upd1["used"] != upd1["after"] and records[0]["invariants"] == []
    # a resume rewrites the steps after the checkpoint: the file equals an uninterrupted run's
    Trainer(load_graph("grpo", overrides=TINY), backend="local", steps=3, out=tmp_path / "straight",
            say=lambda m: None).run()
    Trainer(g, backend="local", steps=3, out=tmp_path, resume=True, say=lambda m: None).run()
    _, resumed = read_prints(tmp_path)
    _, straight = read_prints(tmp_path / "straight")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert [r["nodes"] for r in resumed] == [r["nodes"] for r in straight]
    # a file an older flowrl wrote (digest format 1) is kept aside on a resume, and a new one starts
    path = tmp_path / "fingerprints.jsonl"
    lines = path.read_text().splitlines()
    old = json.loads(lines[0])
    del old["header"]["format"]
    path.write_text("\n".join([json.dumps(old), *lines[1:]]) + "\n")
    before = path.read_text()
    said: list[str] = []
    Trainer(g, backend="local", steps=4, out=tmp_path, resume=True, say=said.append).run()
    assert (tmp_path / "fingerprints.format1.jsonl").read_text() == before
    header, records = read_prints(tmp_path)
    assert header["format"] == FORMAT == 2 and [r["step"] for r in records] == [4]
    assert any("fingerprints.format1.jsonl" in m for m in said)


def test_fingerprints_can_be_turned_off_and_a_damaged_file_is_named(tmp_path):
    g = load_graph("grpo", overrides={**TINY, "trainer.fingerprints": False})
    Trainer(g, backend="local", steps=1, out=tmp_path, say=lambda m: None).run()
    with pytest.raises(FingerprintFileError, match=str(tmp_path / "fingerprints.jsonl")):
        read_prints(tmp_path)
    (tmp_path / "fingerprints.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(FingerprintFileError, match="not a fingerprint header"):
        read_prints(tmp_path)
    (tmp_path / "fingerprints.jsonl").write_text(json.dumps({"header": {}}) + "\nnot json\n{}\n")
    with pytest.raises(FingerprintFileError, match="line 2"):
        read_prints(tmp_path)


def _digest_on_rank(rank: int, port: int, weights: dict, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for dim in (0, 1):  # rows split unevenly (5 rows: FSDP2's way), then columns
            sharded = [(k, distribute_tensor(v, mesh, [Shard(min(dim, v.dim() - 1))])) for k, v in weights.items()]
            queue.put((rank, dim, weights_digest(sharded)))
    finally:
        dist.destroy_process_group()


def test_the_digest_of_weights_sharded_by_rows_is_the_whole_weights_digest():
    import socket

    import torch.multiprocessing as mp


    weights = {"w": torch.randn(5, 3), "b": torch.randn(7), "h": torch.randn(4, 6).to(torch.bfloat16)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_digest_on_rank, args=(r, port, weights, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=120) for _ in range(4)]
    for p in procs:
        p.join(timeout=60)
    whole = weights_digest(weights.items())
    parts = [d for _, k, d in got if k == 0]
    assert all(d.startswith("p:") for d in parts) and parts[0] != parts[1]
    assert combine_digests(parts) == whole
    assert [d for _, k, d in got if k == 1] == [None, None]  # not whole rows: no digest rather than a wrong one
    assert combine_digests([whole, whole]) == whole  # full copies on every rank: not added


def test_a_task_s_fields_digested_together_equal_each_digested_alone():
    from flowrl.provenance.fingerprints import _row_digests, fields_print

    g = torch.Generator().manual_seed(0)
    cols = [("f32", torch.randn(6, 3, generator=g)), ("ids", torch.randint(0, 100, (6, 8), generator=g)),
            ("bf16", torch.randn(6, 4, generator=g).bfloat16()), ("flag", torch.randint(0, 2, (6,), generator=g).bool()),
            ("f16", torch.randn(6, 2, 5, generator=g).half()), ("i32", torch.arange(6, dtype=torch.int32)),
            ("other_rows", torch.randn(3, 3, generator=g)), ("scalar", torch.tensor(3.0)),
            ("sliced", torch.randn(10, 4, generator=g)[2:8]), ("strided", torch.randn(6, 7, generator=g)[:, 1:5])]
    together = fields_print(cols)
    assert list(together) == [name for name, _ in cols]
    for name, value in cols:  # the same as one field at a time, and as one tensor's own digest
        assert together[name] == field_print(value) and together[name]["rows"] == _row_digests(value), name
    # one element changed changes that field's digest of that row only
    changed = [(n, v.clone()) for n, v in cols]
    changed[0][1][4, 1] += 1e-6
    after = fields_print(changed)
    differ = [n for n in after if after[n]["rows"] != together[n]["rows"]]
    rows_a, rows_b = row_digests(together["f32"]), row_digests(after["f32"])
    assert differ == ["f32"] and [i for i in range(6) if rows_a[i] != rows_b[i]] == [4]


def _golden_weights():
    g = torch.Generator().manual_seed(7)
    return {"emb": torch.randn(29, 128, generator=g), "norm": torch.randn(128, generator=g),
            "bf": torch.randn(6, 10, generator=g).to(torch.bfloat16), "odd": torch.randn(5, 3, generator=g),
            "i8": torch.randint(-9, 9, (4, 7), generator=g, dtype=torch.int8), "scalar": torch.tensor(3.5),
            "t": torch.randn(8, 6, generator=g).t(), "i64": torch.arange(12).reshape(3, 4)}


def test_digest_format_2_is_pinned():
    """Digests written by earlier commits stay comparable: a change to how digests are computed that
    changes their values must come with a new FORMAT (flowrl diff refuses to compare across formats)."""
    from flowrl.provenance.digest import mixed_rows_of
    from flowrl.provenance.fingerprints import fields_print

    w = _golden_weights()
    assert FORMAT == 2 and weights_digest(w.items()) == "777473c185398263"
    assert weights_digest(w.items()) == weights_digest(w.items())  # the second time from the cached layout
    cols = [w["emb"][:4], torch.arange(8).reshape(4, 2), torch.randn(4, 3, generator=torch.Generator().manual_seed(1))]
    mixed = mixed_rows_of(cols, ["a", "b", "c"])
    assert [f"{int(x) % (1 << 64):016x}" for x in mixed.reshape(-1)[:4]] == [
        "7201098ed821d125", "2bb15cbbf9ef558d", "27899d7285992b4f", "dcd58e52dbfdcb21"]
    fields = fields_print([("ids", torch.arange(6).reshape(3, 2)), ("f", torch.tensor([[0.5, -1.0, 2.0], [3.0, 4.0, 5.0]]))])
    assert fields["ids"]["rows"] == "ee8b2ec91d87042adc27a381133dbb71d8dd"
    assert fields["f"]["rows"] == "07acd746fad50d677d5a1bb0"


def test_an_object_column_digests_each_row_s_repr():
    import hashlib

    import numpy as np

    from flowrl.provenance.rundiff import ROW_HEX

    shared, a, b = {"index": 1}, "x", "x" * 2  # repeated rows share one object; equal values in distinct ones
    column = np.array([shared, a, shared, b, "x", 3, None, shared], dtype=object)
    got = row_digests(field_print(column))
    assert got == [hashlib.blake2b(repr(v).encode(), digest_size=ROW_HEX // 2).hexdigest() for v in column]
    assert got[0] == got[2] == got[7] and got[1] == got[4] and len(set(got)) == 5
    assert field_print(np.array([], dtype=object))["rows"] == ""


def test_each_data_source_field_is_printed_by_its_first_reader_only(tmp_path):
    from flowrl.provenance.fingerprints import source_readers

    g = graph_from("ppo.yaml", tmp_path)
    readers = source_readers(g)
    printed = [f for fields in readers.values() for f in fields]
    assert sorted(printed) == sorted(set(printed))  # each field once
    order = g.topological_order()
    for node, fields in readers.items():
        for f in fields:  # no node before this one reads it
            assert f in g.nodes[node].input_names()
            assert not any(f in g.nodes[n].input_names() for n in order[:order.index(node)])
    assert set(printed) == {f.name for f in g.source_fields} & {f for n in g.nodes.values() for f in n.input_names()}


def test_a_digester_kept_across_updates_equals_a_fresh_digest_every_time():
    from flowrl.provenance.digest import WeightsDigester

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    digester, seen = WeightsDigester(), set()
    for step in range(4):
        loss = model(torch.randn(5, 8)).square().mean()
        loss.backward()
        opt.step()  # in place: the digester's views see the new values
        opt.zero_grad()
        now = digester(model.state_dict(keep_vars=True).items())
        assert now == weights_digest(model.state_dict().items()) and now not in seen
        seen.add(now)
    with torch.no_grad():  # weights replaced, reshaped in place, transposed: noticed, not read through stale views
        model[0].weight.data = model[0].weight.data.clone() * 2
        assert digester(model.state_dict(keep_vars=True).items()) == weights_digest(model.state_dict().items())
        model[2].weight.data = model[2].weight.data.t().contiguous().t()
        assert digester(model.state_dict(keep_vars=True).items()) == weights_digest(model.state_dict().items())
    w = _golden_weights()
    assert digester(w.items()) == weights_digest(w.items()) == "777473c185398263"
