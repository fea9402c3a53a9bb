"""LoRA vs full fine-tuning of one actor: update step time, peak memory, the merged-weights push.

SmolLM2-135M-Instruct (``builtin:smollm2-135m``) as an actor, fp32 on CPU, one torch thread:

- ``full``: every weight trains (AdamW over 134.5M parameters);
- ``lora``: peft adapters of rank ``--r`` (alpha ``2r``) on the attention and MLP projections
  (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``), the base frozen.

Each mode runs in a fresh process: the actor is built, one update warms up, then ``--updates``
updates (``actor.update`` on ``--batch`` synthetic rows of ``--tokens`` tokens, ``--response`` of
them scored) are timed one by one; then the weights a rollout engine with its own copy is pushed
(:meth:`TrainEngine.named_weights`: merged ``W + scale·BA`` under LoRA) are produced and counted.
Peak memory is the process's max RSS (``ru_maxrss``: the model's load included, as a run sees it).
The update's throughput is its tokens (every position of every row goes through the model) per second
of the best timed update, and its model-FLOP utilization (MFU) those tokens' FLOPs over a float32
matmul roofline measured in the same process right after (the best of repeated ``512³`` timings, and
of the model's own MLP matmul, ``2048 × hidden × MLP width``): ``6·N`` FLOPs a token for full
fine-tuning (forward, input and weight gradients), ``4·N + 6·N_adapters`` under LoRA (the frozen base
needs no weight gradient).
Modes alternate A B A B over ``--rounds`` rounds, since the machine is shared; medians and the
ratios lora/full are printed with the load (``uptime``) before and after.

    python benchmarks/lora.py                      # SmolLM2, 3 rounds
    python benchmarks/lora.py --rounds 5 --r 16
    python benchmarks/lora.py --smoke              # builtin:tiny, 1 round: the code path in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
MODES = ("full", "lora")


def child(mode: str, spec: str, r: int, batch: int, tokens: int, response: int, updates: int) -> dict:
    """Build the actor, warm up, time ``updates`` updates and one merged-weights pass; numbers as a dict."""
    import torch

    torch.set_num_threads(1)
    from flowrl.data import DataProto
    from flowrl.runtime.worker import RoleContext
    from operators import actor as actor_ops
    from operators.models.lora import ATTENTION_MLP
    from operators.roles import Actor, ActorConfig

    lora = {"r": r, "alpha": 2.0 * r, "target_modules": list(ATTENTION_MLP)} if mode == "lora" else None
    actor = Actor(ActorConfig(model=spec, lora=lora, optim={"lr": 1e-5}), RoleContext("actor", 0, 1, 0))
    vocab = actor.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, tokens), generator=gen)
    mask = torch.ones_like(ids)
    rows = DataProto.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, -response:], "response_mask": mask[:, -response:],
        "advantages": torch.randn(batch, response, generator=gen),
        "old_log_probs": torch.full((batch, response), -5.0)})
    actor_ops.update(actor, rows, micro_batch_size=batch)  # warm-up: the optimizer's state is made here
    seconds = []
    for _ in range(updates):
        start = time.perf_counter()
        actor_ops.update(actor, rows, micro_batch_size=batch)
        seconds.append(time.perf_counter() - start)
    from benchmarks._common import peaks

    core_peak, model_peak = peaks(actor.model.config)  # the roofline, measured next to the work
    params = sum(p.numel() for p in actor.model.parameters())
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    per_token = 6 * params if mode == "full" else 4 * (params - trainable) + 6 * trainable
    flops = per_token * batch * tokens / min(seconds)
    start = time.perf_counter()
    pushed = sum(t.numel() * t.element_size() for _, t in actor.train_engine.named_weights())
    push_s = time.perf_counter() - start
    max_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {"update_s": statistics.median(seconds), "tokens_per_s": batch * tokens / min(seconds),
            "mfu_core": flops / core_peak, "mfu_model": flops / model_peak, "core_gflops": core_peak / 1e9,
            "model_gflops": model_peak / 1e9, "max_rss_mib": max_rss_mib,
            "push_s": push_s, "push_mib": pushed / 2**20, "trainable": trainable,
            "optimizer_mib": actor.held_bytes()["optimizer"] / 2**20}


def run_child(mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--r", str(args.r), "--batch",
           str(args.batch), "--tokens", str(args.tokens), "--response", str(args.response), "--updates",
           str(args.updates)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="builtin:tiny, one round, short sequences")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.r, args.batch, args.tokens, args.response,
                               args.updates)))
        return
    if args.smoke:
        args.model, args.rounds, args.tokens, args.response, args.updates = "builtin:tiny", 1, 12, 6, 1
    from benchmarks._common import print_table

    load_before = uptime()
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:  # A B A B: both modes see the same stretch of the machine's load
            results[mode].append(run_child(mode, args))
            print(f"{mode}: {json.dumps(results[mode][-1])}", flush=True)  # a long run shows its progress
    load_after = uptime()

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    rows = []
    for key, label, fmt in (("update_s", "update step (s)", "{:.3f}"), ("tokens_per_s", "update tokens/s", "{:.0f}"),
                            ("mfu_core", "update MFU vs 512³ matmul", "{:.1%}"),
                            ("mfu_model", "update MFU vs the model's MLP matmul", "{:.1%}"),
                            ("max_rss_mib", "peak RSS (MiB)", "{:.0f}"),
                            ("optimizer_mib", "optimizer state (MiB)", "{:.1f}"),
                            ("push_s", "merged-weights pass (s)", "{:.3f}"), ("push_mib", "push size (MiB)", "{:.1f}")):
        full, lora = med("full", key), med("lora", key)
        rows.append([label, fmt.format(full), fmt.format(lora), f"{lora / full:.3f}" if full else "-"])
    rows.append(["trainable parameters", f"{med('full', 'trainable'):,.0f}", f"{med('lora', 'trainable'):,.0f}",
                 f"{med('lora', 'trainable') / med('full', 'trainable'):.4f}"])
    print_table(f"LoRA vs full fine-tuning: {args.model}, r={args.r}, batch {args.batch} × {args.tokens} tokens "
                f"({args.response} scored), medians of {args.rounds} rounds",
                ["", "full", f"lora r={args.r}", "ratio lora/full"], rows,
                notes=[f"load before: {load_before}", f"load after:  {load_after}",
                       f"float32 matmul roofline, one thread (medians): 512³ "
                       f"{statistics.median(r['core_gflops'] for m in MODES for r in results[m]):.1f} GFLOP/s, "
                       f"the model's MLP matmul "
                       f"{statistics.median(r['model_gflops'] for m in MODES for r in results[m]):.1f} GFLOP/s; "
                       f"tokens/s and MFU from each process's best update (6·N FLOPs a token full, "
                       f"4·N + 6·N_adapters LoRA)",
                       "each mode in a fresh process, interleaved full, lora, full, lora, ...; one torch thread"])


if __name__ == "__main__":
    main()
