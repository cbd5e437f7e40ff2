"""When a search looks again and when it may stop: the rules the searcher proposes
another look by (:func:`another_look`) and the run's trial log stops on (:func:`settled`),
both read off the search model's assessment (docs/confidence.md, "Before it stops")."""

from __future__ import annotations

import math
from collections.abc import Sequence

from mbtune.lattice import BatchConfig
from mbtune.recommend.confidence import TOLERANCE, Assessment
from mbtune.recommend.tie import TIE_LOOKS, TIE_RESOLVE_LOOKS
from mbtune.report import sizes, step_suffix
from mbtune.runs.record import CONFIG_KEY, SIZES

__all__ = [
    "MATERIAL",
    "RIVAL_ACROSS",
    "RIVAL_MATERIAL",
    "another_look",
    "device_layout",
    "nearest",
    "end_reason",
    "one_look_reason",
    "settled",
    "strongest_rival",
]

MATERIAL = 0.01
"""A measured rival whose chance of beating the leader by more than the tolerance is
below this is not worth another look."""

RIVAL_MATERIAL = 0.02
"""Before the search stops, the strongest rival (the configuration likeliest to beat the
leader by more than the tolerance) is looked at where its chance is at least this
(:func:`strongest_rival`; bench/close_calls.py: a true best measured once on a low draw
keeps 3-8%; docs/confidence.md)."""

RIVAL_ACROSS = 0.01
"""At each device layout but the leader's (a device count, and the model's split over it:
t, p and the schedule), the configuration likeliest to beat it is measured before the
search stops unless the model gives it less than this: the model carries the shape of
throughput in m from one layout to another, which a link tier (or a pipeline's schedule,
or another split) breaks (bench/confidence_calibration.py --families fewer: 2 devices
measured only at m = 8, 43% of the best, and 4 devices at m = 128 recommended at 97 while
2 devices at 128 was the best; such stops 4 in 100 without this rule, 1 with it; 0.2% made
it none, and cost the quickstart a trial)."""


def one_look_reason(*, max_repeats: int, noise_floor: float) -> str | None:
    """Why one measurement of the leader is enough to stop on, or None where the leader
    must be measured twice first (once, at a quiet moment, says too little where trials
    drift)."""
    if max_repeats < 2:
        return "search.max_repeats is 1"
    if noise_floor <= 0:
        return "search.noise_floor is 0: trials are taken not to drift"
    return None


def settled(a: Assessment, *, target: int, max_repeats: int, noise_floor: float) -> bool:
    """Whether a search may stop: on a tie (the search model names one), or on its
    target: the score reached it, the leader was measured twice (or once where
    :func:`one_look_reason` says why that is enough); either way once no rival is left to
    look at (:func:`strongest_rival`)."""
    if a.tie is None and (a.recommended is None or a.confidence < target):
        return False
    once = one_look_reason(max_repeats=max_repeats, noise_floor=noise_floor) is not None
    leader_seen = a.tie is not None or a.looks.get(a.recommended, 0) >= 2 or once
    rival = strongest_rival(a, max_repeats=max_repeats, noise_floor=noise_floor)
    return leader_seen and rival is None


def strongest_rival(a: Assessment, *, max_repeats: int, noise_floor: float) -> BatchConfig | None:
    """The rival to look at before stopping; None where there is none. First, a value of
    a dimension never measured (:func:`_never_measured`). On the target: the
    configuration likeliest to beat the leader by more than the tolerance, where its
    chance is at least ``RIVAL_MATERIAL`` and it was measured less than twice (and may be
    measured again). On a tie: the same outside the tie, where it was never measured (a
    tie of 4 devices' micro-batch sizes while 2 devices at large ones was never measured:
    bench/close_calls.py --landscape fewer-devices). Either way, before those: on each
    device layout but the leader's (:func:`device_layout`), the configuration likeliest
    to beat it, where it was never measured and its chance is at least
    ``RIVAL_ACROSS``. After those, on the target, a rival on another device count that
    the model puts behind the leader by its trend alone (:func:`_level_across`; the
    leader itself where it was measured fewer times), unless :func:`one_look_reason` says
    trials do not drift."""
    if a.open_points:
        return _never_measured(a)
    members = a.tie.members if a.tie is not None else (a.recommended,)
    enough = 1 if a.tie is not None else min(2, max_repeats)
    across = [
        c
        for c in _likeliest_at_each_layout(a)
        if c not in members and not a.looks.get(c, 0) and a.threat[c] >= RIVAL_ACROSS
    ]
    if across:
        return max(across, key=a.threat.__getitem__)
    others = {c: t for c, t in a.threat.items() if c not in members}
    rival = max(others, key=others.__getitem__, default=None)
    if rival is not None and others[rival] >= RIVAL_MATERIAL and a.looks.get(rival, 0) < enough:
        return rival
    if a.tie is not None or one_look_reason(max_repeats=max_repeats, noise_floor=noise_floor):
        return None
    return _level_across(a, max_repeats=max_repeats)


