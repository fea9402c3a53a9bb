"""flowrl.data: the batch container (DataProto), its futures and field specs.

Imports nothing else from flowrl, and does not start (or import) Ray:
:class:`DataProtoFuture` imports ray only when a future is resolved.
``DataProto`` carries verl's whole API; the part flowrl never calls itself
lives in :mod:`flowrl.data.verl_compat`.

Example::

    >>> import torch
    >>> from flowrl.data import DataProto, Field
    >>> dp = DataProto.from_dict({"responses": torch.zeros(2, 4, dtype=torch.int64)})
    >>> dp.check_fields([Field.parse("responses", "int64[B, R]")])
    []
"""

from flowrl.data.columns import (
    DataProtoError,
    list_of_dict_to_dict_of_list,
    union_numpy_dict,
    union_tensor_dict,
)
from flowrl.data.fields import Field, FieldSpecError, field
from flowrl.data.future import DataProtoFuture, resolve
from flowrl.data.proto import DataProto, collate_fn
from flowrl.data.serialize import (
    deserialize_single_tensor,
    deserialize_tensordict,
    get_readonly_policy,
    readonly_policy,
    serialize_single_tensor,
    serialize_tensordict,
    set_readonly_policy,
)
from flowrl.data.verl_compat import (
    AUTO_PADDING_KEY,
    PADDING_SIZE_KEY,
    DataProtoConfig,
    DataProtoItem,
    fold_batch_dim,
    get_tensordict,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unpad_dataproto,
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
    "get_tensordict",
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
