"""Weight loading's progress bar: tqdm, drawn only when stderr is a terminal.

Logs and CI output stay clean: when stderr is not a tty nothing is written at all.
"""
from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


def load_progress(total: int, label: str, stream: TextIO | None = None) -> tqdm:
    """A bar over `total` steps (update() per step, close() at the end) on `stream`, stderr by default."""
    stream = stream if stream is not None else sys.stderr
    # disable=None is tqdm's own "only on a terminal"
    return tqdm(total=total, desc=label, file=stream, disable=None)
