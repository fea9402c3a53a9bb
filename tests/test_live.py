"""The live run view: terminal rendering, plain non-TTY lines, sparklines, pool load."""

from __future__ import annotations

import io

import pytest

from rich.console import Console

from flowrl.graph import load_graph
from visualizer.live import LiveView, Waits, pool_busy, sparkline


def test_sparkline_scales_to_the_range():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert sparkline([3.0, 3.0, 3.0]) == "▁▁▁"
    assert sparkline([]) == ""
    assert len(sparkline(list(range(100)), width=10)) == 10


def test_pool_busy_is_node_time_over_step_time():
    g = load_graph("ppo")
    row = {"timing/step": 2.0, "timing/generate": 0.5, "timing/old_logprob": 0.3, "timing/update_actor": 0.7,
           "timing/values": 0.4, "timing/update_critic": 0.6, "timing/advantage": 0.1}
    busy = pool_busy(g, row)
    assert busy == {"train": (0.5 + 0.3 + 0.7) / 2.0, "critic": (0.4 + 0.6) / 2.0}


def test_non_tty_output_is_plain_and_throttled():
    g = load_graph("grpo")
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with LiveView(g, total_steps=50, console=console, min_interval_s=3600) as view:
        assert not view.interactive
        for step in range(50):
            view.progress(step, {"generate": "running"})
            view.step(step, {"reward/mean": step / 100, "timing/step": 0.1, "timing/generate": 0.05})
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 1/50  reward/mean 0  timing/step 0.1",
        "step 50/50  reward/mean 0.49  timing/step 0.1",
    ]
    assert "\x1b[" not in out.getvalue()  # no escape codes in a log


def test_a_wait_gets_a_line_after_5_s_then_every_10_s_and_a_new_wait_starts_again():
    now = [100.0]
    said: list[str] = []
    waits = Waits(said.append, clock=lambda: now[0])
    waits.close()  # its thread stops: the ticks below are the test's
    waits.begin("starting Ray")
    lines = []
    for t in range(0, 31):  # a tick every second for 30 s
        now[0] = 100.0 + t
        lines.append(waits.tick())
    assert [(t, line) for t, line in enumerate(lines) if line] == [
        (5, "… starting Ray: 5 s"), (15, "… starting Ray: 15 s"), (25, "… starting Ray: 25 s")]
    now[0] = 132.0
    waits.begin("step 1/3")  # the next wait keeps the rhythm: its first line at 135 s, with its own 3 s
    assert waits.tick() is None
    now[0] = 135.5
    assert waits.tick() == "… step 1/3: 4 s"
    now[0] = 157.0  # a tick 11.5 s late (a loaded machine): one line, and the schedule goes on at 165 s
    assert waits.tick() == "… step 1/3: 25 s" and waits.tick() is None
    now[0] = 165.0
    assert waits.tick() == "… step 1/3: 33 s"
    waits.end()
    now[0] += 60
    assert waits.tick() is None
    waits.begin("step 2/3")  # after a pause, a new wait's first line comes after 5 s
    now[0] += 4.9
    assert waits.tick() is None
    now[0] += 0.1
    assert waits.tick() == "… step 2/3: 5 s"
    waits.begin("step 3/300")  # that wait was said; the steps after it come every 3 s: none gets a line
    for t in range(1, 61):
        now[0] += 1
        if t % 3 == 0:
            waits.begin(f"step {3 + t // 3}/300")
        assert waits.tick() is None, t


def test_validation_scores_are_said_as_they_come_with_the_declared_maximum():
    g = load_graph("grpo_tools")
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=80)
    with LiveView(g, total_steps=4, console=console, min_interval_s=3600) as view:
        view.score_max = 1.2
        for step in range(4):
            row = {"reward/mean": 0.25 * step, "timing/step": 0.1}
            if step % 2 == 1:
                row["val/reward/mean"] = 0.5 + 0.25 * step
            view.step(step, row)
    assert view.headline == "reward/mean" and view.val_metric == "val/reward/mean"
    assert view.val_scores == [(2, 0.75), (4, 1.25)] and view.recent == [0.0, 0.25, 0.5, 0.75]
    said = [line for line in out.getvalue().splitlines() if line.startswith("validation")]
    assert said == ["validation after step 2: val/reward/mean 0.75 (of 1.2)",
                    "validation after step 4: val/reward/mean 1.25 (of 1.2)"]


