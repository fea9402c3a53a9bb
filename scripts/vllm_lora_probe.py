"""Can vLLM's CPU build take LoRA adapters alone, and is that faster than pushing merged weights?

Two halves, two interpreters (peft lives in the default environment, vLLM in build/vllm-venv):

    python scripts/vllm_lora_probe.py prepare /tmp/vlora          # default env: adapters + merged weights
    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind PYTHONPATH=. \\
        build/vllm-venv/bin/python scripts/vllm_lora_probe.py measure /tmp/vlora

``prepare`` puts LoRA r=8 (alpha 16, attention + MLP projections) on SmolLM2-135M, moves its B
matrices off zero (a trained adapter), and writes the base directory's path, the adapter in peft's
format (``adapter/``) and the merged weights (``merged.safetensors``). ``measure`` times, alternating
``--rounds`` times: (a) vLLM with ``enable_lora=True``: a new adapter version by a new
``LoRARequest`` (a fresh id, as a push each step would be), the first one-token generation that
loads it minus one on an adapter already loaded; (b) flowrl's vLLM engine (``VLLMRolloutEngine``)
pushing the merged weights through ``update_weights`` (its names-loaded check included), and the
greedy tokens of both against each other.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def prepare(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from operators.models import load_model
    from operators.models.loading import _check_dir
    from operators.models.lora import LoraConfig, add_adapters, merged_weights

    spec = "builtin:smollm2-135m"
    model, tok = load_model(spec)
    model = add_adapters(model, LoraConfig(r=8, alpha=16), seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "adapter")
    save_file({n: t.clone().contiguous() for n, t in merged_weights(model)}, str(out / "merged.safetensors"))
    (out / "base.txt").write_text(str(_check_dir(spec)))


#: the generation compared (greedy, through the adapters against on merged weights)
GEN_PROMPTS, GEN_TOKENS = 16, 32


def measure(out: Path, rounds: int = 3) -> None:
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from operators.rollout.vllm_engine import VLLMRolloutEngine

    base = (out / "base.txt").read_text().strip()
    merged = load_file(str(out / "merged.safetensors"))
    one = SamplingParams(max_tokens=1, temperature=0.0)
    prompt = ["The capital of France is"]
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    try:
        llm = LLM(model=base, enable_lora=True, max_lora_rank=8, max_loras=1, dtype="float32",
                  enforce_eager=True, max_model_len=256, gpu_memory_utilization=0.3,
                  kv_cache_memory_bytes=256 * 2**20)  # CPU: the share of RAM vLLM checks is free
    except Exception as err:  # noqa: BLE001 - the question is whether it works at all
        print(json.dumps({"enable_lora": "failed", "error": f"{type(err).__name__}: {err}"[:2000]}), flush=True)
        return
    adapter_s = []
    for i in range(rounds):
        copy = out / f"adapter-{i}"  # a new version: a new directory and id, as each step's push would be
        shutil.copytree(out / "adapter", copy, dirs_exist_ok=True)
        request = LoRARequest(f"v{i}", i + 1, str(copy))
        start = time.perf_counter()
        llm.generate(prompt, one, lora_request=request, use_tqdm=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate(prompt, one, lora_request=request, use_tqdm=False)
        again = time.perf_counter() - start
        adapter_s.append(first - again)
    questions = [f"Calculate {a} + {b}." for a, b in zip(range(3, 99, 6), range(5, 85, 5))][:GEN_PROMPTS]
    gen = SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0)
    lora_gen_s = []
    for _ in range(rounds):  # generation through the adapters (vLLM's LoRA kernels on every step): tokens/s
        start = time.perf_counter()
        outs = llm.generate(questions, gen, lora_request=request, use_tqdm=False)
        lora_gen_s.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    print(json.dumps({"enable_lora": "works", "adapter_push_s": adapter_s, "lora_generate_tokens_per_s": lora_gen_s}),
          flush=True)
    del llm
    import gc

    gc.collect()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    options = {"dtype": "float32", "max_model_len": 256, "gpu_memory_utilization": 0.3, "kv_cache_mib": 256}
    engine = VLLMRolloutEngine(base, pad_token_id=tok.pad_token_id or 0, stop_token_ids={tok.eos_token_id},
                               options=options, weight_names=merged.keys())
    push_s = []
    for i in range(rounds):
        start = time.perf_counter()
        engine.update_weights(merged, version=i + 1)
        push_s.append(time.perf_counter() - start)
    from operators.rollout import SamplingParams as FlowrlSampling

    ids = [tok(q)["input_ids"] for q in questions]
    width = max(len(x) for x in ids)
    prompts = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros_like(prompts)
    for i, row in enumerate(ids):
        prompts[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1
    merged_gen_s = []
    for _ in range(rounds):  # the same prompts on the merged weights (no LoRA kernels)
        start = time.perf_counter()
        done = engine.generate(prompts, mask, FlowrlSampling(greedy=True, max_new_tokens=GEN_TOKENS))
        merged_gen_s.append(float(done["response_mask"].sum()) / (time.perf_counter() - start))
    engine.shutdown()
    print(json.dumps({"lora_generate_tokens_per_s": statistics.median(lora_gen_s),
                      "merged_generate_tokens_per_s": statistics.median(merged_gen_s), "prompts": len(questions),
                      "max_tokens": GEN_TOKENS}), flush=True)
    mib = sum(t.numel() * t.element_size() for t in merged.values()) / 2**20
    adapter_mib = sum(p.stat().st_size for p in (out / "adapter").iterdir()) / 2**20
    print(json.dumps({"merged_push_s": push_s, "merged_mib": mib, "adapter_dir_mib": adapter_mib,
                      "median_adapter_s": statistics.median(adapter_s),
                      "median_merged_s": statistics.median(push_s)}), flush=True)
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)


if __name__ == "__main__":
    what, where = sys.argv[1], Path(sys.argv[2])
    prepare(where) if what == "prepare" else measure(where, int(sys.argv[3]) if len(sys.argv) > 3 else 3)
