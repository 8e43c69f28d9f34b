"""How much of a source command a translation carries: each setting the command made is `exact` (it landed in
the config, or needs none because the appliance behaves that way), `pending` (left commented out for the user) or
`noted` (carried only as a note: no equivalent here). tools/translate_corpus.py sums this over a corpus."""
from __future__ import annotations

from collections import Counter
from typing import Literal

from appliance.translate.result import Translation, Use

Outcome = Literal["exact", "pending", "noted"]


def outcome(tr: Translation, use: Use) -> Outcome:
    if use.implied or use.display in tr.implied_sources:
        return "exact"
    if any(p.source == use.display for p in tr.pending):
        return "pending"
    for s in tr.settings.values():
        # combined sources ("--master-addr a --master-port b") and JSON keys ("--speculative-config method=...")
        if use.display in s.source or s.source.startswith(use.written + " ") or s.source == use.written:
            return "exact"
    return "noted"


def coverage(tr: Translation) -> Counter[str]:
    return Counter(outcome(tr, use) for use in tr.uses)
