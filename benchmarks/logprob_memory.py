"""Peak memory of one log-prob + entropy forward and backward over a 49k vocabulary: whole logits vs chunks.

SmolLM2-135M-Instruct (``builtin:smollm2-135m``, a 49,152-token vocabulary), a micro-batch of
``--batch`` sequences of ``--tokens`` tokens, the last ``--response`` of them scored: the loss
``-mean(log_probs) - 0.01·mean(entropy)`` and its backward pass, in fp32 on CPU.

- ``whole``: the logits of every response position at once (``[B, R, V]`` fp32, kept for backward), as
  flowrl computed them before the chunked head: the baseline;
- ``chunked``: :func:`operators.models.forward.response_log_probs`, the LM head a chunk of tokens at a
  time under activation checkpointing (``LOGITS_CHUNK_ELEMENTS`` logits a chunk).

Each runs in a fresh process; the peak is the process's resident-set high-water mark over the step
alone (reset after the model is loaded through ``/proc/self/clear_refs``; Linux), so the weights'
load does not hide it. ``tracemalloc`` does not see torch's CPU allocations. Prints both peaks, what the
step added above the loaded model, and the ratios.

    python benchmarks/logprob_memory.py                       # 16 × 128 tokens, 112 scored
    python benchmarks/logprob_memory.py --batch 8 --tokens 256 --response 224
    python benchmarks/logprob_memory.py --smoke                # builtin:tiny: the code path in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(mode: str, model_spec: str, batch: int, tokens: int, response: int, threads: int) -> dict:
    """One forward + backward in this process; the step's peak resident memory in MiB."""
    import torch

    from operators.algos.functional import entropy_from_logits, logprobs_from_logits
    from operators.models import load_model, response_log_probs

    torch.set_num_threads(threads)
    model, _ = load_model(model_spec)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=gen)
    mask = torch.ones_like(ids)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    loaded = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again here
    start = time.perf_counter()
    if mode == "whole":
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                       logits_to_keep=response + 1).logits[:, :-1].float()
        log_probs, entropy = logprobs_from_logits(logits, ids[:, -response:]), entropy_from_logits(logits)
    else:
        log_probs, entropy = response_log_probs(model, ids, mask, positions, response, with_entropy=True)
    loss = -log_probs.mean() - 0.01 * entropy.mean()
    loss.backward()
    seconds = time.perf_counter() - start
    peak = _status_kb("VmHWM")
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return {"mode": mode, "vocab": model.config.vocab_size, "loaded_mib": loaded / 1024, "peak_mib": peak / 1024,
            "step_mib": (peak - loaded) / 1024, "seconds": seconds, "loss": float(loss),
            "grad_norm": float(grads.norm())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--response", type=int, default=112, help="scored tokens at the end of each sequence")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument("--smoke", action="store_true", help="builtin:tiny, 2 x 16 tokens: the code path only")
    parser.add_argument("--child", choices=["whole", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.batch, args.tokens, args.response = "builtin:tiny", 2, 16, 8
    if args.child:
        print(json.dumps(child(args.child, args.model, args.batch, args.tokens, args.response, args.threads)))
        return
    results = {}
    for mode in ("whole", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model, "--batch",
                              str(args.batch), "--tokens",
                              str(args.tokens), "--response", str(args.response), "--threads", str(args.threads)],
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if out.returncode != 0:
            sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    whole, chunked = results["whole"], results["chunked"]
    logits_mib = args.batch * args.response * whole["vocab"] * 4 / 2 ** 20
    print(f"log-prob memory: {args.model} (vocabulary {whole['vocab']:,}), {args.batch} x {args.tokens} tokens "
          f"({args.response} scored; their fp32 logits: {logits_mib:.0f} MiB), forward + backward, "
          f"{args.threads} thread(s)")
    print(f"{'':10} {'peak MiB':>10} {'step MiB':>10} {'seconds':>9} {'loss':>10} {'grad norm':>10}")
    for r in (whole, chunked):
        print(f"{r['mode']:10} {r['peak_mib']:10.0f} {r['step_mib']:10.0f} {r['seconds']:9.2f} {r['loss']:10.5f} "
              f"{r['grad_norm']:10.4f}")
    print(f"ratio chunked/whole: peak {chunked['peak_mib'] / whole['peak_mib']:.3f}, "
          f"step {chunked['step_mib'] / whole['step_mib']:.3f}, time {chunked['seconds'] / whole['seconds']:.2f}")


if __name__ == "__main__":
    main()
