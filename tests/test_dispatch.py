"""Dispatch modes: registered split/collect pairs with named errors."""

from __future__ import annotations

import pytest
import torch

from flowrl.data import DataProto
from flowrl.data.dispatch import (DISPATCH_MODES, DispatchError, DispatchMode, dispatch_mode, get_mode, in_row_order,
                                  rank_rows)
from flowrl.data.padding import concat_padded
from flowrl.graph import operator


def _rows(n: int) -> DataProto:
    return DataProto.from_dict(tensors={"x": torch.arange(n)})


def test_split_gives_each_rank_its_rows_and_collects_them_in_order():
    mode = get_mode("split")
    parts = [mode.split(_rows(5), r, 2) for r in mode.ranks(2)]
    assert [p["x"].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert mode.collect(parts)["x"].tolist() == [0, 1, 2, 3, 4]
    assert [rank_rows(5, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]


def test_all_runs_every_rank_on_the_whole_batch_and_keeps_rank_0():
    mode = get_mode("all")
    assert mode.ranks(3) == [0, 1, 2] and mode.collected(3) == [0]
    assert len(mode.split(_rows(4), 2, 3)) == 4
    with pytest.raises(DispatchError, match="got 2 outputs"):
        mode.collect([_rows(1), _rows(1)])


def test_unknown_modes_are_named_errors_at_lookup_and_declaration():
    with pytest.raises(DispatchError, match="unknown dispatch mode 'dp'; registered: split, all, driver"):
        get_mode("dp")
    with pytest.raises(TypeError, match="dispatch must be a registered mode"):
        operator("test.bad_dispatch", role="actor", dispatch="dp", register=False)


def test_a_new_mode_registers_by_name():
    mode = DispatchMode("test_first_rank", runs_on=lambda w: [0], split=lambda b, r, w: b,
                        collected=lambda w: [0], collect=lambda parts: parts[0])
    try:
        dispatch_mode(mode)
        assert get_mode("test_first_rank") is mode
        with pytest.raises(DispatchError, match="registered twice"):
            dispatch_mode(DispatchMode("test_first_rank", runs_on=lambda w: [1], split=mode.split,
                                       collected=mode.collected, collect=mode.collect))
    finally:
        DISPATCH_MODES.pop("test_first_rank", None)


def _ragged(lengths: list[int], first: int = 0) -> DataProto:
    """Rows ``first, first+1, ...`` with ``lengths[i]`` real tokens of 12, left-aligned."""
    mask = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).long()
    return DataProto.from_dict(tensors={"x": torch.arange(first, first + len(lengths)), "attention_mask": mask})


def test_balanced_gives_ranks_equal_real_tokens_and_collects_every_task_in_row_order():
    mode = get_mode("balanced")
    # two micro-batches, long rows first: a contiguous split gives rank 0 every long row
    tasks = [_ragged([10, 10, 10, 10, 1, 1, 1, 1]), _ragged([9, 1, 8, 2, 5, 5, 3, 7], first=8)]
    parts = [[mode.split(batch, r, 2) for r in mode.ranks(2)] for batch in tasks]
    loads = [[int(p["attention_mask"].sum()) for p in task] for task in parts]
    assert loads == [[22, 22], [20, 20]]  # contiguous by count: [[40, 4], [20, 20]]
    split = get_mode("split")
    assert [int(split.split(tasks[0], r, 2)["attention_mask"].sum()) for r in (0, 1)] == [40, 4]
    # one task's outputs, ranks concatenated: back in its row order
    assert mode.collect(parts[1])["x"].tolist() == list(range(8, 16))
    # a barrier reads every micro-batch's ranks, concatenated task after task: each task in order
    together = in_row_order(concat_padded([p for task in parts for p in task]))
    assert together["x"].tolist() == list(range(16))
    assert "_dispatch_row" not in together.non_tensor_batch
    with pytest.raises(DispatchError, match="not one task's rows"):  # a rank's output went missing
        in_row_order(concat_padded([parts[0][0], parts[1][0], parts[1][1]]))
