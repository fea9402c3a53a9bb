"""Runs that several test modules read, each made once per session (conftest's fixtures).

Starting a Ray run's worker processes costs seconds each (every one imports torch
and the operators), so the tests that need an uninterrupted run of the same job
share one instead of each making its own. A shared run is never written to: a test
that resumes it resumes a copy (:func:`copy_run`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from flowrl.store.checkpoint import CheckpointStore, steps_done

#: the default GRPO job on a train pool of two workers, small enough for a test
TWO = {"pools.train.workers": 2, "data.batch_size": 4, "nodes.generate.n": 4, "nodes.generate.max_new_tokens": 4,
       "trainer.checkpoint_every": 2, "trainer.val_every": 0}
#: steps of the shared 2-worker run: checkpoints at steps 2, 4 and 5 (a run always ends with one)
STEPS = 5


def copy_run(run: Path, to: Path, keep_through: int) -> Path:
    """A copy of the run directory ``run`` at ``to`` as a run killed after step ``keep_through``'s
    checkpoint leaves it: the checkpoints after it removed, its metrics and fingerprints left as they were
    (rows past the checkpoint are what a resume cuts back)."""
    shutil.copytree(run, to)
    store = CheckpointStore(to / "checkpoints")
    later = [p for p in store.complete() if steps_done(p) > keep_through]
    if not later or keep_through not in map(steps_done, store.complete()):
        raise ValueError(f"{run} has no checkpoint of step {keep_through} with one after it")
    for path in later:
        shutil.rmtree(path)
    return to
