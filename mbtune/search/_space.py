"""The lattice as Optuna's search space (:class:`OptunaSpace`): a define-by-run space whose
parameters are *indices* into fixed, sorted lists (one list of device counts, one list of
batch sizes per device count) and the micro-batch size's log2, so that every proposal is
a point of the experiment's lattice, valid by construction (a layout, t, p and the
schedule, that cannot run the chosen (devices, batch) is read as the nearest that can, as
the micro-batch size is, and settings of a step that are another's measurement as its).
Each parameter name always has the same range (Optuna forbids dynamic ones) and its order
(small to large) is something TPE and GP can exploit. Every sampler of mbtune proposes
through it, Optuna's and mbtune's own (mbtune.search._samplers).
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import optuna

from mbtune.lattice import LAYOUT, SETTINGS, BatchConfig

__all__ = ["OptunaSpace"]


class OptunaSpace:
    """A define-by-run space proposing only the given points (picklable, for resume).

    Devices and batch sizes are indices into fixed sorted lists. The micro-batch size is
    one parameter shared by every (devices, batch): its log2, mapped to the nearest valid
    size of the chosen (devices, batch). Sharing it lets the sampler carry what it learnt
    about micro-batch sizes on one device count over to the others.
    """

    M_PARAM = "micro_batch_size_log2"

    def __init__(self, points: Sequence[BatchConfig]) -> None:
        self.by_n: dict[int, list[int]] = defaultdict(list)
        self.by_nb: dict[tuple[int, int], list[int]] = defaultdict(list)
        self.layouts: dict[tuple[int, int], list[tuple]] = defaultdict(list)
        """The layouts (t, p, schedule) each (devices, batch) runs."""
        self.by_layout: dict[tuple, list[int]] = defaultdict(list)
        """The micro-batch sizes of each (devices, batch, layout)."""
        self.settings: dict[tuple, list[tuple]] = defaultdict(list)
        """The settings of a step (mbtune.lattice.SETTINGS) each (devices, batch, layout,
        micro-batch) runs with: every combination the space lists, but where two are one
        measurement (``BatchConfig.canonical``: grad_sync at one micro-batch a device)."""
        for c in sorted(set(points), key=lambda c: str(c.settings)):
            self.settings[c.num_devices, c.batch_size, c.layout, c.micro_batch_size].append(
                c.settings
            )
        # (B, n, m) once each, whatever layout and settings of a step come with it
        for n, b, m in sorted({(c.num_devices, c.batch_size, c.micro_batch_size) for c in points}):
            if not self.by_n[n] or self.by_n[n][-1] != b:
                self.by_n[n].append(b)
            self.by_nb[n, b].append(m)
        for n, b, layout, m in sorted({(c.num_devices, c.batch_size, c.layout, c.micro_batch_size)
                                       for c in points}):  # fmt: skip
            if layout not in self.layouts[n, b]:
                self.layouts[n, b].append(layout)
            self.by_layout[n, b, layout].append(m)
        self.choices = {key: sorted({getattr(c, key) for c in points}, key=str)
                        for key in (*LAYOUT, *SETTINGS)}  # fmt: skip
        """The layout (mbtune.lattice.LAYOUT: tensor_parallel, pipeline_parallel,
        pipeline_schedule) and each setting of a step (mbtune.lattice.SETTINGS:
        activation_checkpointing, reshard_after_forward, grad_sync) and the values the space
        gives it: one value, or several, then a categorical parameter of its own, named as
        it (every (B, n, m) of the lattice comes with each combination of the settings; a
        layout only where its rules let it)."""
        self.ns = sorted(self.by_n)
        self.log2_max = math.log2(max(max(ms) for ms in self.by_nb.values()))

    def encode(self, c: BatchConfig) -> tuple[dict[str, float], dict[str, Any]]:
        """The Optuna parameters (and their distributions) that propose ``c``."""
        params: dict[str, float] = {}
        dists: dict[str, Any] = {}
        for name, values, value in (
            ("num_devices_index", self.ns, c.num_devices),
            (f"batch_size_index_n{c.num_devices}", self.by_n[c.num_devices], c.batch_size),
        ):
            if len(values) > 1:
                params[name] = values.index(value)
                dists[name] = optuna.distributions.IntDistribution(0, len(values) - 1)
        if self.log2_max > 0:
            params[self.M_PARAM] = math.log2(c.micro_batch_size)
            dists[self.M_PARAM] = optuna.distributions.FloatDistribution(0.0, self.log2_max)
        for key, values in self.choices.items():
            if len(values) > 1:
                params[key] = getattr(c, key)
                dists[key] = optuna.distributions.CategoricalDistribution(values)
        return params, dists

    def decode(self, params: dict[str, Any]) -> BatchConfig:
        """The configuration that Optuna parameters (as :meth:`encode` gives) propose."""
        return BatchConfig.from_mapping(self(optuna.trial.FixedTrial(params)))

    def __call__(self, trial: Any) -> dict[str, Any]:
        n = _pick(trial, "num_devices_index", self.ns)
        b = _pick(trial, f"batch_size_index_n{n}", self.by_n[n])
        x = trial.suggest_float(self.M_PARAM, 0.0, self.log2_max) if self.log2_max > 0 else 0.0
        chosen = {
            key: trial.suggest_categorical(key, values) if len(values) > 1 else values[0]
            for key, values in self.choices.items()
        }
        t, p, schedule = _nearest_layout(self.layouts[n, b], tuple(chosen[k] for k in LAYOUT))
        ms = self.by_layout[n, b, (t, p, schedule)]
        m = min(ms, key=lambda m: abs(math.log2(m) - x))
        c = BatchConfig(b, n, m, tensor_parallel=t, pipeline_parallel=p,
                        pipeline_schedule=schedule)  # fmt: skip
        wanted = tuple(chosen[key] for key in SETTINGS)
        runs = self.settings[n, b, (t, p, schedule), m]
        # the settings chosen, or (where those are another's measurement, or not listed
        # with this micro-batch) the ones of the lattice that agree with most of them
        settings = max(runs, key=lambda s: sum(map(operator.eq, s, wanted)))
        return c.with_settings(settings).sizes()


def _nearest_layout(layouts: list[tuple], wanted: tuple) -> tuple:
    """``wanted`` (t, p, schedule) where it is one of ``layouts``, else the nearest of them:
    in octaves of t and p, then the schedule, then the first."""
    if wanted in layouts:
        return wanted
    t, p, schedule = wanted
    return min(layouts, key=lambda lay: (abs(math.log2(lay[0] / t)) + abs(math.log2(lay[1] / p))
                                         + (lay[2] != schedule), lay))  # fmt: skip


def _pick(trial: Any, name: str, values: list[int]) -> int:
    """One of ``values`` (sorted), through an integer index Optuna can model."""
    if len(values) == 1:
        return values[0]
    return values[trial.suggest_int(name, 0, len(values) - 1)]
