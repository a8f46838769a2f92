"""Which commit a benchmark measured, for its result file."""

from __future__ import annotations

import os
import subprocess


def measured_commit() -> str | None:
    """``KVSTRATA_COMMIT`` if set (a copied checkout, as on the GPU machine, may not say its own commit), else the
    checkout's short HEAD, else None."""
    named = os.environ.get("KVSTRATA_COMMIT")
    if named:
        return named
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    return head or None
