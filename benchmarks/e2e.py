"""End-to-end GRPO: seconds per step and generated tokens per second, flowrl vs a plain loop vs TRL.

The same job everywhere: ``builtin:tiny`` (0.53M-param Llama), the
``builtin:copy`` task, 32 prompts × 8 samples, 8 new tokens, temperature 1,
AdamW lr 5e-4, grad clip 1.0, clip ε 0.2, no KL, one optimizer step per batch,
one torch thread per process. Systems:

* **flowrl sync (ray)** — ``graphs/grpo.yaml`` (the baseline of the ratios): the
  rollout colocated with the actor on one 1-CPU pool, reward and advantage in
  that pool's process too (they read and feed only it); every stage waits for
  the one before it (staleness 0);
* **flowrl sync (local)** — the same graph on the in-process backend;
* **flowrl async (ray)** — ``graphs/grpo_async.yaml``: generation on its own
  1-CPU pool one weight version behind, so step t+1's rollout overlaps step
  t's update;
* **plain PyTorch** — ``benchmarks/plain_grpo.py``, stage by stage in one
  process. It also runs an old-log-prob forward pass that the flowrl graphs
  skip (they take π_old from the sampler), so its time without that stage is
  printed in the notes;
* **TRL GRPOTrainer** — when ``trl`` imports: the same model, tokenizer,
  prompts and token reward, ``beta=0``, ``num_iterations=1``, one generation
  per optimizer step (so TRL, too, skips the old-log-prob pass), ``use_vllm=False``,
  no logging or saving.

A step's time is the wall time between two consecutive finished steps, seen
from the driver (for flowrl, the ``Trainer``'s ``on_step`` callback; for the
plain loop, the start of two consecutive generations; for TRL, its
``on_step_end`` callback), so driver overhead and, for the async graph, the
overlap are in it. The first ``--warmup`` steps of every run are dropped
(Ray worker start-up, first-call allocations). s/step is the median over the
measured steps of all rounds; tokens/s is the mean generated tokens per step
(prompts × n × mean response length, EOS included) over the median s/step.
Systems run one after another, in reversed order every other round, so a
noisy neighbour's load is spread over all of them.

    python benchmarks/e2e.py                  # 40 steps (5 warm-up), 2 rounds: ~4 min on 2 cores
    python benchmarks/e2e.py --quick          # 20 steps (5 warm-up), 1 round: ~1.5 min
    python benchmarks/e2e.py --smoke          # 4 steps of 2 prompts, local backend and plain loop: seconds
    python benchmarks/e2e.py --prompts 16 --systems flowrl-ray-sync trl
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.set_num_threads(1)

from benchmarks._common import median, print_table  # noqa: E402

N_SAMPLES, MAX_NEW_TOKENS, LR, WEIGHT_DECAY, GRAD_CLIP, CLIP_RATIO = 8, 8, 5e-4, 0.01, 1.0, 0.2
BASELINE = "flowrl-ray-sync"


@dataclass
class Run:
    """What one system did in one run: per measured step, wall seconds, tokens and reward."""

    step_s: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # every step, warm-up included
    phases: dict[str, list[float]] = field(default_factory=dict)  # phase → seconds per measured step

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases.setdefault(name, []).append(seconds)


def measured(stamps: list[float], warmup: int) -> list[float]:
    """Wall seconds of steps warmup+1.. from the finish times of every step."""
    return [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]


# ---------------------------------------------------------------- flowrl
def run_flowrl(graph: str, backend: str, steps: int, warmup: int, prompts: int) -> Run:
    from flowrl.graph import load_graph
    from flowrl.run.trainer import Trainer

    stamps: list[float] = []
    rows: list[dict[str, float]] = []

    def on_step(_step: int, row: dict[str, float]) -> None:
        stamps.append(time.perf_counter())
        rows.append(row)

    # nothing but training steps: no checkpoints, validation or rollout dumps inside the timed steps
    g = load_graph(graph, overrides={"data.batch_size": prompts, "trainer.checkpoint_every": 0,
                                     "trainer.val_every": 0, "trainer.dump_rollouts": False})
    with tempfile.TemporaryDirectory(prefix="flowrl-e2e-") as out:
        Trainer(g, backend=backend, steps=steps, out=out, on_step=on_step, say=lambda _: None).run()
    run = Run(step_s=measured(stamps, warmup), rewards=[r["reward/mean"] for r in rows])
    for row in rows[warmup + 1:]:
        run.tokens.append(prompts * N_SAMPLES * row["response_length/mean"])
        for name in ("generate", "reward", "advantage", "update_actor", "step"):
            run.add_phase(name, row[f"timing/{name}"])
    return run


# ---------------------------------------------------------------- plain PyTorch
def run_plain(steps: int, warmup: int, prompts: int) -> Run:
    """``plain_grpo.run`` with its rollout engine wrapped to stamp each step's start and count tokens."""
    from benchmarks import plain_grpo

    starts: list[float] = []
    lengths: list[float] = []

    class StampedEngine(plain_grpo.HFRolloutEngine):
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            starts.append(time.perf_counter())
            out = super().generate(*args, **kwargs)
            lengths.append(float(out["response_mask"].sum()))
            return out

    saved = plain_grpo.HFRolloutEngine, plain_grpo.PROMPTS
    plain_grpo.HFRolloutEngine, plain_grpo.PROMPTS = StampedEngine, prompts
    try:
        # one extra step: a step ends where the next one's generation starts
        result = plain_grpo.run(steps + 1, seed=0, verbose=False)
    finally:
        plain_grpo.HFRolloutEngine, plain_grpo.PROMPTS = saved
    run = Run(step_s=measured(starts, warmup), tokens=lengths[warmup:steps], rewards=result["rewards"][:steps])
    # stage times are only given as means over all steps (warm-up included)
    for stage, s in result["stage_s"].items():
        run.phases[stage] = [s]
    return run


