"""Rollout engines side by side, interleaved: raw vLLM, flowrl's vLLM engine and flowrl's hf engine.

For each model: ``--prompts`` prompts × ``--n`` samples (temperature 1, a keyed
seed per prompt, the sampled tokens' log-probs), ``--tokens`` new tokens, in
``--rounds`` rounds of A B C (A: raw vLLM's ``LLM.generate``, in a process of its
own, in-process engine core, one request per prompt with ``n`` and the prompt's
seed, flat log-probs; B: flowrl's ``VLLMRolloutEngine.generate``; C: flowrl's
``HFRolloutEngine.generate``). Reported: median tokens/s of each and the
per-round ratios B/A and B/C. Then the weight push: ``update_weights`` of the
whole state dict against ``torch.save`` of the same state dict to ``/dev/shm``,
interleaved, MiB/s and the per-round ratio; and the probe check alone. Then
start-up, build to first token, vLLM against hf: in this process (vLLM's import in the first
round only), and from a fresh process with every import (``--cold-rounds``). Then (``--steps``) the default
job on each engine, where its step time goes by phase. Every figure carries the
load average beside it: on a shared machine, compare ratios, not seconds.

It needs vLLM: run it with build/vllm-venv's Python (``bash scripts/vllm_env.sh``).

    build/vllm-venv/bin/python benchmarks/engines.py --smoke          # builtin:tiny, 2 rounds, a few tokens
    build/vllm-venv/bin/python benchmarks/engines.py                  # builtin:tiny and llama-30m, 5 rounds
    build/vllm-venv/bin/python benchmarks/engines.py --models builtin:smollm2-135m --tokens 64
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _common  # noqa: F401  (repository on sys.path, one torch thread)
import torch

from _common import llama_dir, print_table
from operators.models import load_model
from operators.models.hf import hf
from operators.rollout import HFRolloutEngine, SamplingParams
from operators.rollout.base import prompt_seeds
from operators.rollout.vllm_engine import VLLMRolloutEngine, save_for_vllm
from operators.rollout.vllm_engine.weights import shm_dir

#: the models: builtin ones by spec; Llama shapes over builtin:tiny's vocabulary (llama-30m: the issue's 29M)
MODELS = {"builtin:tiny": None, "builtin:smollm2-135m": None,
          "llama-30m": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8)}


def load(name: str, root: str):
    """``(model, tokenizer)`` of ``name`` (fp32, seed 0)."""
    if MODELS[name] is None:
        return load_model(name, dtype="float32", seed=0)
    return load_model(llama_dir(MODELS[name], root, name), dtype="float32", seed=0)


def prompts(count: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` left-padded prompts of 4-9 tokens (ids 4 ... min(vocab, 30)), id 1 first."""
    generator = torch.Generator().manual_seed(seed)
    rows = [[1, *torch.randint(4, min(vocab, 30), (int(torch.randint(3, 9, (1,), generator=generator)),),
                               generator=generator).tolist()] for _ in range(count)]
    width = max(map(len, rows))
    ids = torch.zeros((count, width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
    return ids, (ids != 0).long()


def load_average() -> float:
    return os.getloadavg()[0]


# --- raw vLLM, in a process of its own ---------------------------------------------------------------

def raw_vllm(conn, model_dir: str, kv_mib: int, max_num_seqs: int) -> None:
    """Serve timed ``LLM.generate`` calls over ``conn``: ``(prompts, seeds, n, tokens, stop ids)`` in,
    ``(seconds, real tokens)`` out; ``None`` ends it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as flowrl's engine runs it on CPU
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    from vllm import LLM, SamplingParams as VSampling

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True,
              max_num_seqs=max_num_seqs, enable_chunked_prefill=False, kv_cache_memory_bytes=kv_mib * 2**20,
              logprobs_mode="processed_logprobs", disable_log_stats=True)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        rows, seeds, n, tokens, stops = job
        params = [VSampling(n=n, max_tokens=tokens, temperature=1.0, seed=seed, stop_token_ids=stops, logprobs=0,
                            flat_logprobs=True, detokenize=False) for seed in seeds]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        conn.send((seconds, sum(len(c.token_ids) for o in outs for c in o.outputs)))


def generation(name: str, model, tok, args) -> list[list[str]]:
    ids, mask = prompts(args.prompts, model.config.vocab_size)
    seeds = prompt_seeds(list(range(args.prompts)), seed=0)
    params = SamplingParams(n=args.n, max_new_tokens=args.tokens, temperature=1.0)
    options = {"kv_cache_mib": args.kv_mib}
    ours = VLLMRolloutEngine.from_model(model, tok, seed=0, options=options)
    hf_engine = HFRolloutEngine(model, tok, seed=0)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    raw = multiprocessing.get_context("spawn").Process(
        target=raw_vllm, args=(child, str(save_for_vllm(model, tok)), args.kv_mib, ours.max_num_seqs))
    raw.start()
    parent.recv()
    rows = [r[m.bool()].tolist() for r, m in zip(ids, mask)]
    job = (rows, [int(s) & (2**62 - 1) for s in seeds.tolist()], args.n, args.tokens, ours.stop_token_ids)

    def run_raw() -> tuple[float, int]:
        parent.send(job)
        return parent.recv()

    def run(engine) -> tuple[float, int]:
        start = time.perf_counter()
        out = engine.generate(ids, mask, params, seeds=seeds)
        return time.perf_counter() - start, int(out["response_mask"].sum())

    rates = {"raw": [], "flowrl": [], "hf": []}
    loads = []
    try:
        run_raw(), run(ours), run(hf_engine)  # warm-up: first-call allocations
        for _ in range(args.rounds):
            loads.append(load_average())
            for key, fn in (("raw", run_raw), ("flowrl", lambda: run(ours)), ("hf", lambda: run(hf_engine))):
                seconds, tokens = fn()
                rates[key].append(tokens / seconds)
        pushes = push_rounds(ours, model, args.rounds)
    finally:
        parent.send(None)
        raw.join(60)
        ours.shutdown()
    ratio_raw = [f / r for f, r in zip(rates["flowrl"], rates["raw"])]
    ratio_hf = [f / h for f, h in zip(rates["flowrl"], rates["hf"])]
    gen = [name, f"{statistics.median(rates['raw']):,.0f}", f"{statistics.median(rates['flowrl']):,.0f}",
           f"{statistics.median(rates['hf']):,.0f}", f"{statistics.median(ratio_raw):.2f}x",
           " ".join(f"{r:.2f}" for r in ratio_raw), f"{statistics.median(ratio_hf):.2f}x",
           f"{min(loads):.1f}-{max(loads):.1f}"]
    return gen, [name, *pushes]


def push_rounds(engine: VLLMRolloutEngine, model, rounds: int) -> list[str]:
    """``update_weights`` of the whole state dict against ``torch.save`` of it to ``/dev/shm``, interleaved."""
    state = {k: v + 0.01 for k, v in model.state_dict().items()}
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    path = os.path.join(shm_dir(), f"flowrl-bench-{os.getpid()}.pt")
    push, save, check, loads = [], [], [], []
    try:
        for version in range(1, rounds + 1):
            loads.append(load_average())
            start = time.perf_counter()
            engine.update_weights(state, version=version)
            push.append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.save(state, path)
            save.append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.weights_fingerprint()
            check.append(time.perf_counter() - start)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    ratios = [s / p for p, s in zip(push, save)]  # bandwidth ratio push / save
    return [f"{mib:.1f}", f"{statistics.median(push) * 1e3:.1f}", f"{mib / statistics.median(push):,.0f}",
            f"{mib / statistics.median(save):,.0f}", f"{statistics.median(ratios):.2f}x",
            " ".join(f"{r:.2f}" for r in ratios), f"{statistics.median(check) * 1e3:.1f}",
            f"{min(loads):.1f}-{max(loads):.1f}"]


def startup(name: str, model, tok, rounds: int) -> list[str]:
    """Build to first token, hf and vLLM interleaved (the vLLM model directory already written)."""
    ids, mask = prompts(1, model.config.vocab_size)
    save_for_vllm(model, tok)
    hf_s, vllm_s, loads = [], [], []
    for _ in range(rounds):
        loads.append(load_average())
        start = time.perf_counter()
        HFRolloutEngine(model, tok, seed=0).generate(ids, mask, SamplingParams(max_new_tokens=1))
        hf_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine = VLLMRolloutEngine.from_model(model, tok, seed=0, options={"kv_cache_mib": 64})
        engine.generate(ids, mask, SamplingParams(max_new_tokens=1))
        vllm_s.append(time.perf_counter() - start)
        engine.shutdown()
    hf_m, vllm_m = statistics.median(hf_s), statistics.median(vllm_s)
    return [name, f"{hf_m:.2f}", f"{vllm_m:.1f}", f"{2 * hf_m + 15:.1f}", " ".join(f"{s:.1f}" for s in vllm_s),
            f"{min(loads):.1f}-{max(loads):.1f}"]


def cold_child(engine: str, name: str, root: str) -> None:
    """(``--cold-child``) ``engine`` built in this fresh process from nothing imported, to its first token."""
    model, tok = load(name, root)
    ids, mask = prompts(1, model.config.vocab_size)
    if engine == "hf":
        HFRolloutEngine(model, tok, seed=0).generate(ids, mask, SamplingParams(max_new_tokens=1))
    else:
        VLLMRolloutEngine.from_model(model, tok, seed=0, options={"kv_cache_mib": 64}).generate(
            ids, mask, SamplingParams(max_new_tokens=1))
    print("FIRST-TOKEN", flush=True)
    os._exit(0)  # the time measured ends at the line; the engine's shutdown is not part of it


def cold_startup(name: str, root: str, rounds: int) -> list[str]:
    """Each engine from a fresh process, every import included (torch, transformers; vLLM for vLLM), to its
    first token, hf and vLLM interleaved: the wall time from starting the process to the first token."""
    times, loads = {"hf": [], "vllm": []}, []
    for _ in range(rounds):
        loads.append(load_average())
        for engine in times:
            start = time.perf_counter()
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--cold-child", engine, name, root],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for line in proc.stdout:
                if line.startswith("FIRST-TOKEN"):
                    times[engine].append(time.perf_counter() - start)
            if proc.wait() != 0 or len(times[engine]) < len(loads):
                raise RuntimeError(f"the {engine} engine did not start in a fresh process ({name})")
    hf_m, vllm_m = statistics.median(times["hf"]), statistics.median(times["vllm"])
    return [name, f"{hf_m:.1f}", f"{vllm_m:.1f}", f"{2 * hf_m + 15:.1f}",
            " ".join(f"{h:.1f}/{v:.1f}" for h, v in zip(times["hf"], times["vllm"])), f"{min(loads):.1f}-{max(loads):.1f}"]


def hf_only(name: str, model, tok, args) -> list[str]:
    """The hf engine's tokens/s alone, where vLLM is not installed (the main environment)."""
    ids, mask = prompts(args.prompts, model.config.vocab_size)
    seeds = prompt_seeds(list(range(args.prompts)), seed=0)
    params = SamplingParams(n=args.n, max_new_tokens=args.tokens, temperature=1.0)
    engine, rates, loads = HFRolloutEngine(model, tok, seed=0), [], []
    engine.generate(ids, mask, params, seeds=seeds)  # warm-up: first-call allocations
    for _ in range(args.rounds):
        loads.append(load_average())
        start = time.perf_counter()
        out = engine.generate(ids, mask, params, seeds=seeds)
        rates.append(int(out["response_mask"].sum()) / (time.perf_counter() - start))
    return [name, f"{statistics.median(rates):,.0f}", " ".join(f"{r:,.0f}" for r in rates),
            f"{min(loads):.1f}-{max(loads):.1f}"]


def default_job(steps: int, overrides: dict, engines: tuple[str, ...]) -> list[list[str]]:
    """The default job (grpo, local backend) on each engine, interleaved step counts: medians after step 1."""
    from flowrl.graph import load_graph
    from flowrl.run.trainer import Trainer

    rows = []
    for engine in engines:
        graph = load_graph("grpo", overrides={**overrides, "roles.actor.rollout.engine": engine,
                                              "trainer.val_every": 0, "trainer.checkpoint_every": 0})
        load = load_average()
        with tempfile.TemporaryDirectory() as out:
            metrics = Trainer(graph, backend="local", steps=steps, out=out, say=lambda _: None).run()[1:]

        def median(key: str) -> str:
            values = [r[key] for r in metrics if key in r]
            return f"{statistics.median(values):.3f}" if values else "-"

        rows.append([engine, str(len(metrics)), median("timing/step"), median("timing/generate"),
                     median("timing/update_actor"), median("rollout/weight_push_s"), f"{load:.1f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=["builtin:tiny", "llama-30m"], choices=list(MODELS))
    parser.add_argument("--tokens", type=int, default=128, help="max_new_tokens")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians over them)")
    parser.add_argument("--start-rounds", type=int, default=2, help="engine starts of each kind per model")
    parser.add_argument("--kv-mib", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=0, help="steps of the default job per engine (0: none)")
    parser.add_argument("--cold-rounds", type=int, default=2,
                        help="engine starts of each kind from a fresh process, every import included")
    parser.add_argument("--smoke", action="store_true", help="builtin:tiny, 2 rounds, 8 prompts x 2 x 8 tokens")
    parser.add_argument("--cold-child", nargs=3, help=argparse.SUPPRESS)  # ENGINE MODEL ROOT: one cold start
    args = parser.parse_args()
    if args.cold_child:
        cold_child(*args.cold_child)
    job: dict = {}
    if args.smoke:
        args.models, args.tokens, args.prompts, args.n, args.rounds, args.start_rounds, args.cold_rounds = (
            ["builtin:tiny"], 8, 8, 2, 2, 1, 1)
        args.steps, job = 3, {"data.batch_size": 4, "nodes.generate.n": 2}
    hf("logging").disable_progress_bar()
    have_vllm = importlib.util.find_spec("vllm") is not None
    engines = ("hf", "vllm") if have_vllm else ("hf",)
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:  # each model's tables as soon as it is measured: a long run shows progress
            model, tok = load(name, root)
            if not have_vllm:
                print_table(f"rollout engines: hf only, {args.prompts} prompts x {args.n} samples x {args.tokens} "
                            f"tokens, median of {args.rounds} rounds", ["model", "hf tok/s", "per round", "load"],
                            [hf_only(name, model, tok, args)],
                            notes=["vLLM is not installed in this environment: run this script with "
                                   "build/vllm-venv/bin/python (bash scripts/vllm_env.sh) for raw vLLM, flowrl's "
                                   "vLLM engine, the push and start-up"])
                continue
            if args.start_rounds:  # first: the first model's first round includes importing vLLM
                print_table("start-up, build to first token (median; the first model's first vLLM round imports "
                            "vLLM)", ["model", "hf s", "vLLM s", "2 x hf + 15 s", "vLLM rounds", "load"],
                            [startup(name, model, tok, args.start_rounds)])
            if args.cold_rounds:
                print_table("start-up from a fresh process, every import included, to the first token (median)",
                            ["model", "hf s", "vLLM s", "2 x hf + 15 s", "rounds hf/vLLM", "load"],
                            [cold_startup(name, root, args.cold_rounds)])
            gen, push = generation(name, model, tok, args)
            print_table(f"generation: {args.prompts} prompts x {args.n} samples x {args.tokens} tokens, "
                        f"temperature 1, keyed seeds, log-probs; median of {args.rounds} interleaved rounds "
                        "(tokens/s)", ["model", "raw vLLM", "flowrl vLLM", "flowrl hf", "flowrl/raw", "per round",
                                       "flowrl/hf", "load"], [gen],
                        notes=["raw vLLM: LLM.generate in a process of its own, in-process engine core, one "
                               "request per prompt with n and its seed, flat log-probs"])
            print_table(f"weight push of the whole state dict against torch.save of it to {shm_dir()}, "
                        f"median of {args.rounds} interleaved rounds",
                        ["model", "MiB", "push ms", "push MiB/s", "save MiB/s", "push/save", "per round",
                         "probe ms", "load"], [push])
    if args.steps > 1:
        print_table(f"the default job (grpo, local backend), median of steps 2-{args.steps}",
                    ["engine", "steps", "step s", "generate s", "update_actor s (push, check)", "push s", "load"],
                    default_job(args.steps, job, engines))


if __name__ == "__main__":
    main()
