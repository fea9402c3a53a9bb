"""The graph language: building, the two front ends, and every check's message."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

import tests.graph_ops as t
from flowrl.graph import (
    CycleError,
    DataSourceError,
    DuplicateProducerError,
    FieldTypeError,
    GraphBuilder,
    GraphError,
    GraphImportError,
    GraphSyntaxError,
    MissingProducerError,
    ParameterError,
    PoolError,
    ResourceError,
    RoleError,
    RoleWithoutPoolError,
    UnknownOperatorError,
    UnusedOutputWarning,
    graph,
    load_graph,
)

HERE = Path(__file__).parent
PPO_YAML = HERE / "data" / "ppo.yaml"
BIG = {"CPU": 64.0, "GPU": 0.0}


def ppo_dict() -> dict:
    return yaml.safe_load(PPO_YAML.read_text())


def write(tmp_path: Path, data: dict | str, name: str = "g.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def problems_of(tmp_path: Path, data: dict, cls):
    report = load_graph(write(tmp_path, data)).check(resources=BIG)
    return report.of(cls)


# ---------------------------------------------------------------- building
def test_ppo_graph_builds_with_edges_inferred_from_fields():
    g = load_graph(PPO_YAML)
    report = g.check(resources=BIG)
    assert report.ok, [str(p) for p in report.errors]
    assert g.dag.edges["generate", "reward"]["fields"] == ["responses", "response_mask"]
    assert g.dag.edges["data", "generate"]["fields"] == ["prompts", "uid"]
    assert sorted(g.dag.edges["advantage", "update_actor"]["fields"]) == ["advantages"]
    assert g.layers() == [
        ["generate"], ["reward", "old_logprob", "ref_logprob", "values"], ["kl_reward"], ["advantage"],
        ["update_critic", "update_actor"],
    ]
    assert g.pool_of("ref_logprob") == "train" and g.pool_of("values") == "critic"
    assert g.pool_of("advantage") is None


def test_state_edges_carry_the_staleness_bound_and_skip_frozen_roles():
    data = ppo_dict()
    data["schedule"]["staleness"] = {"actor": 2}
    g = load_graph(write(Path(pytest.importorskip("tempfile").mkdtemp()), data))
    edges = {(e.role, e.src, e.dst, e.staleness) for e in g.state_edges}
    assert edges == {
        ("actor", "update_actor", "generate", 2),
        ("actor", "update_actor", "old_logprob", 2),
        ("critic", "update_critic", "values", 0),
    }  # ref is frozen: no edge to ref_logprob


def test_readers_of_a_role_run_before_its_update():
    data = ppo_dict()
    # a node that reads the actor but whose output nobody downstream of the update needs
    data["nodes"]["probe"] = {"op": "test.old_logprob", "role": "actor", "outputs": {"old_log_probs": "probe_lp"}}
    g = load_graph(write(Path(pytest.importorskip("tempfile").mkdtemp()), data))
    assert g.dag.edges["probe", "update_actor"]["kind"] == "order"
    order = g.topological_order()
    assert order.index("probe") < order.index("update_actor")


def test_yaml_and_python_twin_build_identical_ir():
    a = load_graph(PPO_YAML)
    b = load_graph(str(HERE / "data" / "ppo_twin.py"))
    assert a.to_dict() == b.to_dict()
    assert b.locate("nodes", "reward").line is not None  # the traced call's line


def test_builder_api_builds_the_same_graph():
    d = ppo_dict()
    b = GraphBuilder(d["name"], roles=d["roles"], pools=d["pools"], data=d["data"],
                     schedule=d["schedule"], trainer=d["trainer"], imports=d["imports"])
    for name, node in d["nodes"].items():
        node = dict(node)
        b.node(name, node.pop("op"), **node)
    assert b.build().to_dict() == load_graph(PPO_YAML).to_dict()


def test_user_operator_module_plugs_in_between_reward_and_advantage(tmp_path):
    data = ppo_dict()
    data["nodes"]["kl_reward"]["outputs"] = {"token_level_rewards": "kl_rewards"}
    data["nodes"]["length_penalty"] = {
        "op": "tests.userpkg.length_penalty:length_penalty", "coef": 0.5,
        "inputs": {"token_level_scores": "kl_rewards"},
    }
    g = load_graph(write(tmp_path, data))
    report = g.check(resources=BIG)
    assert report.ok, [str(p) for p in report.errors]
    assert g.dag.edges["kl_reward", "length_penalty"]["fields"] == ["kl_rewards"]
    assert g.dag.edges["length_penalty", "advantage"]["fields"] == ["token_level_rewards"]
    assert g.nodes["length_penalty"].params.coef == 0.5


def test_operators_declare_the_metrics_a_person_watches_and_the_one_counting_tokens(tmp_path):
    from flowrl.graph import TokenMetrics, operator
    from flowrl.graph.spec import OperatorDeclarationError

    data = yaml.safe_load((HERE.parent / "graphs" / "ppo.yaml").read_text())  # the built-in operators
    data["nodes"]["kl_reward"]["outputs"] = {"token_level_rewards": "kl_rewards"}
    data["nodes"]["length_penalty"] = {"op": "tests.userpkg.length_penalty:length_penalty",
                                       "inputs": {"token_level_scores": "kl_rewards"}}
    g = load_graph(write(tmp_path, data))
    # in the step's order (the penalty, last in the file, runs before the advantage); then validation's
    assert g.headline_metrics() == ["response_length/mean", "reward/mean", "actor/reward_kl_penalty",
                                    "reward/length_penalty", "critic/vf_loss", "actor/pg_loss", "actor/approx_kl",
                                    "actor/entropy", "val/reward/mean"]
    assert g.token_metrics() == TokenMetrics(mean="response_length/mean", max="response_length/max")
    del data["nodes"]["generate"]  # nothing generates: nothing counts tokens
    assert load_graph(write(tmp_path, data)).token_metrics() is None
    with pytest.raises(OperatorDeclarationError, match="headline is a tuple of metric names"):
        operator("t.one", headline="reward/mean", register=False)
    with pytest.raises(OperatorDeclarationError, match=r"tokens is a TokenMetrics\(mean=..., max=...\)"):
        operator("t.two", tokens="response_length/mean", register=False)


def test_user_operator_runs_eagerly_with_its_math():
    from flowrl.data import DataProto
    from tests.userpkg.length_penalty import length_penalty

    import torch

    batch = DataProto.from_dict(tensors={
        "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]),
        "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
    })
    out = length_penalty(batch, coef=0.5)
    # row 0: 2 tokens, penalty 1.0 on token 1; row 1: 3 tokens, penalty 1.5 on token 2
    assert out.batch["token_level_rewards"].tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.5]]


def test_graph_decorator_is_inert_and_records_call_lines():
    calls = []

    @graph(name="inert", imports=["tests.graph_ops"], roles={"actor": {"kind": "test_actor"}},
           pools={"p": {"roles": ["actor"]}}, data={"source": "testdata:x"})
    def step(batch):
        calls.append(batch)
        batch = t.generate(batch, sleep_s=100.0)  # would sleep if it ran
        return t.reward(batch)

    assert len(calls) == 1 and list(step.nodes) == ["generate", "reward"]
    assert step.nodes["generate"].params.sleep_s == 100.0
    assert step.check(resources=BIG).ok


# ---------------------------------------------------------------- every check's message
def test_cycle_is_reported_with_the_loop(tmp_path):
    data = ppo_dict()
    data["nodes"]["reward"]["inputs"] = {"responses": "advantages"}
    (err,) = problems_of(tmp_path, data, CycleError)
    msg = str(err)
    assert "the step has a cycle" in msg
    for hop in ("--[advantages]-->", "reward", "advantage"):
        assert hop in msg


def test_missing_producer_suggests_near_names(tmp_path):
    data = ppo_dict()
    data["nodes"]["reward"]["inputs"] = {"response_mask": "responses_mask"}
    (err,) = problems_of(tmp_path, data, MissingProducerError)
    assert err.node == "reward" and err.field == "responses_mask"
    assert "input 'responses_mask' (int64[B, R]) of operator 'test.reward' has no producer" in str(err)
    assert "did you mean 'response_mask'" in str(err)
    assert str(err).startswith(f"{tmp_path / 'g.yaml'}:")  # the node's line


def test_two_producers(tmp_path):
    data = ppo_dict()
    data["nodes"]["values"]["outputs"] = {"values": "advantages"}
    errs = problems_of(tmp_path, data, DuplicateProducerError)
    assert len(errs) == 1
    assert "field 'advantages' is produced by values and advantage" in str(errs[0])


def test_dtype_and_shape_mismatch(tmp_path):
    data = ppo_dict()
    data["nodes"]["values"]["inputs"] = {"responses": "uid"}  # object[B] where int64[B, R] is read
    (err,) = problems_of(tmp_path, data, FieldTypeError)
    assert err.node == "values" and err.field == "uid"
    assert "the data source produces object[B] but operator 'test.values' reads int64[B, R]" in str(err)
    data = ppo_dict()
    data["nodes"]["reward"]["inputs"] = {"response_mask": "policy_version"}  # int64[B] vs int64[B, R]
    (err,) = problems_of(tmp_path, data, FieldTypeError)
    assert "shape [B] is produced but [B, R] is expected" in str(err)


def test_unknown_operator_suggests_close_names(tmp_path):
    data = ppo_dict()
    data["nodes"]["reward"]["op"] = "test.rewrad"
    (err,) = problems_of(tmp_path, data, UnknownOperatorError)
    assert "unknown operator 'test.rewrad'" in str(err) and "did you mean 'test.reward'" in str(err)
    lines = (tmp_path / "g.yaml").read_text().splitlines()
    assert lines[err.location.line - 1].strip() == "op: test.rewrad"



def test_unknown_and_ill_typed_parameters(tmp_path):
    data = ppo_dict()
    data["nodes"]["generate"]["temprature"] = 1.0
    data["nodes"]["advantage"]["gamma"] = "high"
    errs = problems_of(tmp_path, data, ParameterError)
    msgs = sorted(str(e) for e in errs)
    assert len(errs) == 2
    assert any("unknown parameter 'temprature'" in m and "valid parameters: n, max_new_tokens" in m for m in msgs)
    assert any("parameter 'gamma'" in m and "'high'" in m for m in msgs)
    data = ppo_dict()
    data["nodes"]["advantage"]["lam"] = 3.0
    (err,) = problems_of(tmp_path, data, ParameterError)
    assert "less than or equal to 1" in str(err) and err.node == "advantage"


def test_role_problems(tmp_path):
    data = ppo_dict()
    data["nodes"]["values"]["role"] = "critc"
    (err,) = problems_of(tmp_path, data, RoleError)
    assert "runs on role 'critc', which is not declared" in str(err) and "role: critic" in str(err)
    data = ppo_dict()
    data["nodes"]["values"]["role"] = "actor"
    (err,) = problems_of(tmp_path, data, RoleError)
    assert "needs a role of kind test_critic, but 'actor' is a test_actor" in str(err)
    data = ppo_dict()
    data["nodes"]["reward"]["role"] = "actor"
    (err,) = problems_of(tmp_path, data, RoleError)
    assert "runs on the driver and takes no role" in str(err)
    data = ppo_dict()
    data["nodes"]["update_actor"]["role"] = "ref"
    errs = problems_of(tmp_path, data, RoleError)
    assert any("updates its role, but 'ref' is frozen" in str(e) for e in errs)


def test_role_with_no_pool(tmp_path):
    data = ppo_dict()
    data["pools"]["train"]["roles"] = ["actor"]
    (err,) = problems_of(tmp_path, data, RoleWithoutPoolError)
    assert "role 'ref' is in no pool (used by ref_logprob)" in str(err)
    assert "pools: {<pool>: {roles: [ref]}}" in str(err)


def test_pool_problems(tmp_path):
    data = ppo_dict()
    data["pools"]["critic"]["roles"] = ["critic", "actor", "nobody"]
    msgs = [str(e) for e in problems_of(tmp_path, data, PoolError)]
    assert any("pool 'critic' hosts 'nobody', which is not a role" in m for m in msgs)
    assert any("role 'actor' is in pools train and critic" in m for m in msgs)


def test_pools_asking_more_than_the_cluster(tmp_path):
    data = ppo_dict()
    data["pools"]["train"]["workers"] = 3
    report = load_graph(write(tmp_path, data)).check(resources={"CPU": 2.0, "GPU": 0.0})
    (err,) = report.of(ResourceError)
    assert "the pools ask for 4 CPUs (train 3×1, critic 1×1) but the cluster has 2" in str(err)
    data["pools"]["critic"]["gpus"] = 1
    report = load_graph(write(tmp_path, data)).check(resources={"CPU": 8.0, "GPU": 0.0})
    assert "ask for 1 GPUs" in str(report.of(ResourceError)[0])


def test_unused_output_is_a_warning_not_an_error():
    report = load_graph(PPO_YAML).check(resources=BIG)
    (w,) = report.of(UnusedOutputWarning)
    assert report.ok and w.severity == "warning"
    assert "output 'policy_version' is produced but no node reads it" in str(w)


def test_data_source_problems(tmp_path):
    data = ppo_dict()
    data["data"]["source"] = "testdat:x"
    (err,) = problems_of(tmp_path, data, DataSourceError)
    assert "unknown data source kind 'testdat'" in str(err) and "did you mean 'testdata'" in str(err)
    data = ppo_dict()
    data["data"]["prompt_lenght"] = 3
    (err,) = problems_of(tmp_path, data, ParameterError)
    assert "data: unknown parameter 'prompt_lenght'" in str(err)


def test_all_problems_are_reported_at_once(tmp_path):
    data = ppo_dict()
    data["nodes"]["reward"]["op"] = "test.rewrad"
    data["nodes"]["advantage"]["gamma"] = "high"
    data["pools"]["train"]["roles"] = ["actor"]
    report = load_graph(write(tmp_path, data)).check(resources=BIG)
    kinds = {type(p) for p in report.errors}
    assert {UnknownOperatorError, ParameterError, RoleWithoutPoolError} <= kinds
    with pytest.raises(GraphError) as exc:
        report.raise_if_errors()
    assert str(exc.value).startswith(f"{len(report.errors)} errors in the graph")


# ---------------------------------------------------------------- file-level errors
def test_malformed_yaml_names_line_and_column(tmp_path):
    path = write(tmp_path, "name: x\nnodes:\n  a: {op: test.reward\n  b: 1\n")
    with pytest.raises(GraphError) as exc:
        load_graph(path)
    (p,) = exc.value.problems
    assert isinstance(p, GraphSyntaxError)
    assert f"{path}:" in str(p) and "malformed YAML, column" in str(p)


def test_unknown_and_missing_keys_name_file_and_line(tmp_path):
    text = textwrap.dedent("""\
        name: x
        data: {source: testdata:x}
        nodes:
          reward: {op: test.reward}
        scheduel: {micro_batches: 2}
        trainer: {stpes: 3}
        """)
    with pytest.raises(GraphError) as exc:
        load_graph(write(tmp_path, text))
    msgs = [str(p) for p in exc.value.problems]
    assert any(":5: unknown key 'scheduel'" in m and "allowed keys: name" in m for m in msgs)
    assert any(":6: unknown key 'trainer.stpes'" in m and "steps" in m for m in msgs)
    with pytest.raises(GraphError) as exc:
        load_graph(write(tmp_path, "name: x\nnodes:\n  r: {role: actor}\n"))
    msgs = [str(p) for p in exc.value.problems]
    assert any("missing key 'data'" in m for m in msgs)
    assert any(":3" in m and "missing key 'nodes.r.op'" in m for m in msgs)


def test_unknown_graph_reference():
    with pytest.raises(GraphError) as exc:
        load_graph("no_such_graph")
    assert "no graph 'no_such_graph'" in str(exc.value)


def test_overrides_apply_before_validation(tmp_path):
    g = load_graph(PPO_YAML, overrides={"trainer.steps": 7, "nodes.advantage.lam": 0.5})
    assert g.config.trainer.steps == 7 and g.nodes["advantage"].params.lam == 0.5
    # the source file is untouched, and so is what a later load without overrides reads
    assert ppo_dict()["trainer"]["steps"] == 3
    again = load_graph(PPO_YAML)
    assert again.config.trainer.steps == 3 and again.nodes["advantage"].params.lam != 0.5
    # a Python graph's module is imported once per process: overrides change a copy, never the module's graph
    python_graph = Path(__file__).resolve().parents[1] / "graphs" / "ppo.py"
    before = load_graph(str(python_graph)).config.trainer.steps
    assert load_graph(str(python_graph), overrides={"trainer.steps": before + 5}).config.trainer.steps == before + 5
    assert load_graph(str(python_graph)).config.trainer.steps == before


def test_eager_call_leaves_the_callers_batch_unchanged():
    from flowrl.data import DataProto
    from tests.userpkg.length_penalty import length_penalty

    import torch

    batch = DataProto.from_dict(tensors={"token_level_scores": torch.zeros(2, 2),
                                         "response_mask": torch.ones(2, 2, dtype=torch.int64)})
    out = length_penalty(batch, coef=1.0)
    assert "token_level_rewards" in out and "token_level_rewards" not in batch


def test_a_role_without_a_kind_is_an_error(tmp_path):
    data = ppo_dict()
    data["roles"]["policy"] = {"width": 4}
    data["pools"]["train"]["roles"].append("policy")
    errs = problems_of(tmp_path, data, RoleError)
    assert any("role 'policy' has no kind" in str(e) and "add kind: <one of" in str(e) and "test_actor" in str(e)
               for e in errs)


def real_ppo() -> dict:
    """The built-in PPO graph (real roles and operators) as a dict."""
    return yaml.safe_load((HERE.parent / "graphs" / "ppo.yaml").read_text())


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_number_is_refused_where_it_is_given(tmp_path, value):
    data = real_ppo()
    data["roles"]["actor"]["optim"]["lr"] = value
    (err,) = problems_of(tmp_path, data, ParameterError)
    assert "'optim.lr'" in str(err) and "finite number" in err.fix
    data = real_ppo()
    data["nodes"]["update_actor"]["clip_ratio"] = value
    (err,) = problems_of(tmp_path, data, ParameterError)
    assert err.node == "update_actor" and "finite number" in err.fix


def test_a_fix_says_what_the_value_must_be_or_the_key_meant(tmp_path):
    data = real_ppo()
    data["roles"]["actor"]["optim"]["lr"] = -1.0
    (err,) = problems_of(tmp_path, data, ParameterError)
    assert err.fix == "change 'optim.lr': input should be greater than 0"  # no list of unrelated keys
    data = real_ppo()
    data["nodes"]["update_actor"]["clip_ration"] = 0.2
    (err,) = problems_of(tmp_path, data, ParameterError)
    assert err.fix.startswith("did you mean 'clip_ratio'?")


def test_a_local_folder_does_not_hide_a_built_in_graph(tmp_path, monkeypatch):
    (tmp_path / "grpo").mkdir()
    (tmp_path / "ppo").write_text("not a graph")
    monkeypatch.chdir(tmp_path)
    assert load_graph("grpo").name == "grpo" and load_graph("ppo").name == "ppo"


def test_a_module_that_does_not_import_is_an_import_problem(tmp_path):
    data = yaml.safe_load((HERE.parent / "graphs" / "grpo.yaml").read_text())
    data["imports"] = ["no_such_module_here"]
    (err,) = load_graph(write(tmp_path, data)).check().errors
    assert isinstance(err, GraphImportError) and err.title == "import"
    with pytest.raises(GraphError) as raised:
        load_graph("no_such_module_here:graph")
    assert [type(p) for p in raised.value.problems] == [GraphImportError]


def test_an_edge_names_each_field_once():
    from flowrl.graph import builtin_graphs

    for name in builtin_graphs():
        g = load_graph(name)
        for u, v, data in g.dag.edges(data=True):
            assert len(data["fields"]) == len(set(data["fields"])), (name, u, v)
    fields = load_graph("grpo").dag.edges["generate", "update_actor"]["fields"]
    assert fields.count("rollout_log_probs") == 1  # read as old_log_probs and as itself
