"""Builtin tasks and rewards: generation, token-id scoring, gsm8k, user functions, reward models."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from operators.data import TASKS, TaskRows, get_task
from operators.models import VOCAB, load_model, load_tokenizer
from operators.rewards import (
    RewardFnError,
    RewardModelScorer,
    compute_scores,
    exact_match_score,
    extract_gsm8k_answer,
    gsm8k_score,
    load_reward_fn,
    partial_match_score,
    place_at_last_token,
    split_score,
    task_eos_score,
    task_token_score,
)

TOK = load_tokenizer("builtin:tiny")
PAD, BOS, EOS = 0, 1, 2
D = {d: VOCAB.index(d) for d in "0123456789"}   # digit → token id


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


# --- tasks ------------------------------------------------------------------------------------

def test_task_rows_are_a_function_of_seed_and_index():
    a, b, other = TaskRows("copy", seed=7), TaskRows("copy", seed=7), TaskRows("copy", seed=8)
    assert [a[i] for i in range(20)] == [b[i] for i in range(20)]
    assert [a[i]["prompt"] for i in range(20)] != [other[i]["prompt"] for i in range(20)]
    assert a[5] == TaskRows("copy", seed=7, size=10)[5]      # the size does not change row i
    with pytest.raises(IndexError):
        TaskRows("copy", size=3)[3]


@pytest.mark.parametrize("name", ["copy", "reverse", "add"])
def test_task_answers_are_right(name):
    for i in range(50):
        row = TaskRows(name, seed=1)[i]
        words = row["prompt"][0]["content"].split()
        assert words[0] == name and words[-1] == "="
        numbers = [int(w) for w in words[1:-1]]
        answer = row["reward_model"]["ground_truth"]
        expected = {"copy": numbers, "reverse": numbers[::-1],
                    "add": [int(c) for c in str(sum(numbers))]}[name]
        assert answer == " ".join(map(str, expected))
        assert row["data_source"] == f"builtin:{name}"
        assert all(t != TOK.unk_token_id for t in ids(row["prompt"][0]["content"]) + ids(answer))


def test_default_task_is_two_digit_copy_and_unknown_tasks_are_named():
    row = TaskRows()[0]
    assert row["data_source"] == "builtin:copy" and len(row["reward_model"]["ground_truth"].split()) == 2
    assert get_task("builtin:reverse") is TASKS["reverse"]
    with pytest.raises(ValueError, match="unknown builtin task 'builtin:sort'.*builtin:copy"):
        get_task("builtin:sort")


# --- token-id rewards ---------------------------------------------------------------------------

@pytest.mark.parametrize("response, score", [
    ([D["3"], D["7"], EOS], 1.0),                   # exact, then EOS
    ([D["3"], D["7"]], 1.0),                        # exact, cut by the length limit
    ([D["3"], D["9"], EOS], 0.5),                   # one of two positions
    ([D["7"], D["3"], EOS], 0.0),                   # right digits, wrong places
    ([D["3"], D["7"], D["7"], EOS], 2 / 3),         # one extra token before EOS
    ([D["3"], D["7"], D["3"], D["7"], D["3"], D["7"], D["3"], D["7"]], 2 / 8),   # rambling, no EOS
    ([BOS, D["3"], D["7"], EOS], 0.0),              # junk special token first shifts everything
    ([D["3"], PAD, D["7"], EOS], 1 / 3),            # junk special token inside
    ([D["3"], D["7"], EOS, D["9"], BOS], 1.0),      # anything after EOS is ignored
    ([EOS], 0.0),                                   # empty answer
])
def test_task_token_score_by_hand(response, score):
    assert task_token_score(response, [D["3"], D["7"]], EOS) == pytest.approx(score)


@pytest.mark.parametrize("response, score", [
    ([D["3"], D["7"], EOS], 1.0),                   # exact, then EOS
    ([D["3"], EOS], 1 / 3),                         # stopped one digit early: less than a wrong digit
    ([D["3"], D["9"], EOS], 2 / 3),                 # a wrong second digit, then the stop
    ([D["3"], D["7"]], 2 / 3),                      # exact, cut by the length limit: the stop is missing
    ([D["3"], D["7"], D["7"], EOS], 2 / 4),         # one extra token before EOS
    ([D["3"], D["7"], D["3"], D["7"], D["3"], D["7"], D["3"], D["7"]], 2 / 8),   # rambling, no EOS
    ([D["3"], D["7"], EOS, D["9"], BOS], 1.0),      # anything after EOS is ignored
    ([EOS], 0.0),                                   # empty answer
])
def test_task_eos_score_scores_the_stop_as_one_more_token(response, score):
    assert task_eos_score(response, [D["3"], D["7"]], EOS) == pytest.approx(score)
    responses = torch.tensor([response])
    scores, _ = compute_scores(responses, torch.ones_like(responses), data_source=["builtin:copy"],
                               ground_truth=["3 7"], tokenizer=TOK, fn="task_eos")
    assert scores.tolist() == pytest.approx([score])


def test_token_scoring_cannot_be_fooled_by_special_tokens_that_text_scoring_hides():
    # "<bos> 3 7 <eos>" decodes to "3 7" with special tokens skipped: text says right, tokens say wrong
    responses = torch.tensor([[BOS, D["3"], D["7"], EOS]])
    mask = torch.ones_like(responses)
    token_score, _ = compute_scores(responses, mask, data_source=["builtin:copy"], ground_truth=["3 7"], tokenizer=TOK)
    text_score, _ = compute_scores(responses, mask, data_source=["builtin:copy"], ground_truth=["3 7"], tokenizer=TOK,
                                   fn="exact")
    assert token_score.tolist() == [0.0] and text_score.tolist() == [1.0]


def test_compute_scores_and_placement_on_a_batch():
    responses = torch.tensor([
        [D["3"], D["7"], EOS, PAD],           # copy 3 7: exact
        [D["3"], D["9"], D["9"], EOS],        # copy 3 7: 1 match of 3
        [D["1"], D["3"], EOS, PAD],           # add 8 5: "1 3" exact
        [D["2"], D["1"], PAD, PAD],           # reverse → "2 1 0": 2 of 3, cut short (no EOS)
    ])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    scores, extras = compute_scores(
        responses, mask, tokenizer=TOK,
        data_source=np.array(["builtin:copy", "builtin:copy", "builtin:add", "builtin:reverse"], dtype=object),
        ground_truth=["3 7", "3 7", "1 3", "2 1 0"],
    )
    torch.testing.assert_close(scores, torch.tensor([1.0, 1 / 3, 1.0, 2 / 3]))
    assert extras == {}
    by_name, _ = compute_scores(responses[:2], mask[:2], data_source=["x", "y"], ground_truth=["3 7", "3 7"],
                                tokenizer=TOK, fn="copy")
    assert by_name.tolist() == scores[:2].tolist()
    placed = place_at_last_token(scores, mask)
    torch.testing.assert_close(placed, torch.tensor([
        [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1 / 3], [0.0, 0.0, 1.0, 0.0], [0.0, 2 / 3, 0.0, 0.0]]))
    # an empty response gets no score anywhere
    assert place_at_last_token(torch.tensor([5.0]), torch.zeros(1, 3)).abs().sum() == 0


def test_unknown_reward_sources_and_names_are_errors():
    with pytest.raises(ValueError, match="no builtin rule reward for data_source 'my/math'"):
        compute_scores(torch.tensor([[EOS]]), torch.ones(1, 1), data_source=["my/math"], ground_truth=["1"],
                       tokenizer=TOK)
    with pytest.raises(ValueError, match="unknown reward function 'bleu'"):
        compute_scores(torch.tensor([[EOS]]), torch.ones(1, 1), data_source=["x"], ground_truth=["1"],
                       tokenizer=TOK, fn="bleu")


# --- text rewards ---------------------------------------------------------------------------------

def test_gsm8k_extraction_and_score():
    solution = "Natalia sold 48/2 = 24 clips in May. 48 + 24 = 72 #### 72"
    assert extract_gsm8k_answer(solution) == "72"
    assert extract_gsm8k_answer("#### 1,234") == "1234"
    assert extract_gsm8k_answer("#### -5") == "-5"
    assert extract_gsm8k_answer("first #### 3 then #### 4") == "4"
    assert extract_gsm8k_answer("no marker 72") is None
    assert extract_gsm8k_answer("no marker 72.", method="flexible") == "72"
    assert gsm8k_score("openai/gsm8k", solution, "72") == 1.0
    assert gsm8k_score("openai/gsm8k", "#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("openai/gsm8k", "72", "72", format_score=0.1) == 0.0
    assert gsm8k_score("openai/gsm8k", "#### 1,000", "1000") == 1.0


def test_exact_and_partial_match():
    assert exact_match_score("x", "  3 7\n", "3 7") == 1.0
    assert exact_match_score("x", "3 7 1", "3 7") == 0.0
    assert partial_match_score("x", "3 9 1", "3 7 1") == pytest.approx(2 / 3)
    assert partial_match_score("x", "3 7 1 1", "3 7 1") == pytest.approx(3 / 4)


# --- user functions -------------------------------------------------------------------------------

def test_user_function_from_a_file_and_a_module(tmp_path):
    file = tmp_path / "my_reward.py"
    file.write_text(textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            return {"score": float(solution_str == ground_truth), "length": len(solution_str.split()),
                    "source": data_source, "bonus": extra_info.get("bonus", 0)}
    """))
    fn = load_reward_fn(f"{file}:compute_score")
    assert fn("d", "3 7", "3 7", {})["score"] == 1.0
    responses = torch.tensor([[D["3"], D["7"], EOS], [D["3"], EOS, PAD]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    scores, extras = compute_scores(responses, mask, data_source=["d", "d"], ground_truth=["3 7", "3 7"],
                                    extra_info=[{"bonus": 2}, None], tokenizer=TOK, fn=f"{file}:compute_score")
    assert scores.tolist() == [1.0, 0.0]
    assert extras == {"length": [2, 1], "source": ["d", "d"], "bonus": [2, 0]}
    module_fn = load_reward_fn("operators.rewards.rule:partial_match_score")
    assert module_fn("d", "3 9", "3 7", {}) == 0.5


def test_user_function_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(RewardFnError, match="expected 'package.module:function'"):
        load_reward_fn("no_colon_here")
    with pytest.raises(RewardFnError, match="does not exist"):
        load_reward_fn(f"{tmp_path}/missing.py:fn")
    with pytest.raises(RewardFnError, match="cannot import module 'not_a_module_xyz'"):
        load_reward_fn("not_a_module_xyz:fn")
    with pytest.raises(RewardFnError, match="has no attribute 'nope'"):
        load_reward_fn("operators.rewards.rule:nope")
    with pytest.raises(RewardFnError, match="without 'score'"):
        split_score({"acc": 1.0})
    with pytest.raises(RewardFnError, match="return a float or a dict"):
        split_score("high")


# --- reward model ---------------------------------------------------------------------------------

def test_reward_model_scores_the_last_attended_token_whatever_the_padding():
    rm, _ = load_model("builtin:tiny", head="reward", seed=0)
    scorer = RewardModelScorer(rm)
    seq = [BOS, VOCAB.index("copy"), D["3"], D["7"], VOCAB.index("="), D["3"], D["7"], EOS]
    alone = torch.tensor([seq])
    padded = torch.tensor([[PAD, PAD] + seq, seq + [PAD, PAD]])      # left pad (prompt) / right pad (response)
    expected = scorer.score(alone, torch.ones_like(alone))
    got = scorer.score(padded, (padded != PAD).long())
    torch.testing.assert_close(got, expected.expand(2), atol=1e-5, rtol=0)
    # the score is the classifier head at the last token
    hidden = rm.model(input_ids=alone).last_hidden_state
    torch.testing.assert_close(expected, rm.score(hidden)[:, -1, 0], atol=1e-5, rtol=0)
