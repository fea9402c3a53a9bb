"""Weights into a running vLLM engine, and the probe that says which weights it computes with.

A push hands each bucket of ``(name, tensor)`` to vLLM's worker by the
cheapest way the two sides share (:func:`transport`):

- ``inproc`` — the engine core runs in this process (CPU default): the tensors
  themselves are the RPC's arguments; the only copy is into the parameters.
- ``shm`` — the worker is another process, the tensors on CPU: the bucket is
  written once into a file under ``/dev/shm``; the RPC carries its path and a
  layout; the worker maps it (mmap) and copies from the mapping into the parameters.
- ``cuda_ipc`` — the tensors on a GPU: the bucket is packed into one device
  buffer and the RPC carries its CUDA IPC handle (as verl's bucketed sender
  does); the worker opens it and copies on the device.

On the worker, :class:`WeightSyncExtension` loads the buckets one of two ways,
then drops the caches derived from the old weights:

- in place (CPU, an unquantized model): vLLM's loaders copy each tensor into the
  parameter it belongs to, then each linear layer is re-packed for its CPU
  kernel. vLLM frees a linear layer's unpacked weight once it is packed, so the
  first such push gives each one an unpacked copy to load into, kept after
  (memory: one copy of the linear weights);
- layer-wise (anything else, or ``push_in_place: false``): vLLM's reload
  rebuilds each layer from fresh tensors as its last one arrives and processes
  it, which costs a fixed amount per layer on every push.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Mapping

import torch

from operators.models.fsdp import full_tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: the probe of a weights fingerprint: this many tokens
PROBE_LENGTH = 48
#: offsets of tensors in a bucket are multiples of this (any dtype's view is then aligned)
ALIGN = 64

Transport = Literal["inproc", "shm", "cuda_ipc"]
Bucket = list[tuple[str, torch.Tensor]]


# --- the model directory vLLM loads -----------------------------------------------------------------

def model_cache_dir() -> Path:
    """Where models saved for vLLM go: ``$FLOWRL_CACHE_DIR/vllm-models`` (default ``~/.cache/flowrl``)."""
    return Path(os.environ.get("FLOWRL_CACHE_DIR", Path.home() / ".cache" / "flowrl")) / "vllm-models"


def save_for_vllm(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                  cache_dir: str | Path | None = None) -> Path:
    """Write ``model`` and ``tokenizer`` as a Hugging Face directory keyed by their config and weights.

    The same model (``builtin:tiny`` from the same seed) is written once; a
    directory appears whole or not at all (written aside, then renamed).
    """
    state = model.state_dict()
    digest = hashlib.blake2b(model.config.to_json_string(use_diff=False).encode(), digest_size=16)
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    target = Path(cache_dir or model_cache_dir()) / digest.hexdigest()
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another process wrote it first: same key, same content
        if not (target / "config.json").is_file():
            raise
    return target


# --- the sender's side ------------------------------------------------------------------------------

def weight_buckets(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   bucket_bytes: int, *, device: bool = False) -> Iterator[Bucket]:
    """Cut ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (a larger tensor goes alone).

    Tensors are taken one at a time, so an iterator that gathers each tensor on
    demand (a sharded model) never holds more than a bucket of full tensors.
    ``device``: tensors stay where they are (a GPU push); else they come to the CPU.

    Example::

        >>> w = {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(8)}
        >>> [[n for n, _ in b] for b in weight_buckets(w, bucket_bytes=32)]
        [['a', 'b'], ['c']]
    """
    bucket: Bucket = []
    size = 0
    for name, tensor in (weights.items() if isinstance(weights, Mapping) else weights):
        tensor = full_tensor(tensor.detach())  # a shard: this rank's part of a gather
        tensor = (tensor if device else tensor.cpu()).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def bucket_layout(bucket: Bucket) -> tuple[list[list[Any]], int]:
    """``[name, dtype, shape, offset]`` rows placing ``bucket``'s tensors in one buffer, and its size.

    Example::

        >>> bucket_layout([("a", torch.zeros(3)), ("b", torch.zeros(2, dtype=torch.bfloat16))])
        ([['a', 'float32', [3], 0], ['b', 'bfloat16', [2], 64]], 68)
    """
    layout, offset = [], 0
    for name, tensor in bucket:
        layout.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
        offset += tensor.numel() * tensor.element_size()
        offset = -(-offset // ALIGN) * ALIGN if offset else 0
    end = layout[-1][3] + bucket[-1][1].numel() * bucket[-1][1].element_size() if bucket else 0
    return layout, end


def fill(buffer: torch.Tensor, bucket: Bucket, layout: list[list[Any]]) -> None:
    """Copy ``bucket``'s tensors into ``buffer`` (``uint8``) where ``layout`` places them: the one copy."""
    for (_, tensor), (_, _, _, offset) in zip(bucket, layout):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            buffer[offset:offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))


