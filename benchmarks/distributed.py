"""One FSDP2 update step of a 29M-parameter Llama: 1 worker vs 2 workers of 1 thread each.

Run from the repository root::

    python benchmarks/distributed.py            # ~3 min on 2 busy cores
    python benchmarks/distributed.py --quick    # a 5M-parameter model
    python benchmarks/distributed.py --smoke    # --quick's model, 2 steps of 4 tiny rows: seconds

Each configuration runs in fresh processes (spawned, one torch thread each,
gloo on loopback): the model is built, sharded over the ranks
(:func:`operators.models.fsdp.build_sharded`: only rank 0 builds the full
model; a pool of one is left whole), and
takes ``--steps`` AdamW updates on the same batch split by
:func:`flowrl.data.balance.balance_ranks`, with the loss normalised by the
all-reduced token count (the ``fsdp2`` training engine's
:meth:`~operators.models.engine.TrainEngine.forward_backward` and ``optimizer_step``).
Per rank it reports the median step time after one warm-up step, the peak
resident memory of those steps (Linux ``VmHWM``, reset after the warm-up) and
how far it rises above the process's memory before the model was built, the
bytes of parameters and optimizer state the rank holds, and the time to gather
the full weights onto rank 0 (:func:`operators.models.fsdp.full_state_dict`).
Ratios are 2 workers / 1 worker from the same run. On 2 shared cores a speed-up
is not expected; what a rank holds is the figure that matters.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import print_table  # noqa: E402  (puts the repo on sys.path, 1 thread)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

MIB = 2 ** 20


def model_config(quick: bool):
    from transformers import LlamaConfig

    hidden, layers = (256, 4) if quick else (512, 8)
    return LlamaConfig(vocab_size=8000, hidden_size=hidden, intermediate_size=int(hidden * 2.6875),
                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                       max_position_embeddings=256, tie_word_embeddings=True)


def make_batch(rows: int, prompt: int, response: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 8000, (rows, prompt + response), generator=gen)
    lengths = torch.randint(response // 4, response + 1, (rows,), generator=gen)
    mask = (torch.arange(response)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": torch.cat([torch.ones(rows, prompt, dtype=torch.long), mask], 1),
            "response_mask": mask, "advantages": torch.randn(rows, response, generator=gen)}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def rank_main(rank: int, world: int, args, addresses, results) -> None:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM

    from flowrl.data.balance import balance_ranks
    from flowrl.runtime.distributed import PoolGroup, listen
    from operators.models import OptimConfig, response_log_probs
    from operators.models.engine import build_engine
    from operators.models.fsdp import build_sharded

    if world == 1:
        group = PoolGroup.single("train")
    elif rank == 0:
        listener = listen()
        for _ in range(world - 1):
            addresses.put(f"127.0.0.1:{listener.getsockname()[1]}")
        group = PoolGroup.join("train", 0, world, f"127.0.0.1:{listener.getsockname()[1]}", listener=listener)
    else:
        group = PoolGroup.join("train", rank, world, addresses.get())
    started = _status_kib("VmRSS") * 1024  # torch, gloo and the group, before any model memory

    def build():
        torch.manual_seed(0)
        return LlamaForCausalLM(model_config(args.quick))

    # only rank 0 ever holds the full model; the engine keeps the sharded one as it is
    engine = build_engine(None, build_sharded(build, group), optim=OptimConfig(lr=1e-5, grad_clip=1.0),
                          group=group)
    engine.reduce_once = args.reduce_once
    model = engine.model
    batch = make_batch(args.rows, args.prompt, args.response)
    mine = balance_ranks(batch["response_mask"].sum(-1).tolist(), world)[rank]
    mbs = [{k: v[mine[s:s + args.micro]] for k, v in batch.items()} for s in range(0, len(mine), args.micro)]
    R = args.response

    def loss_fn(mb, norm):
        pos = mb["attention_mask"].cumsum(-1) - 1
        lp, _ = response_log_probs(model, mb["input_ids"], mb["attention_mask"], pos, R)
        loss = -(lp * mb["advantages"] * mb["response_mask"]).sum() / norm.tokens
        return loss, {}

    times = []
    for step in range(args.steps):
        if step == 1:  # after the warm-up step (it allocates the optimizer state): steady state
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand back what building the model freed
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak-RSS counter
        group.barrier("step start")
        start = time.perf_counter()
        engine.zero_grad()
        engine.forward_backward(mbs, loss_fn)
        engine.optimizer_step()
        group.barrier("step end")
        times.append(time.perf_counter() - start)
    peak = _status_kib("VmHWM") * 1024
    group.barrier("gather start")
    start = time.perf_counter()
    engine.get_weights()
    gather = time.perf_counter() - start
    held = engine.held_bytes()
    results.put({"world": world, "rank": rank, "step_s": statistics.median(times[1:] or times),
                 "peak": peak, "started": started, "params": held["params"], "optim": held["optimizer"],
                 "gather_s": gather, "n_params": sum(p.numel() for p in model.parameters())})
    group.close()


def run(world: int, args) -> list[dict]:
    ctx = mp.get_context("spawn")
    addresses, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, args, addresses, results)) for r in range(world)]
    for p in procs:
        p.start()
    out = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    return sorted(out, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 5M-parameter model")
    parser.add_argument("--reduce-once", action="store_true",
                        help="one reduce-scatter per step instead of one per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="updates, the first a warm-up (at least 2)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="--quick's model, 2 steps of 4 rows x 8+8 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.quick, args.steps, args.rows, args.micro, args.prompt, args.response = True, 2, 4, 2, 8, 8
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first is a warm-up)")
    one, two = run(1, args), run(2, args)
    base = one[0]
    rows = []
    for r in one + two:
        label = f"{r['world']} worker{'s' if r['world'] > 1 else ''}, rank {r['rank']}"
        rows.append([label, f"{r['step_s']:.2f} s ({r['step_s'] / base['step_s']:.2f}x)",
                     f"{r['peak'] / MIB:.0f} MiB ({r['peak'] / base['peak']:.2f}x)",
                     f"{(r['peak'] - r['started']) / MIB:.0f} MiB ({(r['peak'] - r['started']) / (base['peak'] - base['started']):.2f}x)",
                     f"{r['params'] / MIB:.1f} MiB ({r['params'] / base['params']:.2f}x)",
                     f"{r['optim'] / MIB:.1f} MiB ({r['optim'] / base['optim']:.2f}x)",
                     f"{r['gather_s'] * 1e3:.0f} ms" + ("" if r["rank"] else f" ({r['gather_s'] / base['gather_s']:.1f}x)")])
    n = base["n_params"]
    print_table(
        f"one update step, {n / 1e6:.1f}M-parameter Llama, {args.rows} rows x {args.prompt}+{args.response} "
        f"tokens, micro-batch {args.micro}, AdamW fp32, 1 torch thread per rank",
        ["configuration", "step time", "peak RSS", "peak RSS above start", "params held", "optimizer held",
         "gather full weights"], rows,
        notes=["ratios: against 1 worker, measured in the same run; gather time on rank 0 (the other ranks "
               "take part in the collective)",
               "peak RSS: steady-state steps after a warm-up; 'above start': minus the process's RSS after "
               "importing torch and joining the group, before the model is built",
               f"machine: {os.cpu_count()} cores shared with other work; a speed-up is not expected"])


if __name__ == "__main__":
    main()
