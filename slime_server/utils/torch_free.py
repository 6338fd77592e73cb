"""Load transformers as if torch were not installed, in a process that needs only its tokenizers: the gateway
run alone.

Why: transformers imports torch whenever it is installed (its configuration module's RoPE helpers do), and that
is most of a gateway's start: ~1.4 of its ~3 CPU-s and ~180 of its ~300 MB (measured: 306 -> 123 MB RSS), for a
process that renders chat templates, counts tokens and forwards ids. Transformers without torch keeps its tokenizers, configurations
and file utilities, all a gateway uses (tests/test_torch_free.py: the same ids and text for every model the suite
serves). Torch is hidden only while transformers decides (``sys.modules[name] = None`` makes a module
unimportable; transformers' cached availability check then sees none): whatever needs torch later still imports
it (xgrammar, on a gateway's first constrained call), and transformers goes on as it started, without.
"""

from __future__ import annotations

import os
import sys


def transformers_without_torch() -> bool:
    """Import transformers with torch out of its sight, unless either is loaded already (then nothing would be
    saved, and nothing changes). Returns whether transformers is now running without torch."""
    if "transformers" in sys.modules or "torch" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    # transformers advises, each time its package initialises (an image processor's import does it again), that
    # models will not load without torch: true, and this process loads none
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        from transformers.utils import is_torch_available

        return not is_torch_available()  # cached: transformers asks once, and the answer stays
    finally:
        del sys.modules["torch"]
