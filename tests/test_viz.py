"""The DAG drawing and its exports, through the public API of ``visualizer``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from rich.console import Console

from flowrl.graph import SOURCE, GraphBuilder, load_graph, operator
from visualizer import STATES, pool_colors, print_dag, render_dag, state_style, to_dot, to_json, to_mermaid

PPO = "tests/data/ppo.yaml"


# ---------------------------------------------------------------- a 20-node graph
@operator("viztest.score", inputs={"responses": "int64[B, R]"}, outputs={"score": "float32[B]"})
def _score(batch, p):
    return {"score": batch["responses"].float().mean(-1)}


@operator("viztest.judge", role="judge", role_kinds=("test_critic",),
          inputs={"responses": "int64[B, R]"}, outputs={"score": "float32[B]"})
def _judge(judge, batch, p):
    return {"score": batch["responses"].float().mean(-1) * judge.w.mean()}


@operator("viztest.pair", inputs={"a": "float32[B]", "b": "float32[B]"}, outputs={"score": "float32[B]"})
def _pair(batch, p):
    return {"score": batch["a"] + batch["b"]}


@operator("viztest.total", inputs={f"s{i}": "float32[B]" for i in range(6)},
          outputs={"total_score": "float32[B]"}, scope="batch")
def _total(batch, p):
    return {"total_score": sum(batch[f"s{i}"] for i in range(6))}


def twenty_node_graph():
    """generate → 8 rule scorers + 4 judges (one 12-node layer) → 6 pairwise merges → total."""
    b = GraphBuilder(
        "wide_scoring", imports=["tests.graph_ops"],
        roles={"actor": {"kind": "test_actor"}, "judge": {"kind": "test_critic"}},
        pools={"rollout": {"workers": 2, "cpus": 1, "gpus": 1, "roles": ["actor"]},
               "judges": {"workers": 4, "cpus": 2, "roles": ["judge"]}},
        data={"source": "testdata:prompts", "batch_size": 8},
    )
    b.node("generate", "test.generate", role="actor")
    scorers = [f"rule_score_{i}" for i in range(8)] + [f"judge_quality_{i}" for i in range(4)]
    for name in scorers:
        op = "viztest.judge" if name.startswith("judge") else "viztest.score"
        b.node(name, op, outputs={"score": f"{name}_s"})
    for i in range(6):
        b.node(f"merge_{i}", "viztest.pair",
               inputs={"a": f"{scorers[2 * i]}_s", "b": f"{scorers[2 * i + 1]}_s"}, outputs={"score": f"pair_{i}"})
    b.node("total", "viztest.total", inputs={f"s{i}": f"pair_{i}" for i in range(6)})
    return b.build()


# ---------------------------------------------------------------- helpers
def render_text(renderable, width: int = 80) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def ir_edges(graph) -> set[tuple[str, str, str, tuple[str, ...]]]:
    return {(u, v, d["kind"], tuple(d["fields"])) for u, v, d in graph.dag.edges(data=True)}


@pytest.fixture(scope="module")
def ppo():
    return load_graph(PPO)


@pytest.fixture(scope="module")
def wide():
    return twenty_node_graph()


# ---------------------------------------------------------------- terminal drawing
def test_ppo_at_80_columns_shows_every_node_op_and_field_label(ppo):
    lines = render_text(render_dag(ppo))
    text = "\n".join(lines)
    assert max(len(line) for line in lines) <= 80
    assert "╭─ generate " in text, "the PPO graph fits 80 columns boxed"
    for name, node in ppo.nodes.items():
        assert name in text
        assert node.op_name in text
    stripped = [line.strip() for line in lines]
    assert "data → generate: prompts, uid" in stripped
    assert "generate → reward: responses, response_mask" in stripped
    assert "generate → old_logprob, ref_logprob, values: responses" in stripped
    assert "kl_reward → advantage: token_level_rewards" in stripped
    assert "advantage → update_actor: advantages" in stripped
    # pools in the legend, placements in the boxes, the weight hand-off in the footer
    assert any(re.search(r"■ train\s+1 worker × 1 cpu · roles actor, ref", line) for line in lines)
    assert "actor@train" in text and "critic@critic" in text and "driver" in text
    assert "update_actor ⇢ generate, old_logprob  (next step, actor weights, staleness 0)" in stripped


def test_ppo_layers_are_drawn_in_topological_order(ppo):
    text = "\n".join(render_text(render_dag(ppo)))
    positions = [text.index(f"layer {i}") for i in range(1, 6)]
    assert positions == sorted(positions)
    for i, layer in enumerate(ppo.layers(), start=1):
        block = text[positions[i - 1]: positions[i] if i < 5 else len(text)]
        for name in layer:
            assert f"╭─ {name} " in block


def test_twenty_nodes_at_80_columns_wrap_the_wide_layer(wide):
    assert len(wide.nodes) == 20
    lines = render_text(render_dag(wide))
    text = "\n".join(lines)
    assert max(len(line) for line in lines) <= 80
    for name in wide.nodes:
        assert f"╭─ {name} " in text
    # the 12-node layer is wrapped onto several rows of boxes
    layer2 = text[text.index("layer 2"): text.index("layer 3")]
    rows = [line for line in layer2.splitlines() if "╭─" in line]
    assert len(rows) >= 3
    assert sum(line.count("╭─") for line in rows) == 12
    assert "■ rollout  2 workers × 1 cpu, 1 gpu · roles actor" in text
    assert "merge_0 → total: pair_0" in text


def test_twenty_nodes_compact_is_one_entry_per_node_within_80_columns(wide):
    lines = render_text(render_dag(wide, compact=True))
    assert max(len(line) for line in lines) <= 80
    assert not any("╭" in line for line in lines)
    starts = {line.split()[1] if re.match(r"\s*\d+\s", line) else line.split()[0] for line in lines if line.strip()}
    for name in wide.nodes:
        assert name in starts, f"{name} does not start a compact line"
    total = next(line for line in lines if "total" in line.split()[:2])
    assert "← pair_0, pair_1" in total


def test_compact_is_chosen_when_boxes_do_not_fit(ppo):
    narrow = render_text(render_dag(ppo), width=40)
    assert max(len(line) for line in narrow) <= 40
    assert not any("╭" in line for line in narrow)
    text = "\n".join(narrow)
    for name in ppo.nodes:
        assert name in text
    # the explicit width wins over a wider console
    capped = render_text(render_dag(ppo, width=40), width=120)
    assert capped == narrow


def test_print_dag_prints_on_the_given_console(ppo):
    console = Console(width=80, record=True, color_system=None)
    print_dag(ppo, console, compact=True)
    text = console.export_text()
    assert "update_critic  test.update_critic  critic@critic  ← returns, values" in text


# ---------------------------------------------------------------- states
def test_each_state_has_its_own_style_and_unknown_ones_are_refused(ppo):
    styles = [state_style(s) for s in STATES]
    assert len({str(s) for s in styles}) == len(STATES)
    assert state_style("failed").color.name == "red"
    assert state_style("done").color.name == "green"
    # a pool is never drawn in a state's colour
    assert not {c for c in pool_colors(ppo).values()} & {s.color.name for s in styles}
    with pytest.raises(ValueError, match="unknown node state 'paused'"):
        render_dag(ppo, states={"generate": "paused"})
    with pytest.raises(ValueError, match="not in graph 'test_ppo': nope"):
        render_dag(ppo, states={"nope": "done"})


def _border_style(graph, node: str, **kwargs):
    """The style of the top-left corner of ``node``'s box, rendered in true colour."""
    console = Console(width=80, color_system="truecolor")
    for line in console.render_lines(render_dag(graph, **kwargs), pad=False):
        text = "".join(s.text for s in line)
        if f"╭─ {node} " in text:
            col = text.index(f"╭─ {node} ")
            for seg in line:
                if col < len(seg.text):
                    return seg.style
                col -= len(seg.text)
    raise AssertionError(f"no box for {node}")