def _never_measured(a: Assessment) -> BatchConfig:
    """Of the configurations with a value of a dimension never measured (a device count, an
    activation checkpointing setting: ``Assessment.open_points``), the one beside the
    leader (:func:`nearest`: the two differ in that value alone, as the model sampler
    measures it below the target): measured before a stop, whatever the model says of it.
    A cost fitted on the measured device counts cannot see a link tier between two of them
    (1, 4 and 8 devices measured, 2 the fastest: bench/close_calls.py, docs/confidence.md);
    the score is the model's all the same (mbtune.recommend.confidence.OPEN_CHANCE)."""
    return nearest(sorted(a.open_points), a.recommended or min(a.open_points))


def nearest(points: Sequence[BatchConfig], to: BatchConfig) -> BatchConfig:
    """The point of ``points`` nearest ``to``, in octaves of m, n and B and the other
    dimensions (0 or 1 where they differ)."""

    def distance(c: BatchConfig) -> tuple[float, BatchConfig]:
        octaves = sum(abs(math.log2(getattr(c, d)) - math.log2(getattr(to, d))) for d in SIZES)
        return octaves + sum(getattr(c, d) != getattr(to, d) for d in CONFIG_KEY
                             if d not in SIZES), c  # fmt: skip

    return min(points, key=distance)


def _level_across(a: Assessment, *, max_repeats: int) -> BatchConfig | None:
    """At the target: a measured configuration on another device count that the model
    puts behind the leader by its trend rather than by their looks (its estimates put the
    two further apart than their own looks do, by more than the tolerance), where their
    own looks cannot tell them apart (its threat read on the two's looks alone,
    ``Assessment.own_threat``, at least ``RIVAL_MATERIAL``): looked at again with the
    leader, the one of the two measured fewer times (the leader on a tie), up to
    ``search.max_repeats`` looks each (``TIE_RESOLVE_LOOKS`` where this machine's spread
    cannot tell two apart by the tolerance); None where there is none. The model relates
    device counts by a smooth trend, and a link tier is what that trend cannot see: two
    configurations level on their looks are not told apart by the trend alone
    (bench/close_calls.py --landscape fewer-devices, seed 68: 4 and 2 devices at m = 16
    each seen at 0.96 and 0.99 of the best, the model 3% apart; 2 devices 8% faster)."""
    leader = a.recommended
    if leader is None or leader not in a.own_estimate:
        return None
    limit = max_repeats if a.resolvable else min(TIE_RESOLVE_LOOKS, max_repeats)
    ahead = -math.log(1 - TOLERANCE)

    def by_trend(c: BatchConfig) -> float:
        """How much further apart the model puts ``c`` and the leader than their looks."""
        model = math.log(a.estimate[leader] / a.estimate[c])
        return model - math.log(a.own_estimate[leader] / a.own_estimate[c])

    level = [
        c
        for c, t in a.own_threat.items()
        if t >= RIVAL_MATERIAL and c.num_devices != leader.num_devices and c in a.estimate
        and by_trend(c) > ahead and min(a.looks.get(c, 0), a.looks.get(leader, 0)) < limit
    ]  # fmt: skip
    if not level:
        return None
    rival = max(level, key=a.own_threat.__getitem__)
    return min((leader, rival), key=lambda c: a.looks.get(c, 0))


def device_layout(c: BatchConfig) -> tuple[int, int, int, str]:
    """How ``c`` places the model on its devices: the device count and the split over it
    (t, p, the schedule). Each is a candidate of its own before a stop: what the model
    learnt of throughput in m at one layout it carries to another by its smooth shape,
    and a cost that only one layout pays (a slower link past some device count, another
    schedule's passes, a split's sends) is what that shape cannot see without a look. A
    data-parallel space's layouts are its device counts."""
    return (c.num_devices, *c.layout)


def _likeliest_at_each_layout(a: Assessment) -> list[BatchConfig]:
    """At each device layout but the leader's, the configuration likeliest to beat it."""
    if a.recommended is None:
        return []
    likeliest: dict[tuple[int, int, int, str], BatchConfig] = {}
    leader = device_layout(a.recommended)
    for c, threat in a.threat.items():
        layout = device_layout(c)
        if layout != leader and (layout not in likeliest or threat > a.threat[likeliest[layout]]):
            likeliest[layout] = c
    return list(likeliest.values())


