"""The lattice math: exact values on hand-made cases, properties on random ones."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mbtune import lattice
from mbtune.config.train_input import check_batch_size, check_micro_batch_size
from mbtune.lattice import BatchConfig, LatticeError


def test_the_pure_cores_import_neither_torch_nor_ray(light_imports):
    loaded = light_imports.loaded("cores")  # conftest.LIGHT_IMPORTS: the modules imported
    assert not {"torch", "ray"} & loaded.keys(), loaded


# -- splits -------------------------------------------------------------------


def test_even_split_puts_larger_parts_first():
    assert lattice.even_split(10, 3) == [4, 3, 3]
    assert lattice.even_split(8, 4) == [2, 2, 2, 2]
    assert lattice.even_split(7, 3) == [3, 2, 2]


def test_even_split_refuses_empty_parts():
    with pytest.raises(LatticeError, match="cannot split 2 samples into 3 non-empty parts"):
        lattice.even_split(2, 3)


def test_per_device_and_accumulation():
    assert lattice.per_device_batch(64, 2) == 32
    assert lattice.per_device_batch(65, 2) == 33
    assert lattice.grad_accum_steps(32, 8) == 4
    assert lattice.grad_accum_steps(32, 5) == 7


def test_canonical_micro_batch_is_the_largest_run():
    # P = 8, m = 5: g = 2, two micro-batches of 4; so m = 4..7 are one measurement.
    assert [lattice.canonical_micro_batch_size(8, m) for m in range(1, 9)] == [
        1, 2, 3, 4, 4, 4, 4, 8
    ]  # fmt: skip


def test_divisors():
    assert lattice.divisors(1) == [1]
    assert lattice.divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]


# -- strict validity ------------------------------------------------------------


def test_valid_micro_batch_sizes():
    assert lattice.valid_micro_batch_sizes(64, 2) == [1, 2, 4, 8, 16, 32]
    assert lattice.valid_micro_batch_sizes(65, 2) == []
    assert lattice.valid_micro_batch_sizes(1, 2) == []


def test_valid_num_devices():
    assert lattice.valid_num_devices(12) == [1, 2, 3, 4, 6, 12]
    assert lattice.valid_num_devices(12, 4) == [1, 3]  # 12 / 4 = 3 micro-batches of 4 to share
    assert lattice.valid_num_devices(12, 5) == []


def test_nearest_valid_batch_sizes():
    assert lattice.nearest_valid_batch_sizes(64, 2, 5) == (60, 70)
    assert lattice.nearest_valid_batch_sizes(60, 2, 5) == (60, 60)
    assert lattice.nearest_valid_batch_sizes(3, 2, 4) == (None, 8)
    assert lattice.nearest_valid_batch_sizes(100, 3, 4) == (96, 108)  # not 99 or 102


def test_nearest_valid_batch_sizes_when_splits_may_be_uneven():
    # any B >= n with m <= ceil(B / n): from n x (m - 1) + 1 on
    assert lattice.nearest_valid_batch_sizes(7, 3, 4, allow_uneven=True) == (None, 10)
    assert lattice.nearest_valid_batch_sizes(11, 3, 4, allow_uneven=True) == (11, 11)
    assert lattice.nearest_valid_batch_sizes(2, 3, 1, allow_uneven=True) == (None, 3)


def test_the_strict_rules_name_rule_numbers_and_valid_values():
    with pytest.raises(
        LatticeError,
        match=r"^micro_batch_size 5 does not divide the per-device batch 32 \(batch_size 64 / "
        r"num_devices 2\); nearest valid batch_size for micro_batch_size 5: 60 \(below\) or "
        r"70 \(above\); valid micro_batch_size for batch_size 64: 1, 2, 4, 8, 16, 32$",
    ):
        check_micro_batch_size(64, 2, 5)
    with pytest.raises(LatticeError, match=r"^batch_size 65 is not divisible by num_devices 2; "
                       r"nearest valid batch_size for micro_batch_size 1: 64 \(below\) or 66 "
                       r"\(above\); valid num_devices for batch_size 65 and micro_batch_size 1: "
                       r"1, 5, 13, 65$"):  # fmt: skip
        check_batch_size(65, 2, 1)
    with pytest.raises(LatticeError, match=r"^batch_size 2 is smaller than num_devices 4: every "
                       r"device needs at least one sample; nearest valid batch_size for "
                       r"micro_batch_size 1: 4 \(above\); valid num_devices for batch_size 2 and "
                       r"micro_batch_size 1: 1, 2$"):  # fmt: skip
        check_batch_size(2, 4, 1)
    check_batch_size(64, 2, 8)
    check_micro_batch_size(64, 2, 8)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        # the nearest batch sizes are multiples of n x m, whichever rule broke
        ((100, 3, 4), "batch_size 100 is not divisible by num_devices 3; nearest valid batch_size "
         "for micro_batch_size 4: 96 (below) or 108 (above); valid num_devices for batch_size "
         "100 and micro_batch_size 4: 1, 5, 25 (or set allow_uneven: true)"),
        # 87 is no multiple of 4: no device count runs micro_batch_size 4, none is named
        ((87, 8, 4), "batch_size 87 is not divisible by num_devices 8; nearest valid batch_size "
         "for micro_batch_size 4: 64 (below) or 96 (above) (or set allow_uneven: true)"),
        # P = 3 < m = 7: allow_uneven would not help, so it is not offered
        ((22, 8, 7), "batch_size 22 is not divisible by num_devices 8; nearest valid batch_size "
         "for micro_batch_size 7: 56 (above)"),
        # the device counts that run this batch are named too (mbtune trial --num-devices 3)
        ((32, 3, None), "batch_size 32 is not divisible by num_devices 3; nearest valid "
         "batch_size: 30 (below) or 33 (above); valid num_devices for batch_size 32: 1, 2, 4, "
         "8, 16, 32 (or set allow_uneven: true)"),
        ((65, 2, None), "batch_size 65 is not divisible by num_devices 2; nearest valid "
         "batch_size: 64 (below) or 66 (above); valid num_devices for batch_size 65: 1, 5, 13, "
         "65 (or set allow_uneven: true)"),
        ((2, 4, 3), "batch_size 2 is smaller than num_devices 4: every device needs at least one "
         "sample; nearest valid batch_size for micro_batch_size 3: 12 (above)"),
        ((6, 8, None), "batch_size 6 is smaller than num_devices 8: every device needs at least "
         "one sample; nearest valid batch_size: 8 (above); valid num_devices for batch_size 6: "
         "1, 2, 3, 6"),
    ],
)  # fmt: skip
def test_check_batch_size_names_values_that_pass_every_rule(sizes, message):
    with pytest.raises(LatticeError, match=f"^{re.escape(message)}$"):
        check_batch_size(*sizes, offer_uneven=True)


@pytest.mark.parametrize(
    ("check", "sizes", "message"),
    [
        (check_batch_size, (10, 12, 4), "batch_size 10 is smaller than num_devices 12: "
         "every device needs at least one sample; nearest valid batch_size for micro_batch_size "
         "4: 37 (above); valid num_devices for batch_size 10 and micro_batch_size 4: 1..3"),
        (check_micro_batch_size, (10, 3, 8), "micro_batch_size 8 exceeds the per-device "
         "batch 4 (batch_size 10 / num_devices 3); nearest valid batch_size for micro_batch_size "
         "8: 22 (above); valid micro_batch_size for batch_size 10: 1..4"),
    ],
)  # fmt: skip
def test_uneven_splits_name_ranges_of_valid_values(check, sizes, message):
    with pytest.raises(LatticeError, match=f"^{re.escape(message)}$"):
        check(*sizes, allow_uneven=True)
    check_micro_batch_size(10, 3, 3, allow_uneven=True)


def test_a_huge_batch_is_named_as_a_range_not_listed():
    with pytest.raises(LatticeError, match=r"valid micro_batch_size for batch_size 2147483647: "
                       r"1\.\.2147483647$"):  # fmt: skip
        check_micro_batch_size(2**31 - 1, 1, 2**31, allow_uneven=True)


# -- pipelines --------------------------------------------------------------------


def test_the_pipeline_bubble_is_megatrons():
    assert lattice.bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert lattice.bubble_fraction(1, 8) == 0.0


# -- configurations ---------------------------------------------------------------


def test_batch_config_properties():
    c = BatchConfig(10, 3, 2)
    assert c.device_batch_sizes == [4, 3, 3]
    assert c.per_device_batch == 4
    assert c.grad_accum_steps == 2
    assert c.micro_batch_sizes == [2, 2]
    assert not c.is_strict
    assert BatchConfig(64, 2, 5).canonical() == BatchConfig(64, 2, 5)  # P 32, g 7: 5+5+5+5+4+4+4
    assert BatchConfig(16, 2, 5).canonical() == BatchConfig(16, 2, 4)
    # one micro-batch a device: its gradients are synchronised once, whatever grad_sync says
    assert BatchConfig(32, 2, 16, grad_sync="every").canonical() == BatchConfig(32, 2, 16)
    assert BatchConfig(32, 2, 8, grad_sync="every").canonical().grad_sync == "every"
    with pytest.raises(LatticeError, match="smaller than num_devices"):
        BatchConfig(2, 4, 1)


def _enum(mode, b=(32,), n=(1,), ms=None, **kw):
    return [
        (c.batch_size, c.num_devices, c.micro_batch_size)
        for c in lattice.enumerate_configs(
            mode=mode, batch_sizes=b, num_devices=n, micro_batch_sizes=ms, **kw
        )
    ]


def test_enumerate_int_mode_keeps_only_strict_configs():
    assert _enum(4, b=(32,), n=(1, 2, 3, 16)) == [(32, 1, 4), (32, 2, 4)]
    assert _enum(4, b=(30,), n=(2,), allow_uneven=True) == [(30, 2, 4)]


def test_enumerate_none_mode_is_one_micro_batch():
    assert _enum("none", b=(32,), n=(1, 2, 3)) == [(32, 1, 32), (32, 2, 16)]
    assert _enum("none", b=(32,), n=(3,), allow_uneven=True) == [(32, 3, 11)]


def test_enumerate_auto_mode_is_the_divisors_of_p():
    assert _enum("auto", b=(12,), n=(1, 2)) == [
        (12, 1, 1), (12, 1, 2), (12, 1, 3), (12, 1, 4), (12, 1, 6), (12, 1, 12),
        (12, 2, 1), (12, 2, 2), (12, 2, 3), (12, 2, 6),
    ]  # fmt: skip
    assert _enum("auto", b=(12,), n=(1,), ms=(2, 4, 5, 8)) == [(12, 1, 2), (12, 1, 4)]


def test_enumerate_explore_mode_tries_every_size_up_to_p():
    assert _enum("explore", b=(10,), n=(3,)) == [(10, 3, 1), (10, 3, 2), (10, 3, 3), (10, 3, 4)]
    assert _enum("explore", b=(8,), n=(1,), ms=(3, 5, 16)) == [(8, 1, 3), (8, 1, 5)]


def test_enumerate_batch_range_is_n_times_m_times_g():
    assert _enum(8, b=(16, 40), n=(2,), batch_range=True) == [(16, 2, 8), (32, 2, 8)]
    assert _enum("none", b=(1, 100), n=(2,), ms=(4, 8), batch_range=True) == [
        (8, 2, 4), (16, 2, 8)
    ]  # fmt: skip
    with pytest.raises(LatticeError, match="needs micro_batch_size listed in the space"):
        _enum("auto", b=(1, 100), n=(1,), batch_range=True)


def test_enumerate_refuses_a_space_too_large_to_search():
    with pytest.raises(LatticeError, match="more than 10 configurations"):
        _enum("auto", b=(1, 1000), n=(1,), ms=range(1, 50), batch_range=True, limit=10)
    with pytest.raises(LatticeError, match="list micro_batch_size in the space"):
        _enum("explore", b=(10**6,), n=(1,))


# -- properties -------------------------------------------------------------------

sizes = st.integers(min_value=1, max_value=512)
modes = st.one_of(st.integers(min_value=1, max_value=64), st.sampled_from(lattice.MODES))


@given(total=sizes, parts=sizes)
def test_even_split_sums_and_differs_by_at_most_one(total, parts):
    if total < parts:
        return
    split = lattice.even_split(total, parts)
    assert sum(split) == total and len(split) == parts
    assert max(split) - min(split) <= 1


@given(b=sizes, n=st.integers(1, 16), m=st.integers(1, 64))
def test_nearest_valid_batch_sizes_are_valid_and_nothing_lies_between(b, n, m):
    below, above = lattice.nearest_valid_batch_sizes(b, n, m)
    assert lattice.is_strictly_valid(above, n, m) and above >= b
    if below is not None:
        assert lattice.is_strictly_valid(below, n, m) and below <= b
    lo = below if below is not None else 0
    assert not any(lattice.is_strictly_valid(x, n, m) for x in range(lo + 1, above) if x != b)


@given(b=sizes, n=st.integers(1, 16), m=st.integers(1, 64))
def test_nearest_uneven_batch_sizes_are_the_smallest_that_run(b, n, m):
    below, above = lattice.nearest_valid_batch_sizes(b, n, m, allow_uneven=True)
    runs = [x for x in range(1, above + 1) if x >= n and m <= lattice.per_device_batch(x, n)]
    assert (below, above) == ((b, b) if b in runs else (None, runs[0]))


@given(b=sizes, m=st.one_of(st.none(), st.integers(1, 64)))
def test_valid_num_devices_are_exactly_the_strict_ones(b, m):
    valid = lattice.valid_num_devices(b, m)
    assert valid == [n for n in range(1, b + 1) if lattice.is_strictly_valid(b, n, m or 1)]


@given(b=sizes, n=st.integers(1, 16))
def test_valid_micro_batch_sizes_are_exactly_the_strict_ones(b, n):
    valid = lattice.valid_micro_batch_sizes(b, n)
    assert valid == [m for m in range(1, b + 1) if lattice.is_strictly_valid(b, n, m)]


@given(
    mode=modes,
    b=st.lists(sizes, min_size=1, max_size=3),
    n=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    ms=st.one_of(st.none(), st.lists(st.integers(1, 64), min_size=1, max_size=6)),
    uneven=st.booleans(),
)
def test_every_enumerated_config_is_strict_or_splits_within_one_sample(mode, b, n, ms, uneven):
    configs = lattice.enumerate_configs(
        mode=mode, batch_sizes=b, num_devices=n, micro_batch_sizes=ms, allow_uneven=uneven
    )
    assert len(configs) == len(set(configs))
    for c in configs:
        devices, micro = c.device_batch_sizes, c.micro_batch_sizes
        assert sum(devices) == c.batch_size and max(devices) - min(devices) <= 1
        assert sum(micro) == c.per_device_batch and max(micro) - min(micro) <= 1
        assert max(micro) <= c.micro_batch_size
        if mode == "auto" or not (uneven or mode == "explore"):
            assert c.is_strict, c
        if isinstance(mode, int):
            assert c.micro_batch_size == mode


@given(
    mode=modes,
    lo=st.integers(1, 200),
    width=st.integers(0, 200),
    n=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    ms=st.lists(st.integers(1, 32), min_size=1, max_size=5),
)
def test_a_batch_range_gives_strict_configs_inside_it(mode, lo, width, n, ms):
    configs = lattice.enumerate_configs(
        mode=mode, batch_sizes=(lo, lo + width), num_devices=n, micro_batch_sizes=ms,
        batch_range=True,
    )  # fmt: skip
    for c in configs:
        assert lo <= c.batch_size <= lo + width
        assert c.is_strict
        if mode == "none":
            assert c.grad_accum_steps == 1