def test_state_colours_the_border_and_is_written_in_the_box(ppo):
    pool = _border_style(ppo, "generate")
    done = _border_style(ppo, "generate", states={"generate": "done"})
    failed = _border_style(ppo, "generate", states={"generate": "failed"})
    assert pool.color.name == pool_colors(ppo)["train"]
    assert done.color.name == "green" and failed.color.name == "red"
    lines = render_text(render_dag(ppo, states={"generate": "failed"}, durations={"generate": 1.5}))
    assert any("row · failed · 1.50 s" in line for line in lines)
    assert max(len(line) for line in lines) <= 80


def test_after_edges_are_drawn_without_fields():
    b = GraphBuilder("after", imports=["tests.graph_ops"], roles={"actor": {"kind": "test_actor"}},
                     pools={"train": {"roles": ["actor"]}}, data={"source": "testdata:prompts"})
    b.node("score_a", "viztest.score", inputs={"responses": "prompts"}, outputs={"score": "a"})
    b.node("score_b", "viztest.score", inputs={"responses": "prompts"}, outputs={"score": "b"},
           after=["score_a"])
    g = b.build()
    text = "\n".join(render_text(render_dag(g)))
    assert "score_a ⋯ score_b (after)" in text
    compact = render_text(render_dag(g, compact=True))
    assert any(re.match(r"2\s+score_b\s.*← prompts  → b  after score_a$", line.rstrip()) for line in compact)
    assert {"src": "score_a", "dst": "score_b", "fields": [], "kind": "after"} in to_json(g)["edges"]


