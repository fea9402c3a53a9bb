"""Dispatch modes: registered split/collect pairs with named errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.data import DataProto
from flowrl.data.dispatch import (DISPATCH_MODES, DispatchError, DispatchMode, RowKeys, data_parallel, dispatch_mode,
                                  TASK_ROWS, get_mode, rank_rows, task_rows)
from flowrl.graph import operator

NONE = RowKeys()


def _rows(n: int) -> DataProto:
    return DataProto.from_dict(tensors={"x": torch.arange(n)})


def test_split_gives_each_rank_its_rows_and_collects_them_in_order():
    mode = get_mode("split")
    parts = [mode.split(_rows(5), r, 2, NONE)[0] for r in mode.ranks(2)]
    assert [p["x"].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert mode.collect(parts)["x"].tolist() == [0, 1, 2, 3, 4]
    assert [rank_rows(5, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]


def test_all_runs_every_rank_on_the_whole_batch_and_keeps_rank_0():
    mode = get_mode("all")
    assert mode.ranks(3) == [0, 1, 2] and mode.collected(3) == [0]
    assert len(mode.split(_rows(4), 2, 3, NONE)[0]) == 4
    with pytest.raises(DispatchError, match="got 2 outputs"):
        mode.collect([_rows(1), _rows(1)])


def test_unknown_modes_are_named_errors_at_lookup_and_declaration():
    with pytest.raises(DispatchError, match="unknown dispatch mode 'dp'; registered: split, all, driver"):
        get_mode("dp")
    with pytest.raises(TypeError, match="dispatch must be a registered mode"):
        operator("test.bad_dispatch", role="actor", dispatch="dp", register=False)


def test_a_new_mode_registers_by_name():
    mode = DispatchMode("test_first_rank", runs_on=lambda w: [0], split=lambda b, r, w, keys: (b, None),
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


def _run_ranks(mode, batch: DataProto, world: int, keys: RowKeys, factor: int = 1) -> list[DataProto]:
    """Each rank's output of an operator that returns ``x`` (``factor`` rows per input row),
    tagged by the mode as a worker tags it."""
    outs = []
    for r in mode.ranks(world):
        part, tags = mode.split(batch, r, world, keys)
        out = DataProto.from_dict(tensors={"x": part["x"].repeat_interleave(factor) * 10 + torch.arange(
            factor).repeat(len(part))})
        outs.append(mode.tag(out, tags, factor))
    return outs


def test_balanced_gives_ranks_equal_real_tokens_and_collects_each_task_in_row_order():
    mode = get_mode("balanced")
    keys = RowKeys(tokens="attention_mask")
    # two micro-batches, long rows first: a contiguous split gives rank 0 every long row
    tasks = [_ragged([10, 10, 10, 10, 1, 1, 1, 1]), _ragged([9, 1, 8, 2, 5, 5, 3, 7], first=8)]
    loads = [[int(mode.split(batch, r, 2, keys)[0]["attention_mask"].sum()) for r in mode.ranks(2)] for batch in tasks]
    assert loads == [[22, 22], [20, 20]]  # contiguous by count: [[40, 4], [20, 20]]
    split = get_mode("split")
    assert [int(split.split(tasks[0], r, 2, keys)[0]["attention_mask"].sum()) for r in (0, 1)] == [40, 4]
    # without a token column every row counts one: balanced by count, rows interleaved
    assert [len(mode.split(tasks[0], r, 2, NONE)[0]) for r in (0, 1)] == [4, 4]
    # each task's outputs, its ranks concatenated by collect: back in its row order
    outs = [_run_ranks(mode, batch, 2, keys) for batch in tasks]
    assert [task_rows(p).tolist() for p in outs[0]] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    rows, total = mode.split(tasks[0], 1, 2, keys)[0].meta_info[TASK_ROWS]  # for an update's mini-batches
    assert (rows.tolist(), total) == ([1, 3, 5, 7], 8)
    assert mode.collect(outs[1])["x"].tolist() == [x * 10 for x in range(8, 16)]
    assert "_dispatch_row" not in mode.collect(outs[1]).non_tensor_batch
    with pytest.raises(DispatchError, match="not each row once"):  # a rank's output went missing
        mode.collect([outs[0][0], outs[1][1]])


def test_balanced_tags_an_expanding_operator_s_rows_and_one_rank_is_untouched():
    mode = get_mode("balanced")
    batch = _ragged([10, 1, 10, 1])
    outs = _run_ranks(mode, batch, 2, RowKeys(tokens="attention_mask"), factor=3)
    # input row i became rows 3i..3i+2; collect puts the 12 rows in that order
    assert mode.collect(outs)["x"].tolist() == [10 * i + j for i in range(4) for j in range(3)]
    single, tags = mode.split(batch, 0, 1, NONE)
    assert single is batch and tags is None and mode.tag(single, tags, 1) is single


def test_balanced_groups_keeps_each_group_on_one_rank_by_the_declared_key():
    mode = data_parallel(keep_groups=True)
    assert mode.name == "balanced_groups" and mode.needs == ("groups",) and data_parallel(False).name == "balanced"
    batch = _ragged([9, 9, 1, 1, 5, 5, 3, 3])
    batch.non_tensor_batch["prompt"] = np.array(["a", "a", "b", "b", "c", "c", "d", "d"], dtype=object)
    parts = [mode.split(batch, r, 2, RowKeys("attention_mask", "prompt"))[0] for r in (0, 1)]
    groups = [set(p.non_tensor_batch["prompt"].tolist()) for p in parts]
    assert groups[0].isdisjoint(groups[1]) and groups[0] | groups[1] == {"a", "b", "c", "d"}
    with pytest.raises(DispatchError, match="group_key"):  # no group column declared
        mode.split(batch, 0, 2, RowKeys("attention_mask"))
