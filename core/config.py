"""Engine-side settings that must be read the same way by every adapter."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

MAX_LAYERS_PER_STAGE = 1 << 16


def resolve_layers_per_stage(value: Any, *, setting: str = "layers_per_stage") -> int:
    """The slice width a deployer asked for: 0 = off (chunk-major), N > 0 = N layers per slice.

    Accepts what a deployer plausibly writes in JSON or a CLI: an int, a bool
    (true = one layer per slice) or a decimal string ("8", " 2 ", "true",
    "false"). Anything else (negative, float, "eight", a list) logs a warning
    and reads as off: a typo must not stop an engine from starting.

    This one value drives both the width sent with every RETRIEVE and the CUDA
    graph declaration, so the two can never disagree.
    """
    if value is None:
        return 0
    if isinstance(value, bool):
        return 1 if value else 0
    if isinstance(value, int):
        width = value
    elif isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "yes", "on"):
            return 1
        if text in ("false", "no", "off", ""):
            return 0
        if not text.isdigit():
            log.warning("%s=%r is not an int, bool or decimal string; layer-major overlap stays off", setting, value)
            return 0
        width = int(text)
    else:
        log.warning("%s=%r (%s) is not an int, bool or decimal string; layer-major overlap stays off",
                    setting, value, type(value).__name__)
        return 0
    if width < 0 or width > MAX_LAYERS_PER_STAGE:
        log.warning("%s=%r is out of range [0, %d]; layer-major overlap stays off", setting, value,
                    MAX_LAYERS_PER_STAGE)
        return 0
    return width