# ---------------------------------------------------------------- TRL
def trl_version() -> str | None:
    try:
        import trl
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return trl.__version__


def run_trl(steps: int, warmup: int, prompts: int) -> Run:
    """TRL's GRPOTrainer on the builtin model, prompts and token reward; phases timed by wrapping its methods."""
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from operators.data import load_dataset
    from operators.models import load_model
    from operators.rewards.rule import task_token_score

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames, seen through TRL
    torch.manual_seed(0)
    model, tok = load_model("builtin:tiny", seed=0)
    rows = prompts * (steps + 2)
    ds = load_dataset("builtin:copy", tok, seed=0, task_size=rows)
    texts, truths = [], []
    for i in range(rows):
        ids = ds.prompt_ids(i)
        text = tok.decode(ids)  # "<bos> copy 8 6 =": TRL tokenizes it back to the same ids
        assert tok(text)["input_ids"] == ids, (text, ids)
        texts.append(text)
        truths.append(ds.rows[i]["reward_model"]["ground_truth"])
    train = datasets.Dataset.from_dict({"prompt": texts, "ground_truth": truths})

    run = Run()
    targets: dict[str, list[int]] = {}

    def copy_reward(completion_ids: list[list[int]], ground_truth: list[str], **_: Any) -> list[float]:
        """flowrl's builtin task reward on the completion's token ids (EOS included, as in flowrl)."""
        scores = []
        for ids, truth in zip(completion_ids, ground_truth):
            if truth not in targets:
                targets[truth] = tok.encode(truth, add_special_tokens=False)
            scores.append(task_token_score(ids, targets[truth], tok.eos_token_id))
        run.rewards.append(sum(scores) / len(scores))
        run.tokens.append(float(sum(len(ids) for ids in completion_ids)))
        return scores

    with tempfile.TemporaryDirectory(prefix="trl-e2e-") as out:
        args = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=False, seed=0, report_to="none",
            logging_strategy="no", save_strategy="no", disable_tqdm=True,
            max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", weight_decay=WEIGHT_DECAY,
            max_grad_norm=GRAD_CLIP, per_device_train_batch_size=prompts * N_SAMPLES,
            gradient_accumulation_steps=1, steps_per_generation=1, num_generations=N_SAMPLES,
            max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
            beta=0.0, num_iterations=1, epsilon=CLIP_RATIO, loss_type="dapo", scale_rewards="group",
            use_vllm=False, dataloader_num_workers=0, dataloader_pin_memory=False,
        )
        stamps: list[float] = []

        class Stamp(transformers.TrainerCallback):
            def on_step_begin(self, *a: Any, **k: Any) -> None:
                if not stamps:
                    stamps.append(time.perf_counter())

            def on_step_end(self, *a: Any, **k: Any) -> None:
                stamps.append(time.perf_counter())

        trainer = GRPOTrainer(model=model, reward_funcs=copy_reward, args=args, train_dataset=train,
                              processing_class=tok, callbacks=[Stamp()])
        trainer.remove_callback(transformers.PrinterCallback)  # its end-of-training summary
        phase_s: dict[str, list[float]] = {}

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*a: Any, **k: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    phase_s.setdefault(name, []).append(time.perf_counter() - t0)
            return wrapper

        # prepare = generate + reward + advantages; the rest of a step is the update
        # (log-prob forward with grad, backward, clip, optimizer step)
        trainer._generate = timed("generate", trainer._generate)
        trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
        trainer._prepare_inputs = timed("prepare", trainer._prepare_inputs)
        torch.set_num_threads(1)
        trainer.train()
    step_s = [b - a for a, b in zip(stamps, stamps[1:])]  # stamps[0]: the first step's start
    run.step_s = step_s[warmup:]
    run.tokens = run.tokens[warmup:steps]
    for i in range(warmup, min(steps, len(step_s))):
        gen, rew, prep = (phase_s[k][i] for k in ("generate", "reward", "prepare"))
        run.add_phase("generate", gen)
        run.add_phase("reward+adv", prep - gen)
        run.add_phase("update", step_s[i] - prep)
    return run


