"""Field specs: the typed columns a batch carries and operators read and write.

A :class:`Field` names one column of a :class:`~flowrl.data.DataProto` and says
what it holds: a dtype, a symbolic shape whose first dimension is the batch
(``B``), and a kind — a tensor column, a non-tensor (numpy object) column, or a
``meta_info`` entry. Operators declare the fields they read and write; the graph
checker matches producers against consumers with :meth:`Field.mismatch`, and a
concrete batch is checked against a spec with :meth:`Field.check_value`.

Example::

    >>> responses = Field.parse("responses", "int64[B, R]")
    >>> str(responses)
    'responses: int64[B, R]'
    >>> Field.parse("uid", "object[B]").kind
    'non_tensor'
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal, Union
from flowrl.errors import ConfigError

Kind = Literal["tensor", "non_tensor", "meta"]
Dim = Union[int, str]

#: dtype names a tensor field may declare (torch's names without the prefix).
TENSOR_DTYPES = frozenset(
    {
        "bool", "uint8", "int8", "int16", "int32", "int64",
        "float16", "bfloat16", "float32", "float64", "complex64",
    }
)
#: a dimension or dtype that matches anything
ANY = "*"

_SPEC = re.compile(r"^\s*(?P<dtype>[A-Za-z_][A-Za-z0-9_]*|\*)\s*(?:\[(?P<shape>[^\]]*)\])?\s*$")
_DIM = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*|\d+|\*|\.\.\.)$")


class FieldSpecError(ConfigError, ValueError):
    """A field spec string could not be parsed."""


@dataclass(frozen=True)
class Field:
    """One named column: ``name: dtype[shape]`` of a given kind.

    ``dtype`` is a torch dtype name (``int64``, ``float32``...) for tensors,
    ``object`` for non-tensor columns, ``*`` for anything. ``shape`` is a tuple
    of dims — symbols (``"B"``, ``"R"``), integers, ``"*"`` (any one dim) or
    ``"..."`` (any number of trailing dims) — or ``None`` when unconstrained.
    """

    name: str
    dtype: str = ANY
    shape: tuple[Dim, ...] | None = None
    kind: Kind = "tensor"
    doc: str = ""

    # ------------------------------------------------------------------ build
    @classmethod
    def parse(cls, name: str, spec: str, doc: str = "") -> "Field":
        """Build a field from ``"int64[B, R]"``, ``"object[B]"``, ``"meta"``, ``"*"``.

        The kind follows from the dtype: ``object`` is a non-tensor column,
        ``meta`` a ``meta_info`` entry, anything else a tensor.
        """
        spec = spec.strip()
        if spec == "meta":
            return cls(name=name, dtype=ANY, shape=None, kind="meta", doc=doc)
        m = _SPEC.match(spec)
        if not m:
            raise FieldSpecError(
                f"field {name!r}: cannot parse spec {spec!r}; write it as dtype[dims], "
                f"e.g. 'int64[B, R]', 'object[B]' or 'meta'"
            )
        dtype = m.group("dtype")
        shape: tuple[Dim, ...] | None = None
        if m.group("shape") is not None:
            dims = [d.strip() for d in m.group("shape").split(",") if d.strip()]
            for d in dims:
                if not _DIM.match(d):
                    raise FieldSpecError(f"field {name!r}: bad dimension {d!r} in spec {spec!r}")
            shape = tuple(int(d) if d.isdigit() else d for d in dims)
        kind: Kind = "non_tensor" if dtype == "object" else "tensor"
        if kind == "tensor" and dtype != ANY and dtype not in TENSOR_DTYPES:
            raise FieldSpecError(
                f"field {name!r}: unknown dtype {dtype!r}; use one of "
                f"{', '.join(sorted(TENSOR_DTYPES))}, 'object' or '*'"
            )
        return cls(name=name, dtype=dtype, shape=shape, kind=kind, doc=doc)

    def renamed(self, name: str) -> "Field":
        return replace(self, name=name)

    # ------------------------------------------------------------------ text
    @property
    def spec(self) -> str:
        if self.kind == "meta":
            return "meta"
        if self.shape is None:
            return self.dtype
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    def __str__(self) -> str:
        return f"{self.name}: {self.spec}"

    # ------------------------------------------------------------------ checks
    def mismatch(self, expected: "Field") -> str | None:
        """Why this (produced) field cannot feed a consumer expecting ``expected``.

        Returns ``None`` when compatible. Symbols must agree by name: a producer
        of ``[B, R]`` does not feed a consumer of ``[B, T]``.
        """
        if self.kind != expected.kind:
            return f"kind {self.kind} is produced but {expected.kind} is expected"
        if ANY not in (self.dtype, expected.dtype) and self.dtype != expected.dtype:
            return f"dtype {self.dtype} is produced but {expected.dtype} is expected"
        if self.shape is None or expected.shape is None:
            return None
        if not _shapes_agree(self.shape, expected.shape):
            return (
                f"shape [{', '.join(map(str, self.shape))}] is produced but "
                f"[{', '.join(map(str, expected.shape))}] is expected"
            )
        return None

    def check_value(self, dtype: str, shape: tuple[int, ...] | None, bindings: dict[str, int]) -> str | None:
        """Check a concrete column (``dtype``, ``shape``) against this spec.

        ``bindings`` maps symbols to sizes seen so far and is extended in place,
        so one dict checks a whole batch consistently (every ``B`` the same).
        """
        if ANY != self.dtype != dtype:
            return f"{self.name}: dtype {dtype}, expected {self.dtype}"
        if self.shape is None or shape is None:
            return None
        dims = list(self.shape)
        if "..." in dims:
            head = dims[: dims.index("...")]
            if len(shape) < len(head):
                return f"{self.name}: shape {list(shape)} has fewer than {len(head)} dims ({self.spec})"
            pairs = zip(head, shape)
        else:
            if len(dims) != len(shape):
                return f"{self.name}: shape {list(shape)} has {len(shape)} dims, expected {self.spec}"
            pairs = zip(dims, shape)
        for sym, size in pairs:
            if sym == ANY:
                continue
            if isinstance(sym, int):
                if sym != size:
                    return f"{self.name}: dim of size {size}, expected {sym} ({self.spec})"
                continue
            bound = bindings.setdefault(sym, size)
            if bound != size:
                return f"{self.name}: {sym}={size} but {sym}={bound} elsewhere in the batch ({self.spec})"
        return None


def _shapes_agree(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> bool:
    if "..." in a or "..." in b:
        n = min(
            a.index("...") if "..." in a else len(a),
            b.index("...") if "..." in b else len(b),
        )
        a, b = a[:n], b[:n]
    elif len(a) != len(b):
        return False
    return all(x == y or ANY in (x, y) for x, y in zip(a, b))


def field(spec: str, doc: str = "", name: str = "") -> Field:
    """Shorthand for declarations: ``field("int64[B, R]", "sampled tokens")``."""
    return Field.parse(name, spec, doc)