def views(buffer: torch.Tensor, layout: list[list[Any]]) -> Bucket:
    """``(name, tensor)`` views into ``buffer`` (``uint8``) as ``layout`` places them; nothing copied.

    Example::

        >>> bucket = [("w", torch.ones(2, dtype=torch.bfloat16)), ("b", torch.arange(3.0))]
        >>> layout, size = bucket_layout(bucket)
        >>> buffer = torch.zeros(size, dtype=torch.uint8)
        >>> fill(buffer, bucket, layout)
        >>> [(n, t.tolist()) for n, t in views(buffer, layout)]
        [('w', [1.0, 1.0]), ('b', [0.0, 1.0, 2.0])]
    """
    out = []
    for name, dtype, shape, offset in layout:
        dtype = getattr(torch, dtype)
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        out.append((name, buffer[offset:offset + nbytes].view(dtype).reshape(shape)))
    return out


def shm_dir() -> str:
    """``/dev/shm`` where the machine has it (memory, not disk), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@contextlib.contextmanager
def shm_bucket(bucket: Bucket) -> Iterator[tuple[str, list[list[Any]], int]]:
    """``bucket`` written once into a shared-memory file: ``(path, layout, size)``; removed after."""
    layout, size = bucket_layout(bucket)
    fd, path = tempfile.mkstemp(prefix="flowrl-weights-", dir=shm_dir())
    os.close(fd)
    try:
        if size:
            fill(torch.from_file(path, shared=True, size=size, dtype=torch.uint8), bucket, layout)
        yield path, layout, size
    finally:
        os.unlink(path)


def read_shm(path: str, layout: list[list[Any]], size: int) -> Bucket:
    """The bucket a :func:`shm_bucket` wrote, as views into a private mapping of its file (read on use)."""
    if not size:
        return views(torch.empty(0, dtype=torch.uint8), layout)
    return views(torch.from_file(path, shared=False, size=size, dtype=torch.uint8), layout)


def cuda_handle(buffer: torch.Tensor) -> list[Any]:
    """A CUDA tensor's IPC handle as plain values (msgpack carries them; no function is pickled)."""
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream(buffer.device).synchronize()  # the copies into it are done before it is read
    _, args = reduce_tensor(buffer)
    # (cls, size, stride, offset, storage_cls, dtype, device, handle, size_bytes, offset_bytes,
    #  requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
    return [list(args[1]), list(args[2]), args[3], str(args[5]).removeprefix("torch."), *args[6:]]


def open_cuda_handle(handle: list[Any]) -> torch.Tensor:
    """The tensor a :func:`cuda_handle` names, opened in this process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    size, stride, offset, dtype, *rest = handle
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(size), tuple(stride), offset, torch.UntypedStorage,
                               getattr(torch, dtype), *rest)


@contextlib.contextmanager
def cuda_bucket(bucket: Bucket) -> Iterator[tuple[list[Any], list[list[Any]]]]:
    """``bucket`` packed into one device buffer: ``(IPC handle, layout)``; the buffer lives until the exit."""
    layout, size = bucket_layout(bucket)
    device = bucket[0][1].device if bucket[0][1].is_cuda else torch.device("cuda", torch.cuda.current_device())
    buffer = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
    fill(buffer, bucket, layout)
    yield cuda_handle(buffer), layout
    del buffer


# --- the worker's side ------------------------------------------------------------------------------

class WeightSyncExtension:
    """Methods vLLM mixes into its worker (``worker_extension_cls``): one reload over many calls.

    ``flowrl_begin_reload`` picks the way (in place, or vLLM's layer-wise
    reload state); each ``flowrl_load_*`` loads a bucket by one transport (in
    place: copied into the parameters; layer-wise: a layer whose tensors span
    buckets is processed when its last one arrives); ``flowrl_finish_reload``
    re-packs the linear layers (in place) or processes what is left
    (layer-wise), drops the caches derived from the old weights and returns the names loaded.
    """

    def flowrl_begin_reload(self, in_place: bool = False) -> str:
        """Start a push: ``"in_place"`` where the model allows it and ``in_place`` asks, else ``"layerwise"``."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self.model_runner.get_model()
        self.flowrl_loaded: list[str] = []
        self.flowrl_repack = in_place_layers(model) if in_place else None
        if self.flowrl_repack is not None:
            self.flowrl_aliases = tied_aliases(model)
            return "in_place"
        self.flowrl_aliases: set[str] = set()
        drop_unpacked_copies(model)  # a layer-wise reload after in-place ones: as vLLM left the layers
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
        return "layerwise"

    def flowrl_load_tensors(self, bucket: Bucket) -> int:
        """``inproc``: the sender's tensors themselves."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):  # a tied alias shares its tensor: loaded with it
            self.model_runner.get_model().load_weights(
                (name, tensor) for name, tensor in bucket if name not in self.flowrl_aliases)
        self.flowrl_loaded.extend(name for name, _ in bucket)
        return len(bucket)

    def flowrl_load_shm(self, path: str, layout: list[list[Any]], size: int) -> int:
        """``shm``: views into the mapped file (read once, by the copy into the parameters)."""
        return self.flowrl_load_tensors(read_shm(path, layout, size))

    def flowrl_load_cuda_ipc(self, handle: list[Any], layout: list[list[Any]]) -> int:
        """``cuda_ipc``: views into the sender's device buffer."""
        return self.flowrl_load_tensors(views(open_cuda_handle(handle), layout))

    def flowrl_finish_reload(self) -> list[str]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            if self.flowrl_repack is None:
                finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
            for layer in self.flowrl_repack or ():  # the packed kernel weights from the loaded ones
                dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
        return list(self.flowrl_loaded)


