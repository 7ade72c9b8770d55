"""KTO's desirable / undesirable weights: from the flags when given (checked against the KTO paper's range, a warning
when outside), otherwise from the training split's counts, always inside that range (the toolkit never warns about a
value it chose). Light: no torch.

The KTO paper (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", arXiv 2402.01306,
eq. 8 and section 4) recommends weights such that the weighted counts satisfy
    1 <= (desirable_weight x desirable rows) / (undesirable_weight x undesirable rows) <= 4/3,
so that neither class dominates the loss (TRL's KTOTrainer warns with the same bounds).
"""

from __future__ import annotations

import math

PAPER_RANGE = (1.0, 4 / 3)
PAPER = "the KTO paper's recommended [1, 4/3] (Ethayarajh et al. 2024, eq. 8)"


def weighted_ratio(desirable_weight: float, undesirable_weight: float, desirable: int, undesirable: int) -> float:
    return desirable_weight * desirable / (undesirable_weight * undesirable)


def in_range(ratio: float) -> bool:
    return PAPER_RANGE[0] - 1e-9 <= ratio <= PAPER_RANGE[1] + 1e-9


def weight_for_equal_counts(desirable: float, undesirable: float, weighted: str) -> float:
    """The weight (4 decimals) of the `weighted` class ("desirable" or "undesirable") that makes the (weighted) counts
    equal, rounded the way that keeps the weighted ratio at 1 or just above, inside the paper's range: rounded to the
    nearest, 21 desirable and 22 undesirable rows would take desirable_weight 1.0476, a ratio of 0.99998, outside.
    (The 1e-6 keeps an exact quotient exact: 120 / 100 x 1e4 is 12000.000000000002 in floating point.)"""
    if weighted == "desirable":
        return math.ceil(undesirable / desirable * 1e4 - 1e-6) / 1e4
    return math.floor(desirable / undesirable * 1e4 + 1e-6) / 1e4


def resolve_kto_weights(config, train_counts: dict) -> tuple[dict, str, str | None]:
    """({desirable_weight, undesirable_weight}, the line saying where they came from, a warning or None).
    `config`: a src.config.Config (this module imports none of the project's: KTO's row imports it)."""
    desirable, undesirable = train_counts["desirable"], train_counts["undesirable"]
    given = {key: config.trl_overrides[key] for key in ("desirable_weight", "undesirable_weight")
             if key in config.trl_overrides}
    counts = f"{desirable:,} desirable, {undesirable:,} undesirable training rows"
    if given:
        weights = {"desirable_weight": float(given.get("desirable_weight", 1.0)),
                   "undesirable_weight": float(given.get("undesirable_weight", 1.0))}
        source = " and ".join(f"{config.sources.get(key, '--' + key)}" for key in given)
        origin = f"from {source}"
    else:
        weights = {"desirable_weight": 1.0, "undesirable_weight": 1.0}
        origin = "TRL's defaults"
        if not in_range(weighted_ratio(1.0, 1.0, desirable, undesirable)):
            # The smaller class's weight raised so that the weighted counts are equal (the range's lower end).
            if desirable < undesirable:
                weights["desirable_weight"] = weight_for_equal_counts(desirable, undesirable, "desirable")
            else:
                weights["undesirable_weight"] = weight_for_equal_counts(desirable, undesirable, "undesirable")
            origin = "set from the data's counts"
    ratio = weighted_ratio(weights["desirable_weight"], weights["undesirable_weight"], desirable, undesirable)
    line = (f"  KTO weights: desirable {weights['desirable_weight']:g}, undesirable {weights['undesirable_weight']:g} "
            f"({origin}; {counts}: weighted ratio {ratio:.2f}, {'inside' if in_range(ratio) else 'outside'} "
            f"{PAPER})")
    warning = None
    if given and not in_range(ratio):  # weights set from the counts are inside by construction
        if desirable * weights["desirable_weight"] < undesirable * weights["undesirable_weight"]:
            fix = (f"--desirable_weight "
                   f"{weight_for_equal_counts(desirable, undesirable * weights['undesirable_weight'], 'desirable'):g}")
        else:
            fix = (f"--undesirable_weight "
                   f"{weight_for_equal_counts(desirable * weights['desirable_weight'], undesirable, 'undesirable'):g}")
        warning = (f"desirable_weight {weights['desirable_weight']:g} and undesirable_weight "
                   f"{weights['undesirable_weight']:g} give a weighted desirable:undesirable ratio of {ratio:.2f} "
                   f"on {counts}, outside {PAPER}: the heavier class dominates the loss and the rewards of the other "
                   f"barely move; {fix} gives 1.00 (or drop both flags: the toolkit then sets them from the counts)")
    return weights, line, warning