# ---------------------------------------------------------------- driver
SYSTEMS: dict[str, tuple[str, Callable[[int, int, int], Run]]] = {
    "flowrl-ray-sync": ("flowrl grpo (ray, sync)", lambda s, w, p: run_flowrl("grpo", "ray", s, w, p)),
    "flowrl-ray-async": ("flowrl grpo_async (ray, staleness 1)",
                         lambda s, w, p: run_flowrl("grpo_async", "ray", s, w, p)),
    "flowrl-local-sync": ("flowrl grpo (local, sync)", lambda s, w, p: run_flowrl("grpo", "local", s, w, p)),
    "plain": ("plain PyTorch stage by stage", run_plain),
    "trl": ("TRL GRPOTrainer", run_trl),
}


def init_ray() -> None:
    """One local Ray for every flowrl run (flowrl leaves a Ray it did not start running), so its
    start-up is paid once; the same settings as flowrl's own ``ray.init``."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})


def fmt(x: float, digits: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="steps per run, warm-up included (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each run not measured")
    parser.add_argument("--rounds", type=int, default=None, help="runs of every system (default 2)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (× 8 samples)")
    parser.add_argument("--quick", action="store_true", help="20 steps, 1 round")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--smoke", action="store_true",
                        help="4 steps (1 warm-up) of 2 prompts, 1 round, flowrl-local-sync and plain only")
    args = parser.parse_args()
    if args.smoke:  # the Ray systems take their own start-up each: the local one covers the same Trainer path
        args.steps, args.warmup, args.rounds, args.prompts = 4, 1, 1, 2
        args.systems = ["flowrl-local-sync", "plain"]
    steps = args.steps or (20 if args.quick else 40)
    rounds = args.rounds or (1 if args.quick else 2)
    if steps < args.warmup + 2:
        parser.error(f"--steps must be at least --warmup + 2 = {args.warmup + 2}")

    systems = list(args.systems)
    version = trl_version()
    if "trl" in systems and version is None:
        print("trl does not import: TRL row skipped (pip install torch==2.13.0 trl)")
        systems.remove("trl")
    if any(s.startswith("flowrl-ray") for s in systems):
        init_ray()

    print(f"{args.prompts} prompts × {N_SAMPLES} samples, {MAX_NEW_TOKENS} new tokens, {steps} steps per run "
          f"({args.warmup} warm-up), {rounds} round(s); load average {os.getloadavg()[0]:.2f}", flush=True)
    runs: dict[str, list[Run]] = {s: [] for s in systems}
    for r in range(rounds):
        for s in (systems if r % 2 == 0 else systems[::-1]):
            t0 = time.perf_counter()
            run = SYSTEMS[s][1](steps, args.warmup, args.prompts)
            runs[s].append(run)
            print(f"  round {r + 1}: {s:18s} {median(run.step_s):.3f} s/step ({time.perf_counter() - t0:.0f} s "
                  f"with start-up), load {os.getloadavg()[0]:.2f}", flush=True)

    stats = {}
    for s, rs in runs.items():
        step = median([x for run in rs for x in run.step_s])
        toks = [x for run in rs for x in run.tokens]
        per_step = sum(toks) / len(toks) if toks else float("nan")
        first = [sum(run.rewards[:5]) / 5 for run in rs]
        last = [sum(run.rewards[-5:]) / 5 for run in rs]
        stats[s] = dict(step=step, tps=per_step / step, first=sum(first) / len(first), last=sum(last) / len(last))

    base = stats.get(BASELINE, {}).get("step")
    trl = stats.get("trl", {}).get("step")
    header = ["system", "key", "s/step", "tokens/s", "vs flowrl sync (×time)"]
    if trl is not None:
        header.append("vs TRL (×time)")
    header.append("reward first 5 → last 5")
    rows = []
    for s in systems:
        st = stats[s]
        row = [SYSTEMS[s][0], s, fmt(st["step"]), f"{st['tps']:.0f}",
               fmt(st["step"] / base, 2) if base else "-"]
        if trl is not None:
            row.append(fmt(st["step"] / trl, 2))
        row.append(f"{st['first']:.3f} → {st['last']:.3f}")
        rows.append(row)

    notes = ["ratios are s/step ÷ the other system's s/step: below 1 is faster; phases are the operators' own "
             "times (flowrl: timing/<node>; 'step' is one step's makespan, which with staleness 1 spans the "
             "previous step's update too)"]
    for s in systems:
        phases = {k: median([x for run in runs[s] for x in run.phases.get(k, [])]) for k in runs[s][0].phases}
        notes.append(f"{s}: per-step phases (s, median) " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    if "plain" in stats:
        stage = {k: median([run.phases[k][0] for run in runs["plain"]]) for k in runs["plain"][0].phases}
        notes.append(f"plain without its old-log-prob pass (which the flowrl graphs and TRL skip): "
                     f"{stats['plain']['step'] - stage['old_logprob']:.3f} s/step")
    if trl is not None and base:
        notes.append(f"goal: flowrl sync within 1.3× of TRL's step time: {base / trl:.2f}× "
                     f"({'met' if base / trl <= 1.3 else 'not met'})")
        if "flowrl-ray-async" in stats:
            a = stats["flowrl-ray-async"]["step"] / trl
            notes.append(f"goal: flowrl staleness 1 faster than TRL: {a:.2f}× ({'met' if a < 1 else 'not met'})")
    if version:
        notes.append(f"TRL {version}")
    print_table(f"GRPO end to end, {args.prompts}×{N_SAMPLES}, 1 torch thread per process, "
                f"{os.cpu_count()} cores", header, rows, notes)


if __name__ == "__main__":
    main()
