"""Pay for tokens, not padding: GRPO steps on builtin:skewed, padded path vs padding-free path.

Each setting runs a few GRPO steps (generate → rule reward → GRPO advantage →
actor update, on-policy, as ``graphs/grpo_skewed.yaml``) through the operators
themselves, in this process, on one core, twice from the same seed:

* **padded** — the old path: every row steps until the longest stops
  (``rollout.drop_finished: false``), responses ``max_new_tokens`` wide, the
  update one pass over the whole batch (no token budget), as wide as its
  longest row;
* **trimmed** — finished rows leave the decode batch and the KV cache,
  responses as wide as the longest, the update in length-bucketed micro-batches
  under ``max_tokens_per_micro_batch``, each cut to its own longest response.

Reported per setting: seconds per step, real (response) tokens per second,
the padded share of decode positions (rows stepped per token vs tokens made)
and of update positions (``rows × width`` summed over micro-batches, a
micro-batch as wide as its longest row, vs real prompt + response tokens),
the update's share of the step, and the update's useful MFU: ``6 · params ·
real tokens`` FLOPs per second of update (the best timed step), against this
core's float32 matmul peak (512³) and against the model's own MLP matmul (2048
rows × hidden × MLP width), both the best of repeated timings just before each
setting (the machine may be shared). The model starts untrained, so response lengths are what an
untrained policy writes: long-tailed, cut at ``max_new_tokens``.

``--model`` picks the policy: ``builtin:tiny`` (0.53M parameters, hidden 128:
its matmuls are too small to reach the core's peak) or ``llama-25m`` (hidden
512, 6 layers, MLP 2048, the same word tokenizer, so the task runs unchanged;
built here from a config and saved as a local model directory, loaded the way
a user's model is).

    PYTHONPATH=$PWD python benchmarks/tokens.py            # builtin:tiny at 8, 64, 128, 512 new tokens
    PYTHONPATH=$PWD python benchmarks/tokens.py --steps 3 --lengths 8 128
    PYTHONPATH=$PWD python benchmarks/tokens.py --model llama-25m     # at 8 and 128 new tokens
    PYTHONPATH=$PWD python benchmarks/tokens.py --smoke    # 1 step of 2 prompts x 2 at 8 and 16 tokens: seconds
"""

from __future__ import annotations

import argparse
import tempfile
import time

import _common  # noqa: F401  (repository on sys.path, one torch thread)
import numpy as np
import torch

from _common import llama_dir, peaks, print_table
from flowrl.data import DataProto
from flowrl.runtime.worker import RoleContext
from operators import actor as actor_ops
from operators import advantage, reward, rollout
from operators.data import PromptLoader, load_dataset
from operators.models.hf import hf
from operators.models.microbatch import response_lengths, token_budget_split
from operators.roles import Actor, ActorConfig

BUDGET = 2048
#: ``--model`` choices: builtin ones by name, the others built by :func:`build_model_dir`
MODELS = {"builtin:tiny": None,
          "llama-25m": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8)}
#: ``max_new_tokens`` settings when ``--lengths`` is not given (the padded path of the larger model
#: at 512 would take minutes a step)
DEFAULT_LENGTHS = {"builtin:tiny": [8, 64, 128, 512], "llama-25m": [8, 128]}


def build_model_dir(name: str, root: str) -> str:
    """The model directory of ``MODELS[name]``'s shape (:func:`_common.llama_dir`); returns its path."""
    return llama_dir(MODELS[name], root, name)


def prompts(loader: PromptLoader, tokenizer_spec: str) -> DataProto:
    """The next batch as the runtime hands it to ``rollout.generate`` and the graph after it."""
    raw = loader.next_batch()
    rows = len(raw["input_ids"])
    uid = np.array([f"{i}" for i in range(rows)], dtype=object)
    return DataProto.from_dict(
        tensors={"prompts": raw["input_ids"], "prompt_mask": raw["attention_mask"]},
        non_tensors={"uid": uid, "data_source": raw["data_source"], "ground_truth": raw["ground_truth"],
                     "extra_info": raw["extra_info"]},
        meta_info={"tokenizer": tokenizer_spec},
    )


def update_positions(batch: DataProto, budget: int | None) -> int:
    """Positions the update's forward passes cover: micro-batches as ``fit`` cuts them (one without a
    budget), each as wide as its longest row's real tokens (the forward packs rows to column 0)."""
    width, total = batch["responses"].shape[1], batch["input_ids"].shape[1]
    real = batch["attention_mask"].sum(-1)
    parts = ([torch.arange(len(batch))] if budget is None
             else token_budget_split(response_lengths(batch), total - width, budget))
    return sum(len(rows) * int(real[rows].max()) for rows in parts)


