"""The names of the simulator's gradient methods and the ``--baselines`` parser.

Kept free of torch: the command line parses its options, and starts preparing the data, before the
modules that train anything are imported (their import costs seconds).
"""

from __future__ import annotations

MISSING_ALL = (1, 3, 5, 7)  # the paper's missing levels, ``--missing all``
FEDAVG = "FedAvg"
# paper Table II's gradient baselines, in its order (sim/baselines/ trains them)
TABLE2_BASELINES = ("RSCFed", "FedFixMatch", "FedIRM", "CBAFed", "FedLSR", "FedNoRo", "FedMLP")
FEDNCA = "FedNCA-ML"  # not in Table II; --baselines can add it (sim/fednca.py)
# FedMLP's released code (``utils/options.py``: ``rounds_warmup``) runs every method for 500 rounds;
# its stage boundaries and ramps are counted in those rounds.
REFERENCE_ROUNDS = 500
# ``--schedule``: the rounds of FedAvg and the baselines.  ``paper``: R = 50 (paper §IV-E), every
# stage boundary scaled by 50/500 so that every stage runs; ``reference``: the released code's 500.
SCHEDULES = {"paper": 50, "reference": REFERENCE_ROUNDS}


class BaselineError(ValueError):
    """An unknown baseline name."""


def parse_baselines(text: str) -> tuple[str, ...]:
    """``"all"``, ``"none"``/``""`` or a comma list of names (any case), in Table II's order."""
    text = text.strip()
    if text.lower() == "all":
        return TABLE2_BASELINES
    if text.lower() in ("", "none"):
        return ()
    by_lower = {name.lower(): name for name in TABLE2_BASELINES}
    chosen = []
    for part in text.split(","):
        name = by_lower.get(part.strip().lower())
        if name is None:
            raise BaselineError(
                f"unknown baseline {part.strip()!r}: choose from {', '.join(TABLE2_BASELINES)}, or 'all' "
                "(FedAvg always runs)"
            )
        chosen.append(name)
    return tuple(name for name in TABLE2_BASELINES if name in chosen)
