"""DataProto: every operation asserts values; every error asserts what it says."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from flowrl.data import (
    PADDING_SIZE_KEY,
    DataProto,
    DataProtoConfig,
    DataProtoError,
    DataProtoItem,
    Field,
    collate_fn,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    readonly_policy,
    serialize_single_tensor,
    serialize_tensordict,
    set_readonly_policy,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)


def obj(*values) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def make(n: int = 4, meta: dict | None = None) -> DataProto:
    """n rows: x[i] = [10i, 10i+1, 10i+2], y[i] = i/2, uid[i] = 'u{i}'."""
    x = torch.arange(n * 3).view(n, 3) + torch.arange(n).view(n, 1) * 7
    return DataProto.from_dict(
        tensors={"x": x, "y": torch.arange(n, dtype=torch.float32) / 2},
        non_tensors={"uid": obj(*[f"u{i}" for i in range(n)])},
        meta_info=dict(meta or {"temperature": 1.0}),
    )


def rows(dp: DataProto) -> list[int]:
    """Recover row ids from y (y[i] = i/2)."""
    return [int(v * 2) for v in dp.batch["y"].tolist()]


def uids(dp: DataProto) -> list[str]:
    return dp.non_tensor_batch["uid"].tolist()


def round_trip(dp: DataProto, readonly: bool = False) -> DataProto:
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(dp, protocol=5, buffer_callback=buffers.append)
    if readonly:  # what Ray's object store hands back
        return pickle.loads(blob, buffers=[bytes(b.raw()) for b in buffers])
    return pickle.loads(blob, buffers=buffers)


# ---------------------------------------------------------------------- build
def test_from_dict_builds_columns_and_converts_lists_to_1d_object_arrays():
    dp = DataProto.from_dict(
        tensors={"a": torch.tensor([[1, 2], [3, 4]])},
        non_tensors={"tokens": [[1, 2], [3, 4]], "tag": ("p", "q")},
        meta_info={"k": 3},
    )
    assert len(dp) == 2
    assert dp.batch["a"].tolist() == [[1, 2], [3, 4]]
    # a list per row stays one element per row (numpy would make a 2-D array)
    assert dp.non_tensor_batch["tokens"].shape == (2,)
    assert dp.non_tensor_batch["tokens"][1] == [3, 4]
    assert dp.non_tensor_batch["tag"].dtype == object
    assert dp.meta_info == {"k": 3}


def test_from_single_dict_routes_tensors_and_arrays():
    dp = DataProto.from_single_dict({"a": torch.zeros(3, 2), "uid": obj("x", "y", "z")}, meta_info={"m": 1})
    assert list(dp.batch.keys()) == ["a"]
    assert uids(dp) == ["x", "y", "z"]
    assert dp.meta_info == {"m": 1}


def test_from_single_dict_rejects_lists_with_a_fix():
    with pytest.raises(DataProtoError, match=r"'uid' is a list.*np.array\(values, dtype=object\)"):
        DataProto.from_single_dict({"a": torch.zeros(2), "uid": ["x", "y"]})


def test_from_dict_names_columns_whose_lengths_differ():
    with pytest.raises(DataProtoError, match=r"'a' has 3 rows, 'b' has 2"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(2)})


def test_from_dict_rejects_scalars_and_extra_batch_dims():
    with pytest.raises(DataProtoError, match=r"tensors\['s'\] is a scalar.*meta_info"):
        DataProto.from_dict({"a": torch.zeros(2), "s": torch.tensor(1.0)})
    with pytest.raises(DataProtoError, match="num_batch_dims=2 is not supported.*fold_batch_dim"):
        DataProto.from_dict({"a": torch.zeros(2, 2)}, num_batch_dims=2)


def test_non_tensor_column_must_be_an_object_array():
    with pytest.raises(DataProtoError, match=r"non_tensor_batch\['uid'\] is a list"):
        DataProto(non_tensor_batch={"uid": ["a", "b"]})
    with pytest.raises(DataProtoError, match=r"non_tensor_batch\['uid'\] has dtype <U1.*dtype=object"):
        DataProto(non_tensor_batch={"uid": np.array(["a", "b"])})
    with pytest.raises(AssertionError, match=r"non_tensor_batch\['uid'\] has dtype \|S1"):  # verl's type, too
        DataProto(non_tensor_batch={"uid": np.array([b"a", b"b"])})


def test_numeric_non_tensor_columns_are_accepted_as_in_verl():
    dp = DataProto.from_dict({"x": torch.arange(3)}, {"num_turns": np.array([1, 3, 2], dtype=np.int32)})
    assert dp[1:].non_tensor_batch["num_turns"].tolist() == [3, 2]
    assert DataProto.concat([dp, dp]).non_tensor_batch["num_turns"].dtype == np.int32
    back = pickle.loads(pickle.dumps(dp, protocol=5))
    assert back.non_tensor_batch["num_turns"].tolist() == [1, 3, 2]


def test_mismatched_column_lengths_name_key_and_sizes():
    batch = TensorDict({"a": torch.zeros(4)}, batch_size=[4])
    with pytest.raises(DataProtoError, match=r"non_tensor_batch\['uid'\] has 3 rows but the tensor batch has 4"):
        DataProto(batch=batch, non_tensor_batch={"uid": obj("a", "b", "c")})
    with pytest.raises(DataProtoError, match=r"non_tensor_batch\['v'\] has 2 rows but non_tensor_batch\['u'\] has 1"):
        DataProto(non_tensor_batch={"u": obj("a"), "v": obj("a", "b")})


def test_batch_must_have_one_batch_dim_and_keys_one_home():
    with pytest.raises(DataProtoError, match=r"exactly one batch dimension; got batch_size \[2, 3\]"):
        DataProto(batch=TensorDict({"a": torch.zeros(2, 3)}, batch_size=[2, 3]))
    with pytest.raises(DataProtoError, match="'a' is both a tensor and a non-tensor column"):
        DataProto(batch=TensorDict({"a": torch.zeros(2)}, batch_size=[2]), non_tensor_batch={"a": obj(1, 2)})


def test_check_consistency_catches_direct_mutation():
    dp = make(2)
    dp.non_tensor_batch["score"] = np.array([1, 2, 3], dtype=object)
    with pytest.raises(DataProtoError, match=r"'score'\] has 3 rows but the tensor batch has 2"):
        dp.check_consistency()


def test_len_of_tensor_only_non_tensor_only_and_empty():
    assert len(make(5)) == 5
    assert len(DataProto(non_tensor_batch={"u": obj("a", "b")})) == 2
    assert len(DataProto()) == 0


# ---------------------------------------------------------------------- indexing
def test_int_index_returns_a_row_item_like_verl():
    dp = make(4)
    item = dp[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["x"].tolist() == dp.batch["x"][2].tolist()
    assert item.non_tensor_batch == {"uid": "u2"}
    assert item.meta_info == {"temperature": 1.0}
    assert dp[-1].non_tensor_batch["uid"] == "u3"
    assert dp[np.int64(1)].non_tensor_batch["uid"] == "u1"
    with pytest.raises(IndexError, match="row 4 is out of range for a DataProto of 4 rows"):
        dp[4]
    assert [it.non_tensor_batch["uid"] for it in dp] == ["u0", "u1", "u2", "u3"]


def test_slice_returns_views():
    dp = make(6)
    part = dp[1:6:2]
    assert rows(part) == [1, 3, 5] and uids(part) == ["u1", "u3", "u5"]
    assert dp[4:].batch["x"].data_ptr() == dp.batch["x"][4].data_ptr()
    assert len(dp[10:]) == 0


@pytest.mark.parametrize(
    "index",
    [[3, 0, 3], np.array([3, 0, 3]), torch.tensor([3, 0, 3]), torch.tensor([-1, 0, -1], dtype=torch.int32)],
    ids=["list", "ndarray", "tensor", "negative-int32"],
)
def test_index_arrays_select_rows_in_order(index):
    dp = make(4)
    out = dp[index]
    assert rows(out) == [3, 0, 3]
    assert uids(out) == ["u3", "u0", "u3"]
    assert out.batch["x"].tolist() == [dp.batch["x"][i].tolist() for i in (3, 0, 3)]


@pytest.mark.parametrize(
    "mask",
    [[True, False, True, False], np.array([1, 0, 1, 0], dtype=bool), torch.tensor([True, False, True, False])],
    ids=["list", "ndarray", "tensor"],
)
def test_boolean_mask_keeps_true_rows(mask):
    out = make(4)[mask]
    assert rows(out) == [0, 2] and uids(out) == ["u0", "u2"]


def test_index_errors_say_what_is_wrong():
    dp = make(4)
    with pytest.raises(DataProtoError, match=r"boolean mask has shape \[3\] but the DataProto has 4 rows"):
        dp[torch.tensor([True, False, True])]
    with pytest.raises(DataProtoError, match="row index 7 is out of range for a DataProto of 4 rows"):
        dp[[0, 7]]
    with pytest.raises(DataProtoError, match="row index -5 is out of range"):
        dp.select_idxs([-5])
    with pytest.raises(DataProtoError, match="1-D integer or boolean"):
        dp[torch.tensor([0.0, 1.0])]
    with pytest.raises(TypeError, match="cannot index a DataProto with float"):
        dp[1.5]


def test_column_name_index_returns_the_column():
    dp = make(3)
    assert dp["x"] is dp.batch["x"]
    assert dp["uid"].tolist() == ["u0", "u1", "u2"]
    with pytest.raises(KeyError, match="no column 'nope' in this DataProto; it has: x, y, uid"):
        dp["nope"]
    assert "x" in dp and "uid" in dp and "temperature" not in dp and "nope" not in dp


def test_select_idxs_on_a_non_tensor_only_batch():
    dp = DataProto(non_tensor_batch={"u": obj("a", "b", "c")})
    assert dp.select_idxs([2, 0]).non_tensor_batch["u"].tolist() == ["c", "a"]


# ---------------------------------------------------------------------- select / pop / union / rename
def test_select_keeps_only_the_keys_and_shares_storage():
    dp = make(3, meta={"a": 1, "b": 2})
    out = dp.select(batch_keys=["x"], non_tensor_batch_keys=[], meta_info_keys=["b"])
    assert list(out.batch.keys()) == ["x"]
    assert out.non_tensor_batch == {}
    assert out.meta_info == {"b": 2}
    assert out.batch["x"].data_ptr() == dp.batch["x"].data_ptr()
    everything = dp.select()
    everything.batch["z"] = torch.zeros(3)  # a new container: the source is untouched
    assert "z" not in dp.batch.keys()


def test_select_deepcopy_copies_non_tensor_and_meta():
    dp = make(2, meta={"cfg": {"k": [1]}})
    out = dp.select(deepcopy=True)
    assert out.non_tensor_batch["uid"] is not dp.non_tensor_batch["uid"]
    out.meta_info["cfg"]["k"].append(2)
    assert dp.meta_info["cfg"] == {"k": [1]}


def test_select_unknown_keys_name_them_and_the_available_ones():
    dp = make(2)
    with pytest.raises(DataProtoError, match=r"select: unknown batch key\(s\) 'nope'; available: 'x', 'y'"):
        dp.select(batch_keys=["x", "nope"])
    with pytest.raises(DataProtoError, match=r"unknown non_tensor_batch key\(s\) 'ids'; available: 'uid'"):
        dp.select(non_tensor_batch_keys=["ids"])
    with pytest.raises(DataProtoError, match=r"unknown meta_info key\(s\) 'lr'; available: 'temperature'"):
        dp.select(meta_info_keys=["lr"])


def test_pop_moves_keys_out_without_copying():
    dp = make(3, meta={"a": 1, "b": 2})
    x_ptr = dp.batch["x"].data_ptr()
    popped = dp.pop(batch_keys=["x"], non_tensor_batch_keys=["uid"], meta_info_keys=["a"])
    assert list(popped.batch.keys()) == ["x"] and popped.batch["x"].data_ptr() == x_ptr
    assert uids(popped) == ["u0", "u1", "u2"] and popped.meta_info == {"a": 1}
    assert list(dp.batch.keys()) == ["y"] and dp.non_tensor_batch == {} and dp.meta_info == {"b": 2}


def test_pop_unknown_key_removes_nothing():
    dp = make(2)
    with pytest.raises(DataProtoError, match=r"pop: unknown batch key\(s\) 'nope'"):
        dp.pop(batch_keys=["x", "nope"])
    assert sorted(dp.batch.keys()) == ["x", "y"]


def test_union_merges_in_place_and_shares_storage():
    dp = make(3)
    left = dp.select(batch_keys=["x"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    right = dp.select(batch_keys=["y"], non_tensor_batch_keys=[])
    right.meta_info["step"] = 7
    out = left.union(right)
    assert out is left
    assert sorted(out.batch.keys()) == ["x", "y"]
    assert out.batch["y"].data_ptr() == dp.batch["y"].data_ptr()
    assert out.meta_info == {"temperature": 1.0, "step": 7}


def test_union_accepts_equal_values_under_the_same_key():
    a, b = make(3), make(3)  # equal values, different memory
    out = a.union(b)
    assert sorted(out.batch.keys()) == ["x", "y"] and uids(out) == ["u0", "u1", "u2"]


def test_union_conflicts_name_the_key():
    a = make(2)
    b = make(2)
    b.batch["x"] = b.batch["x"] + 1
    with pytest.raises(DataProtoError, match=r"union: column 'x' differs between the two batches \(int64\[2, 3\]"):
        make(2).union(b)
    c = make(2)
    c.non_tensor_batch["uid"] = obj("u0", "other")
    with pytest.raises(DataProtoError, match="union: non-tensor column 'uid' differs"):
        a.union(c)
    with pytest.raises(DataProtoError, match=r"union: meta_info\['temperature'\] differs: 1.0 vs 0.5"):
        make(2).union(make(2, meta={"temperature": 0.5}))
    with pytest.raises(DataProtoError, match="union: batch sizes differ: 2 rows vs 3 rows"):
        make(2).union(make(3))
    d = DataProto(non_tensor_batch={"x": obj(1, 2)})
    with pytest.raises(DataProtoError, match="'x' is a tensor on one side and a non-tensor column on the other"):
        make(2).union(d)


def test_union_helpers_follow_verl():
    td = TensorDict({"a": torch.zeros(2)}, batch_size=[2])
    merged = union_tensor_dict(td, TensorDict({"b": torch.ones(2)}, batch_size=[2]))
    assert merged is td and merged["b"].tolist() == [1.0, 1.0]
    with pytest.raises(DataProtoError, match="column 'a' differs"):
        union_tensor_dict(td, TensorDict({"a": torch.ones(2)}, batch_size=[2]))
    with pytest.raises(DataProtoError, match=r"batch sizes differ: \[2\] vs \[3\]"):
        union_tensor_dict(td, TensorDict({"c": torch.ones(3)}, batch_size=[3]))
    # NaN equals NaN, nested containers compare by value
    first = {"s": obj(float("nan"), {"k": [1]})}
    assert union_numpy_dict(first, {"s": obj(float("nan"), {"k": [1]}), "t": obj(1, 2)})["t"].tolist() == [1, 2]
    with pytest.raises(DataProtoError, match="non-tensor column 's' differs"):
        union_numpy_dict(first, {"s": obj(1.0, {"k": [1]})})


def test_rename_tensor_and_non_tensor_columns():
    dp = make(2)
    assert dp.rename(["x", "uid"], ["input_ids", "prompt_uid"]) is dp
    assert sorted(dp.batch.keys()) == ["input_ids", "y"]
    assert dp.non_tensor_batch["prompt_uid"].tolist() == ["u0", "u1"]
    with pytest.raises(DataProtoError, match=r"rename: unknown column\(s\) 'nope'"):
        dp.rename("nope", "z")
    with pytest.raises(DataProtoError, match="rename: 'y' already exist"):
        dp.rename("input_ids", "y")
    with pytest.raises(DataProtoError, match=r"1 old key\(s\) \['y'\] but 2 new key\(s\)"):
        dp.rename(["y"], ["a", "b"])


# ---------------------------------------------------------------------- split & merge
def test_concat_joins_rows_and_merges_meta():
    a, b = make(2, meta={"t": 1, "metrics": {"loss": 0.5}}), make(3, meta={"t": 1, "metrics": {"loss": 0.25}})
    out = DataProto.concat([a, b])
    assert rows(out) == [0, 1, 0, 1, 2]
    assert uids(out) == ["u0", "u1", "u0", "u1", "u2"]
    assert out.meta_info == {"t": 1, "metrics": {"loss": [0.5, 0.25]}}


def test_concat_errors_name_parts_and_keys():
    with pytest.raises(DataProtoError, match="concat: got an empty list"):
        DataProto.concat([])
    with pytest.raises(DataProtoError, match=r"part 1 has tensor keys \['x'\] but part 0 has \['x', 'y'\]"):
        DataProto.concat([make(2), make(2).select(batch_keys=["x"])])
    with pytest.raises(DataProtoError, match=r"part 1 has non-tensor keys \[\] but part 0 has \['uid'\]"):
        DataProto.concat([make(2), make(2).select(non_tensor_batch_keys=[])])
    with pytest.raises(DataProtoError, match=r"meta_info\['temperature'\] differs between parts: 1.0 vs 2.0"):
        DataProto.concat([make(2), make(2, meta={"temperature": 2.0})])


def test_chunk_splits_into_equal_views():
    dp = make(6)
    parts = dp.chunk(3)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [uids(p) for p in parts] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    assert parts[1].batch["x"].data_ptr() == dp.batch["x"][2].data_ptr()
    assert all(p.meta_info == {"temperature": 1.0} for p in parts)


def test_chunk_non_divisible_without_padding_says_how_to_fix():
    with pytest.raises(DataProtoError, match=r"cannot split 5 rows into 2 equal chunks \(5 % 2 = 1\).*pad_dataproto_to_divisor"):
        make(5).chunk(2)
    with pytest.raises(DataProtoError, match="chunks must be a positive int, got 0"):
        make(4).chunk(0)


def test_chunk_with_auto_padding_pads_with_leading_rows_and_unpads():
    dp = DataProto.from_dict({"y": torch.arange(5.0)}, {"uid": obj(*"abcde")}, auto_padding=True)
    assert dp.is_padding_enabled()
    parts = dp.chunk(4)
    assert [p.non_tensor_batch["uid"].tolist() for p in parts] == [["a", "b"], ["c", "d"], ["e", "a"], ["b", "c"]]
    assert all(p.meta_info[PADDING_SIZE_KEY] == 3 for p in parts)
    restored = unpad_dataproto(DataProto.concat(parts))
    assert restored.batch["y"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert PADDING_SIZE_KEY not in restored.meta_info


def test_global_auto_padding_switch():
    previous = DataProtoConfig.auto_padding
    DataProtoConfig.auto_padding = True
    try:
        assert [len(p) for p in make(3).chunk(2)] == [2, 2]
    finally:
        DataProtoConfig.auto_padding = previous
    with pytest.raises(DataProtoError, match="must be a bool"):
        DataProtoConfig.auto_padding = "yes"


def test_pad_to_divisor_wraps_around_and_unpad_by_count():
    padded, pad = pad_dataproto_to_divisor(make(2), 5)
    assert pad == 3 and rows(padded) == [0, 1, 0, 1, 0]
    assert rows(unpad_dataproto(padded, pad)) == [0, 1]
    same, zero = pad_dataproto_to_divisor(make(4), 2)
    assert zero == 0 and same.batch is not None and len(same) == 4


def test_padding_method_appends_first_or_last_row_in_place():
    dp = make(3)
    dp.padding(2, padding_candidate="first")
    assert rows(dp) == [0, 1, 2, 0, 0]
    dp = make(3)
    dp.padding(1)
    assert uids(dp) == ["u0", "u1", "u2", "u2"]


def test_split_gives_consecutive_parts_last_shorter():
    parts = make(5).split(2)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3], [4]]
    assert [uids(p) for p in parts][-1] == ["u4"]
    with pytest.raises(DataProtoError, match="split_size must be a positive int"):
        make(2).split(0)


def test_repeat_interleaved_and_tiled():
    dp = make(2)
    inter = dp.repeat(3, interleave=True)
    assert rows(inter) == [0, 0, 0, 1, 1, 1] and uids(inter) == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert inter.batch["x"][4].tolist() == dp.batch["x"][1].tolist()
    tiled = dp.repeat(2, interleave=False)
    assert rows(tiled) == [0, 1, 0, 1] and uids(tiled) == ["u0", "u1", "u0", "u1"]
    with pytest.raises(DataProtoError, match="repeat_times must be a positive int"):
        dp.repeat(0)


def test_sample_level_repeat_uses_one_count_per_row():
    out = make(3).sample_level_repeat(torch.tensor([2, 0, 1]))
    assert rows(out) == [0, 0, 2] and uids(out) == ["u0", "u0", "u2"]
    with pytest.raises(DataProtoError, match=r"need one count per row \(3\), got shape \[2\]"):
        make(3).sample_level_repeat([1, 1])


def test_reorder_permutes_in_place():
    dp = make(3)
    dp.reorder(torch.tensor([2, 0, 1]))
    assert rows(dp) == [2, 0, 1] and uids(dp) == ["u2", "u0", "u1"]


def test_make_iterator_in_order_over_epochs():
    dp = make(4, meta={"m": 1})
    batches = list(dp.make_iterator(mini_batch_size=2, epochs=2))
    assert [rows(b) for b in batches] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert all(b.meta_info is dp.meta_info for b in batches)


def test_make_iterator_shuffles_like_a_seeded_dataloader():
    dp = make(6)
    got = [rows(b) for b in dp.make_iterator(3, epochs=2, seed=7, dataloader_kwargs={"shuffle": True})]
    loader = torch.utils.data.DataLoader(range(6), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(7))
    expected = [b.tolist() for _ in range(2) for b in loader]
    assert got == expected


def test_make_iterator_errors():
    with pytest.raises(DataProtoError, match="5 rows do not split into mini-batches of 2"):
        make(5).make_iterator(2, epochs=1)
    with pytest.raises(DataProtoError, match=r"unsupported dataloader_kwargs \['sampler'\]"):
        make(4).make_iterator(2, epochs=1, dataloader_kwargs={"sampler": None})


def test_fold_and_unfold_batch_dim():
    dp = make(6)
    folded = fold_batch_dim(dp, 2)
    assert len(folded) == 2
    assert folded.batch["y"].tolist() == [[0.0, 0.5, 1.0], [1.5, 2.0, 2.5]]
    assert folded.batch["x"].shape == (2, 3, 3)
    assert folded.non_tensor_batch["uid"].tolist() == [["u0", "u1", "u2"], ["u3", "u4", "u5"]]
    back = unfold_batch_dim(folded, batch_dims=2)
    assert rows(back) == [0, 1, 2, 3, 4, 5] and uids(back) == [f"u{i}" for i in range(6)]
    assert torch.equal(back.batch["x"], dp.batch["x"])
    with pytest.raises(DataProtoError, match="6 rows do not fold into 4 groups"):
        fold_batch_dim(dp, 4)


def test_to_and_from_tensordict():
    dp = make(3, meta={"t": 0.7})
    td = dp.to_tensordict()
    assert td.batch_size == torch.Size([3])
    back = DataProto.from_tensordict(td)
    assert rows(back) == [0, 1, 2] and uids(back) == ["u0", "u1", "u2"]
    assert back.meta_info == {"t": 0.7}
    clash = make(2)
    clash.meta_info["x"] = 1
    with pytest.raises(DataProtoError, match="meta_info key 'x' collides with a column"):
        clash.to_tensordict()


def test_collate_fn_stacks_items():
    dp = make(3)
    out = collate_fn([dp[2], dp[0]])
    assert rows(out) == [2, 0] and uids(out) == ["u2", "u0"]


def test_to_device_is_in_place():
    dp = make(2)
    assert dp.to("cpu") is dp
    assert dp.batch.device == torch.device("cpu")


# ---------------------------------------------------------------------- fields
def test_fields_are_concrete():
    dp = make(4, meta={"temperature": 1.0})
    dp.batch["h"] = torch.zeros(4, 2, dtype=torch.bfloat16)
    assert dp.fields() == {
        "x": Field("x", "int64", (4, 3), "tensor"),
        "y": Field("y", "float32", (4,), "tensor"),
        "h": Field("h", "bfloat16", (4, 2), "tensor"),
        "uid": Field("uid", "object", (4,), "non_tensor"),
        "temperature": Field("temperature", "*", None, "meta"),
    }


def test_check_fields_reports_every_problem():
    dp = make(4)
    dp.batch["mask"] = torch.ones(4, 5)
    specs = [
        Field.parse("x", "int64[B, R]"),
        Field.parse("mask", "float32[B, R]"),   # R=5 vs R=3
        Field.parse("y", "int64[B]"),            # wrong dtype
        Field.parse("uid", "int64[B]"),          # a non-tensor column where a tensor is expected
        Field.parse("scores", "float32[B]"),     # missing
        Field.parse("temperature", "meta"),      # present
        Field.parse("lr", "meta"),               # missing meta
    ]
    assert dp.check_fields(specs) == [
        "mask: R=5 but R=3 elsewhere in the batch (float32[B, R])",
        "y: dtype float32, expected int64",
        "uid: is a non_tensor column (object[4]) but a tensor column (int64[B]) is expected",
        "missing tensor column 'scores' (float32[B]); the batch has mask, uid, x, y",
        "missing meta_info key 'lr' (meta); the batch has mask, uid, x, y",
    ]
    assert dp.check_fields([Field.parse("x", "int64[B, 3]"), Field.parse("uid", "object[B]")]) == []


def test_check_fields_bindings_are_shared_across_calls():
    bindings: dict[str, int] = {}
    assert make(4).check_fields([Field.parse("y", "float32[B]")], bindings) == []
    assert bindings == {"B": 4}
    assert make(3).check_fields([Field.parse("y", "float32[B]")], bindings) == [
        "y: B=3 but B=4 elsewhere in the batch (float32[B])"
    ]


def test_repr_shows_fields_dtypes_shapes_and_meta():
    text = repr(make(4))
    assert "DataProto(rows=4" in text
    assert "x: int64[4, 3]" in text and "y: float32[4]" in text
    assert "uid: object[4]" in text
    assert "temperature: float" in text
    assert make(2).get_data_info() == repr(make(2))


# ---------------------------------------------------------------------- serialisation
def full_batch() -> DataProto:
    """Every dtype that matters, a non-contiguous column, objects and meta."""
    base = torch.arange(24).view(4, 6)
    return DataProto.from_dict(
        tensors={
            "ids": base.clone(),
            "strided": base[:, ::2],  # non-contiguous
            "bf16": (torch.arange(4) / 4).to(torch.bfloat16),
            "half": torch.tensor([0.5, 1.5, -2.0, 4.0], dtype=torch.float16),
            "flags": torch.tensor([True, False, True, True]),
            "c": torch.tensor([1 + 2j, 0j, 3j, -1 + 0j], dtype=torch.complex64),
        },
        non_tensors={"uid": obj("a", "b", "c", "d"), "info": obj({"i": 0}, {"i": 1}, [2], None)},
        meta_info={"temperature": 0.7, "metrics": {"x": 1}},
    )


def assert_same(a: DataProto, b: DataProto) -> None:
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for key in a.batch.keys():
        assert a.batch[key].dtype == b.batch[key].dtype, key
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert a.non_tensor_batch.keys() == b.non_tensor_batch.keys()
    for key in a.non_tensor_batch:
        assert a.non_tensor_batch[key].tolist() == b.non_tensor_batch[key].tolist(), key
    assert a.meta_info == b.meta_info


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_plain_pickle_round_trips_every_dtype(protocol):
    dp = full_batch()
    back = pickle.loads(pickle.dumps(dp, protocol=protocol))
    assert_same(dp, back)
    back.batch["ids"].add_(1)  # in-band pickles own their memory
    assert dp.batch["ids"][0, 0].item() == 0


def test_protocol5_sends_tensors_out_of_band_without_copying():
    dp = full_batch()
    buffers: list[pickle.PickleBuffer] = []
    blob = pickle.dumps(dp, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 6  # one per tensor, none of the bytes in the pickle stream
    assert len(blob) < 2000
    back = pickle.loads(blob, buffers=buffers)
    assert_same(dp, back)
    assert back.batch["ids"].data_ptr() == dp.batch["ids"].data_ptr()  # zero-copy
    assert back.readonly_keys == []  # the sender's buffers are writable


def test_read_only_buffers_are_views_by_default_and_to_writable_copies():
    dp = full_batch()
    back = round_trip(dp, readonly=True)
    assert_same(dp, back)
    assert sorted(back.readonly_keys) == sorted(dp.batch.keys())
    assert "read-only (call to_writable())" in repr(back)
    ptr = back.batch["ids"].data_ptr()
    # views survive row-preserving operations; new memory does not carry the mark
    assert back[1:3].readonly_keys and back.select(batch_keys=["ids"]).readonly_keys == ["ids"]
    assert back.repeat(2).readonly_keys == []
    assert back.to_writable() is back
    assert back.readonly_keys == [] and back.batch["ids"].data_ptr() != ptr
    back.batch["ids"].add_(1)
    assert back.batch["ids"][0].tolist() == [1, 2, 3, 4, 5, 6]


def test_copy_policy_gives_private_writable_tensors():
    dp = full_batch()
    with readonly_policy("copy"):
        back = round_trip(dp, readonly=True)
    assert back.readonly_keys == []
    assert_same(dp, back)
    with pytest.raises(ValueError, match="unknown read-only policy 'mmap'"):
        set_readonly_policy("mmap")


def test_torch_save_copy_and_deepcopy():
    dp = full_batch()
    buffer = io.BytesIO()
    torch.save(dp, buffer)
    buffer.seek(0)
    assert_same(dp, torch.load(buffer, weights_only=False))
    shallow = copy.copy(dp)
    assert shallow.batch["ids"].data_ptr() == dp.batch["ids"].data_ptr()
    shallow.batch["new"] = torch.zeros(4)
    assert "new" not in dp.batch.keys()
    deep = copy.deepcopy(dp)
    assert_same(dp, deep)
    assert deep.batch["ids"].data_ptr() != dp.batch["ids"].data_ptr()


def test_save_and_load_from_disk(tmp_path):
    dp = full_batch()
    path = tmp_path / "batch.pkl"
    dp.save_to_disk(path)
    assert_same(dp, DataProto.load_from_disk(path))
    other = tmp_path / "other.pkl"
    other.write_bytes(pickle.dumps({"not": "a batch"}))
    with pytest.raises(DataProtoError, match="holds a dict, not a DataProto"):
        DataProto.load_from_disk(other)


def test_batchless_and_empty_protos_pickle():
    only_objects = DataProto(non_tensor_batch={"u": obj("a")}, meta_info={"k": 1})
    back = round_trip(only_objects)
    assert back.batch is None and back.non_tensor_batch["u"].tolist() == ["a"] and back.meta_info == {"k": 1}
    assert len(round_trip(DataProto())) == 0


def test_tensor_serialisers_handle_bfloat16_and_non_contiguous():
    t = torch.arange(12, dtype=torch.bfloat16).view(3, 4).t()
    dtype, shape, data = serialize_single_tensor(t)
    assert (dtype, shape, data.dtype, data.size) == ("bfloat16", (4, 3), np.uint8, 24)
    back = deserialize_single_tensor((dtype, shape, bytes(data)))
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    # a contiguous tensor is encoded as a view of its own memory
    c = torch.arange(4)
    assert serialize_single_tensor(c)[2].ctypes.data == c.data_ptr()


def test_tensordict_serialisers_round_trip_nested_jagged_tensors():
    nested = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)], layout=torch.jagged)
    td = TensorDict({"x": torch.ones(2, 3), "ragged": nested}, batch_size=[2])
    back = deserialize_tensordict(pickle.loads(pickle.dumps(serialize_tensordict(td))))
    assert back.batch_size == torch.Size([2])
    assert back["x"].tolist() == [[1.0] * 3] * 2
    assert [row.tolist() for row in back["ragged"].unbind()] == [[0, 1], [0, 1, 2]]
    dp = DataProto(batch=td)
    assert dp.fields()["ragged"] == Field("ragged", "int64", (2, "*"), "tensor")


def test_nested_tensordicts_round_trip_under_their_path():
    inner = TensorDict({"a": torch.tensor([1, 2])}, batch_size=[2])
    dp = DataProto(batch=TensorDict({"x": torch.zeros(2), "sub": inner}, batch_size=[2]))
    back = round_trip(dp, readonly=True)
    assert back.batch["sub", "a"].tolist() == [1, 2]
    assert sorted(back.fields()) == ["sub.a", "x"]


def test_non_tensor_values_in_the_batch_are_rejected_when_pickling():
    td = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    td["text"] = "hello"  # tensordict wraps it as NonTensorData
    with pytest.raises(TypeError, match=r"batch\['text'\].*put other values in non_tensor_batch"):
        pickle.dumps(DataProto(batch=td))


# ---------------------------------------------------------------------- verl parity
def plain(dp) -> dict:
    """Any DataProto (flowrl or verl) as plain lists, to compare the two."""
    out = {k: dp.batch[k].tolist() for k in sorted(dp.batch.keys())} if dp.batch is not None else {}
    out.update({k: dp.non_tensor_batch[k].tolist() for k in sorted(dp.non_tensor_batch)})
    return out


def test_same_results_as_verl():
    verl = pytest.importorskip("verl.protocol", reason="verl not installed: parity with verl/protocol.py unchecked")

    def build(cls):
        return cls.from_dict(
            tensors={"x": torch.arange(24).view(6, 4), "y": torch.arange(6.0)},
            non_tensors={"uid": obj(*[f"u{i}" for i in range(6)])},
            meta_info={"t": 1},
        )

    for name, op in {
        "index list": lambda d: d[[5, 0, 5]],
        "bool mask": lambda d: d[torch.tensor([True, False] * 3)],
        "slice": lambda d: d[1:5:2],
        "repeat interleave": lambda d: d.repeat(2, interleave=True),
        "repeat tiled": lambda d: d.repeat(3, interleave=False),
        "sample_level_repeat": lambda d: d.sample_level_repeat([0, 1, 2, 0, 1, 3]),
        "select": lambda d: d.select(batch_keys=["y"], non_tensor_batch_keys=["uid"]),
        "pop": lambda d: d.pop(batch_keys=["x"]),
        "union": lambda d: d.select(batch_keys=["x"]).union(d.select(batch_keys=["y"], non_tensor_batch_keys=[])),
        "concat of chunks": lambda d: type(d).concat(d.chunk(3)[::-1]),
    }.items():
        # a fresh batch per case: some verl operations mutate their input
        assert plain(op(build(DataProto))) == plain(op(build(verl.DataProto))), name

    ours, theirs = build(DataProto), build(verl.DataProto)
    assert plain(unfold_batch_dim(fold_batch_dim(ours, 3))) == plain(verl.unfold_batch_dim(verl.fold_batch_dim(theirs, 3)))
    ours, theirs = build(DataProto), build(verl.DataProto)
    assert plain(pad_dataproto_to_divisor(ours, 4)[0]) == plain(verl.pad_dataproto_to_divisor(theirs, 4)[0])
    assert [plain(c) for c in ours.chunk(2)] == [plain(c) for c in theirs.chunk(2)]
    assert [plain(c) for c in ours.split(4)] == [plain(c) for c in theirs.split(4)]
    assert ours[2].non_tensor_batch == theirs[2].non_tensor_batch
    assert ours[2].batch["x"].tolist() == theirs[2].batch["x"].tolist()
    shuffle = {"shuffle": True}
    assert [plain(b) for b in ours.make_iterator(3, 2, seed=5, dataloader_kwargs=shuffle)] == [
        plain(b) for b in theirs.make_iterator(3, 2, seed=5, dataloader_kwargs=shuffle)
    ]
    assert plain(DataProto.from_tensordict(theirs.to_tensordict())) == plain(ours)
