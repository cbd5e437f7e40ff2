"""The search model's communication term (issue 38): where the trials shard the model, a
step's collectives per sample, counted by mbtune.comm, as a term of the trend (pure:
neither torch nor ray)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from mbtune.lattice import BatchConfig, enumerate_configs
from mbtune.recommend import gp


def test_unsharded_the_column_is_zero_and_the_model_what_it_was():
    # data parallelism's all-reduce, once a step, is a function of n, B, t and p, which
    # their own columns carry: the term is left out (gp.comm_per_sample's docstring)
    points = enumerate_configs(mode="auto", batch_sizes=[512], num_devices=[1, 2, 4, 8])
    assert all(gp.features(c)[-1] == 0.0 for c in points)
    assert not gp.Scale(points)(points)[:, -1].any()


def test_sharded_it_counts_every_gather_and_scatter_of_the_step():
    x = gp.comm_per_sample
    each = 7 / 8 / 64  # one all-gather or reduce-scatter of the model over 8, per sample
    g = 4  # P = 64, m = 16
    # reshard_after_forward: two all-gathers a micro-batch; one reduce-scatter a step
    assert x(BatchConfig(512, 8, 16)) == pytest.approx((2 * g + 1) * each)
    kept = BatchConfig(512, 8, 16, reshard_after_forward=False)
    assert x(kept) == pytest.approx((g + 1) * each)
    every = BatchConfig(512, 8, 16, grad_sync="every")
    assert x(every) == pytest.approx((2 * g + g) * each)
    assert x(BatchConfig(512, 1, 16)) == 0.0  # one device: nothing sent


def test_the_sharding_reaches_the_features_through_the_scale():
    points = [BatchConfig(512, n, 16, grad_sync=s) for n in (1, 8) for s in ("last", "every")]
    sharded = gp.Scale(points, sharded=True)(points)[:, -1]
    plain = gp.Scale(points)(points)[:, -1]
    # sharded, in octaves: grad_sync every on 8 devices sends 12 gathers' and scatters'
    # worth, last 9, and one device (nothing) counts as the least the space sends;
    # unsharded, no column
    assert sharded[3] - sharded[2] == pytest.approx(math.log2(12 / 9))
    assert sharded[0] == sharded[1] == sharded[2]
    assert not plain.any()


@pytest.mark.parametrize(
    ("devices", "k", "overlap"),
    [((1, 2, 4, 8), 2.0, 0.0), ((2, 4, 8), 4.0, 0.8)],
    ids=["exposed", "hidden-until-it-outlasts-the-compute"],
)
def test_the_trend_learns_what_grad_sync_every_costs_a_small_micro_batch(
    monkeypatch, devices, k, overlap
):
    # FSDP with grad_sync every reduce-scatters once a micro-batch: the smaller m, the more
    # it sends per sample. Measured: grad_sync last everywhere, every at m >= 16 on 2 and 8
    # devices only; asked: every at m = 1 on 8 devices. A step is its compute (saturating
    # in m) and its collectives (k x: the link's time for the gradient k times one
    # sample's compute), less the ``overlap`` of the shorter of the two: exposed (every
    # 17% slower than last there), or hidden by prefetching until they outlast the compute
    # (30% slower). A shift for grad_sync every and the curvatures alone put it 16% and
    # 41% too fast; the communication's two columns, learnt on the large micro-batches and
    # the device counts, carry most of it over
    base = enumerate_configs(mode="auto", batch_sizes=[512], num_devices=list(devices))
    points = [dataclasses.replace(c, grad_sync=s) for c in base for s in ("last", "every")]

    def samples_per_s(c: BatchConfig) -> float:
        compute = (c.micro_batch_size + 4) / c.micro_batch_size  # per sample, saturating
        comm = k * gp.comm_per_sample(c)
        return c.num_devices / (compute + comm - overlap * min(compute, comm))

    measured = [c for c in points if c.grad_sync == "last" or (
        c.num_devices in (2, 8) and c.micro_batch_size >= 16)]  # fmt: skip
    asked = BatchConfig(512, 8, 1, grad_sync="every")

    def error() -> float:
        scale = gp.Scale(points, sharded=True)
        y = np.log([samples_per_s(c) / c.num_devices for c in measured])
        model = gp.Mixture(scale(measured), y, np.full(len(measured), 1e-4))
        return abs(math.exp(model.mean(scale([asked]))[0]) * 8 / samples_per_s(asked) - 1)

    with_term = error()
    monkeypatch.setattr(gp, "_COMM_SD", 0.0)  # without the term: both columns held at 0
    monkeypatch.setattr(gp, "_COMM_OCTAVE_SD", 0.0)
    without = error()
    assert without > 0.15
    assert with_term < without / 2
