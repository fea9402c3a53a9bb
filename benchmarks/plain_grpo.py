"""Plain-PyTorch GRPO: the sequential loop flowrl's graph is measured against.

generate → reward → old log-prob → advantage → update, one after another, in
one process, with no Ray and no graph, on ``builtin:tiny`` and the default
``builtin:copy`` task. Hyperparameters: 32 prompts × 8 samples, 8 new tokens,
temperature 1, AdamW lr 5e-4 (constant), grad clip 1.0, clip ε 0.2, no KL,
token-mean loss, group-std-normalised advantages, one update per batch.

    python benchmarks/plain_grpo.py --steps 300 --seed 0
    python benchmarks/plain_grpo.py --smoke     # 3 steps of 4 prompts: a few seconds

prints the mean reward of every 25 steps, seconds per step, and the time of
each stage; ``run()`` returns the same numbers for other benchmarks to compare
against. ``--compare-generate`` also times the lean sampling loop against
``model.generate()`` on one batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from operators.algos import grpo_advantages, policy_loss  # noqa: E402
from operators.data import PromptLoader, load_dataset  # noqa: E402
from operators.models import OptimConfig, build_optimizer, clip_grad_norm, load_model, response_log_probs  # noqa: E402
from operators.rewards import compute_scores, place_at_last_token  # noqa: E402
from operators.rollout import HFRolloutEngine, SamplingParams  # noqa: E402

PROMPTS, SAMPLES, MAX_NEW_TOKENS, TEMPERATURE = 32, 8, 8, 1.0
OPTIM = OptimConfig(lr=5e-4, schedule="constant", grad_clip=1.0)
CLIP_RATIO = 0.2
STAGES = ("generate", "reward", "old_logprob", "advantage", "update")


@contextmanager
def timed(totals: dict[str, float], stage: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    totals[stage] += time.perf_counter() - start


def run(steps: int = 300, seed: int = 0, task: str = "builtin:copy", log_every: int = 25,
        verbose: bool = True) -> dict[str, Any]:
    """Train for ``steps`` and return ``{"rewards": [per step], "s_per_step", "stage_s": {stage: s/step}}``."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    policy, tokenizer = load_model("builtin:tiny", seed=seed)
    engine = HFRolloutEngine(policy, tokenizer, seed=seed)  # shares the policy's weights: no sync needed
    loader = PromptLoader(load_dataset(task, tokenizer, seed=seed), batch_size=PROMPTS, seed=seed)
    optimizer, scheduler = build_optimizer(policy.parameters(), OPTIM)
    sampling = SamplingParams(n=SAMPLES, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE)

    rewards: list[float] = []
    totals: dict[str, float] = defaultdict(float)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch = loader.next_batch()

        with timed(totals, "generate"):
            policy.eval()
            out = engine.generate(batch["input_ids"], batch["attention_mask"], sampling)
            mask = out["response_mask"]
            uid = np.repeat(np.arange(PROMPTS), SAMPLES)  # the samples of one prompt form a group
            seq = (out["input_ids"], out["attention_mask"], out["position_ids"])

        with timed(totals, "reward"):
            scores, _ = compute_scores(
                out["responses"], mask,
                data_source=np.repeat(batch["data_source"], SAMPLES),
                ground_truth=np.repeat(batch["ground_truth"], SAMPLES),
                tokenizer=tokenizer,
            )
            token_level_rewards = place_at_last_token(scores, mask)

        with timed(totals, "old_logprob"), torch.no_grad():
            old_log_prob, _ = response_log_probs(policy, *seq, MAX_NEW_TOKENS, TEMPERATURE)

        with timed(totals, "advantage"):
            advantages, _ = grpo_advantages(token_level_rewards, mask, index=uid)

        with timed(totals, "update"):
            policy.train()
            log_prob, _ = response_log_probs(policy, *seq, MAX_NEW_TOKENS, TEMPERATURE)
            loss = policy_loss(old_log_prob, log_prob, advantages, mask,
                               clip_ratio=CLIP_RATIO, loss_agg_mode="token-mean")
            optimizer.zero_grad(set_to_none=True)
            loss.pg_loss.backward()
            clip_grad_norm(policy.parameters(), OPTIM.grad_clip)
            optimizer.step()
            scheduler.step()

        rewards.append(float(scores.mean()))
        if verbose and step % log_every == 0:
            window = rewards[-log_every:]
            elapsed = time.perf_counter() - start
            print(f"step {step:4d}  reward/mean(last {len(window)}) {np.mean(window):.3f}  "
                  f"charts/s_per_step {elapsed / step:.3f}", flush=True)

    elapsed = time.perf_counter() - start
    result = {
        "rewards": rewards,
        "s_per_step": elapsed / steps,
        "stage_s": {stage: totals[stage] / steps for stage in STAGES},
    }
    if verbose:
        print(f"done: {steps} steps in {elapsed:.1f} s = {elapsed / steps:.3f} s/step; per stage (s/step): "
              + ", ".join(f"{k} {v:.4f}" for k, v in result["stage_s"].items()))
    return result


def compare_generate(seed: int = 0, repeats: int = 10) -> float:
    """Time ``HFRolloutEngine.generate`` against ``model.generate`` on one 32×8 batch; print the ratio."""
    torch.set_num_threads(1)
    policy, tokenizer = load_model("builtin:tiny", seed=seed)
    engine = HFRolloutEngine(policy, tokenizer, seed=seed)
    batch = PromptLoader(load_dataset("builtin:copy", tokenizer, seed=seed), batch_size=PROMPTS).next_batch()
    ids = batch["input_ids"].repeat_interleave(SAMPLES, 0)
    mask = batch["attention_mask"].repeat_interleave(SAMPLES, 0)
    sampling = SamplingParams(n=SAMPLES, max_new_tokens=MAX_NEW_TOKENS)

    def lean() -> None:
        engine.generate(batch["input_ids"], batch["attention_mask"], sampling)

    @torch.no_grad()
    def hf() -> None:  # with scores, since a rollout needs log-probs
        policy.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=MAX_NEW_TOKENS,
                        min_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                        output_scores=True, return_dict_in_generate=True)

    times = {}
    for name, fn in (("lean", lean), ("hf_generate", hf)):
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        times[name] = (time.perf_counter() - start) / repeats
    print(f"generate 32x8, 8 tokens: lean loop {times['lean'] * 1e3:.1f} ms, model.generate "
          f"{times['hf_generate'] * 1e3:.1f} ms -> ratio {times['hf_generate'] / times['lean']:.2f}x")
    return times["hf_generate"] / times["lean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default="builtin:copy")
    parser.add_argument("--json", type=Path, help="also write the per-step rewards and timings here")
    parser.add_argument("--compare-generate", action="store_true",
                        help="time the lean sampling loop against model.generate() first")
    parser.add_argument("--smoke", action="store_true", help="3 steps of 4 prompts, every step printed")
    args = parser.parse_args()
    global PROMPTS
    log_every = 25
    if args.smoke:
        args.steps, PROMPTS, log_every = 3, 4, 1
    if args.compare_generate:
        compare_generate(args.seed)
    result = run(args.steps, args.seed, args.task, log_every=log_every)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
