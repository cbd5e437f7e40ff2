"""A tie: measured configurations the search cannot tell apart, which together hold the
best (mbtune.recommend.confidence's docstring, 6). The fewest that hold it with the target's
probability are the contenders (:func:`find_contenders`); they are a tie once each was measured
enough and their estimates lie within a few measured spreads of each other
(:func:`called_tie`; whether more looks could still tell two apart: :func:`resolvable`);
the rule picks the recommendation among them (:func:`tie_order`), and the tie says what the
search was sure of. Pure numerics (numpy; no torch, no ray).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mbtune.lattice import BatchConfig
from mbtune.runs.record import CONFIG_KEY

__all__ = [
    "TIE_LOOKS",
    "TIE_RESOLVES",
    "TIE_RESOLVE_LOOKS",
    "TIE_RULE",
    "TIE_SPREADS",
    "Tie",
    "called_tie",
    "find_contenders",
    "resolvable",
    "tie_order",
]

TIE_LOOKS = 2
"""How often each contender of a tie is measured, at least, before the search calls it
a tie: with two looks each, the spread between repeats is measured on the contenders
themselves. Enough where the machine's spread is too wide for the looks left to tell
two apart by the tolerance (``TIE_RESOLVES``), and for contenders within one spread of
the fastest; otherwise every contender is measured as often as ``search.max_repeats``
allows."""

TIE_RESOLVES = 2.0
"""A machine's spread lets the search tell two configurations apart where the standard
error of their difference at ``TIE_RESOLVE_LOOKS`` looks each (or ``search.max_repeats``
where fewer) is below this many tolerances (a busy machine, 7% between repeats, cannot:
bench/close_calls.py --landscape busy; a quiet one, 3.5%, can: --landscape close)."""

TIE_RESOLVE_LOOKS = 3
"""The looks each that ``TIE_RESOLVES`` is read at: more looks shrink the error on any
machine, but on a busy one a close pair measured four or five times each spends the
quickstart's budget on one comparison (bench/close_calls.py --landscape busy: 20 of 30
searches within 12 trials when read at five looks, 28 at three)."""

TIE_SPREADS = 2.0
"""A tie's members' estimates lie within this many measured spreads of each other."""


@dataclass(frozen=True)
class Tie:
    """Measured configurations the search cannot tell apart, which together hold the best."""

    members: tuple[BatchConfig, ...]
    """The recommendation first: those whose estimate is within the tolerance of the
    fastest's in the order of :func:`tie_order`, then the rest by their estimate."""
    width: float
    """How far apart their estimates are: 1 - the slowest's over the fastest's."""
    probability: float
    """The probability that one of them is within the tolerance of the best."""
    sure: tuple[tuple[str, Any, Any, float], ...] = ()
    """What the search is sure of: (dimension, the members' value, the best other value,
    how many times faster the best member is than the best configuration with it)."""

    def record(self) -> dict[str, Any]:
        """As recommendations.jsonl and summary.json carry it."""
        return {
            "members": [c.sizes() for c in self.members],
            "width": round(self.width, 4),
            "probability": round(self.probability, 3),
            "rule": TIE_RULE,
            "sure": [
                {"dimension": d, "value": v, "over": o, "speedup": round(x, 3)}
                for d, v, o, x in self.sure
            ],
        }


TIE_RULE = "among those within 2% of the fastest: the fewest devices, then the fastest"
"""How a tie picks its recommendation (:func:`tie_order`)."""


def tie_order(c: BatchConfig, estimate: float) -> tuple:
    """A tie's order among its members within the tolerance of the fastest estimate: the
    fewest devices (at the same throughput, the cheapest), then the highest estimate."""
    return (c.num_devices, -estimate, c)


def find_contenders(
    within: np.ndarray,
    columns: dict[BatchConfig, int],
    estimate: dict[BatchConfig, float],
    *,
    target: int,
    tolerance: float,
) -> Tie | None:
    """The fewest measured configurations (added in order of their own chance of being
    within the tolerance of the best) that together hold it with a probability of at
    least ``target``, where they are several; None where none do together. ``within``:
    for each draw (row) and configuration (column), within ``tolerance`` of the draw's best."""
    alone = {c: float(within[:, j].mean()) for c, j in columns.items()}
    members: list[BatchConfig] = []
    held = np.zeros(len(within), dtype=bool)
    for c in sorted(alone, key=lambda c: (-alone[c], c)):
        members.append(c)
        held |= within[:, columns[c]]
        if held.mean() * 100 >= target:
            break
    else:
        return None
    if len(members) < 2:
        return None
    fastest = max(estimate[c] for c in members)
    # the rule picks among the members as fast as the fastest within the tolerance: where
    # the estimates say one is faster by more, it stays first
    close = [c for c in members if estimate[c] >= fastest * (1 - tolerance)]
    members = sorted(close, key=lambda c: tie_order(c, estimate[c])) + sorted(
        (c for c in members if c not in close), key=lambda c: -estimate[c]
    )
    return Tie(
        members=tuple(members),
        width=1 - min(estimate[c] for c in members) / fastest,
        probability=float(held.mean()),
        sure=tuple(_sure(members, estimate, fastest)),
    )


def _sure(
    members: Sequence[BatchConfig], estimate: dict[BatchConfig, float], fastest: float
) -> Iterator[tuple[str, Any, Any, float]]:
    """What a tie's members agree on, against the best measured configuration that
    differs there: (dimension, their value, its value, how much faster they are)."""
    for dim in CONFIG_KEY:
        if dim == "micro_batch_size":
            continue
        values = {getattr(c, dim) for c in members}
        others = [c for c in estimate if getattr(c, dim) not in values]
        if len(values) == 1 and others:
            rival = max(others, key=estimate.__getitem__)
            yield dim, values.pop(), getattr(rival, dim), fastest / estimate[rival]


def resolvable(trial_sd: float, max_repeats: int, *, tolerance: float) -> bool:
    """Whether the looks the search may take (``TIE_RESOLVE_LOOKS`` each, or
    ``search.max_repeats`` where fewer) can tell two configurations apart by ``tolerance``,
    at one trial's relative spread ``trial_sd``."""
    looks = max(1, min(TIE_RESOLVE_LOOKS, max_repeats))
    return trial_sd * math.sqrt(2 / looks) < TIE_RESOLVES * tolerance


def called_tie(
    contenders: Tie | None,
    *,
    estimate: Mapping[BatchConfig, float],
    looks: Mapping[BatchConfig, int],
    trial_sd: float,
    resolvable: bool,
    max_repeats: int,
    tolerance: float,
) -> Tie | None:
    """The contenders, where another look cannot tell them apart at this machine's spread
    ``trial_sd``: each measured enough (``TIE_LOOKS`` times where it is close to the
    fastest and more looks could not tell them apart, else as often as ``max_repeats``
    allows), their estimates within ``TIE_SPREADS`` spreads of each other."""
    tie = contenders
    if tie is None:
        return None
    sd = trial_sd
    fastest = max(estimate[c] for c in tie.members)
    for c in tie.members:
        close = estimate[c] >= fastest * (1 - max(tolerance, sd))
        needed = TIE_LOOKS if close and not resolvable else max(TIE_LOOKS, max_repeats)
        if looks.get(c, 0) < min(needed, max_repeats):
            return None
    return tie if tie.width <= TIE_SPREADS * sd else None
