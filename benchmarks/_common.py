"""What the runtime benchmarks share: Ray start-up, a shared backend, medians, tables.

Importing this module puts the repository root on ``sys.path`` (so ``flowrl``
and ``benchmarks.ops`` import when a benchmark runs as a script) and pins torch
to one thread.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import torch  # noqa: E402

torch.set_num_threads(1)



def print_table(title: str, header: list[str], rows: list[list[str]], notes: Iterable[str] = ()) -> None:
    """A rich table (plain text without rich), wide enough not to wrap, then notes."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in [header, *rows]:
            print(" | ".join(row))
    else:
        table = Table(title=title, title_justify="left")
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i < 2 else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        Console(width=250).print(table)
    for note in notes:
        print(note)


def init_ray(num_cpus: int) -> Any:
    """Start a local Ray with ``num_cpus`` logical CPUs; workers get one torch
    thread and the repository on their path (``benchmarks.ops`` must import there)."""
    import ray

    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": path,
                                       "TOKENIZERS_PARALLELISM": "false"}})
    return ray


def cpu_note(num_cpus: int) -> str:
    phys = os.cpu_count() or 1
    extra = (f" (more than the {phys} cores: fine for sleeping operators; CPU-bound ones share {phys} cores)"
             if num_cpus > phys else "")
    return f"Ray: {num_cpus} logical CPUs on {phys} cores{extra}"


class SharedBackend:
    """A started backend lent to another :class:`~flowrl.runtime.scheduler.Runtime`:
    same worker processes, so variants of one graph (same nodes, other edges or
    micro-batches) run on the very same actors; its owner starts and stops it."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def start(self, *args: Any, **kwargs: Any) -> None:
        pass  # already started by the owner

    def shutdown(self) -> None:
        pass  # the owner shuts it down

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def one_step(rt: Any, batch: Any, step: int) -> Any:
    """Run one step and return its result. The generator is exhausted, never
    abandoned: dropping ``Runtime.run``'s generator early (as ``Runtime.run_step``
    does) closes the runtime."""
    (result,) = list(rt.run([batch], steps=1, start_step=step))
    return result


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    """(wall seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def llama_dir(shape: dict[str, int], root: str, name: str) -> str:
    """A randomly initialised (seed 0) Llama of ``shape`` (hidden size, layers, heads, ...) over builtin:tiny's
    word vocabulary, saved with that tokenizer as the model directory ``root/name``; returns its path. The
    benchmarks' mid-sized models, one recipe for all of them."""
    from operators.models import VOCAB, build_tiny_tokenizer, save_model
    from operators.models.hf import hf

    tokenizer = build_tiny_tokenizer()
    config = hf("LlamaConfig")(vocab_size=len(VOCAB), num_key_value_heads=shape["num_attention_heads"],
                               max_position_embeddings=1024, tie_word_embeddings=True,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = hf("LlamaForCausalLM")(config)
    return str(save_model(model, tokenizer, f"{root}/{name}"))


def matmul_rate(m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """float32 FLOP/s of ``[m, k] @ [k, n]`` on this thread: the best of repeated timings."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * m * k * n / best


def peaks(config) -> tuple[float, float]:
    """(the core's matmul peak: 512×512×512, the model's own MLP matmul: 2048 × hidden × MLP width) in FLOP/s."""
    return matmul_rate(512, 512, 512), matmul_rate(2048, config.hidden_size, config.intermediate_size)
