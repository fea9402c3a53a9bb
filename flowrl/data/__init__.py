"""flowrl.data: the batch container (DataProto), its futures and field specs.

Imports nothing else from flowrl, and does not start (or import) Ray:
:class:`DataProtoFuture` imports ray only when a future is resolved.

Example::

    >>> import torch
    >>> from flowrl.data import DataProto, Field
    >>> dp = DataProto.from_dict({"responses": torch.zeros(2, 4, dtype=torch.int64)})
    >>> dp.check_fields([Field.parse("responses", "int64[B, R]")])
    []
"""

from flowrl.data.lazy import lazy_exports

#: where each public name lives, imported on first use: the graph layer needs only
#: ``flowrl.data.fields``, so loading and checking a graph does not import torch or tensordict
_HOME = {
    "Field": "flowrl.data.fields",
    "FieldSpecError": "flowrl.data.fields",
    "field": "flowrl.data.fields",
    "DataProtoFuture": "flowrl.data.future",
    "resolve": "flowrl.data.future",
    "AUTO_PADDING_KEY": "flowrl.data.proto",
    "PADDING_SIZE_KEY": "flowrl.data.proto",
    "DataProto": "flowrl.data.proto",
    "DataProtoConfig": "flowrl.data.proto",
    "DataProtoError": "flowrl.data.proto",
    "DataProtoItem": "flowrl.data.proto",
    "collate_fn": "flowrl.data.proto",
    "fold_batch_dim": "flowrl.data.proto",
    "list_of_dict_to_dict_of_list": "flowrl.data.proto",
    "pad_dataproto_to_divisor": "flowrl.data.proto",
    "unfold_batch_dim": "flowrl.data.proto",
    "union_numpy_dict": "flowrl.data.proto",
    "union_tensor_dict": "flowrl.data.proto",
    "unpad_dataproto": "flowrl.data.proto",
    "deserialize_single_tensor": "flowrl.data.serialize",
    "deserialize_tensordict": "flowrl.data.serialize",
    "get_readonly_policy": "flowrl.data.serialize",
    "readonly_policy": "flowrl.data.serialize",
    "serialize_single_tensor": "flowrl.data.serialize",
    "serialize_tensordict": "flowrl.data.serialize",
    "set_readonly_policy": "flowrl.data.serialize",
}
__getattr__, __dir__ = lazy_exports(__name__, _HOME)

__all__ = [
    "AUTO_PADDING_KEY",
    "PADDING_SIZE_KEY",
    "DataProto",
    "DataProtoConfig",
    "DataProtoError",
    "DataProtoFuture",
    "DataProtoItem",
    "Field",
    "FieldSpecError",
    "collate_fn",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "field",
    "fold_batch_dim",
    "get_readonly_policy",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "readonly_policy",
    "resolve",
    "serialize_single_tensor",
    "serialize_tensordict",
    "set_readonly_policy",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]
