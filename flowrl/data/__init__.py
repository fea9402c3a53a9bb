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

from flowrl.data.fields import Field, FieldSpecError, field
from flowrl.data.future import DataProtoFuture, resolve
from flowrl.data.proto import (
    AUTO_PADDING_KEY,
    PADDING_SIZE_KEY,
    DataProto,
    DataProtoConfig,
    DataProtoError,
    DataProtoItem,
    collate_fn,
    fold_batch_dim,
    list_of_dict_to_dict_of_list,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)
from flowrl.data.serialize import (
    deserialize_single_tensor,
    deserialize_tensordict,
    get_readonly_policy,
    readonly_policy,
    serialize_single_tensor,
    serialize_tensordict,
    set_readonly_policy,
)

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
