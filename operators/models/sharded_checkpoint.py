"""A model and its optimizer as one ``Stateful``: what a role hands the checkpointer.

:class:`ModelState` gives the model's and the optimizer's state as
torch.distributed.checkpoint's ``get_state_dict`` lays them out: keyed by
parameter name (not by the optimizer's integer ids), DTensors when the model
is sharded over a pool's ranks, plain tensors in one process. The checkpointer
(:mod:`flowrl.store.checkpoint_state`) writes the tensors with DCP, so a
state written by N ranks loads into M; nothing here knows files or directories.

A tied parameter is stored once, under its first name (see
:func:`~operators.models.fsdp.tied_parameters`), and tied again on load.

Example::

    state = ModelState(model, optimizer)
    tensors = state.state_dict()        # {"model": {...}, "optimizer": {"state": ..., "param_groups": ...}}
    state.load_state_dict(tensors)
"""

from __future__ import annotations

from typing import Any

import torch

from operators.models.fsdp import tied_parameters

# torch.distributed.checkpoint (half a second to import) is imported when a state is saved or
# loaded, not when a role is declared (``flowrl validate``)


class ModelState:
    """``state_dict`` / ``load_state_dict`` over a model and its optimizer (``None``: frozen)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 trainable_only: bool = False) -> None:
        self.model, self.optimizer = model, optimizer
        # a frozen base (LoRA's) is rebuilt from the model the graph names: only what trains is saved
        self.trainable_only = trainable_only

    def _options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)

    def state_dict(self) -> dict[str, Any]:
        """``{"model": {name: tensor}}``, plus the optimizer's ``state`` (per parameter name) and
        ``param_groups`` and whether it has stepped yet."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            return {"model": self._once(get_model_state_dict(self.model, options=self._options()))}
        stepped = bool(self.optimizer.state)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        if not stepped:
            # get_state_dict fills an optimizer that never stepped with zero moments at step 1;
            # keep training as it was (a fresh Adam step differs from one at step 2)
            self.optimizer.state.clear()
        return {"model": self._once(model_sd), "optimizer": optim_sd, "stepped": stepped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_sd = dict(state["model"])
        for first, *aliases in tied_parameters(self.model):
            model_sd.update({alias: model_sd[first] for alias in aliases if first in model_sd})
        optim_sd = state.get("optimizer") if self.optimizer is not None else None
        set_state_dict(self.model, self.optimizer if optim_sd is not None else [],
                       model_state_dict=model_sd, optim_state_dict=optim_sd or {}, options=self._options())
        if optim_sd is not None and not state.get("stepped", True):
            self.optimizer.state.clear()

    def _once(self, model_sd: dict[str, Any]) -> dict[str, Any]:
        # a tied parameter once, under its first name (safetensors refuses shared storage)
        aliases = {alias for _, *rest in tied_parameters(self.model) for alias in rest}
        return {k: v for k, v in model_sd.items() if k not in aliases}
