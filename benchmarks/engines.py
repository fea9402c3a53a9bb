"""Rollout engines side by side: the transformers (``hf``) engine against vLLM, on one CPU core.

For each model and dtype: 64 prompts × 8 samples (temperature 1, keyed
seeds), ``max_new_tokens`` new tokens, through each engine's ``generate``;
reported are real (response-mask) tokens per second of each and the ratio
vLLM / hf, vLLM's start-up, and the time to push the model's weights into the
running vLLM engine (``update_weights``, in 64 MiB buckets) against their size.
Each engine gets one untimed warm-up call first. Then the default job (``grpo``,
local backend) for ``--steps`` steps on each engine: where its step time goes
(median seconds of the step, ``generate``, and ``update_actor``, which holds the
push into vLLM and its check). Nothing is asserted: timings on
a shared machine are noisy; run it twice before believing a ratio.

It needs vLLM for its vLLM half: run it with build/vllm-venv's Python (``bash
scripts/vllm_env.sh``). Without vLLM it runs the hf half alone and says so.

    build/vllm-venv/bin/python benchmarks/engines.py --smoke    # builtin:tiny, fp32, 8 tokens: mostly start-up
    build/vllm-venv/bin/python benchmarks/engines.py                # builtin:tiny and llama-25m, fp32 and bf16
    build/vllm-venv/bin/python benchmarks/engines.py --models builtin:tiny --lengths 128 512
    build/vllm-venv/bin/python benchmarks/engines.py --models --steps 40       # the default job's steps only
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time

import _common  # noqa: F401  (repository on sys.path, one torch thread)
import torch

from _common import print_table
from flowrl.graph import load_graph
from flowrl.run.trainer import Trainer
from operators.models import load_model
from operators.rollout import HFRolloutEngine, SamplingParams
from operators.rollout.base import prompt_seeds
from operators.rollout.vllm_engine import VLLMRolloutEngine
from tokens import MODELS, build_model_dir


def prompts(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` left-padded task-like prompts over builtin:tiny's vocabulary (``<bos> word digits =``)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        digits = torch.randint(4, 14, (int(torch.randint(2, 7, (1,), generator=generator)),), generator=generator)
        rows.append([1, int(torch.randint(20, 27, (1,), generator=generator)), *digits.tolist(), 16])
    width = max(map(len, rows))
    ids = torch.zeros((count, width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
    return ids, (ids != 0).long()


def timed_generate(engine, ids, mask, params, seeds) -> tuple[float, int]:
    start = time.perf_counter()
    out = engine.generate(ids, mask, params, seeds=seeds)
    return time.perf_counter() - start, int(out["response_mask"].sum())


def default_job_steps(engine: str, steps: int, overrides: dict) -> list[str]:
    """The default job on ``engine`` for ``steps`` steps (local backend): medians after the first step."""
    graph = load_graph("grpo", overrides={**overrides, "roles.actor.rollout.engine": engine, "trainer.val_every": 0,
                                          "trainer.checkpoint_every": 0})
    with tempfile.TemporaryDirectory() as out:
        rows = Trainer(graph, backend="local", steps=steps, out=out, say=lambda _: None).run()[1:]

    def median(key: str) -> str:
        values = sorted(r[key] for r in rows if key in r)
        return f"{values[len(values) // 2]:.3f}" if values else "-"

    return [engine, str(len(rows)), median("timing/step"), median("timing/generate"), median("timing/update_actor"),
            median("rollout/weight_push_s")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["builtin:tiny", "llama-25m"], choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[128])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40, help="steps of the default job per engine (0: none)")
    parser.add_argument("--smoke", action="store_true", help="builtin:tiny, fp32, 8 prompts x 2 samples x 8 tokens")
    args = parser.parse_args()
    job: dict = {}
    if args.smoke:
        args.models, args.dtypes, args.lengths, args.prompts, args.n = ["builtin:tiny"], ["float32"], [8], 8, 2
        args.steps, job = 3, {"data.batch_size": 4, "nodes.generate.n": 2}

    has_vllm = importlib.util.find_spec("vllm") is not None
    ids, mask = prompts(args.prompts)
    seeds = prompt_seeds(list(range(args.prompts)), seed=0)
    rows, push_rows = [], []
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            spec = name if MODELS[name] is None else build_model_dir(name, root)
            for dtype in args.dtypes:
                model, tok = load_model(spec, dtype=dtype, seed=0)
                params_m = sum(p.numel() for p in model.parameters()) / 1e6
                hf = HFRolloutEngine(model, tok, seed=0)
                start = time.perf_counter()
                kv_mib = 2048 if MODELS[name] else 256
                vllm = VLLMRolloutEngine.from_model(model, tok, seed=0, options={
                    "kv_cache_mib": kv_mib, "max_num_seqs": 512}) if has_vllm else None
                startup = time.perf_counter() - start
                try:
                    for engine in (hf, vllm) if vllm else (hf,):  # warm-up: first-call allocations, kernels
                        engine.generate(ids[:2], mask[:2], SamplingParams(max_new_tokens=4), seeds=seeds[:2])
                    for length in args.lengths:
                        params = SamplingParams(n=args.n, max_new_tokens=length)
                        hf_s, hf_tokens = timed_generate(hf, ids, mask, params, seeds)
                        row = [name, dtype, f"{params_m:.2f}", str(length), f"{hf_tokens}", f"{hf_tokens / hf_s:,.0f}"]
                        if vllm is None:
                            rows.append(row + ["-"] * 4)
                            continue
                        v_s, v_tokens = timed_generate(vllm, ids, mask, params, seeds)
                        rows.append(row + [f"{v_tokens}", f"{v_tokens / v_s:,.0f}",
                                           f"{(v_tokens / v_s) / (hf_tokens / hf_s):.2f}x", f"{startup:.0f}"])
                    if vllm is None:
                        continue
                    state = {k: v + 0.01 for k, v in model.state_dict().items()}
                    pushes = [vllm.update_weights(state, version=v) for v in range(1, 4)]
                    best = min(p["rollout/weight_push_s"] for p in pushes)
                    mb = pushes[0]["rollout/weight_push_mb"]
                    push_rows.append([name, dtype, f"{mb:.1f}", f"{int(pushes[0]['rollout/weight_push_buckets'])}",
                                      f"{best:.3f}", f"{mb / best:,.0f}"])
                finally:
                    if vllm is not None:
                        vllm.shutdown()

    print_table(f"rollout engines: {args.prompts} prompts x {args.n} samples, temperature 1, one CPU core",
                ["model", "dtype", "params (M)", "new tokens", "hf tokens", "hf tok/s", "vllm tokens",
                 "vllm tok/s", "vllm/hf", "vllm start (s)"], rows,
                notes=["tokens: real response tokens (response_mask); untrained models, so lengths differ by engine "
                       "(sampling streams differ)"]
                + ([] if has_vllm else ["vLLM is not installed in this Python: the hf half only (run it with "
                                        "build/vllm-venv/bin/python, built by `bash scripts/vllm_env.sh`)"]))
    if has_vllm and push_rows:
        print_table("weight push into the running vLLM engine (best of 3)",
                    ["model", "dtype", "MiB", "buckets", "seconds", "MiB/s"], push_rows)
    if args.steps > 1:
        steps = [default_job_steps(engine, args.steps, job) for engine in (["hf", "vllm"] if has_vllm else ["hf"])]
        print_table(f"the default job (grpo, local backend), median of steps 2-{args.steps}",
                    ["engine", "steps", "step s", "generate s", "update_actor s (push, check)", "push s"], steps)


if __name__ == "__main__":
    main()
