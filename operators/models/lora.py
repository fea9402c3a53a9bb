"""LoRA adapters on a role's model, with peft.

``roles.actor.lora: {r, alpha, target_modules, dropout}`` wraps the actor's
causal LM in peft's ``PeftModelForCausalLM``: only the adapters' parameters
take gradients and optimizer state, the base stays frozen. What the rest of
flowrl needs of such a model lives here:

- :class:`LoraConfig`: the graph's ``lora:`` block, its targets checked against
  the model's linear modules before anything runs (:func:`check_targets`).
- :func:`add_adapters`: the peft model, its adapters initialised from the run's
  seed (the global RNG untouched), so every rank and every resume starts alike.
- :func:`base_only`: a block in which the model is its base (peft's
  ``disable_adapter``): the reference policy, with no second copy (verl's
  ``ref_in_actor``).
- :func:`merged_weights`: ``(HF name, W + B·A·scale)`` for every tensor of the
  base model: what a rollout engine with its own copy of the weights, another
  pool or an export receives; the live model is never merged in place (an
  unmerge does not give the base back bit for bit).

Example::

    model = add_adapters(model, LoraConfig(r=8, alpha=16), seed=0)
    with base_only(model):
        ref = model(input_ids).logits        # the base model's
    weights = dict(merged_weights(model))   # plain Llama names, adapters folded in
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterable, Iterator

import torch
from pydantic import BaseModel, ConfigDict, Field

from flowrl.graph import Graph, Role
from flowrl.graph.checks import RoleError, graph_check
from operators.models.fsdp import full_tensor

#: the attention and MLP projections of Llama-style models (SmolLM2, Qwen2, Mistral, builtin:tiny)
ATTENTION_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: peft's name of the one adapter flowrl trains
ADAPTER = "default"


class LoraConfig(BaseModel):
    """A role's ``lora:`` block: rank ``r``, scale ``alpha / r``, the linear modules to adapt
    (names or name suffixes, as peft matches them) and the adapters' input ``dropout``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    r: int = Field(8, ge=1, description="the adapters' rank")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / r")
    target_modules: list[str] = Field(default_factory=lambda: list(ATTENTION_MLP), min_length=1,
                                      description="linear modules to adapt: names or suffixes (q_proj, "
                                      "model.layers.0.mlp.up_proj)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input while training")

    def peft(self) -> Any:
        """The peft ``LoraConfig`` this block stands for."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                              target_modules=list(self.target_modules), bias="none", task_type="CAUSAL_LM")


def linear_names(model: torch.nn.Module) -> list[str]:
    """The qualified names of every ``nn.Linear`` of ``model``."""
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


@functools.lru_cache(maxsize=8)
def model_linear_names(spec: str) -> tuple[str, ...]:
    """The linear modules of the causal LM ``spec``, from its config alone (built on the meta device:
    no weights read, cheap enough for ``flowrl validate``)."""
    from operators.models.loading import LOCAL_BUILTINS, _build_tiny, _check_dir
    from operators.models.hf import hf

    with torch.device("meta"):
        if spec in LOCAL_BUILTINS:
            model = _build_tiny(spec, "causal_lm", 0)
        else:
            config = hf("AutoConfig").from_pretrained(str(_check_dir(spec)))
            model = hf("AutoModelForCausalLM").from_config(config)
    return tuple(linear_names(model))


def _matches(name: str, target: str) -> bool:
    # peft's rule for a list of targets: the whole name, or its last dotted parts
    return name == target or name.endswith("." + target)


def check_targets(targets: list[str], names: tuple[str, ...] | list[str], model: str) -> None:
    """Raise ``ValueError`` naming each of ``targets`` that matches none of the linear modules
    ``names`` of ``model``, and listing the module names there are."""
    missing = [t for t in targets if not any(_matches(n, t) for n in names)]
    if missing:
        short = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ValueError(f"lora.target_modules {missing} match no linear module of {model!r}; its linear "
                         f"modules are named {', '.join(short)} (full names such as {names[0]!r})")


def add_adapters(model: torch.nn.Module, cfg: LoraConfig, seed: int) -> torch.nn.Module:
    """``model`` wrapped with LoRA adapters (peft), the base frozen; the adapters' initial ``A`` drawn
    from ``seed`` (``B`` starts at zero: the wrapped model computes what ``model`` did)."""
    from peft import get_peft_model

    check_targets(cfg.target_modules, linear_names(model), type(model).__name__)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, cfg.peft())


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries peft adapters (peft is imported only once a model has them)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def base_only(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A block in which ``model`` computes as its base (adapters off); nothing for a model without."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """The adapted modules by their name in the base model."""
    from peft.tuners.lora import LoraLayer

    inner = model.get_base_model()
    return {name: m for name, m in inner.named_modules() if isinstance(m, LoraLayer)}


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every entry of the base model's state dict under its own (Hugging Face)
    name, each adapted weight as ``W + scale · B A`` (peft's ``get_delta_weight``), one tensor at a
    time. Sharded, each tensor is gathered when reached (a collective: every rank iterates to the
    end); the adapters, small, are gathered first. The live model is left as it is."""
    inner = model.get_base_model()
    state = inner.state_dict(keep_vars=True)
    deltas = {}
    for name, layer in _lora_layers(model).items():
        a = full_tensor(state[f"{name}.lora_A.{ADAPTER}.weight"]).detach()
        b = full_tensor(state[f"{name}.lora_B.{ADAPTER}.weight"]).detach()
        delta = (b @ a) * layer.scaling[ADAPTER]
        deltas[f"{name}.base_layer.weight"] = delta.T if layer.fan_in_fan_out else delta
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        tensor = full_tensor(tensor).detach()
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        yield name.replace(".base_layer.", "."), tensor