def test_terminal_view_shows_states_durations_and_metrics():
    g = load_graph("ppo")
    console = Console(file=io.StringIO(), force_terminal=True, width=120, color_system=None)
    view = LiveView(g, total_steps=10, console=console)
    view.step(0, {"reward/mean": 0.25, "timing/step": 1.0, "timing/generate": 0.4, "timing/values": 0.5})
    view.progress(1, {"generate": "done", "values": "running", "update_actor": "waiting"})
    rec = Console(width=120, record=True, color_system=None, file=io.StringIO())
    rec.print(view.render())
    text = rec.export_text()
    for expected in ("1/10", "generate", "done · 0.40 s", "running · 0.50 s", "waiting", "reward/mean",
                     "0.25", "pools busy: train 40%  critic 50%"):
        assert expected in text, expected


def test_live_view_shows_where_light_nodes_really_run():
    from flowrl.plan.planner import make_plan

    g = load_graph("grpo")
    view = LiveView(g, total_steps=3, console=Console(file=io.StringIO(), force_terminal=True, width=120))
    view.placement = dict(make_plan(g).moved)
    assert view.placement == {"reward": "train", "advantage": "train"}
    row = {"timing/step": 1.0, "timing/generate": 0.2, "timing/reward": 0.1, "timing/advantage": 0.1,
           "timing/update_actor": 0.5}
    assert pool_busy(g, row, view.placement) == {"train": pytest.approx(0.9)}
    view.step(0, row)
    rec = Console(width=120, record=True, color_system=None, file=io.StringIO())
    rec.print(view.render())
    text = rec.export_text()
    assert "reward.rule  @train" in text and "advantage.grpo  @train" in text
    assert "□ driver" not in text  # no node left on the driver: no legend row for it


#: the operator metrics each built-in graph's live view showed before operators declared them: the
#: old hard-coded list in the live view intersected with the keys a one-step run of the graph (with
#: validation) reported, at d10bc53
HEADLINE_BEFORE = {
    **{name: {"reward/mean", "response_length/mean", "actor/pg_loss", "actor/approx_kl", "actor/entropy",
              "val/reward/mean"}
       for name in ("grpo", "grpo_async", "rloo", "remax", "grpo_skewed", "grpo_tools", "grpo_vision")},
    "reinforce_pp": {"reward/mean", "response_length/mean", "actor/pg_loss", "actor/approx_kl", "actor/entropy",
                     "actor/reward_kl_penalty", "val/reward/mean"},
    "ppo": {"reward/mean", "response_length/mean", "actor/pg_loss", "actor/approx_kl", "actor/entropy",
            "actor/reward_kl_penalty", "critic/vf_loss", "val/reward/mean"},
}


@pytest.mark.parametrize("name", sorted(HEADLINE_BEFORE))
def test_the_declared_headline_of_every_builtin_graph_is_what_the_view_showed_before(name):
    g = load_graph(name)
    headline = g.headline_metrics()
    assert len(headline) == len(set(headline)) and set(headline) == HEADLINE_BEFORE[name]
    # the step's flow orders it: what the generator reports before what the update reports
    assert headline.index("response_length/mean") < headline.index("reward/mean") < headline.index("actor/pg_loss")
    assert headline[-1] == "val/reward/mean"


def test_the_plain_line_shows_the_graphs_headline_then_the_runs_own_metrics():
    g = load_graph("ppo")
    view = LiveView(g, total_steps=5, console=Console(file=io.StringIO(), width=400))
    row = {key: 1.0 for key in ("actor/pg_loss", "critic/vf_loss", "reward/mean", "actor/clipfrac", "reward/max",
                                "timing/step", "timing/generate", "throughput/tokens_per_s")}
    shown = [part.split(" ")[0] for part in view.line(1, row).split("  ")[1:]]
    order = g.headline_metrics()
    assert shown == sorted(("critic/vf_loss", "reward/mean", "actor/pg_loss"), key=order.index) + [
        "throughput/tokens_per_s", "timing/step"]