# ---------------------------------------------------------------- exports
_MERMAID_NODE = re.compile(r'^\s+(n_\w+)(?:\["(.*)"\]|\[\("(.*)"\)\])$')
_MERMAID_EDGE = re.compile(r'^\s+(n_\w+) (-->|-\.->)\|"([^"]*)"\| (n_\w+)$')


def _parse_mermaid(text: str):
    """(nodes: id → name, edges: {(src, dst, arrow, label)}); every line must be valid syntax."""
    lines = text.splitlines()
    assert lines[0] == "flowchart TD"
    nodes, edges, depth = {}, set(), 0
    for line in lines[1:]:
        if m := _MERMAID_NODE.match(line):
            nodes[m[1]] = (m[2] or m[3]).split("<br/>")[0]
        elif m := _MERMAID_EDGE.match(line):
            edges.add((m[1], m[4], m[2], m[3]))
        elif re.match(r'^\s+subgraph p\d+\["[^"]*"\]$', line):
            depth += 1
        elif line.strip() == "end":
            depth -= 1
        else:
            raise AssertionError(f"not a mermaid line this exporter writes: {line!r}")
    assert depth == 0
    return nodes, edges


def test_mermaid_has_every_node_and_every_edge_with_its_fields(ppo):
    text = to_mermaid(ppo)
    nodes, edges = _parse_mermaid(text)
    assert set(nodes.values()) == {SOURCE, *ppo.nodes}
    named = {(nodes[s], nodes[d], label) for s, d, arrow, label in edges if not label.startswith("next step")}
    assert named == {(u, v, ", ".join(f) if f else k) for u, v, k, f in ir_edges(ppo)}
    state = {(nodes[s], nodes[d]) for s, d, arrow, label in edges if label.startswith("next step")}
    assert state == {(e.src, e.dst) for e in ppo.state_edges}
    assert text.count("subgraph") == len(ppo.config.pools)
    assert 'subgraph p0["train · 1 worker × 1 cpu"]' in text


def _dot_tokens(text: str) -> list[str]:
    """Tokenize DOT; fails on anything outside the language (an unclosed quote, a stray char)."""
    token = re.compile(r'"(?:[^"\\]|\\.)*"|->|[A-Za-z_][A-Za-z0-9_]*|-?\d+(?:\.\d+)?|[{}\[\];=,]|\s+')
    pos, out = 0, []
    while pos < len(text):
        m = token.match(text, pos)
        assert m, f"invalid DOT at {text[pos:pos + 30]!r}"
        if not m[0].isspace():
            out.append(m[0])
        pos = m.end()
    assert out.count("{") == out.count("}")
    return out


def _unquote(tok: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], tok[1:-1])


def _dot_edges(text: str) -> set[tuple[str, str, str, bool]]:
    edges = set()
    for m in re.finditer(r'^\s+("(?:[^"\\]|\\.)*") -> ("(?:[^"\\]|\\.)*") \[label=("(?:[^"\\]|\\.)*")(.*)\];$',
                         text, re.M):
        edges.add((_unquote(m[1]), _unquote(m[2]), _unquote(m[3]), "constraint=false" in m[4]))
    return edges


