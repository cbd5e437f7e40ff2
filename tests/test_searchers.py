"""The searchers, driven directly (no Ray cluster): valid, never twice, exact sequences."""

import functools

import optuna
import pytest
from ray.tune.search import Searcher

from mbtune.lattice import BatchConfig, enumerate_configs
from mbtune.recommend.confidence import OPEN_CHANCE, SearchModel
from mbtune.recommend.observation import Observation
from mbtune.runs.record import TrialRecord
from mbtune.search import (
    METRIC,
    RIVAL_MATERIAL,
    LatticeGridSampler,
    MbtuneSearcher,
    make_searcher,
)
from mbtune.search._samplers import Proposal
from mbtune.search._searcher import STUCK_PROPOSALS
from mbtune.search._stopping import nearest


def drive(searcher, value_of, limit=100, status=None):
    """Suggest and complete one trial at a time; return the configurations measured.
    ``status(value)``: the status each trial reports (default none: an error to the model)."""
    measured = []
    for i in range(limit):
        params = searcher.suggest(f"t{i}")
        if params == Searcher.FINISHED:
            return measured
        assert params is not None
        config = BatchConfig(
            params["batch_size"], params["num_devices"], params["micro_batch_size"]
        )
        measured.append(config)
        value = value_of(config)
        said = {"status": status(value)} if status else {}
        searcher.on_trial_complete(f"t{i}", {METRIC: value, **said, **params})
    raise AssertionError("the search never finished")


POINTS = enumerate_configs(mode="auto", batch_sizes=[32], num_devices=[1, 2])


def speed(c):
    """Faster with larger micro-batches, out of memory above 8 per device on 2 devices."""
    if c.num_devices == 2 and c.micro_batch_size > 8:
        return 0.0
    return c.num_devices * c.micro_batch_size / (c.micro_batch_size + 4)


@pytest.mark.parametrize(
    "sampler", ["model", "tpe", pytest.param("gp", marks=pytest.mark.slow), "random", "grid"]
)  # gp: Optuna's Gaussian process, 6 s here
def test_every_sampler_proposes_each_valid_point_once_and_finishes(sampler):
    searcher = make_searcher(sampler, POINTS, seed=0)
    measured = drive(searcher, speed)
    assert sorted(measured) == sorted(POINTS)  # all 11, none twice, then FINISHED


