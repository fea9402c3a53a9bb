"""Sharding a model over a pool's ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each decoder layer is one FSDP unit and the root module another (it owns the
embeddings, the final norm and the head, so tied input/output embeddings stay
one parameter). Every function takes the pool's group — anything with
``rank``, ``world_size``, ``mesh``, ``broadcast``, ``all_reduce`` and
``guard`` (``flowrl.runtime.distributed.PoolGroup`` is one) — and on a pool of
one leaves the model as it is, so the caller writes one code path.

- :func:`shard_model`: rank 0's weights broadcast to every rank, then sharded;
  gradients are reduced with SUM (the loss carries the global normaliser).
- :func:`build_sharded`: the same, but only rank 0 ever builds the full model.
- :func:`full_state_dict`: the full weights, gathered by all ranks, kept on rank 0.
- :func:`full_tensor`: one tensor whole (a shard gathered by all ranks, on each).
- :func:`unsharded`: full parameters inside a block (a colocated rollout), sharded after.
- :func:`state_bytes`: what this rank holds of parameters and optimizer state.

Example (on every rank of a 2-worker pool)::

    model, tok = load_model("builtin:tiny", seed=0)
    model = shard_model(model, group)
    opt, sched = build_optimizer(model.parameters(), {"lr": 1e-4})
    with unsharded(model, group) as memory:          # rollout on full weights
        out = model.generate(ids, max_new_tokens=8)
    weights = full_state_dict(model, group)          # dict on rank 0, None elsewhere
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Protocol

import torch

# torch.distributed's FSDP, DTensor and checkpoint modules take a second or more to import:
# imported where a model is sharded or its state gathered, never to declare operators
# (``flowrl validate``) or to run a single process
if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


class Group(Protocol):
    """The collectives this module needs from a pool's process group."""

    rank: int
    world_size: int

    @property
    def mesh(self) -> Any: ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0, name: str = ...) -> torch.Tensor: ...

    def all_reduce(self, tensor: torch.Tensor, name: str = ..., op: str = ...) -> torch.Tensor: ...

    def barrier(self, name: str = ...) -> None: ...

    def guard(self, name: str) -> ContextManager[None]: ...


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a transformers model (or of a wrapper holding one).

    Found by the classes the model itself declares unsplittable
    (``_no_split_modules``: ``LlamaDecoderLayer``, ``Qwen2DecoderLayer``...).
    """
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (no _no_split_modules); "
                         f"FSDP2 needs one unit per layer to shard it")
    return layers


def shard_model(model: torch.nn.Module, group: Group, *, reshard_after_forward: bool = True) -> torch.nn.Module:
    """Make every rank's weights rank 0's, then shard ``model`` in place over ``group.mesh``.

    For a model every rank has loaded in full (from a directory). Returns the
    same module (now an ``FSDPModule``); build the optimizer after this, over
    its (sharded) parameters. Gradients are summed across ranks, not averaged:
    normalise the loss by the global token count
    (:class:`operators.models.data_parallel.LossNorm`).
    """
    if group.world_size == 1:
        return model
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            group.broadcast(tensor.data, src=0, name="initial weights from rank 0")
    return _fully_shard(model, group, reshard_after_forward)


def build_sharded(build: Callable[[], torch.nn.Module], group: Group, *,
                  reshard_after_forward: bool = True) -> torch.nn.Module:
    """``build()`` on rank 0; every other rank builds on the meta device and receives only its shards.

    No rank but 0 ever holds the full weights, so a model too large for one
    process's memory twice over still starts. ``build`` must construct the
    model without moving it (``LlamaForCausalLM(config)``, not ``.to("cpu")``).
    Buffers (rotary frequencies) are copied from rank 0 too.

    Example::

        model = build_sharded(lambda: build_tiny_model(seed=0), group)
    """
    if group.world_size == 1:
        return build()
    if group.rank == 0:
        model = build()
        full = model.state_dict()  # holds the full tensors past sharding, until they are sent
    else:
        with torch.device("meta"):
            model = build()
        full = {}
    _fully_shard(model, group, reshard_after_forward)
    if group.rank != 0:
        model.to_empty(device=_device(group))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with group.guard("initial weights from rank 0"):
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                   broadcast_from_rank0=True))
    with torch.no_grad():
        for buffer in model.buffers():
            group.broadcast(buffer, src=0, name="initial buffers from rank 0")
    return model


def _device(group: Group) -> torch.device:
    mesh = group.mesh
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _fully_shard(model: torch.nn.Module, group: Group, reshard_after_forward: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=group.mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=group.mesh, reshard_after_forward=reshard_after_forward)
    for unit in fsdp_units(model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # never gloo's AVG (pytorch#162338)
    return model


def fsdp_units(model: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP units of ``model``, root last (empty when it is not sharded)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # whatever sharded the model imported it
    if fsdp is None:
        return []
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)][::-1]


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (one rank's shard); no DTensor exists until its module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor shard gathered from every rank (a collective: every rank calls it
    on the same tensor), any other tensor as it is. The one gather of a single tensor: the weights
    a rollout engine loads, however they reach it."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def full_state_dict(model: torch.nn.Module, group: Group) -> dict[str, torch.Tensor] | None:
    """The full weights on CPU, on rank 0 (``None`` on the others). A collective: call on every rank.

    Every key of the unsharded model's ``state_dict`` is present, tied ones
    (``lm_head.weight`` ≡ ``model.embed_tokens.weight``) included, so the dict
    loads into a fresh model with ``load_state_dict(strict=True)``.
    """
    if group.world_size == 1 or not fsdp_units(model):
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with group.guard("gather full weights"):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if group.rank != 0:
        return None
    for names in tied_parameters(model):
        present = next((n for n in names if n in state), None)
        for name in names:
            if present is not None and name not in state:
                state[name] = state[present]
    return state


def tied_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one parameter (tied embeddings)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


@dataclass
class MemoryChange:
    """What entering :func:`unsharded` took and leaving it freed, on this rank."""

    sharded_bytes: int
    full_bytes: int
    #: device memory actually allocated on entry (CUDA only; 0 on CPU)
    device_bytes: int = 0
    #: parameter bytes released on leaving (set on exit)
    freed_bytes: int = 0

    @property
    def taken_bytes(self) -> int:
        return self.full_bytes - self.sharded_bytes


@contextmanager
def unsharded(model: torch.nn.Module, group: Group) -> Iterator[MemoryChange]:
    """Full parameters on every rank inside the block; sharded again on leaving.

    For a rollout colocated with a sharded actor: one all-gather on entry, no
    collective per forward inside (generation calls forward many times), and
    the gathered memory is released on exit. Yields the :class:`MemoryChange`.
    """
    units = fsdp_units(model)
    sharded = state_bytes(model)["params"]
    if not units:
        yield MemoryChange(sharded, sharded)
        return
    cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
    before = torch.cuda.memory_allocated() if cuda else 0
    with group.guard("unshard for rollout"):
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
    change = MemoryChange(sharded, _bytes(model.parameters()),
                          torch.cuda.memory_allocated() - before if cuda else 0)
    try:
        yield change
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)
        change.freed_bytes = change.full_bytes - state_bytes(model)["params"]


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters and of optimizer state held by this rank (its shards only)."""
    optim = 0
    if optimizer is not None:
        optim = _bytes(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
    return {"params": _bytes(model.parameters()), "optimizer": optim}


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own tensor of a (possibly sharded) tensor; no communication."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        local = local_part(t)
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += local.numel() * local.element_size()
    return total