def in_place_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The layers a CPU push re-packs after loading in place, each with an unpacked weight to load into;
    ``None`` where a layer needs more than vLLM's CPU GEMM packing after a load (quantized, off CPU).

    The unpacked weight vLLM freed after packing is rebuilt once from the
    shape and loader vLLM recorded for reloading, and kept.
    """
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    layers = []
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if method is None:
            continue
        if type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
            return None
        if getattr(layer, "_cpu_skip_gemm_dispatch", False):
            continue  # computes with torch's linear on the weight itself: loading is all it needs
        if layer.weight.numel() == 0 and not layer.weight.is_meta:  # freed once packed
            meta = get_layerwise_info(layer).restore_metadata[0].get("weight")
            if meta is None:
                return None
            with torch.device(layer.weight.device):
                weight = restore_layer_refs(materialize_meta_tensor(meta), layer)
            # a layer-wise reload leaves its deferring wrapper on the recorded loader: the loader itself
            weight.weight_loader = _get_original_loader(weight)
            weight.requires_grad_(False)
            layer.register_parameter("weight", weight)
            layer.flowrl_unpacked_copy = True
        layers.append(layer)
    return layers


def drop_unpacked_copies(model: torch.nn.Module) -> None:
    """Free the unpacked weights :func:`in_place_layers` kept, leaving the layers as vLLM packed them."""
    for layer in model.modules():
        if getattr(layer, "flowrl_unpacked_copy", False):
            weight = layer.weight
            layer.register_parameter("weight", torch.nn.Parameter(
                torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False))
            del layer.flowrl_unpacked_copy


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """The names under which ``model`` holds a parameter a second time (a tied ``lm_head.weight``).

    Example::

        >>> head = torch.nn.Linear(2, 3, bias=False)
        >>> model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(3, 2), "head": head})
        >>> model["head"].weight = model["embed"].weight
        >>> tied_aliases(model)
        {'head.weight'}
    """
    first: dict[int, str] = {}
    return {name for name, param in model.named_parameters(remove_duplicate=False)
            if first.setdefault(id(param), name) != name}


def push_buckets(rpc: Any, weights: Any, bucket_bytes: int, transport: Transport,
                 in_place: bool = False) -> tuple[list[str], int, int, bool]:
    """One reload over ``weights`` through ``rpc(method, *args)`` (vLLM's ``collective_rpc``):
    ``(names loaded, bytes, buckets, whether it loaded in place)``. ``in_place``: load into the
    parameters where the model allows (:func:`in_place_layers`), else vLLM's layer-wise reload."""
    way = rpc("flowrl_begin_reload", in_place)[0]
    nbytes = buckets = 0
    for bucket in weight_buckets(weights, bucket_bytes, device=transport == "cuda_ipc"):
        if transport == "inproc":
            rpc("flowrl_load_tensors", bucket)
        elif transport == "shm":
            with shm_bucket(bucket) as (path, layout, size):
                rpc("flowrl_load_shm", path, layout, size)
        else:
            with cuda_bucket(bucket) as (handle, layout):
                rpc("flowrl_load_cuda_ipc", handle, layout)
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        buckets += 1
    return rpc("flowrl_finish_reload")[0], nbytes, buckets, way == "in_place"


def transport(in_process: bool, on_cpu: bool) -> Transport:
    """How a push reaches the worker: by reference in process, else shared memory on CPU, CUDA IPC on a GPU."""
    return "inproc" if in_process else ("shm" if on_cpu else "cuda_ipc")


# --- the probe --------------------------------------------------------------------------------------

def probe_tokens(vocab_size: int, length: int = PROBE_LENGTH) -> list[int]:
    """A fixed token sequence spread over the vocabulary: the input of a weights fingerprint."""
    return [(17 + 7919 * i) % vocab_size for i in range(length)]


@torch.no_grad()
def probe_forward(model: torch.nn.Module, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``float32[len(tokens) - 1]`` twice: ``model``'s log-prob of each next token of ``tokens`` (an HF
    causal LM), and the spread of its logits at that position (largest minus smallest)."""
    ids = torch.tensor([tokens], device=next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, :-1].float()
    log_probs = logits.log_softmax(-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return log_probs.cpu(), (logits.amax(-1) - logits.amin(-1)).cpu()


def model_fingerprint(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The log-probs of :func:`probe_forward`."""
    return probe_forward(model, tokens)[0]