def test_dot_has_a_cluster_per_pool_and_every_edge_with_its_fields(ppo):
    text = to_dot(ppo)
    tokens = _dot_tokens(text)
    assert tokens[:3] == ["digraph", '"test_ppo"', "{"]
    assert sum(1 for t in tokens if t.startswith('"cluster_')) == len(ppo.config.pools)
    edges = _dot_edges(text)
    assert {(u, v, lbl) for u, v, lbl, state in edges if not state} == {
        (u, v, ", ".join(f) if f else k) for u, v, k, f in ir_edges(ppo)
    }
    assert {(u, v) for u, v, _, state in edges if state} == {(e.src, e.dst) for e in ppo.state_edges}
    for name, node in ppo.nodes.items():
        assert f'"{name}" [label="{name}\\n{node.op_name}\\n' in text


def test_json_edges_equal_the_ir_edges(ppo):
    d = json.loads(json.dumps(to_json(ppo)))
    assert {(e["src"], e["dst"], e["kind"], tuple(e["fields"])) for e in d["edges"]} == ir_edges(ppo)
    assert len(d["edges"]) == ppo.dag.number_of_edges()
    assert set(d["nodes"]) == set(ppo.nodes)
    gae = d["nodes"]["advantage"]
    assert (gae["op"], gae["role"], gae["pool"], gae["scope"], gae["layer"]) == ("test.gae", None, None, "batch", 4)
    assert [f["name"] for f in gae["inputs"]] == ["token_level_rewards", "values", "response_mask"]
    assert gae["outputs"] == [{"name": "advantages", "spec": "float32[B, R]"},
                              {"name": "returns", "spec": "float32[B, R]"}]
    assert d["nodes"]["values"]["pool"] == "critic"
    assert {(e["role"], e["src"], e["dst"], e["staleness"]) for e in d["state_edges"]} == {
        (e.role, e.src, e.dst, e.staleness) for e in ppo.state_edges
    }
    assert d["pools"]["train"] == {"workers": 1, "cpus": 1.0, "gpus": 0.0, "roles": ["actor", "ref"]}
    assert d["layers"] == [[SOURCE], *ppo.layers()]


def test_exports_stay_valid_with_hostile_names():
    """Quotes, pipes, '#', a keyword and spaces in names must not break either syntax."""
    weird = ['say "hi"', "a|b #1", "end", "x\\y", "[red]alarm"]
    b = GraphBuilder('my "graph"', imports=["tests.graph_ops"], roles={"actor": {"kind": "test_actor"}},
                     pools={'pool "one"': {"roles": ["actor"]}}, data={"source": "testdata:prompts"})
    b.node(weird[0], "viztest.score", inputs={"responses": "prompts"}, outputs={"score": "s0"})
    b.node(weird[1], "viztest.score", inputs={"responses": "prompts"}, outputs={"score": "s1"})
    for i, name in enumerate(weird[2:], start=2):
        b.node(name, "viztest.pair", inputs={"a": f"s{i - 1}", "b": "s0"}, outputs={"score": f"s{i}"})
    g = b.build()
    nodes, edges = _parse_mermaid(to_mermaid(g))
    assert len(nodes) == len(g.nodes) + 1 and len(set(nodes)) == len(nodes)
    assert len(edges) == g.dag.number_of_edges()
    text = to_dot(g)
    _dot_tokens(text)
    assert {(u, v) for u, v, _, _ in _dot_edges(text)} == {(u, v) for u, v in g.dag.edges}
    json.dumps(to_json(g))
    for compact in (False, True):
        text = "\n".join(render_text(render_dag(g, compact=compact)))
        assert all(name in text for name in weird), "names are printed as text, never as markup"


def test_visualizer_never_imports_operators():
    # loading a graph may load operator plugins through the registry; rendering must add none
    code = ("import sys, visualizer, visualizer.plan; "
            "bad = [m for m in sys.modules if m == 'operators' or m.startswith('operators.')]; "
            "assert not bad, ('import', bad); "
            "from flowrl.graph import load_graph; import visualizer as v; "
            f"g = load_graph({PPO!r}); before = set(sys.modules); v.to_json(g); v.to_dot(g); v.to_mermaid(g); "
            "from rich.console import Console; Console(file=open('/dev/null', 'w')).print(v.render_dag(g)); "
            "bad = [m for m in set(sys.modules) - before if m.startswith('operators')]; "
            "assert not bad, ('render', bad)")
    subprocess.run([sys.executable, "-c", code], check=True)
