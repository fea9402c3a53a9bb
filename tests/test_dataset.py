"""verl-format prompt files and builtin tasks through one dataset and one resumable loader."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from operators.data import (
    DatasetError,
    PromptDataset,
    PromptLoader,
    TaskRows,
    left_pad,
    load_dataset,
    position_ids_from_mask,
    read_rows,
)
from operators.models import VOCAB, load_tokenizer

TOK = load_tokenizer("builtin:tiny")
V = {w: i for i, w in enumerate(VOCAB)}


def row(content: str, answer: str, source: str = "my/copy", **extra) -> dict:
    return {
        "prompt": [{"role": "user", "content": content}],
        "data_source": source,
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", **extra},
    }


ROWS = [
    row("copy 3 7 =", "3 7", tools_kwargs={"calc": {"create_kwargs": {"x": 1}}}),
    row("add 1 2 =", "3", source="my/add"),
    row("reverse 1 2 3 4 5 =", "5 4 3 2 1"),      # 8 tokens with <bos>: the long one
    row("copy 0 0 =", "0 0"),
]


def write(tmp_path, rows, fmt: str):
    path = tmp_path / f"data.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_file_round_trip(tmp_path, fmt):
    path = write(tmp_path, ROWS, fmt)
    ds = PromptDataset.from_file(path, TOK, max_prompt_length=10)
    assert len(ds) == 4
    batch = ds.collate([0, 1])
    copy = [V["<bos>"], V["copy"], V["3"], V["7"], V["="]]
    add = [V["<bos>"], V["add"], V["1"], V["2"], V["="]]
    assert batch["input_ids"].tolist() == [[0] * 5 + copy, [0] * 5 + add]          # left-padded to 10
    assert batch["attention_mask"].tolist() == [[0] * 5 + [1] * 5] * 2
    assert batch["position_ids"].tolist() == [[0] * 5 + [0, 1, 2, 3, 4]] * 2
    assert list(batch["raw_prompt_ids"]) == [copy, add]
    assert list(batch["ground_truth"]) == ["3 7", "3"]
    assert list(batch["data_source"]) == ["my/copy", "my/add"]
    assert batch["tools_kwargs"][0] == {"calc": {"create_kwargs": {"x": 1}}}
    assert batch["tools_kwargs"][1] == {}
    assert batch["extra_info"][1]["split"] == "train"
    assert batch["index"].tolist() == [0, 1]
    assert batch["data_source"].dtype == object


def test_without_a_limit_a_batch_pads_to_its_longest_prompt():
    ds = PromptDataset(ROWS, TOK)
    assert ds.collate([0, 1])["input_ids"].shape == (2, 5)
    assert ds.collate([0, 2])["input_ids"].shape == (2, 8)


def test_truncation_modes(tmp_path):
    long_ids = [V["<bos>"], V["reverse"], V["1"], V["2"], V["3"], V["4"], V["5"], V["="]]
    assert PromptDataset(ROWS, TOK).prompt_ids(2) == long_ids
    left = PromptDataset(ROWS, TOK, max_prompt_length=4, truncation="left")
    right = PromptDataset(ROWS, TOK, max_prompt_length=4, truncation="right")
    assert left.prompt_ids(2) == long_ids[-4:]
    assert right.prompt_ids(2) == long_ids[:4]
    assert left.collate([2])["input_ids"].tolist() == [long_ids[-4:]]
    strict = PromptDataset(ROWS, TOK, max_prompt_length=6, truncation="error", name="train.parquet")
    assert strict.prompt_ids(0) == [V["<bos>"], V["copy"], V["3"], V["7"], V["="]]
    with pytest.raises(DatasetError, match=r"train.parquet: row 2 has a 8-token prompt, over max_prompt_length=6"):
        strict.collate([0, 2])
    with pytest.raises(DatasetError, match=r"data.jsonl: row 2 has a 8-token prompt"):   # at load time
        PromptDataset.from_file(write(tmp_path, ROWS, "jsonl"), TOK, max_prompt_length=6)
    with pytest.raises(ValueError, match="truncation must be"):
        PromptDataset(ROWS, TOK, truncation="middle")


def test_overlong_prompts_are_filtered_once():
    ds = PromptDataset(ROWS, TOK, max_prompt_length=6, filter_overlong_prompts=True)
    assert len(ds) == 3
    batch = ds.collate([0, 1, 2])
    assert batch["index"].tolist() == [0, 1, 3]                 # row 2 is gone; indices are the file's rows
    assert list(batch["ground_truth"]) == ["3 7", "3", "0 0"]


def test_missing_file_and_columns_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        read_rows(tmp_path / "missing.parquet")
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in ROWS]
    path = write(tmp_path, rows, "parquet")
    with pytest.raises(DatasetError, match=r"data.parquet: missing required column 'reward_model'") as err:
        PromptDataset.from_file(path, TOK)
    assert str(path) in str(err.value)
    path = write(tmp_path, [ROWS[0], {k: v for k, v in ROWS[1].items() if k != "prompt"}], "jsonl")
    with pytest.raises(DatasetError, match=r"data.jsonl: row 1: no value for column 'prompt'"):
        PromptDataset.from_file(path, TOK)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported dataset format '.csv'"):
        read_rows(tmp_path / "data.csv")
    bad_truth = [dict(ROWS[0], reward_model={"style": "rule"})]
    with pytest.raises(DatasetError, match="row 0: column 'reward_model' needs a 'ground_truth' key"):
        PromptDataset(bad_truth, TOK).collate([0])


def take(loader: PromptLoader, n: int) -> list[list[int]]:
    return [loader.next_batch()["index"].tolist() for _ in range(n)]


def test_loader_covers_each_epoch_and_reshuffles():
    ds = load_dataset("builtin:copy", TOK, task_size=10, seed=0)
    loader = PromptLoader(ds, batch_size=3, seed=0)
    batches = take(loader, 6)                                     # 3 per epoch, the last row of each dropped
    epoch0, epoch1 = sum(batches[:3], []), sum(batches[3:], [])
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9
    assert epoch0 != epoch1
    assert loader.state_dict() == {"epoch": 1, "index": 9}
    keep_all = PromptLoader(ds, batch_size=3, seed=0, drop_last=False)
    assert [len(b) for b in take(keep_all, 4)] == [3, 3, 3, 1]
    in_order = PromptLoader(ds, batch_size=5, shuffle=False)
    assert take(in_order, 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_resuming_reproduces_the_exact_batches(tmp_path):
    path = write(tmp_path, [row(f"copy {i % 10} {i // 10} =", f"{i % 10} {i // 10}") for i in range(23)], "parquet")
    ds = PromptDataset.from_file(path, TOK)
    straight = PromptLoader(ds, batch_size=4, seed=3)
    reference = [straight.next_batch() for _ in range(12)]        # crosses two epoch boundaries
    for stop in (0, 4, 5, 7):
        first = PromptLoader(ds, batch_size=4, seed=3)
        for _ in range(stop):
            first.next_batch()
        state = json.loads(json.dumps(first.state_dict()))          # survives a checkpoint file
        resumed = PromptLoader(PromptDataset.from_file(path, TOK), batch_size=4, seed=3)
        resumed.load_state_dict(state)
        for expected in reference[stop:]:
            got = resumed.next_batch()
            assert torch.equal(got["input_ids"], expected["input_ids"])
            assert got["index"].tolist() == expected["index"].tolist()
            assert list(got["ground_truth"]) == list(expected["ground_truth"])


def test_a_builtin_task_batches_like_the_same_rows_in_a_file(tmp_path):
    rows = TaskRows("reverse", size=12, seed=4)
    path = write(tmp_path, [rows[i] for i in range(len(rows))], "jsonl")
    from_task = PromptLoader(load_dataset("builtin:reverse", TOK, seed=4, task_size=12), batch_size=4, seed=1)
    from_file = PromptLoader(load_dataset(str(path), TOK), batch_size=4, seed=1)
    for _ in range(5):
        a, b = from_task.next_batch(), from_file.next_batch()
        assert set(a) == set(b)
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert torch.equal(a[key], b[key]), key
            else:
                assert list(a[key]) == list(b[key]), key


def test_loader_errors():
    ds = load_dataset("builtin:copy", TOK, task_size=4)
    with pytest.raises(DatasetError, match="batch_size=8 exceeds its 4 rows"):
        PromptLoader(ds, batch_size=8)
    empty = PromptDataset(ROWS, TOK, max_prompt_length=2, filter_overlong_prompts=True)
    with pytest.raises(DatasetError, match="no rows left"):
        PromptLoader(empty, batch_size=1)


def test_padding_helpers():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0, length=4)
    assert ids.tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 1, 2], [0, 0, 0, 0]]
    assert position_ids_from_mask(torch.tensor([[0, 1, 1, 0, 0]])).tolist() == [[0, 0, 1, 1, 1]]


@pytest.mark.parametrize("line, says", [(b'{"a": "\xe9t\xe9"}', "line 2 is not UTF-8 text (byte 0xe9 at column 8)"),
                                        (b"[1, 2]", "line 2 is a JSON list, not an object of columns"),
                                        (b"[" * 100_000, "line 2 cannot be read as JSON (RecursionError)"),
                                        (b'{"a": ', "line 2 is not valid JSON")])
def test_a_bad_jsonl_line_is_named(tmp_path, line, says):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n" + line + b"\n")
    with pytest.raises(DatasetError) as err:
        read_rows(path)
    assert str(path) in str(err.value) and says in str(err.value)


def test_make_source_builds_the_graphs_declared_source_seeded_by_the_run_or_by_the_caller(tmp_path):
    from flowrl.graph import load_graph, make_source

    rows = TaskRows("reverse", size=12, seed=4)
    path = write(tmp_path, [rows[i] for i in range(len(rows))], "jsonl")
    cfg = load_graph("grpo", overrides={"data.source": str(path), "data.batch_size": 4, "trainer.seed": 3}).config

    def ids(source) -> list:
        return [source.next_batch().batch["prompts"].tolist() for _ in range(3)]

    run = ids(make_source(cfg))
    assert run == ids(make_source(cfg, seed=3))  # trainer.seed unless told otherwise
    assert run != ids(make_source(cfg, seed=4))  # another seed shuffles the file another way
    assert len(make_source(cfg, split="val").next_batch()) == 12  # validation: the whole file as one batch