def run_setting(model: str, max_new: int, trimmed: bool, steps: int, prompts_per_step: int,
                n: int) -> dict[str, float]:
    cfg = ActorConfig(model=model, optim={"lr": 5e-4, "grad_clip": 1.0}, rollout={"drop_finished": trimmed},
                      max_tokens_per_micro_batch=BUDGET if trimmed else None)
    role = Actor(cfg, RoleContext("actor", 0, 1, seed=0))
    loader = PromptLoader(load_dataset("builtin:skewed", role.tokenizer), batch_size=prompts_per_step, seed=0)
    params = sum(p.numel() for p in role.model.parameters())
    totals = dict(step=0.0, update=0.0, real=0, decode=0, update_pos=0, update_real=0, update_rate=0.0)
    # the machine may be shared: measure the peaks next to the work they are compared with
    core_peak, model_peak = peaks(role.model.config)
    for step in range(steps + 1):  # step 0 warms up allocators and kernels; not counted
        batch = prompts(loader, "builtin:tiny")
        t0 = time.perf_counter()
        out = rollout.generate(role, batch, n=n, max_new_tokens=max_new)
        out = out.union(DataProto.from_dict(
            non_tensors={k: np.repeat(batch.non_tensor_batch[k], n) for k in batch.non_tensor_batch},
            meta_info=batch.meta_info))
        out = out.union(reward.rule(out).rename("token_level_scores", "token_level_rewards"))
        out = out.union(advantage.grpo(out))
        out.rename("rollout_log_probs", "old_log_probs")
        t1 = time.perf_counter()
        actor_ops.update(role, out, clip_ratio=0.2)
        t2 = time.perf_counter()
        if step == 0:
            continue
        lengths = out["response_mask"].sum(-1)
        totals["step"] += t2 - t0
        totals["update"] += t2 - t1
        totals["real"] += int(lengths.sum())
        # decode: the padded path steps every row until the longest stops; the trimmed one only live rows
        totals["decode"] += int(lengths.sum()) if trimmed else len(lengths) * int(lengths.max())
        totals["update_pos"] += update_positions(out, cfg.max_tokens_per_micro_batch)
        totals["update_real"] += int(out["attention_mask"].sum())
        # like the peaks, the best of the timed steps: a step slowed by another process says nothing of the code
        totals["update_rate"] = max(totals["update_rate"], 6 * params * int(out["attention_mask"].sum()) / (t2 - t1))
    return {
        "s_per_step": totals["step"] / steps,
        "tokens_per_s": totals["real"] / totals["step"],
        "decode_pad": 1 - totals["real"] / totals["decode"],
        "update_pad": 1 - totals["update_real"] / totals["update_pos"],
        "update_flops": totals["update_rate"],
        "update_share": totals["update"] / totals["step"],
        "core_peak": core_peak, "model_peak": model_peak,
        "mean_len": totals["real"] / (steps * prompts_per_step * n), "params": params,
        "mlp_shape": f"2048x{role.model.config.hidden_size}x{role.model.config.intermediate_size}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(MODELS), default="builtin:tiny",
                    help="the policy: builtin:tiny (hidden 128) or llama-25m (hidden 512, 6 layers, MLP 2048)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="max_new_tokens settings (default: 8 64 128 512 for builtin:tiny, 8 128 for llama-25m)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per setting (after one warm-up step)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--smoke", action="store_true", help="builtin:tiny at 8 and 16 tokens, 1 step of 2 prompts x 2")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.lengths, args.steps, args.prompts, args.n = "builtin:tiny", [8, 16], 1, 2, 2
    args.lengths = args.lengths or DEFAULT_LENGTHS[args.model]
    hf("logging").disable_progress_bar()  # saving and loading llama-25m would draw bars between the tables

    results: dict[tuple[int, bool], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as root:
        model = args.model if MODELS[args.model] is None else build_model_dir(args.model, root)
        for max_new in args.lengths:
            for trimmed in (False, True):
                results[(max_new, trimmed)] = run_setting(model, max_new, trimmed, args.steps, args.prompts, args.n)

    rows = []
    for max_new in args.lengths:
        for trimmed in (False, True):
            r, base = results[(max_new, trimmed)], results[(max_new, False)]
            rows.append([
                str(max_new), "trimmed" if trimmed else "padded", f"{r['mean_len']:.1f}", f"{r['s_per_step']:.2f}",
                f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                f"{r['decode_pad']:.0%}", f"{r['update_pad']:.0%}", f"{r['update_share']:.0%}",
                f"{r['update_flops'] / r['core_peak']:.0%}", f"{r['update_flops'] / r['model_peak']:.0%}",
            ])
    first = args.lengths[0]
    core = [r["core_peak"] / 1e9 for r in results.values()]
    model = [r["model_peak"] / 1e9 for r in results.values()]
    any_result = next(iter(results.values()))
    notes = [f"{args.model}: {any_result['params'] / 1e6:.2f}M parameters",
             f"update MFU: 6·params·real tokens per second of update (the best timed step) over this core's "
             f"float32 matmul peak (512x512x512, one thread, measured before each setting: "
             f"{min(core):.0f}-{max(core):.0f} GFLOP/s); "
             f"vs model mm: over the model's own MLP matmul ({any_result['mlp_shape']}: "
             f"{min(model):.0f}-{max(model):.0f} GFLOP/s)",
             f"{args.prompts} prompts x {args.n} samples per step, {args.steps} timed steps per setting; "
             f"token budget {BUDGET} positions per micro-batch (trimmed)"]
    for trimmed in (False, True) if len(args.lengths) > 1 else ():
        label = "trimmed" if trimmed else "padded"
        at_first = results[(first, trimmed)]["tokens_per_s"]
        ratios = ", ".join(f"{m}: {at_first / results[(m, trimmed)]['tokens_per_s']:.2f}x"
                           for m in args.lengths[1:])
        notes.append(f"{label}: real tokens/s at {first} over the rate at ({ratios})  (goal at 128: <= 1.5x)")
    print_table(f"GRPO on builtin:skewed, {args.model}: padded vs trimmed",
                ["max_new_tokens", "path", "mean len", "s/step", "real tok/s", "vs padded", "decode pad",
                 "update pad", "update time", "update MFU", "vs model mm"], rows, notes)


if __name__ == "__main__":
    main()