def load_merged(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load full, merged weights (another pool's :func:`merged_weights`) as ``model``'s base, its
    adapters' ``B`` zeroed: the model then computes exactly ``weights``' model."""
    inner = model.get_base_model()
    layers = _lora_layers(model)
    names = {}
    for name in inner.state_dict():
        if ".lora_" not in name:
            names[name.replace(".base_layer.", ".")] = name
    with torch.no_grad():
        inner.load_state_dict({names[k]: v for k, v in weights.items()}, strict=False)
        for layer in layers.values():
            layer.lora_B[ADAPTER].weight.zero_()


class BaseView(Role):
    """A frozen role served by a LoRA role's own model with its adapters switched off (peft's
    ``disable_adapter``): the base weights, which no update changes, with no second copy. Forward
    passes only; nothing to checkpoint (the role it views holds everything)."""

    def __init__(self, role: Any) -> None:
        self.role = role

    model = property(lambda self: self.role.model)

    def forward(self, batch: Any, fn: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """``fn`` over ``batch`` on the base model: the viewed role's ``forward`` with the adapters off."""
        with base_only(self.role.model):
            return self.role.forward(batch, fn)

    def weights_for_digest(self) -> Any:
        return [(n, t) for n, t in self.role.model.state_dict().items() if ".lora_" not in n]


@graph_check
def _lora_roles_train(graph: Graph) -> Iterable[RoleError]:
    """``lora`` belongs on a role some node updates, and on the role whose settings count (a derived
    role takes its source's)."""
    updated = {node.role for node in graph.nodes.values() if node.updates_role and node.role}
    for name, role in graph.config.roles.items():
        if "lora" not in role.settings:
            continue
        where = graph.locate("roles", name, "lora")
        if role.from_ is not None:
            yield RoleError(f"role {name!r} is derived from {role.from_!r} and takes its settings from it: its "
                            f"lora would be ignored", location=where,
                            fix=f"set lora on {role.from_!r} (a frozen role derived from a LoRA actor in its "
                                f"pool is that actor's base, adapters off)")
        elif not graph.roles_sharing_weights(name) & updated:
            yield RoleError(f"role {name!r} has lora but no node trains it: adapters that never train leave "
                            f"the base model as it is", location=where,
                            fix=f"remove lora from {name!r}, or add an update node on it (actor.update)")


def plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain Hugging Face model (no peft) with ``model``'s merged weights, for an engine that saves
    and loads its own copy (vLLM starts from a directory)."""
    import copy

    return copy.deepcopy(model).merge_and_unload()  # the copy merged, the live model untouched


__all__ = ["ATTENTION_MLP", "BaseView", "LoraConfig", "add_adapters", "base_only", "check_targets", "is_lora",
           "linear_names", "load_merged", "merged_weights", "model_linear_names", "plain_copy"]