class Fixated(optuna.samplers.RandomSampler):
    """An Optuna sampler stuck on its first proposal: it proposes it again and again."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.first: dict = {}

    def sample_independent(self, study, trial, name, distribution):
        if name not in self.first:
            self.first[name] = super().sample_independent(study, trial, name, distribution)
        return self.first[name]


def test_a_sampler_stuck_on_measured_configurations_gets_the_nearest_unmeasured_one():
    searcher = make_searcher("random", POINTS, seed=0)
    searcher.sampler = Fixated()  # the study, made at the first suggestion, asks it
    measured = drive(searcher, speed)
    assert sorted(measured) == sorted(POINTS)  # all 11, none twice, then FINISHED
    # each after STUCK_PROPOSALS proposals of the measured, the nearest of the rest to them
    asked = searcher.study.trials()
    assert len(asked) == len(POINTS) + (len(POINTS) - 1) * STUCK_PROPOSALS
    assert measured[1] == nearest(sorted(set(POINTS) - {measured[0]}), measured[0])


def test_grid_goes_in_order():
    assert drive(make_searcher("grid", POINTS, seed=0), speed) == sorted(POINTS)


def test_halving_starts_at_p_and_halves_on_oom():
    measured = drive(make_searcher("halving", POINTS, seed=0), speed)
    sizes = [(c.num_devices, c.micro_batch_size) for c in measured]
    assert sizes == [(1, 32), (2, 16), (2, 8)]


def test_doubling_doubles_until_no_faster_or_out_of_memory():
    def peaked(c):  # fastest at m = 4 on one device
        return {1: 1.0, 2: 2.0, 4: 3.0, 8: 2.5}.get(c.micro_batch_size, 1.0) * c.num_devices

    measured = drive(make_searcher("doubling", POINTS, seed=0), peaked)
    assert [(c.num_devices, c.micro_batch_size) for c in measured] == [
        (1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (2, 8),
    ]  # fmt: skip
    measured = drive(make_searcher("doubling", POINTS, seed=0), speed)
    assert [(c.num_devices, c.micro_batch_size) for c in measured][-2:] == [(2, 8), (2, 16)]


def test_same_split_is_one_measurement_reported_with_the_canonical_size():
    # explore: P = 8; m = 5, 6, 7 run two micro-batches of 4, the same as m = 4
    points = enumerate_configs(mode="explore", batch_sizes=[8], num_devices=[1])
    searcher = make_searcher("grid", points, seed=0)
    measured = drive(searcher, lambda c: float(c.micro_batch_size))
    assert [c.micro_batch_size for c in measured] == [1, 2, 3, 4, 8]


class Repeating(LatticeGridSampler):
    """A sampler that keeps proposing the first point: the cache must answer it."""

    def propose(self, h):
        return Proposal(self.points[0])


def test_repeated_proposals_are_answered_from_the_cache_and_the_search_ends():
    searcher = MbtuneSearcher(Repeating(POINTS), SearchModel(tuple(POINTS)))
    measured = drive(searcher, speed)
    # each proposal after the first answered from the cache, until the sampler counts as
    # stuck and the nearest unmeasured point is measured: every point once, then the end
    assert measured[0] == POINTS[0] and sorted(measured) == sorted(POINTS)
    cached = [t for t in searcher.study.trials() if t.user_attrs["status"] == "cached"]
    assert cached and {t.value for t in cached} == {speed(POINTS[0])}  # told the value


def row(i, c, value, **more):
    """A finished trial as trials.csv's record of it."""
    return TrialRecord(trial=i, trial_id=f"x{i}", status="ok" if value else "oom",
                       objective=value, **c.sizes(), **more)  # fmt: skip


def test_what_the_study_holds_is_never_measured_again():
    searcher = make_searcher("grid", POINTS, seed=0)
    for i, c in enumerate(POINTS[:5], start=1):  # measured before the driver stopped
        searcher.study.add(row(i, c, speed(c)))
    assert drive(searcher, speed) == sorted(POINTS)[5:]


