"""Where the parity tests find verl's code: ``.ci/run`` installs verl (without its
dependencies) into ``build/verl``, outside site-packages, because verl's wheel
also ships top-level ``tests`` and ``scripts`` packages that would shadow
flowrl's. An installed verl works too. Nothing of verl is copied into flowrl.
"""

from __future__ import annotations

import sys
from pathlib import Path

TARGET = Path(__file__).resolve().parents[1] / "build" / "verl"
INSTALL = ("python -m pip install --no-deps --upgrade --target build/verl "
           "verl==0.9.1 omegaconf==2.4.0 codetiming==1.4.0")


def add_verl_to_path() -> None:
    """Make ``build/verl`` importable, behind everything else on ``sys.path``."""
    if TARGET.is_dir() and str(TARGET) not in sys.path:
        sys.path.append(str(TARGET))
