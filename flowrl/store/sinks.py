"""Where metrics go: JSONL always; TensorBoard when installed; wandb when installed and asked for.

``metrics.jsonl`` is flushed after every row and fsync'd at every checkpoint
(:meth:`Sinks.sync`), so a checkpoint never gets ahead of the metrics it
continues. :func:`read_metrics` reads it back tolerating what a crash or a full
disk leaves: a torn last line is dropped with a warning naming the file.

Example::

    sinks = open_sinks(Path("runs/grpo"), wandb_project=None)
    sinks.write(step=1, row={"reward/mean": 0.1})
    sinks.close()
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Callable

from flowrl.errors import ConfigError


class MetricsFileError(ConfigError, ValueError):
    """A metrics file that cannot be read (a damaged line before the last one)."""


def read_metrics(path: Path, warn: Callable[[str], None], tolerant: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """``(line, row)`` for every row of a metrics JSONL file.

    A last line that is not a complete JSON object (a write torn by a crash or a
    full disk) is dropped with a warning naming the file; a damaged line before
    it raises :class:`MetricsFileError` with the file and line number, unless
    ``tolerant`` (a record no later step builds on, such as ``fingerprints.jsonl``'s:
    every damaged line is dropped with a warning).
    """
    lines = [x for x in path.read_text(errors="replace").splitlines()]
    while lines and not lines[-1].strip():
        lines.pop()
    out: list[tuple[str, dict[str, Any]]] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == len(lines):
                warn(f"{path}: line {i} is incomplete (a write cut short by a crash or a full disk); dropped it")
                break
            if tolerant:
                warn(f"{path}: line {i} is not a JSON object ({e}); dropped it")
                continue
            raise MetricsFileError(f"{path}, line {i}: not a metrics row ({e}); remove or repair that line") from None
        out.append((line, row))
    return out


def cut_metrics(path: Path, keep_through: int, warn: Callable[[str], None]) -> None:
    """Drop the rows of steps after ``keep_through`` (1-based) from a metrics file (a resume: those
    steps run again, identically), and nothing else."""
    if not path.is_file():
        return
    kept = [line for line, row in read_metrics(path, warn=warn) if row.get("step", 0) <= keep_through]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


class Sinks:
    """Fan a metrics row out to every open sink."""

    def __init__(self, out: Path, tensorboard: Any = None, wandb_run: Any = None) -> None:
        self.jsonl = (out / "metrics.jsonl").open("a")
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    @property
    def names(self) -> list[str]:
        return ["jsonl"] + (["tensorboard"] if self.tensorboard else []) + (["wandb"] if self.wandb_run else [])

    def write(self, step: int, row: dict[str, Any]) -> None:
        try:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        except OSError as e:  # a full disk: say which file, and that checkpoints so far are intact
            raise OSError(e.errno, f"cannot write {self.jsonl.name}: {e.strerror or e}; free disk space and "
                                   f"continue with --resume (checkpoints so far are intact)") from None
        scalars = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self.tensorboard is not None:
            for k, v in scalars.items():
                self.tensorboard.add_scalar(k, v, step)
            self.tensorboard.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def cut_back(self, keep_through: int, warn: Callable[[str], None]) -> None:
        """Drop ``metrics.jsonl``'s rows after step ``keep_through`` (1-based; :func:`cut_metrics`) and
        write on after the rows kept (a rollback)."""
        self.sync()
        self.jsonl.close()
        path = Path(self.jsonl.name)
        cut_metrics(path, keep_through, warn)
        self.jsonl = path.open("a")

    def sync(self) -> None:
        """Make every row written so far durable (called before a checkpoint is saved)."""
        self.jsonl.flush()
        os.fsync(self.jsonl.fileno())

    def close(self) -> None:
        self.sync()
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