@pytest.mark.parametrize("sampler", ["grid", "model"])
def test_batch_mixing_collapses_the_space_to_m_equals_p(sampler):
    searcher = make_searcher(sampler, POINTS, seed=0)
    measured = []
    for i in range(20):
        params = searcher.suggest(f"t{i}")
        if params == Searcher.FINISHED:
            break
        n, b = params["num_devices"], params["batch_size"]
        measured.append((n, params["micro_batch_size"]))
        # the trial measured m = P instead and said why
        searcher.on_trial_complete(
            f"t{i}", {METRIC: 1.0, "mixes_batch": True, "batch_size": b, "num_devices": n,
                      "micro_batch_size": b // n},
        )  # fmt: skip
    # after the first trial, only m = P on each device count, each once
    assert all(m == 32 // n for n, m in measured[1:]) and len(measured) <= 3
    assert {n for n, _ in measured} == {1, 2}
    if sampler == "grid":
        assert measured == [(1, 1), (2, 16)]  # then only m = P, reported as what runs


def test_searcher_state_survives_save_and_restore(tmp_path):
    searcher = make_searcher("tpe", POINTS, seed=0)
    first = drive_some(searcher, 3)
    path = str(tmp_path / "state.pkl")
    searcher.save(path)
    restored = make_searcher("tpe", POINTS, seed=0)
    restored.restore(path)
    rest = drive(restored, speed)
    assert sorted(first + rest) == sorted(POINTS)


def drive_some(searcher, k):
    out = []
    for i in range(k):
        params = searcher.suggest(f"a{i}")
        c = BatchConfig.from_mapping(params)
        searcher.on_trial_complete(f"a{i}", {METRIC: speed(c), **params})
        out.append(c)
    return out


def test_start_points_are_measured_first_and_taught_to_the_sampler():
    first = [BatchConfig(32, 2, 4), BatchConfig(32, 1, 16)]
    searcher = make_searcher("tpe", POINTS, seed=0, start_points=first)
    measured = drive(searcher, speed)
    assert measured[:2] == first
    assert sorted(measured) == sorted(POINTS)
    assert len(searcher.study.trials()) >= len(POINTS)


def test_warm_start_teaches_optuna_without_skipping_anything():
    searcher = make_searcher("tpe", POINTS, seed=0)
    for i, c in enumerate(POINTS[:4], start=1):
        searcher.teach(row(i, c, speed(c)), f"earlier, trial {i}")
    assert len(searcher.study.trials()) == 4  # Optuna learnt them
    assert sorted(drive(searcher, speed)) == sorted(POINTS)  # and every point is measured here
    grid = make_searcher("grid", POINTS, seed=0)
    grid.teach(row(1, POINTS[0], 1.0))
    assert drive(grid, speed) == sorted(POINTS)  # a baseline is not taught by a warm start


def test_the_model_sampler_starts_on_most_devices_and_goes_where_the_best_is_likely():
    # B = 512 on 1..8 devices; per-device throughput saturating in m, out of memory above 64
    points = enumerate_configs(mode="auto", batch_sizes=[512], num_devices=[1, 2, 4, 8])
    searcher = make_searcher("model", points, seed=0)
    measured = []
    for i in range(7):
        params = searcher.suggest(f"t{i}")
        c = BatchConfig.from_mapping(params)
        measured.append(c)
        fits = c.micro_batch_size <= 64
        value = c.num_devices * 1000 * c.micro_batch_size / (c.micro_batch_size + 6) if fits else 0
        result = {METRIC: value, "status": "ok" if fits else "oom", **params}
        result["step_times_ms"] = [1e3 * c.batch_size / value] * 3 if fits else []
        searcher.on_trial_complete(f"t{i}", result)
    # throughput per device is what it models: with samples/s over all devices, the most
    # devices, and the middle of their micro-batch sizes (1..64), in octaves
    assert measured[0] == BatchConfig(512, 8, 8)
    # then the configuration the model finds likeliest the fastest, before any check: the
    # best guess first (issue 39), and the best (8 devices at 64) by the third trial
    first = searcher.model.assess(searcher.observations[:1])
    assert measured[1] == max(first.p_best, key=first.p_best.__getitem__)
    assert measured[1].num_devices == 8 and measured[2] == BatchConfig(512, 8, 64)
    # then, once the likeliest best is measured, every device count never measured,
    # beside the leader (micro_batch_size 64): the model cannot speak for a device count
    # until one was measured (a slow link between two), and the stop waits for them
    assert sorted(measured[3:6]) == [BatchConfig(512, n, 64) for n in (1, 2, 4)]
    assert {o.status for o in searcher.observations} <= {"ok", "oom"}
    per_device = make_searcher("model", points, seed=0, global_objective=False)
    first = BatchConfig.from_mapping(per_device.suggest("t0"))
    assert first == BatchConfig(512, 2, 16)  # per device: the middle of the whole space


def test_a_restored_searcher_learns_what_finished_after_its_last_save(tmp_path):
    from mbtune.runs.rundir import RunDir

    run = RunDir.create(tmp_path, "r")
    searcher = make_searcher("tpe", POINTS, seed=0, ledger=run.trials_file)
    path = str(tmp_path / "state.pkl")
    searcher.save(path)  # Ray saved the searcher here, then two trials finished
    for i, c in enumerate(POINTS[:2], start=1):
        run.append_trial({"trial": i, "status": "ok", "objective": speed(c), **c.sizes()})
    # (max_repeats 1: no second looks at the two, which would be right with repeats on)
    restored = make_searcher("tpe", POINTS, seed=0, ledger=run.trials_file, max_repeats=1)
    restored.restore(path)  # ...and the driver was killed before the next save
    rest = drive(restored, speed)
    assert sorted(rest) == sorted(POINTS[2:])  # neither measured again


# ---------------------------------------------------------------------------
# another look (re-measurement)


LEADER = BatchConfig(32, 2, 8)


def assessment(confidence, looks, threat):
    from mbtune.recommend.confidence import Assessment

    return Assessment(LEADER, 1.0, confidence, confidence / 100, 11, 0,
                      threat=threat, looks=looks)  # fmt: skip


RIVAL, OTHER = BatchConfig(32, 2, 4), BatchConfig(32, 1, 8)
RULE = {"target": 90, "max_repeats": 3, "noise_floor": 0.035, "busy": set()}


def test_the_leader_is_measured_twice_before_the_search_stops_on_its_target():
    from mbtune.search import another_look, settled

    leader = BatchConfig(32, 2, 8)
    once = assessment(95, {leader: 1, RIVAL: 1}, {RIVAL: 0.01})
    assert another_look(once, **RULE, new_threat=0.0) == (
        leader, "re-measuring the leader before stopping"
    )  # fmt: skip
    rule = {"target": 90, "max_repeats": 3, "noise_floor": 0.035}
    assert not settled(once, **rule)
    twice = assessment(95, {leader: 2, RIVAL: 1}, {RIVAL: 0.01})
    assert another_look(twice, **RULE, new_threat=0.0) is None
    assert settled(twice, **rule)
    # once is enough where the user says so, with the reason
    assert settled(once, **{**rule, "max_repeats": 1})
    assert settled(once, **{**rule, "noise_floor": 0.0})
    assert another_look(once, **{**RULE, "noise_floor": 0.0}, new_threat=0.0) is None
    assert not settled(assessment(89, {leader: 5}, {}), **rule)


def test_the_strongest_rival_is_measured_twice_before_the_search_stops_where_it_is_material():
    from mbtune.search import another_look, settled

    rule = {"target": 90, "max_repeats": 3, "noise_floor": 0.035}
    # the true best, measured once on a low draw, keeps 5% of beating the leader
    once = assessment(92, {LEADER: 2, RIVAL: 1, OTHER: 1}, {RIVAL: 0.05, OTHER: 0.04})
    assert not settled(once, **rule)
    assert another_look(once, **RULE, new_threat=0.0) == (
        RIVAL, "re-measuring the strongest rival before stopping"
    )  # fmt: skip
    # one never measured is measured
    new = assessment(92, {LEADER: 2, OTHER: 1}, {RIVAL: 0.05, OTHER: 0.04})
    assert another_look(new, **RULE, new_threat=0.0) == (
        RIVAL, "measuring the strongest rival before stopping"
    )  # fmt: skip
    # measured twice, or immaterial, or while it is being measured: no more
    twice = assessment(92, {LEADER: 2, RIVAL: 2, OTHER: 1}, {RIVAL: 0.05, OTHER: 0.04})
    assert settled(twice, **rule)
    calm = assessment(92, {LEADER: 2, RIVAL: 1}, {RIVAL: RIVAL_MATERIAL / 2})
    assert settled(calm, **rule) and another_look(calm, **RULE, new_threat=0.0) is None
    assert another_look(once, **{**RULE, "busy": {RIVAL}}, new_threat=0.0) is None
    # max_repeats 1: no second look at anything
    assert settled(once, **{**rule, "max_repeats": 1})


def test_each_device_count_is_measured_where_the_model_says_it_is_fastest_before_a_stop():
    from mbtune.search import RIVAL_ACROSS, another_look, settled

    rule = {"target": 90, "max_repeats": 3, "noise_floor": 0.035}
    # 1 device measured only at a small micro-batch: the model carries 2 devices' curve
    # over to it and gives its best at m = 32 under the 2% of a rival, which a link tier
    # can hide
    small, large = BatchConfig(32, 1, 2), BatchConfig(32, 1, 32)
    a = assessment(97, {LEADER: 2, small: 1}, {small: 0.0, large: 0.015, OTHER: 0.001})
    assert not settled(a, **rule)
    assert another_look(a, **RULE, new_threat=0.0) == (
        large, "measuring the strongest rival before stopping"
    )  # fmt: skip
    # measured, or given no chance by the model: the stop stands
    assert settled(assessment(97, {LEADER: 2, large: 1}, {large: 0.015}), **rule)
    assert settled(assessment(97, {LEADER: 2}, {large: RIVAL_ACROSS / 2}), **rule)
    # on the leader's own device count the 2% rule alone
    assert settled(assessment(97, {LEADER: 2}, {BatchConfig(32, 2, 16): 0.01}), **rule)


def test_a_rival_at_another_device_count_put_behind_by_the_trend_alone_is_looked_at_again():
    import dataclasses

    from mbtune.search import another_look, settled

    rule = {"target": 90, "max_repeats": 3, "noise_floor": 0.035}
    # 1 device at m = 8 and the leader, seen twice each and level on those looks, which the
    # model's trend over the device counts puts 4% apart (its threat 0.5%): a link tier is
    # what that trend cannot see (bench/close_calls.py --landscape fewer-devices, seed 68)
    level = dataclasses.replace(
        assessment(92, {LEADER: 2, OTHER: 2}, {OTHER: 0.005}),
        estimate={LEADER: 1.0, OTHER: 0.96},
        own_estimate={LEADER: 0.98, OTHER: 0.98},
        own_threat={OTHER: 0.2},
    )
    assert not settled(level, **rule)
    assert another_look(level, **RULE, new_threat=0.0) == (
        LEADER, "re-measuring the leader before stopping"
    )  # fmt: skip
    third = dataclasses.replace(level, looks={LEADER: 3, OTHER: 2})
    assert another_look(third, **RULE, new_threat=0.0) == (
        OTHER, "re-measuring the strongest rival before stopping"
    )  # fmt: skip
    # as often as max_repeats allows: the stop stands
    assert settled(dataclasses.replace(level, looks={LEADER: 3, OTHER: 3}), **rule)
    # the model puts them apart as their looks do (its trend adds under the tolerance)
    agreed = dataclasses.replace(level, own_estimate={LEADER: 0.99, OTHER: 0.965})
    assert settled(agreed, **rule)
    # on the leader's own device count the model's reading stands (the 2% rule alone)
    same = dataclasses.replace(
        level, looks={LEADER: 2, RIVAL: 2}, threat={RIVAL: 0.005},
        estimate={LEADER: 1.0, RIVAL: 0.96}, own_estimate={LEADER: 0.98, RIVAL: 0.98},
        own_threat={RIVAL: 0.2},
    )  # fmt: skip
    assert settled(same, **rule)
    # apart on their looks too, trials that do not drift, or a machine whose spread more
    # looks cannot settle (three looks each, TIE_RESOLVE_LOOKS, at most): no more looks
    assert settled(dataclasses.replace(level, own_threat={OTHER: RIVAL_MATERIAL / 2}), **rule)
    assert settled(level, **{**rule, "noise_floor": 0.0})
    busy = dataclasses.replace(level, resolvable=False)
    five = {**rule, "max_repeats": 5}
    assert not settled(busy, **five)
    assert settled(dataclasses.replace(busy, looks={LEADER: 3, OTHER: 3}), **five)


def test_a_tie_waits_for_a_material_rival_outside_it_that_was_never_measured():
    import dataclasses

    from mbtune.recommend.tie import Tie
    from mbtune.search import another_look, settled

    rule = {"target": 90, "max_repeats": 3, "noise_floor": 0.035}
    tie = Tie(members=(LEADER, OTHER), width=0.01, probability=0.9)
    # four devices' micro-batch sizes tie while two devices at a large one was never measured
    a = dataclasses.replace(
        assessment(60, {LEADER: 2, OTHER: 2}, {OTHER: 0.3, RIVAL: 0.03}), tie=tie
    )
    assert not settled(a, **rule)
    assert another_look(a, **RULE, new_threat=0.0) == (
        RIVAL, "measuring the strongest rival before stopping"
    )  # fmt: skip
    # measured once is enough outside a tie; the members are the tie's business
    seen = dataclasses.replace(a, looks={LEADER: 2, OTHER: 2, RIVAL: 1})
    assert settled(seen, **rule) and another_look(seen, **RULE, new_threat=0.0) is None


def test_below_the_target_a_close_rival_is_looked_at_again_where_it_beats_anything_new():
    from mbtune.search import another_look

    leader = BatchConfig(32, 2, 8)
    a = assessment(70, {leader: 2, RIVAL: 1, OTHER: 1}, {RIVAL: 0.2, OTHER: 0.05})
    # the rival, measured less often than the leader, threatens it more than a new point
    assert another_look(a, **RULE, new_threat=0.1) == (RIVAL, "re-measuring a close rival")
    assert another_look(a, **RULE, new_threat=0.3) is None  # something new is worth more
    assert another_look(a, **RULE, new_threat=None)[0] == RIVAL  # nothing new to measure
    # on a tie of looks, the leader; a rival at max_repeats leaves the next rival's pair
    tie = assessment(70, {leader: 1, RIVAL: 1}, {RIVAL: 0.2})
    assert another_look(tie, **RULE, new_threat=None)[0] == leader
    full = assessment(70, {leader: 3, RIVAL: 3, OTHER: 1}, {RIVAL: 0.2, OTHER: 0.05})
    assert another_look(full, **RULE, new_threat=None)[0] == OTHER
    # immaterial threats and running configurations are never looked at again
    calm = assessment(70, {leader: 1, RIVAL: 1}, {RIVAL: 0.005})
    assert another_look(calm, **RULE, new_threat=None) is None
    busy = {**RULE, "busy": {leader, RIVAL}}
    assert another_look(tie, **busy, new_threat=None) is None


def test_where_the_machine_cannot_tell_two_apart_a_close_pair_gets_two_looks_each():
    import dataclasses

    from mbtune.search import another_look

    # a busy machine: a third look at the leader or its rival could not tell them apart;
    # once every material rival has two looks, none gets a third and the search measures
    # something new (bench/close_calls.py --landscape busy)
    twice = assessment(70, {LEADER: 2, RIVAL: 2, OTHER: 1}, {RIVAL: 0.2, OTHER: 0.05})
    assert another_look(twice, **RULE, new_threat=None)[0] == OTHER
    busy = dataclasses.replace(twice, resolvable=False)
    assert another_look(busy, **RULE, new_threat=None)[0] == OTHER
    seen = dataclasses.replace(busy, looks={LEADER: 2, RIVAL: 2, OTHER: 2})
    assert another_look(seen, **RULE, new_threat=None) is None
    # a quiet one: a third look each
    assert another_look(dataclasses.replace(seen, resolvable=True), **RULE,
                        new_threat=None)[0] in (LEADER, RIVAL)  # fmt: skip


def test_a_repeat_is_a_fresh_trial_numbered_by_its_configuration():
    # a close call on two configurations, a drift prior, and a target never reached: the model
    # sampler measures both, then looks again at the pair, each repeat numbered, until
    # max_repeats, and then the search is finished
    points = [BatchConfig(32, 1, 8), BatchConfig(32, 1, 16)]
    true = {points[0]: 100.0, points[1]: 101.0}
    searcher = make_searcher("model", points, seed=0, noise_floor=0.035, max_repeats=3,
                             target=100)  # fmt: skip
    seen = []
    for i in range(12):
        params = searcher.suggest(f"t{i}")
        if params == Searcher.FINISHED:
            break
        c = BatchConfig.from_mapping(params)
        seen.append((c.micro_batch_size, params["repeat"]))
        value = true[c]
        steps = [1e3 * c.batch_size / value] * 5
        searcher.on_trial_complete(f"t{i}", {METRIC: value, "status": "ok", **params,
                                             "step_times_ms": steps})  # fmt: skip
    assert sorted(seen) == [(8, 0), (8, 1), (8, 2), (16, 0), (16, 1), (16, 2)]
    assert params == Searcher.FINISHED
    assert searcher.assessment().looks == {points[0]: 3, points[1]: 3}


def test_a_device_count_never_measured_is_a_rival_until_it_is_measured():
    # a slow link: 4 devices are the fastest, but the search starts on 8. However well
    # 8 devices are measured, fewer may be faster on a cluster that does not scale
    # linearly: the search does not stop until every device count was measured (a cost
    # fitted on some cannot see a link tier between two of them), whatever the score, and
    # the model sampler measures one next, beside the leader, so that the two differ in
    # devices alone.
    import dataclasses

    from mbtune.search import settled, strongest_rival

    points = enumerate_configs(mode="auto", batch_sizes=[512], num_devices=[1, 2, 4, 8])

    def slow_link(c):
        m, n = c.micro_batch_size, c.num_devices
        if m > 64:
            return None
        return 512 / ((512 / n) / (1000 * m / (m + 6)) + 0.032 * (n - 1) / n + 0.06 * (n - 1))

    def observe(c, looks=1):
        value = slow_link(c)
        steps = (1e3 * 512 / value * f for f in (0.97, 1.0, 1.03, 0.99, 1.01))
        return [Observation(c, "ok", value, tuple(steps))] * looks

    model = SearchModel(tuple(points), noise_floor=0.035)
    on_8 = [o for m in (4, 8, 16, 32, 64) for o in observe(BatchConfig(512, 8, m), 2)]
    a = model.assess(on_8)
    assert a.unmeasured_values == {"num_devices": (1, 2, 4)}
    assert a.open_points and all(c.num_devices != 8 for c in a.open_points)
    # what a new measurement could settle keeps each value's chance; the stop waits for one
    assert a.unmeasured_threat >= 1 - (1 - OPEN_CHANCE) ** 3
    sure = dataclasses.replace(a, confidence=95, looks={a.recommended: 2}, threat={})
    assert not settled(sure, target=90, max_repeats=5, noise_floor=0.035)
    assert strongest_rival(sure, max_repeats=5, noise_floor=0.035) in a.open_points
    # the search measures another device count next, with the leader's micro-batch
    searcher = make_searcher("model", points, seed=0, noise_floor=0.035)
    for i, o in enumerate(on_8, start=1):
        searcher.study.add(row(i, o.config, o.value, step_times_ms=o.step_times_ms))
    params = searcher.suggest("t0")
    c = BatchConfig.from_mapping(params)
    assert c.num_devices == 4 and c.micro_batch_size == a.recommended.micro_batch_size
    some = model.assess([*on_8, *observe(c, 2)])
    assert some.unmeasured_values == {"num_devices": (1, 2)}
    # measured, or failed otherwise than out of memory: the model speaks for the rest
    failed = Observation(BatchConfig(512, 2, 8), "error")
    oom = Observation(BatchConfig(512, 1, 256), "oom")
    every = model.assess([*on_8, *observe(c, 2), *observe(BatchConfig(512, 1, 8)), failed, oom])
    assert every.unmeasured_values == {} and not every.open_points


def test_every_way_a_search_ends_is_one_sentence():
    """search._stopping.end_reason: the target, a tie, an interrupt, and what ran out, with
    what would make a search that stopped below its target surer."""
    from mbtune.search._stopping import end_reason

    points = tuple(BatchConfig(32, n, m) for n in (1, 2) for m in (1, 2, 4, 8))
    model = SearchModel(points, noise_floor=0.035)
    seen = [Observation(BatchConfig(32, 2, 8), "ok", 630.0, (50.8, 50.7, 50.9)),
            Observation(BatchConfig(32, 2, 4), "ok", 590.0, (54.2, 54.3, 54.1))]  # fmt: skip
    a = model.assess(seen)
    common = {"target": 90, "max_repeats": 5, "noise_floor": 0.035, "budget": 6,
              "measured": 2, "time_budget_s": None, "elapsed_s": 3.0}  # fmt: skip
    say = functools.partial(end_reason, a, **common)
    assert say(status="confident") == "the confidence score reached its target 90"
    assert say(status="tie").startswith("on a tie: ")
    assert say(status="interrupted") == (
        f"interrupted (Ctrl-C or SIGTERM) at confidence {a.confidence}"
    )
    budget = say(status="finished", measured=6)
    assert budget.startswith(f"the trial budget (search.num_samples 6) ran out at confidence "
                             f"{a.confidence}, below its target 90; raise search.num_samples "
                             "for a surer answer: it lacked a second look at its "
                             "recommendation")  # fmt: skip
    clock = say(status="finished", time_budget_s=2.0)
    assert clock.startswith("the time budget (search.time_budget_s 2 s) ran out")
    assert "raise search.time_budget_s" in clock
    looks = say(status="finished")
    assert looks.startswith("every configuration was measured as often as the search may "
                            "(search.max_repeats 5)")  # fmt: skip
    never = say(status="finished", measured=6, target=100)
    assert never.endswith("(search.confidence_target 100: it never stops on confidence)")
    # nothing ran ok, and a failed configuration is not tried again: no repeats to blame
    failed = model.assess([Observation(c, "error") for c in points])
    assert end_reason(failed, **common, status="finished") == (
        "no configuration is left to try, and none ran ok (see each trial's reason)"
    )
    # a rival named by its settings too, where the space searches them: else "m = 4" would
    # name the recommendation itself
    points = tuple(BatchConfig(32, 2, m, grad_sync=s) for m in (2, 4) for s in ("last", "every"))
    looked = [Observation(BatchConfig(32, 2, 4), "ok", v, (50.8, 50.7, 50.9)) for v in (630, 628)]
    slow = Observation(BatchConfig(32, 2, 2), "ok", 500.0, (50.8, 50.7, 50.9))
    sharded = SearchModel(points, noise_floor=0.035, sharded=True).assess([*looked, slow])
    said = end_reason(sharded, **{**common, "budget": 3, "measured": 3}, status="finished")
    assert said.endswith("it lacked a look at its strongest rival (num_devices 2, batch_size "
                         "32, micro_batch_size 4, grad_sync every)")  # fmt: skip


@pytest.mark.parametrize("sampler", ["model", "grid", "halving", "doubling"])
def test_each_sampler_proposes_in_a_plain_optuna_study_what_the_search_measures(sampler):
    """mbtune's samplers are Optuna samplers: in a study of your own, with your objective,
    they propose what `mbtune run`'s searcher measures, in the same order."""
    import optuna

    from mbtune.search._samplers import make_sampler

    def status(value):
        return "ok" if value else "oom"

    expected = drive(make_searcher(sampler, POINTS, seed=0), speed, status=status)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    proposer = make_sampler(sampler, SearchModel(tuple(sorted(POINTS))), seed=0)
    study = optuna.create_study(direction="maximize", sampler=proposer)

    def objective(trial):
        value = speed(proposer.configuration(trial))
        trial.set_user_attr("status", status(value))
        return value

    study.optimize(objective, n_trials=len(expected))
    assert [BatchConfig.from_mapping(t.user_attrs) for t in study.trials] == expected
    assert [t.user_attrs["repeat"] for t in study.trials] == [0] * len(expected)
