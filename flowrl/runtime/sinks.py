"""Where metrics go: JSONL always; TensorBoard when installed; wandb when installed and asked for.

Example::

    sinks = open_sinks(Path("runs/grpo"), wandb_project=None)
    sinks.write(step=1, row={"reward/mean": 0.1})
    sinks.close()
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any


class Sinks:
    """Fan a metrics row out to every open sink."""

    def __init__(self, out: Path, tensorboard: Any = None, wandb_run: Any = None) -> None:
        self.jsonl = (out / "metrics.jsonl").open("a")
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    @property
    def names(self) -> list[str]:
        return ["jsonl"] + (["tensorboard"] if self.tensorboard else []) + (["wandb"] if self.wandb_run else [])

    def write(self, step: int, row: dict[str, Any]) -> None:
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self.tensorboard is not None:
            for k, v in scalars.items():
                self.tensorboard.add_scalar(k, v, step)
            self.tensorboard.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def open_sinks(out: Path, wandb_project: str | None = None, run_name: str | None = None,
               config: dict[str, Any] | None = None) -> Sinks:
    tensorboard = None
    if importlib.util.find_spec("tensorboard") is not None:
        from torch.utils.tensorboard import SummaryWriter

        tensorboard = SummaryWriter(log_dir=str(out / "tensorboard"))
    wandb_run = None
    if wandb_project:
        if importlib.util.find_spec("wandb") is None:
            raise ValueError(f"trainer.wandb_project={wandb_project!r} but wandb is not installed: "
                             f"pip install wandb, or remove trainer.wandb_project")
        import wandb

        wandb_run = wandb.init(project=wandb_project, name=run_name, config=config, dir=str(out))
    return Sinks(out, tensorboard, wandb_run)
