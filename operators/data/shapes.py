"""``builtin:shapes``: generated pictures of coloured shapes, and a question about each one.

A verifiable vision task small enough for ``builtin:tiny-vl`` on a CPU: a 32×32
picture (4 image tokens) on a black background, and

* ``builtin:shapes`` — one big shape (circle, square or triangle) in one of
  four colours; the question is ``"<image> what color ?"``, the answer the
  colour (chance: 1 in 4);
* ``builtin:shapes-count`` — one to three small squares of one colour; the
  question is ``"<image> how many shapes ?"``, the answer a digit (chance: 1 in 3).

Rows come in verl's multimodal layout, so a builtin task and a parquet file
feed the same :class:`~operators.data.multimodal.MultimodalPromptDataset`:
``images`` holds the row's pictures (PIL images here; paths or
``{"bytes": ...}`` in a file) and each ``<image>`` in the message content
marks where one goes. Row ``i`` is a pure function of ``(seed, i)``: the
validation split (another seed) is pictures the policy never trained on.

Example::

    >>> rows = ShapeRows("builtin:shapes", size=10, seed=0)
    >>> row = rows[0]
    >>> row["prompt"], row["reward_model"]["ground_truth"] in COLORS, row["images"][0].size
    ([{'role': 'user', 'content': '<image> what color ?'}], True, (32, 32))
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from operators.data.tasks import Task, TaskRows
from operators.models.tiny_vl import COLORS, SHAPES

#: the RGB of each colour word
RGB = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 80, 230), "yellow": (235, 220, 40)}
SIZE = 32
#: the image tasks and the question each asks
IMAGE_TASKS = {"shapes": "what color ?", "shapes-count": "how many shapes ?"}


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=fill)


def color_sample(rng: np.random.Generator) -> tuple[Image.Image, str]:
    """One shape, 16 to 26 pixels wide, anywhere it fits; the answer is its colour."""
    color = COLORS[rng.integers(len(COLORS))]
    shape = SHAPES[rng.integers(len(SHAPES))]
    side = int(rng.integers(16, 27))
    x, y = (int(v) for v in rng.integers(0, SIZE - side + 1, size=2))
    image = Image.new("RGB", (SIZE, SIZE))
    _draw(ImageDraw.Draw(image), shape, (x, y, x + side - 1, y + side - 1), RGB[color])
    return image, color


def count_sample(rng: np.random.Generator) -> tuple[Image.Image, str]:
    """One to three 8×8 squares of one colour in distinct cells of a 3×3 grid; the answer is how many."""
    count = int(rng.integers(1, 4))
    color = RGB[COLORS[rng.integers(len(COLORS))]]
    image = Image.new("RGB", (SIZE, SIZE))
    draw = ImageDraw.Draw(image)
    for cell in rng.choice(9, size=count, replace=False):
        x, y = 2 + 10 * int(cell % 3), 2 + 10 * int(cell // 3)
        draw.rectangle((x, y, x + 7, y + 7), fill=color)
    return image, str(count)


class ShapeRows(TaskRows):
    """``size`` rows of an image task in verl's multimodal layout; row ``i`` depends only on ``(seed, i)``:
    :class:`~operators.data.tasks.TaskRows`' text row with the row's picture in ``images``."""

    def __init__(self, task: str = "builtin:shapes", *, size: int = 100_000, seed: int = 0):
        name = task.removeprefix("builtin:")
        if name not in IMAGE_TASKS:
            raise ValueError(f"unknown image task {task!r}; available: "
                             + ", ".join(f"builtin:{k}" for k in IMAGE_TASKS))
        super().__init__(size=size, seed=seed)
        self.draw = color_sample if name == "shapes" else count_sample
        question = f"<image> {IMAGE_TASKS[name]}"
        self.task = Task(name, question, lambda rng: (question, self.draw(rng)[1]))

    def __getitem__(self, i: int) -> dict[str, Any]:  # type: ignore[override]
        row = super().__getitem__(i)
        # the same draws as the answer's: the picture the answer is about
        image, _ = self.draw(np.random.default_rng((self.seed, row["extra_info"]["index"])))
        return {**row, "images": [image]}


def is_image_task(spec: str) -> bool:
    """Whether ``spec`` names a builtin image task (``builtin:shapes``...)."""
    return spec.startswith("builtin:") and spec.removeprefix("builtin:") in IMAGE_TASKS
