"""The one model of a step's collectives (mbtune.comm): the ring's factors, FSDP2's counts,
the two tiers."""

import numpy as np
import pytest

from mbtune.comm import (
    Link,
    Traffic,
    all_gather,
    all_reduce,
    fsdp_traffic,
    reduce_scatter,
    send,
    step_traffic,
    two_tier_s,
)
from mbtune.lattice import BatchConfig


def test_the_ring_factors():
    assert all_reduce(10**9, 1) == Traffic() and all_reduce(10**9, 1).seconds(1e9, 1e-5) == 0
    # 2 (n - 1) / n * S / bw + 2 (n - 1) * latency, n = 4
    assert all_reduce(10**9, 4).seconds(1e9, 1e-5) == pytest.approx(1.5 + 6e-5)
    assert all_gather(1000, 4).seconds(1e9, 5e-6) == pytest.approx(0.75 * 1000 / 1e9 + 3 * 5e-6)
    assert reduce_scatter(1000, 4) == all_gather(1000, 4)
    assert send(1000) == Traffic(1000.0, 1)
    assert 3 * send(10) + send(5) == Traffic(35.0, 4) == send(10) * 3 + send(5)


def test_a_unit_gathered_and_scattered_once_moves_an_all_reduce():
    one = BatchConfig(4, 4, 1, reshard_after_forward=False)  # g = 1, root only
    assert fsdp_traffic(((1000, 1000),), one) == all_reduce(1000, 4)
    # a block and the root, g = 2: the block gathered twice a micro-batch (reshard after
    # forward), the root once; reduce-scattered once a step (last) or per micro-batch
    units, rs = ((400, 800), (100, 200)), all_gather
    last = BatchConfig(8, 4, 1)
    assert fsdp_traffic(units, last) == 4 * rs(400, 4) + rs(800, 4) + 2 * rs(100, 4) + rs(200, 4)
    every = BatchConfig(8, 4, 1, grad_sync="every")
    assert fsdp_traffic(units, every) == (
        4 * rs(400, 4) + 2 * rs(800, 4) + 2 * rs(100, 4) + 2 * rs(200, 4)
    )
    kept = BatchConfig(8, 4, 1, reshard_after_forward=False)
    assert fsdp_traffic(units, kept) == 2 * rs(400, 4) + rs(800, 4) + 2 * rs(100, 4) + rs(200, 4)


def test_a_step_without_units_is_the_model_as_one_unit():
    c = BatchConfig(12, 4, 1)  # g = 3
    assert step_traffic(c, grad_bytes=400) == all_reduce(400, 4)
    # reshard after forward, grad_sync last: 2g all-gathers and one reduce-scatter
    assert step_traffic(c, grad_bytes=400, sharding="fsdp") == 7 * all_gather(400, 4)
    assert step_traffic(BatchConfig(12, 1, 1), grad_bytes=400, sharding="fsdp") == Traffic()


def test_the_two_tiers():
    one = Link(np.array([100.0]), np.array([1.0]))
    slow = Link(np.array([10.0]), np.array([3.0]))
    # within a node: (n - 1) / n of the bytes, n - 1 hops
    assert two_tier_s(all_gather(400, 4), 4, 8, one, slow)[0] == pytest.approx(3 / 4 * 4 + 3)
    # 16 devices in nodes of 4: the ring at the slower of 100 and 4 x 10, 3 per hop
    at16 = all_gather(400, 16)
    assert two_tier_s(at16, 16, 4, one, slow)[0] == pytest.approx(15 / 16 * 400 / 40 + 15 * 3.0)
    fast_nics = Link(np.array([1000.0]), np.array([3.0]))  # 4 x 1000 > 100: NVLink's pace
    assert two_tier_s(at16, 16, 4, one, fast_nics)[0] == pytest.approx(15 / 16 * 4 + 15 * 3.0)
    # a hop across nodes waits on the slower tier: never cheaper than within a node
    slow_node = Link(np.array([100.0]), np.array([5.0]))
    assert two_tier_s(at16, 16, 4, slow_node, fast_nics)[0] == pytest.approx(
        15 / 16 * 4 + 15 * 5.0
    )
