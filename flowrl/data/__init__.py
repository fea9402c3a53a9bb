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

from flowrl.data.lazy import lazy_exports

#: where each public name lives, imported on first use: the graph layer needs only
#: ``flowrl.data.fields``, so loading and checking a graph does not import torch or tensordict
_HOME = {
    "DataProtoError": "flowrl.data.columns",
    "list_of_dict_to_dict_of_list": "flowrl.data.columns",
    "union_numpy_dict": "flowrl.data.columns",
    "union_tensor_dict": "flowrl.data.columns",
    "Field": "flowrl.data.fields",
    "FieldSpecError": "flowrl.data.fields",
    "field": "flowrl.data.fields",
    "DataProtoFuture": "flowrl.data.future",
    "resolve": "flowrl.data.future",
    "DataProto": "flowrl.data.proto",
    "collate_fn": "flowrl.data.verl_functions",
    "deserialize_single_tensor": "flowrl.data.serialize",
    "deserialize_tensordict": "flowrl.data.serialize",
    "get_readonly_policy": "flowrl.data.serialize",
    "readonly_policy": "flowrl.data.serialize",
    "serialize_single_tensor": "flowrl.data.serialize",
    "serialize_tensordict": "flowrl.data.serialize",
    "set_readonly_policy": "flowrl.data.serialize",
    "AUTO_PADDING_KEY": "flowrl.data.verl_compat",
    "PADDING_SIZE_KEY": "flowrl.data.verl_compat",
    "DataProtoConfig": "flowrl.data.verl_compat",
    "DataProtoItem": "flowrl.data.verl_compat",
    "fold_batch_dim": "flowrl.data.verl_functions",
    "get_tensordict": "flowrl.data.verl_functions",
    "pad_dataproto_to_divisor": "flowrl.data.verl_functions",
    "unfold_batch_dim": "flowrl.data.verl_functions",
    "unpad_dataproto": "flowrl.data.verl_functions",
}
__getattr__, __dir__ = lazy_exports(__name__, _HOME)

__all__ = list(_HOME)  # every lazily exported name is public
