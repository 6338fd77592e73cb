"""xgrammar's error text as a client reads it. Its own module because the gateway's schema checks
(gateway/constraints.py) name what xgrammar refuses in this text, and ``rollout/grammar.py`` (the engine's masks)
loads torch at import: ~1.3 CPU-s that importing the gateway's modules no longer pays for this one function."""

from __future__ import annotations

import re


def xgrammar_message(e: BaseException) -> str:
    """xgrammar's message without its log prefix (``[10:15:35] /project/cpp/regex_converter.cc:83: ``)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