def another_look(
    a: Assessment,
    *,
    target: int,
    max_repeats: int,
    noise_floor: float,
    busy: set[BatchConfig],
    new_threat: float | None,
) -> tuple[BatchConfig, str] | None:
    """The measured configuration worth measuring again, and why; None if none is.

    At the target (or on a tie): the leader, if it was measured once and :func:`settled`
    wants it measured twice; then the rival :func:`strongest_rival` names, if any (one
    never measured is measured). Below it: the leader or the rival
    that most threatens it (the one of the two measured fewer times; the leader on a
    tie), where that rival's threat is material and larger than ``new_threat``, what a
    new measurement could settle: the unmeasured configurations' threat taken together
    (one trial informs its unmeasured neighbours too; docs/confidence.md); each up to
    ``TIE_LOOKS`` looks, then to ``max_repeats`` where this machine's spread lets more
    looks tell them apart (``Assessment.resolvable``). None: there is nothing new to
    measure."""
    leader = a.recommended
    if leader is None or max_repeats < 2:
        return None

    def can(c: BatchConfig) -> bool:
        return a.looks.get(c, 0) < max_repeats and c not in busy

    if a.confidence >= target or a.tie is not None:
        once = one_look_reason(max_repeats=max_repeats, noise_floor=noise_floor) is not None
        if can(leader) and a.looks.get(leader, 0) < 2 and not once:
            return leader, "re-measuring the leader before stopping"
        rival = strongest_rival(a, max_repeats=max_repeats, noise_floor=noise_floor)
        if rival is not None and rival not in busy:
            if rival == leader:  # with a rival at another layout level on their looks
                return leader, "re-measuring the leader before stopping"
            again = "re-measuring" if a.looks.get(rival, 0) else "measuring"
            return rival, f"{again} the strongest rival before stopping"
        return None
    floor = max(MATERIAL, new_threat or 0.0)
    rivals = [c for c in a.threat if c != leader and a.looks.get(c, 0) and a.threat[c] >= floor]
    rivals.sort(key=a.threat.__getitem__, reverse=True)
    # every material rival (and the leader) measured twice before any is measured a third
    # time: where they cannot be told apart, that is what calls the tie soonest
    for limit in (TIE_LOOKS, max_repeats) if a.resolvable else (TIE_LOOKS,):
        for rival in rivals:
            pair = [c for c in (leader, rival) if can(c) and a.looks.get(c, 0) < limit]
            if pair:  # the one of the two measured fewer times; the leader on a tie
                pick = min(pair, key=lambda c: a.looks.get(c, 0))
                return (
                    pick,
                    "re-measuring the leader" if pick == leader else "re-measuring a close rival",
                )
    return None


def end_reason(
    a: Assessment,
    *,
    status: str,
    target: int,
    max_repeats: int,
    noise_floor: float,
    budget: int,
    measured: int,
    time_budget_s: float | None,
    elapsed_s: float,
) -> str:
    """Why the search ended, in one sentence (the stream's last words and summary.json's
    ``reason``): the target reached, a tie, an interrupt, or what ran out (the trial
    budget, the time budget, or the looks the search may take), and below the target what
    would make it surer."""
    if status == "confident":
        return f"the confidence score reached its target {target}"
    if status == "tie":
        return "on a tie: another look cannot tell its members apart"
    score = f"at confidence {a.confidence}" if a.recommended is not None else "with no ok trial"
    if status == "interrupted":
        return f"interrupted (Ctrl-C or SIGTERM) {score}"
    if time_budget_s is not None and elapsed_s >= time_budget_s:
        ran_out = f"the time budget (search.time_budget_s {time_budget_s:g} s) ran out"
        more = "raise search.time_budget_s"
    elif measured >= budget:
        ran_out = f"the trial budget (search.num_samples {budget}) ran out"
        more = "raise search.num_samples"
    elif a.recommended is None:  # a failed configuration is not tried again
        return "no configuration is left to try, and none ran ok (see each trial's reason)"
    else:
        ran_out = (f"every configuration was measured as often as the search may "
                   f"(search.max_repeats {max_repeats})")  # fmt: skip
        more = "raise search.max_repeats or measure on a quieter machine"
    if a.recommended is None:
        return f"{ran_out} {score}"
    if target >= 100:
        return f"{ran_out} {score} (search.confidence_target 100: it never stops on confidence)"
    lacked = []
    if a.looks.get(a.recommended, 0) < 2 and not one_look_reason(
        max_repeats=max_repeats, noise_floor=noise_floor
    ):
        lacked.append("a second look at its recommendation")
    rival = strongest_rival(a, max_repeats=max_repeats, noise_floor=noise_floor)
    if rival == a.recommended:
        lacked.append("another look at its recommendation beside a rival level with it")
    elif rival is not None:
        look = "another look" if a.looks.get(rival, 0) else "a look"
        lacked.append(
            f"{look} at its strongest rival ({sizes(rival)}{step_suffix(None, *rival.settings)})"
        )
    needs = f": it lacked {' and '.join(lacked)}" if lacked else ""
    if a.confidence >= target:
        return f"{ran_out} {score}, above its target {target}, before it could stop{needs}"
    return f"{ran_out} {score}, below its target {target}; {more} for a surer answer{needs}"
