"""The study read as the search reads it (:class:`History`): what was measured, how often,
what runs now, and what an earlier run taught, read from the study's trials whenever a
proposal is made. Nothing of it is kept anywhere else, so that a resumed search, a warm
start and a sampler in a study of your own read the same thing. A finished trial never
changes, so what the finished trials taught is remembered (:class:`_Learnt`) and each
reading learns only the trials finished since: the same History as learning them all
again, at a cost that no longer grows with the study.

A proposal whose canonical configuration (the micro-batches it really runs) was measured
already is answered from what was measured (``measured``); repeats of a configuration are
pooled as observations of it, and their spread is how the search model learns the drift
between trials (mbtune.recommend.confidence).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from optuna.trial import FrozenTrial, TrialState

from mbtune.lattice import BatchConfig
from mbtune.recommend.observation import Observation, observation
from mbtune.search._space import OptunaSpace
from mbtune.search._study import (
    CACHED,
    DUPLICATE,
    INTERRUPTED,
    WARM_START,
    finished_order,
    record_of,
)

__all__ = ["History", "read_history"]


@dataclass
class History:
    """What a study says the search has done, in the order it learnt it."""

    observations: list[Observation] = field(default_factory=list)
    """This run's finished trials (configurations predicted out of memory first), as the
    search model reads them."""
    taught: list[Observation] = field(default_factory=list)
    """An earlier run's results (warm start): proposals learn from them, scores not."""
    measured: dict[BatchConfig, float] = field(default_factory=dict)
    """Each configuration measured (as proposed and as it ran): its pooled objective."""
    looks: dict[BatchConfig, int] = field(default_factory=lambda: defaultdict(int))
    """How often each configuration was measured (as proposed and as it ran)."""
    values: dict[BatchConfig, float] = field(default_factory=dict)
    """Each proposed configuration's latest answer (measured, from the cache, predicted):
    what a baseline climbs on."""
    running: dict[int, BatchConfig] = field(default_factory=dict)
    """The study's trials being measured now (by number), and what each proposed."""
    trial_ids: set[str] = field(default_factory=set)
    """Ray's ids of this run's finished trials."""
    unnamed: int = 0
    """Finished trials without Ray's id (rows of an older run, a study of your own)."""
    full_batch_only: bool = False
    """A trial reported that the model mixes the batch: then m = P only."""

    @property
    def trials(self) -> int:
        """This run's finished trials (the predictions are none)."""
        return len(self.trial_ids) + self.unnamed

    @property
    def busy(self) -> set[BatchConfig]:
        """What the running trials measure."""
        return {self.key(c) for c in self.running.values()}

    def key(self, config: BatchConfig) -> BatchConfig:
        """The measurement ``config`` is: its canonical configuration (m = P only, once the
        model mixes the batch)."""
        if self.full_batch_only:
            config = dataclasses.replace(config, micro_batch_size=config.per_device_batch)
        return config.canonical()

    def pooled(self, config: BatchConfig) -> float | None:
        values = [o.value for o in self.observations if o.config == config and o.value]
        return statistics.geometric_mean(values) if values else None


def read_history(
    trials: Sequence[FrozenTrial],
    space: OptunaSpace,
    *,
    exclude: int | None = None,
    chosen: Mapping[int, BatchConfig] | None = None,
) -> History:
    """A study's ``trials`` (over ``space``) read as :class:`History`; ``exclude``: the
    trial being proposed now (not yet running anything); ``chosen``: what a sampler
    proposed for trials whose parameters are not all set yet."""
    finished = sorted((t for t in trials if t.state.is_finished()), key=finished_order)
    h = _LEARNT.read(finished, space)
    for t in trials:
        if t.state == TrialState.RUNNING and t.number != exclude:
            proposed = (chosen or {}).get(t.number) or _decoded(space, t)
            if proposed is not None:
                h.running[t.number] = proposed
    return h


class _Learnt:
    """What the finished trials of the last few studies read taught (their History, no
    trial running), with those trials in the order they were learnt: a reading whose
    finished trials begin with the very same trial objects (a study's storage hands back a
    finished trial as the object it read once: Optuna's cached RDB storage and its
    in-memory one alike) learns only the rest; any other reading learns every trial. Its
    answer is a copy: what a caller does with it is not remembered."""

    KEPT = 4
    """Readings remembered: a driver reads one study (a test or a bench, a few)."""

    def __init__(self) -> None:
        self._kept: list[tuple[OptunaSpace, list[FrozenTrial], History]] = []
        self._lock = threading.Lock()

    def read(self, finished: Sequence[FrozenTrial], space: OptunaSpace) -> History:
        """The History of ``finished`` (sorted as learnt), over ``space``; none running."""
        with self._lock:
            known, h = [], History()
            for i, (kept_space, trials, kept) in enumerate(self._kept):
                if kept_space is space and _begins_with(finished, trials):
                    known, h = trials, kept
                    del self._kept[i]
                    break
            h = _copy(h)
            for t in finished[len(known) :]:
                _learn(h, space, t)
            self._kept.insert(0, (space, list(finished), _copy(h)))
            del self._kept[self.KEPT :]
            return h


def _begins_with(trials: Sequence[FrozenTrial], prefix: Sequence[FrozenTrial]) -> bool:
    return len(prefix) <= len(trials) and all(
        a is b for a, b in zip(prefix, trials[: len(prefix)], strict=True)
    )


def _copy(h: History) -> History:
    """``h`` with containers of its own (an Observation is frozen: shared)."""
    return dataclasses.replace(
        h, observations=list(h.observations), taught=list(h.taught), measured=dict(h.measured),
        looks=defaultdict(int, h.looks), values=dict(h.values), running=dict(h.running),
        trial_ids=set(h.trial_ids),
    )  # fmt: skip


_LEARNT = _Learnt()


def _learn(h: History, space: OptunaSpace, t: FrozenTrial) -> None:
    """One finished trial of the study, learnt as the searcher once learnt it."""
    attrs = t.user_attrs
    value = float(t.value or 0.0) if t.state == TrialState.COMPLETE else 0.0
    if WARM_START in attrs:
        config = BatchConfig.from_mapping(attrs).canonical()
        h.taught.append(Observation(config, "ok" if value > 0 else "error", value or None))
        return
    if attrs.get("status") in (DUPLICATE, INTERRUPTED):
        return  # nothing measured (an interrupted trial may not even have its parameters)
    proposed = _decoded(space, t)  # as the sampler proposed it
    if proposed is None:
        return  # failed before it was given a configuration
    if attrs.get("status") == CACHED:
        h.values[proposed] = value
        return
    record = record_of(t, space)
    if record is None:
        return
    if record.predicted:  # no trial: an oom to the search model and to the proposer
        config = h.key(record.config)
        if config not in h.measured:
            h.observations.append(observation(record))
            h.measured[config] = h.values[config] = 0.0
        return
    point = h.key(proposed)  # what the trial was sent to measure
    h.full_batch_only |= bool(attrs.get("mixes_batch"))
    ran = h.key(record.config)
    if record.trial_id:
        h.trial_ids.add(record.trial_id)
    else:
        h.unnamed += 1
    h.observations.append(observation(record))
    h.values[proposed] = value
    for config in {point, ran}:
        h.looks[config] += 1
        h.measured[config] = h.pooled(config) or value


def _decoded(space: OptunaSpace, t: FrozenTrial) -> BatchConfig | None:
    """The configuration trial ``t``'s parameters propose (None while they are not set)."""
    try:
        return space.decode(t.params)
    except (KeyError, ValueError):
        return None
