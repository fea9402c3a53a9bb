"""Write the example's data in verl's schema: ``data/train.parquet`` and the held-out ``data/val.jsonl``.

Each row: ``prompt`` (chat messages), ``data_source``, ``reward_model.ground_truth`` and ``extra_info``,
as verl's data preprocessing scripts (``examples/data_preprocess/gsm8k.py``) write them. The task:
"reverse 3 7 =" is answered "7 3" (every word here is in the stand-in model's vocabulary).
"""

import json
import random
from pathlib import Path

import pandas as pd


def rows(count: int, seed: int, split: str) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index in range(count):
        a, b = rng.randrange(10), rng.randrange(10)
        out.append({"data_source": "my_reverse",
                    "prompt": [{"role": "user", "content": f"reverse {a} {b} ="}],
                    "ability": "reverse",
                    "reward_model": {"style": "rule", "ground_truth": f"{b} {a}"},
                    "extra_info": {"split": split, "index": index}})
    return out


if __name__ == "__main__":
    Path("data").mkdir(exist_ok=True)
    pd.DataFrame(rows(512, seed=0, split="train")).to_parquet("data/train.parquet")
    with open("data/val.jsonl", "w", encoding="utf-8") as f:
        for row in rows(64, seed=1, split="test"):
            f.write(json.dumps(row) + "\n")
    print("wrote data/train.parquet (512 rows) and data/val.jsonl (64 rows)")
