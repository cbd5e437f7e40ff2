"""The plan of the real run: the fitted step model, the rows and picks, `mbtune plan`, the
plan in `mbtune analyze` and its plot."""

import json
import math
import sys

import numpy as np
import pandas as pd
import pytest

from mbtune.cli import main
from mbtune.comm import Link, step_traffic, two_tier_s
from mbtune.config.load import parse_experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, ModelShape, layout_rule
from mbtune.plan.load import plan_run
from mbtune.plan.planner import Interval, make_plan
from mbtune.runs.rundir import read_trials

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from rundirs import EXPERIMENT, PNG_MAGIC, make_run, trial_row  # noqa: E402

GRAD_BYTES = 400_000_000
"""A 100M-parameter model's fp32 gradients."""
INTRA = (300e9, 5e-6)
INTER = (40e9, 12e-6)


def truth_compute_s(m):
    """The generator's seconds per micro-batch: a fixed cost per pass and one per sample."""
    return 0.002 + 0.001 * m


def truth_step_s(config, per_node=8):
    intra = Link(np.array([INTRA[0]]), np.array([INTRA[1]]))
    inter = Link(np.array([INTER[0]]), np.array([INTER[1]]))
    g = config.grad_accum_steps
    traffic = step_traffic(config, grad_bytes=GRAD_BYTES)
    sync = two_tier_s(traffic, config.num_devices, per_node, intra, inter)
    return g * truth_compute_s(config.canonical_micro_batch_size) + float(sync[0])


def exact_row(b, n, m, *, parallel="ddp", **extra):
    """A trials.csv row measured exactly from the generator (no spread in its steps)."""
    config = BatchConfig(b, n, m)
    step = truth_step_s(config)
    comm = step - config.grad_accum_steps * truth_compute_s(config.canonical_micro_batch_size)
    return trial_row(
        b, n, m, b / step,
        comm_time_ms=comm * 1e3, compute_time_ms=(step - comm) * 1e3,
        step_time_ms_iqr=None, step_times_ms=[], parallel=parallel, **extra,
    )  # fmt: skip


def experiment(plan, *, devices=(1, 2, 4, 8), micro=(4, 8, 16), batch=512, parallel="ddp"):
    return {
        **EXPERIMENT,
        "train_input": {"batch_size": batch, "micro_batch_size": "auto"},
        "search": {"space": {"num_devices": list(devices), "micro_batch_size": micro},
                   "noise_floor": 0.0},
        "trial": {"parallel": parallel},
        "plan": plan,
    }  # fmt: skip


EXACT_PLAN = {
    "samples": 1e9,
    "num_devices": [8, 64, 256],
    "price_per_device_hour": 2.5,
    "inter_node": {"bandwidth": int(INTER[0]), "latency_us": INTER[1] * 1e6, "uncertainty": 0.0},
}


def exact_run(tmp_path, plan=EXACT_PLAN, devices=(1, 2, 4, 8), micro=(4, 8, 16), **kwargs):
    rows = [exact_row(512, n, m) for n in devices for m in (4, 8, 16)]
    return make_run(tmp_path, rows, experiment=experiment(plan, devices=devices, micro=micro,
                                                          **kwargs))  # fmt: skip


def plan_of(run, *overrides, draws=200):
    return plan_run(run, overrides, grad_bytes=GRAD_BYTES, draws=draws)


# -- the model -----------------------------------------------------------------


def test_the_fit_recovers_the_generator_at_the_sizes_it_never_measured(tmp_path):
    plan = plan_of(exact_run(tmp_path, micro={"min": 1, "max": 16}))
    assert "fitted to the collectives measured at 2, 4, 8 devices" in plan.link_basis
    assert [r.config.num_devices for r in plan.rows] == [8, 64, 256]
    for row in plan.rows:
        assert row.samples_per_s.value == pytest.approx(
            row.config.batch_size / truth_step_s(row.config), rel=1e-6
        )
        # no noise, no link uncertainty: the interval is the point
        assert row.samples_per_s.low == pytest.approx(row.samples_per_s.value, rel=1e-6)
        assert row.samples_per_s.high == pytest.approx(row.samples_per_s.value, rel=1e-6)
    # 256 devices of a 512 batch: micro-batches of 1 and 2, below every size measured (the
    # affine fit of the compute); the best there is the truth's best
    at_256 = plan.rows[2].config
    best = min((BatchConfig(512, 256, m) for m in (1, 2)), key=truth_step_s)
    assert at_256 == best


def test_a_replay_s_folded_collectives_are_found_and_the_link_fitted_to_them(tmp_path):
    """A replayed table's throughput holds its collectives (comm_time_ms 0): the fit tells
    them apart from the compute by the micro-batch sizes measured at several counts."""
    rows = []
    for n in (1, 2, 4, 8):
        for m in (4, 8, 16):
            row = exact_row(512, n, m, parallel="simulate", backend="replay")
            row.update(comm_time_ms=0.0, compute_time_ms=row["step_time_ms_median"])
            rows.append(row)
    run = make_run(tmp_path, rows, experiment=experiment(EXACT_PLAN, parallel="simulate"))
    plan = plan_of(run)
    assert "fitted to the collectives measured at 2, 4, 8 devices" in plan.link_basis
    for row in plan.rows:  # 8 (measured), 64 and 256 (predicted over two tiers)
        truth = row.config.batch_size / truth_step_s(row.config)
        assert row.samples_per_s.value == pytest.approx(truth, rel=1e-6)


def test_a_single_device_count_rests_on_the_link_prior_and_says_so(tmp_path):
    plan_keys = {**EXACT_PLAN, "intra_node": {}, "inter_node": {}}
    plan = plan_of(exact_run(tmp_path, plan=plan_keys, devices=(1,)))
    assert plan.link_basis.endswith("the run measured a single device count (1)")
    assert "prior alone" in plan.link_basis
    at_64 = plan.rows[1].samples_per_s
    assert at_64.low < at_64.value < at_64.high  # the prior's 30% shows
    one = plan.rows[0].samples_per_s  # 8 devices on one node: the intra-node prior alone
    assert one.low < one.value < one.high


def test_a_simulated_run_s_collectives_are_not_fitted(tmp_path):
    rows = [exact_row(512, n, 8, parallel="simulate") for n in (1, 2, 4)]
    run = make_run(tmp_path, rows, experiment=experiment(EXACT_PLAN, parallel="simulate"))
    assert "modelled (trial.parallel: simulate), not measured" in plan_of(run).link_basis


def test_every_row_s_hours_device_hours_and_cost_follow_from_samples_per_s(tmp_path, capsys):
    run = exact_run(tmp_path, plan={"samples": 3e8, "num_devices": [8, 64]})
    code = main(["plan", str(run), "--set", "plan.price_per_device_hour=2.5", "--json",
                 "--set", "plan.intra_node.uncertainty=0.5"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0 and "inter-node link is the prior" in err
    report = json.loads(out)
    assert set(report) == {"rows", "fastest", "cheapest", "cheapest_within", "layouts"}
    assert [rows[0] for rows in report["layouts"]] == report["rows"]  # one layout: the row
    for row in [*report["rows"], report["fastest"], report["cheapest"], report["cheapest_within"]]:
        assert set(row) == {"num_devices", "batch_size", "micro_batch_size",
                            "activation_checkpointing", "reshard_after_forward", "grad_sync",
                            "tensor_parallel", "pipeline_parallel", "pipeline_schedule",
                            "confidence", "samples_per_s", "hours", "device_hours",
                            "cost"}  # fmt: skip
        assert 0 <= row["confidence"] <= 99
        speed, hours, dh, cost = (row[k] for k in ("samples_per_s", "hours", "device_hours",
                                                   "cost"))  # fmt: skip
        for key, rate in (("value", "value"), ("low", "high"), ("high", "low")):
            assert hours[key] == pytest.approx(3e8 / speed[rate] / 3600)
        for key in ("value", "low", "high"):
            assert dh[key] == pytest.approx(hours[key] * row["num_devices"])
            assert cost[key] == pytest.approx(dh[key] * 2.5)
        for interval in (speed, hours, dh, cost):
            assert interval["low"] <= interval["value"] <= interval["high"]


def test_the_picks(tmp_path):
    # a slow link between nodes: 64 devices are faster than 8, but far dearer per sample
    run = exact_run(tmp_path)
    plan = plan_of(run, "plan.num_devices=[8, 16, 64]", "plan.max_slowdown=0.0")
    by_n = {r.config.num_devices: r for r in plan.rows}
    assert plan.fastest is min(plan.rows, key=lambda r: r.hours.value)
    assert plan.cheapest is min(plan.rows, key=lambda r: r.cost.value)
    assert plan.fastest is by_n[64] and plan.cheapest is by_n[8]
    assert plan.cheapest_within is plan.fastest  # no slowdown allowed: the fastest
    loose = plan_of(run, "plan.num_devices=[8, 16, 64]", "plan.max_slowdown=100")
    assert loose.cheapest_within.config == loose.cheapest.config
    slowdown = by_n[16].hours.value / by_n[64].hours.value - 1
    middle = plan_of(run, "plan.num_devices=[8, 16, 64]", f"plan.max_slowdown={slowdown + 1e-6}")
    assert middle.cheapest_within.config.num_devices == 16


def test_devices_per_node_and_the_tiers_are_honoured(tmp_path):
    run = exact_run(tmp_path)
    base = plan_of(run, "plan.num_devices=[16]").rows[0].samples_per_s.value
    # 16 devices in one node: the fast tier alone
    one_node = plan_of(run, "plan.num_devices=[16]", "plan.devices_per_node=16").rows[0]
    assert one_node.samples_per_s.value > base
    slower = plan_of(run, "plan.num_devices=[16]", "plan.inter_node.bandwidth=4GB")
    assert slower.rows[0].samples_per_s.value < base
    later = plan_of(run, "plan.num_devices=[16]", "plan.inter_node.latency_us=10000")
    assert later.rows[0].samples_per_s.value < base
    narrow = plan_of(run, "plan.num_devices=[16]").rows[0].samples_per_s  # uncertainty 0
    wide = plan_of(run, "plan.num_devices=[16]", "plan.inter_node.uncertainty=1.0").rows[0]
    assert narrow.high / narrow.low == pytest.approx(1.0)
    assert wide.samples_per_s.high / wide.samples_per_s.low > 1.1
    # prior-only intra-node tier (one device count): its bandwidth is honoured
    single = exact_run(tmp_path / "one", plan={"samples": 1e9, "num_devices": [8]}, devices=(1,))
    fast = plan_of(single).rows[0].samples_per_s.value
    assert plan_of(single, "plan.intra_node.bandwidth=10GB").rows[0].samples_per_s.value < fast
    assert plan_of(single, "plan.intra_node.latency_us=1000").rows[0].samples_per_s.value < fast


def test_samples_tokens_and_steps(tmp_path):
    rows = [exact_row(512, n, 8, tokens_per_s=None) for n in (1, 2)]
    for row in rows:
        row["tokens_per_s"] = row["samples_per_s"] * 64  # a seq_len of 64
    run = make_run(tmp_path, rows, experiment=experiment({"samples": 1e9, "num_devices": [8]}))
    by_samples = plan_of(run).rows[0]
    assert by_samples.samples == 1e9
    assert plan_of(run, "plan.samples=null", "plan.tokens=6.4e10").rows[0].samples == 1e9
    by_steps = plan_of(run, "plan.samples=null", "plan.steps=1000").rows[0]
    assert by_steps.samples == 1000 * by_steps.config.batch_size
    assert by_steps.hours.value == pytest.approx(
        1000 * by_steps.config.batch_size / by_steps.samples_per_s.value / 3600
    )
    no_tokens = make_run(tmp_path / "b", [exact_row(512, 1, 8)],
                         experiment=experiment({"tokens": 1e9}))  # fmt: skip
    with pytest.raises(Exception, match=r"^plan\.tokens: the run's trials counted no tokens"):
        plan_of(no_tokens)


def test_without_a_price_there_is_no_cost_and_the_cheapest_is_in_device_hours(tmp_path):
    plan = plan_of(exact_run(tmp_path, plan={"samples": 1e9, "num_devices": [8, 64]}))
    assert all(r.cost is None for r in plan.rows)
    assert plan.as_json()["cheapest"]["cost"] is None
    assert plan.cheapest is min(plan.rows, key=lambda r: r.device_hours.value)


def test_the_plan_uses_no_micro_batch_larger_than_one_that_ran(tmp_path):
    rows = [exact_row(512, n, m) for n in (1, 2) for m in (4, 8)]
    rows.append(trial_row(512, 1, 16, status="oom"))
    run = make_run(tmp_path, rows, experiment=experiment({"samples": 1e9, "num_devices": [1]}))
    assert plan_of(run).rows[0].config.micro_batch_size <= 8


def test_interval_holds_its_point_estimate():
    draws = np.array([1.0, *np.linspace(2, 3, 50)])  # every draw above the point
    interval = Interval.of(draws)
    assert interval.low == 1.0 <= interval.value <= interval.high
    assert interval.into(10.0) == Interval(10.0, 10.0 / interval.high, 10.0)


def test_a_run_s_measured_configurations_are_predicted_as_measured(tmp_path):
    run = exact_run(tmp_path, plan={"samples": 1e9, "num_devices": [1, 2, 4, 8]})
    plan = plan_of(run)
    measured = {(r.num_devices, r.micro_batch_size): r.samples_per_s
                for r in read_trials(run / "trials.csv").records}  # fmt: skip
    for row in plan.rows:
        c = row.config
        assert row.samples_per_s.value == pytest.approx(measured[c.num_devices, c.micro_batch_size])
        best = max(v for (n, _), v in measured.items() if n == c.num_devices)
        assert row.samples_per_s.value == pytest.approx(best)


# -- the command ------------------------------------------------------------------


def test_mbtune_plan_counts_the_model_s_bytes_once_and_prints_the_plan(tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    seen = []

    def counted(model):
        seen.append(model)
        return GRAD_BYTES

    monkeypatch.setattr("mbtune.plan.model_bytes.gradient_bytes", counted)
    run = exact_run(tmp_path)
    assert main(["plan", str(run)]) == 0
    out = capsys.readouterr().out
    assert [m.name for m in seen] == ["mlp"]
    assert "plan: 1e+09 samples on 8, 64, 256 devices, from 12 measured trials" in out
    assert "fastest: " in out and "cheapest within 10% of the fastest: " in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "plan.samples=-1"], "plan.samples: must be positive, got -1"),
        (["--set", "plan.samples=null"], "plan: give one of samples, tokens or steps"),
        (["--set", "plan.num_devices=[0]"], "plan.num_devices: 0 is out of range"),
        (["--set", "plan.inter_node.bandwith=1GB"], "plan.inter_node.bandwith: unknown key"),
        (["--set", "train_input.batch_size=8"], "--set: mbtune plan sets the plan's keys only"),
    ],
)
def test_a_wrong_plan_field_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    code = main(["plan", str(exact_run(tmp_path)), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"mbtune: error: {message}") and err.count("\n") == 1


def test_a_run_without_a_plan_or_trials_is_one_line_and_exit_2(tmp_path, capsys):
    no_plan = make_run(tmp_path / "a", [exact_row(512, 1, 8)])
    assert main(["plan", str(no_plan)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mbtune: error: plan: the run's experiment has no plan section")
    assert err.count("\n") == 1
    failed = make_run(tmp_path / "b", [trial_row(512, 1, 8, status="error")],
                      experiment=experiment(EXACT_PLAN))  # fmt: skip
    assert main(["plan", str(failed)]) == 2
    err = capsys.readouterr().err
    assert "has no measured trial (status ok) to plan from" in err and err.count("\n") == 1
    assert main(["plan", str(tmp_path / "nowhere")]) == 2
    assert "is not an mbtune run directory" in capsys.readouterr().err


def test_mbtune_plan_writes_its_table_and_plot_into_the_run_as_analyze_does(
    tmp_path, capsys, counted_bytes
):
    run = exact_run(tmp_path)
    assert main(["plan", str(run), "--set", "plan.samples=2e9"]) == 0
    out = capsys.readouterr().out
    assert out.endswith(f"\nplan: {run / 'plan.csv'}, {run / 'plot-plan.png'}\n")
    assert (run / "plot-plan.png").read_bytes().startswith(PNG_MAGIC)
    expected = plan_run(run, ["plan.samples=2e9"], grad_bytes=GRAD_BYTES).as_frame()
    pd.testing.assert_frame_equal(pd.read_csv(run / "plan.csv"), expected, check_dtype=False)
    # analyze --set writes the same files, through the same function
    (run / "plot-plan.png").unlink()
    assert main(["analyze", str(run), "--set", "plan.samples=2e9"]) == 0
    assert f"plan: {run / 'plan.csv'}, {run / 'plot-plan.png'}\n" in capsys.readouterr().out
    pd.testing.assert_frame_equal(pd.read_csv(run / "plan.csv"), expected, check_dtype=False)
    # --json keeps stdout the object: the files are named on stderr; --no-plots: no plot
    (run / "plot-plan.png").unlink()
    assert main(["plan", str(run), "--json", "--no-plots"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["fastest"] and err.endswith(f"plan: {run / 'plan.csv'}\n")
    assert not (run / "plot-plan.png").exists()


def test_plan_batch_size_plans_a_device_count_the_run_s_batch_cannot_be_split_over(
    tmp_path, capsys, counted_bytes
):
    run = exact_run(tmp_path, plan={"samples": 1e9})  # batch 512, micro-batches 4, 8, 16
    assert main(["plan", str(run), "--set", "plan.num_devices=[8, 1024]", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert (
        "     1024  no plan: the search space holds no configuration at 1024 devices: its "
        "batch_size 512 cannot be split over 1024; plan.batch_size=4096 would plan it\n"
    ) in out  # 1024 or 2048 would leave each device 1 or 2 samples: no micro-batch of 4
    assert main(["plan", str(run), "--set", "plan.num_devices=[8, 1024]",
                 "--set", "plan.batch_size=4096", "--no-plots"]) == 0  # fmt: skip
    assert "no plan" not in capsys.readouterr().out
    best = pd.read_csv(run / "plan.csv").query("best")
    assert best[["num_devices", "batch_size"]].values.tolist() == [[8, 4096], [1024, 4096]]
    assert main(["plan", str(run), "--set", "plan.num_devices=[1024]",
                 "--set", "plan.batch_size=1000"]) == 2  # fmt: skip
    assert capsys.readouterr().err == (
        "mbtune: error: plan.num_devices: no planned device count has a configuration: the "
        "search space holds no configuration at 1024 devices: plan.batch_size 1000 cannot be "
        "split over 1024; plan.batch_size=4096 would plan it\n"
    )


def test_gradient_bytes_counts_the_model_on_the_meta_device():
    pytest.importorskip("torch")
    from mbtune.models.build import build_from_config
    from mbtune.plan.model_bytes import gradient_bytes

    model = parse_experiment(experiment({"samples": 1.0})).model
    real = build_from_config(model).module
    assert gradient_bytes(model) == 4 * sum(p.numel() for p in real.parameters())


def test_split_shape_reads_the_model_s_width_and_blocks_on_the_meta_device():
    pytest.importorskip("torch")
    from mbtune.plan.model_bytes import split_shape

    exp = {**experiment({"samples": 1.0}), "model": {"name": "gpt", "n_layer": 3, "n_head": 4,
                                                      "d_model": 96, "seq_len": 16}}  # fmt: skip
    shape = split_shape(parse_experiment(exp).model)
    assert (shape.layers, shape.hidden, shape.heads) == (3, 96, 4)


def test_the_fit_imports_neither_torch_nor_ray(light_imports):
    loaded = light_imports.loaded("plan")  # conftest.LIGHT_IMPORTS: the package imported
    assert not {"torch", "ray"} & loaded.keys(), loaded


def test_make_plan_takes_an_experiment_built_in_code(tmp_path):
    run = exact_run(tmp_path)
    exp = parse_experiment(experiment(EXACT_PLAN))
    records = read_trials(run / "trials.csv").records
    plan = make_plan(exp, records, grad_bytes=GRAD_BYTES, draws=50)
    assert math.isclose(plan.rows[0].hours.value, 1e9 / plan.rows[0].samples_per_s.value / 3600)


def test_mbtune_run_ends_with_the_plan_when_the_experiment_has_one(tmp_path, capsys, monkeypatch):
    import types

    from mbtune.runs.rundir import RunDir

    run = exact_run(tmp_path / "runs")
    received = []

    class Outcome:
        summary = {"status": "confident"}

        def __init__(self, exp):
            received.append(exp)
            self.run = RunDir(run)

        def best(self):
            return [{"trial": "1"}]

    search = types.ModuleType("mbtune.search")  # the search itself is not under test here
    search.run_search = lambda exp, **kwargs: Outcome(exp)
    search.resume_search = None
    monkeypatch.setitem(sys.modules, "mbtune.search", search)
    monkeypatch.setattr("mbtune.cluster.prepare_ray", lambda address: None)
    monkeypatch.setattr("mbtune.plan.model_bytes.gradient_bytes", lambda model: GRAD_BYTES)
    path = tmp_path / "e.yaml"
    path.write_text(json.dumps(experiment(EXACT_PLAN)))
    assert main(["run", str(path)]) == 0
    out = capsys.readouterr().out
    assert received[0].plan.samples == 1e9
    assert "plan: 1e+09 samples on 8, 64, 256 devices" in out and "  fastest: " in out
    # without a plan section: no plan block
    path.write_text(json.dumps({**experiment(EXACT_PLAN), "plan": None}))
    assert main(["run", str(path)]) == 0
    assert "plan:" not in capsys.readouterr().out


def test_the_plan_as_a_data_frame_holds_every_configuration_considered(tmp_path):
    run = exact_run(tmp_path, micro={"min": 1, "max": 16})
    plan = plan_of(run)
    frame = plan.as_frame()
    assert list(frame.columns[:12]) == [
        "num_devices", "batch_size", "micro_batch_size", "activation_checkpointing",
        "reshard_after_forward", "grad_sync", "tensor_parallel", "pipeline_parallel",
        "pipeline_schedule", "best", "confidence", "samples",
    ]  # fmt: skip
    assert frame["confidence"].notna().eq(frame["best"]).all()
    # one row per planned device count and configuration of the space: its micro-batch
    # sizes up to the per-device batch (8 devices: 64 samples each; 256: 2)
    sizes = frame.groupby("num_devices")["micro_batch_size"].apply(sorted).to_dict()
    assert sizes == {8: [1, 2, 4, 8, 16], 64: [1, 2, 4, 8], 256: [1, 2]}
    assert not frame.duplicated(["num_devices", "batch_size", "micro_batch_size"]).any()
    best = frame[frame["best"]]
    assert list(best["num_devices"]) == [8, 64, 256]
    assert best["cost"].tolist() == [r.cost.value for r in plan.rows]
    assert best["micro_batch_size"].tolist() == [r.config.micro_batch_size for r in plan.rows]
    for _, at_n in frame.groupby("num_devices"):  # fewest hours first, the best the first
        assert at_n["hours"].is_monotonic_increasing and at_n["best"].iloc[0]
    for key in ("samples_per_s", "hours", "device_hours", "cost"):
        assert (frame[f"{key}_low"] <= frame[key]).all()
        assert (frame[key] <= frame[f"{key}_high"]).all()
    assert frame["hours"].to_numpy() == pytest.approx(
        1e9 / frame["samples_per_s"].to_numpy() / 3600
    )
    assert frame["cost"].to_numpy() == pytest.approx(
        frame["hours"].to_numpy() * frame["num_devices"].to_numpy() * 2.5
    )


def test_mbtune_load_plan_reads_the_run_s_plan_csv_or_plans_with_python_values(
    tmp_path, capsys, counted_bytes
):
    import mbtune

    assert set(mbtune.__all__) <= set(dir(mbtune))  # the lazy names too
    run = exact_run(tmp_path)
    frame = mbtune.load_plan(run, samples=2e9, num_devices=np.array([8, 64]))
    expected = plan_run(run, ["plan.samples=2e9", "plan.num_devices=[8, 64]"]).as_frame()
    pd.testing.assert_frame_equal(frame, expected)
    assert (frame["samples"] == 2e9).all() and not (run / "plan.csv").exists()
    with pytest.raises(MbtuneError, match=r"^plan\.samples: must be positive, got -1$"):
        mbtune.load_plan(run, samples=-1)
    # without keys: the plan.csv that mbtune plan wrote; else the experiment's section
    assert main(["plan", str(run), "--set", "plan.samples=3e9", "--no-plots"]) == 0
    capsys.readouterr()
    pd.testing.assert_frame_equal(mbtune.load_plan(run), pd.read_csv(run / "plan.csv"))
    assert (mbtune.load_plan(run)["samples"] == 3e9).all()
    (run / "plan.csv").unlink()
    assert (mbtune.load_plan(run)["samples"] == 1e9).all()
    bare = make_run(tmp_path / "bare", [exact_row(512, 1, 8)])
    with pytest.raises(MbtuneError, match=r"give one with its keys, e\.g\. mbtune\.load_plan\("):
        mbtune.load_plan(bare)


# -- in mbtune analyze ------------------------------------------------------------


@pytest.fixture
def counted_bytes(monkeypatch):
    monkeypatch.setattr("mbtune.plan.model_bytes.gradient_bytes", lambda model: GRAD_BYTES)


def test_mbtune_analyze_prints_the_plan_and_writes_its_table_and_plot(tmp_path, capsys,
                                                                     counted_bytes):  # fmt: skip
    run = exact_run(tmp_path)
    assert main(["analyze", str(run)]) == 0
    out = capsys.readouterr().out
    report, _, block = out.partition("\nplan: 1e+09 samples on 8, 64, 256 devices")
    assert "trials, best first by samples_per_s:" in report
    assert "  fastest: " in block and "  cheapest within 10% of the fastest: " in block
    assert "plot-plan.png" in out and f"plan: {run / 'plan.csv'}" in out
    assert (run / "plot-plan.png").read_bytes().startswith(PNG_MAGIC)
    written = pd.read_csv(run / "plan.csv")
    expected = plan_run(run, grad_bytes=GRAD_BYTES).as_frame()
    pd.testing.assert_frame_equal(written, expected, check_dtype=False)


def test_mbtune_analyze_plans_a_run_without_a_plan_section_with_set(tmp_path, capsys,
                                                                   counted_bytes):  # fmt: skip
    run = make_run(tmp_path, [exact_row(512, n, m) for n in (1, 2) for m in (4, 8)],
                   experiment=experiment(None))  # fmt: skip
    assert main(["analyze", str(run), "--no-plots"]) == 0
    assert "\nplan: " not in capsys.readouterr().out and not (run / "plan.csv").exists()
    argv = ["analyze", str(run), "--no-plots", "--format", "markdown",
            "--set", "plan.steps=1000", "--set", "plan.num_devices=[2, 16]"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "```\nplan: 1,000 steps on 2, 16 devices" in out and out.rstrip().endswith(
        f"plan: {run / 'plan.csv'}"
    )
    assert pd.read_csv(run / "plan.csv").query("best")["num_devices"].tolist() == [2, 16]
    assert not (run / "plot-plan.png").exists()  # --no-plots


def test_mbtune_analyze_csv_keeps_stdout_the_ranked_table(tmp_path, capsys, counted_bytes):
    run = exact_run(tmp_path)
    assert main(["analyze", str(run), "--format", "csv", "--no-plots"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("rank,") and "\nplan: " not in out and "fastest" not in out
    assert err == f"plan: {run / 'plan.csv'}\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "plan.samples=-1"], "plan.samples: must be positive, got -1"),
        (["--set", "train_input.batch_size=8"],
         "--set: mbtune analyze sets the plan's keys only (plan.KEY=VALUE), got "
         "'train_input.batch_size=8'"),
        (["--set", "plan.num_devices=[1024]"], "plan.num_devices: no planned device count has"),
        (["--set", "plan.samples=1", "--export", "hf"],
         "--set: plans one run: give one run directory and no --export"),
    ],
)  # fmt: skip
def test_a_wrong_plan_in_mbtune_analyze_is_one_line_and_exit_2(tmp_path, capsys, counted_bytes,
                                                              argv, message):  # fmt: skip
    code = main(["analyze", str(exact_run(tmp_path)), "--no-plots", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"mbtune: error: {message}") and err.count("\n") == 1


def test_a_plan_section_that_cannot_be_planned_leaves_the_report_and_says_why(
    tmp_path, capsys, counted_bytes
):
    run = exact_run(tmp_path, plan={**EXACT_PLAN, "num_devices": [1024]})
    assert main(["analyze", str(run), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "trials, best first by samples_per_s:" in out
    assert out.rstrip().endswith(
        "mbtune: no plan: plan.num_devices: no planned device count has a configuration: the "
        "search space holds no configuration at 1024 devices: its batch_size 512 cannot be "
        "split over 1024; plan.batch_size=4096 would plan it"
    )
    assert not (run / "plan.csv").exists()


def test_the_plan_plot_draws_time_and_cost_with_their_bands_and_the_picks(tmp_path):
    from matplotlib.collections import PolyCollection

    from mbtune.analysis.plots import plan_figure

    run = exact_run(tmp_path)
    plan = plan_of(run, "plan.num_devices=[8, 16, 64]", "plan.max_slowdown=0.0")
    fig = plan_figure(plan, title="t")
    top, bottom = fig.axes
    assert fig.get_suptitle() == "t: 1e+09 samples, 90% intervals"
    for ax, key in ((top, "hours"), (bottom, "cost")):
        line = next(x for x in ax.get_lines() if x.get_label() == "best configuration")
        assert list(line.get_xdata()) == [8, 16, 64]
        assert list(line.get_ydata()) == [getattr(r, key).value for r in plan.rows]
        band = next(c for c in ax.collections if isinstance(c, PolyCollection))
        ys = band.get_paths()[0].vertices[:, 1]
        assert min(ys) == pytest.approx(min(getattr(r, key).low for r in plan.rows))
        assert max(ys) == pytest.approx(max(getattr(r, key).high for r in plan.rows))
        fastest = next(x for x in ax.get_lines() if x.get_label() == "fastest")
        assert list(fastest.get_xdata()) == [64]  # the slow inter-node link: 64 is fastest
        cheapest = next(x for x in ax.get_lines() if x.get_label() == "cheapest")
        assert list(cheapest.get_xdata()) == [8]
    assert bottom.get_ylabel() == "cost at 2.5 per device-hour"
    assert [t.get_text() for t in top.texts] == [
        f"B512 m{r.config.micro_batch_size}" for r in plan.rows
    ]
    assert "one node (8 devices)" in [t.get_text() for t in top.get_legend().get_texts()]
    assert bottom.get_xlabel() == "num_devices (measured: 1, 2, 4, 8)"
    unpriced = plan_of(run, "plan.price_per_device_hour=null", "plan.num_devices=[8, 1024]")
    fig = plan_figure(unpriced, title="t")
    assert fig.axes[1].get_ylabel() == "device-hours (no plan.price_per_device_hour)"
    no_config = "num_devices (measured: 1, 2, 4, 8; no configuration at 1024)"
    assert fig.axes[1].get_xlabel() == no_config


# -- nccl-tests outputs as the tiers ------------------------------------------------


def nccl_output(hosts: int, per_host: int, busbw_largest: float, time_smallest_us: float) -> str:
    """An all_reduce_perf output as nccl-tests 2.x prints it."""
    ranks = [
        f"#  Rank {h * per_host + d:2d} Group  0 Pid {100 + d} on node-{h} device  {d} "
        "[0x18] NVIDIA H100 80GB HBM3"
        for h in range(hosts)
        for d in range(per_host)
    ]
    return "\n".join([
        "# nThread 1 nGpus 1 minBytes 8 maxBytes 8589934592 step: 2(factor) warmup iters: 5",
        "#", "# Using devices", *ranks, "#",
        "#                                                              out-of-place"
        "                       in-place",
        "#       size         count      type   redop    root     time   algbw   busbw "
        " #wrong     time   algbw   busbw  #wrong",
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)"
        "             (us)  (GB/s)  (GB/s)",
        f"           8             2     float     sum      -1  {time_smallest_us:7.2f}"
        "    0.00    0.00       0    30.01    0.00    0.00       0",
        "     1048576        262144     float     sum      -1    40.00   26.21   45.87"
        "       0    40.00   26.21   45.87       0",
        f"  8589934592    2147483648     float     sum      -1  40000.0  214.75  {busbw_largest}"
        "       0  40000.0  214.75  999.00       0",
        "# Out of bounds values : 0 OK",
        f"# Avg bus bandwidth    : {busbw_largest / 2}",
    ])  # fmt: skip


def test_the_tiers_are_read_from_nccl_tests_outputs(tmp_path, monkeypatch):
    (tmp_path / "one-node.txt").write_text(nccl_output(1, 8, 360.5, 28.0))
    (tmp_path / "two-nodes.txt").write_text(nccl_output(2, 8, 320.0, 600.0))
    run = exact_run(tmp_path / "runs", plan={"samples": 1e9, "num_devices": [64]}, devices=(1,))
    monkeypatch.chdir(tmp_path)  # --set paths are the user's: from the current directory
    base = plan_of(run)
    read = plan_of(run, "plan.nccl_tests=[one-node.txt, two-nodes.txt]")
    assert "plan.intra_node from nccl-tests one-node.txt (8 ranks on 1 host: 360.5 GB/s, " \
        "2.0 us a hop)" in read.link_basis  # fmt: skip
    # across nodes: 320 GB/s of bus bandwidth over 8 devices a node is 40 GB/s each
    assert "plan.inter_node from nccl-tests two-nodes.txt (16 ranks on 2 hosts: 40.0 GB/s" in (
        read.link_basis
    )
    assert (
        read.rows[0].samples_per_s.value < base.rows[0].samples_per_s.value
    )  # 40 < 45 GB/s, 20 > 10 us
    # measured: the spread is 0.1, not the defaults' 0.3
    width = read.rows[0].samples_per_s.high / read.rows[0].samples_per_s.low
    assert width < base.rows[0].samples_per_s.high / base.rows[0].samples_per_s.low
    # a tier's own keys win over the file
    mine = plan_of(run, "plan.nccl_tests=two-nodes.txt", "plan.inter_node.bandwidth=45GB",
                   "plan.inter_node.latency_us=10", "plan.inter_node.uncertainty=0.3")  # fmt: skip
    assert mine.rows[0].samples_per_s == base.rows[0].samples_per_s


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (["a.txt", "a.txt"], r"a\.txt and a\.txt both measured the intra_node tier"),
        (["missing.txt"], r"cannot read .*missing\.txt: "),
        (["junk.txt"], r".*junk\.txt holds no all_reduce_perf results"),
    ],
)
def test_an_nccl_tests_output_that_cannot_be_read_is_one_line(tmp_path, monkeypatch, files,
                                                             message):  # fmt: skip
    (tmp_path / "a.txt").write_text(nccl_output(1, 4, 300.0, 20.0))
    (tmp_path / "junk.txt").write_text("size busbw\n1 2 3\n")
    run = exact_run(tmp_path / "runs", plan={"samples": 1e9, "num_devices": [64]}, devices=(1,))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MbtuneError, match=rf"^plan\.nccl_tests: {message}"):
        plan_of(run, f"plan.nccl_tests={json.dumps(files)}")


def test_a_device_count_without_a_configuration_is_said_and_none_at_all_is_one_line(tmp_path):
    run = exact_run(tmp_path)
    plan = plan_of(run, "plan.num_devices=[8, 1024]")
    assert [r.config.num_devices for r in plan.rows] == [8]
    assert plan.skipped == (
        (1024, "the search space holds no configuration at 1024 devices: its batch_size 512 "
               "cannot be split over 1024; plan.batch_size=4096 would plan it"),
    )  # fmt: skip
    with pytest.raises(MbtuneError, match=r"^plan\.num_devices: no planned device count has a "):
        plan_of(run, "plan.num_devices=[1024]")


def test_a_pick_is_as_sure_as_the_draws_that_give_its_intervals():
    # the draws of the step model (which draw the link) decide how sure a row's pick is:
    # the share of draws in which it is within 2% of that draw's fastest candidate
    from types import SimpleNamespace

    from mbtune.config.schema import PlanConfig
    from mbtune.plan.planner import _best_row

    rng = np.random.default_rng(0)
    a, b = BatchConfig(512, 64, 8), BatchConfig(512, 64, 16)
    draws = {a: 1.0 + 0.05 * rng.standard_normal(400), b: 1.01 + 0.05 * rng.standard_normal(400)}
    draws[a][0], draws[b][0] = 1.0, 1.01  # draw 0: the point estimate
    model = SimpleNamespace(step_s=lambda c: draws[c])
    row = _best_row(model, [a, b], PlanConfig(samples=1e6), None)
    expected = np.mean(draws[a] * 0.98 <= np.minimum(draws[a], draws[b]))
    assert row.config == a and row.confidence == int(100 * expected)
    assert 40 < row.confidence < 90  # two within noise of each other: not sure
    draws[b] = draws[b] + 0.5  # far slower in every draw: sure
    assert _best_row(model, [a, b], PlanConfig(samples=1e6), None).confidence == 99


def test_a_plan_of_a_single_draw_is_its_point_estimate(tmp_path):
    """draws=1 (or 0): no spread to weigh the prior by; the plan still stands."""
    run = exact_run(tmp_path, micro={"min": 1, "max": 16})
    for draws in (0, 1):
        row = plan_of(run, draws=draws).rows[0]
        assert row.samples_per_s.low <= row.samples_per_s.value <= row.samples_per_s.high


# -- layouts: tensor and pipeline parallelism ---------------------------------------

SHAPE = ModelShape(layers=8, heads=8, kv_heads=8, mlp_width=4096, hidden=1024)
TOKENS = 128
"""One sample's tokens: a sample's activations between blocks are 128 x 1024 x 4 bytes."""
LAYOUTS = ((1, 1, "1f1b"), (2, 1, "1f1b"), (1, 2, "1f1b"), (2, 2, "1f1b"),
           (1, 2, "interleaved_1f1b"))  # fmt: skip


def ring_s(nbytes, n, link):
    """A ring all-reduce of ``nbytes`` over n devices on ``link`` (bytes/s, s a hop)."""
    bandwidth, latency = link
    return 0.0 if n == 1 else 2 * ((n - 1) / n * nbytes / bandwidth + (n - 1) * latency)


def tier(n, members_per_node):
    """A ring of n devices, ``members_per_node`` of them to a node: within one node the
    intra-node link, else the slower of the node's links together and the intra-node's."""
    if n <= members_per_node:
        return INTRA
    return min(INTRA[0], members_per_node * INTER[0]), max(INTRA[1], INTER[1])


def truth_layout_step_s(config, per_node=8, *, parts=False):
    """The generator of a split model's step, written out apart from the code it checks:
    one device's compute (the whole model's over t p, tensor parallelism 15% less
    efficient a rank), the bubble, the data-parallel all-reduce of its gradients over d
    (every t-th rank: it leaves the node where t d > per_node), 4 tensor-parallel
    all-reduces a block a micro-batch over the t consecutive ranks, and 2 sends a
    micro-batch and stage chunk to the next block of t d ranks (another node where
    t d >= per_node: one device's inter-node link)."""
    t, p, schedule = config.layout
    d, g, m = config.data_parallel, config.grad_accum_steps, config.canonical_micro_batch_size
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    bubble = (p - 1) / (v * g)
    compute = g * truth_compute_s(m) / (t * p) * (1 + 0.15 * (t - 1)) * (1 + bubble)
    activation = m * TOKENS * SHAPE.hidden * 4
    data = ring_s(GRAD_BYTES / (t * p), d, tier(d, max(1, per_node // t)))
    tensor = 4 * SHAPE.layers / p * g * ring_s(activation, t, tier(t, per_node))
    link = INTRA if t * d < per_node else (min(INTRA[0], INTER[0]), max(INTRA[1], INTER[1]))
    pipeline = 0.0 if p == 1 else 2 * v * g * (activation / t / link[0] + link[1])
    if parts:
        return compute, data, tensor, pipeline
    return compute + data + tensor + pipeline


def layout_row(config, style):
    """A trials.csv row of ``config`` measured exactly from the generator: ``replay``, its
    collectives folded into the step; ``ddp``, a data-parallel step's all-reduce timed
    apart and a split model's collectives inside its step, as the real trials say them."""
    step = truth_layout_step_s(config)
    compute, data, *_ = truth_layout_step_s(config, parts=True)
    row = trial_row(
        config.batch_size, config.num_devices, config.micro_batch_size, config.batch_size / step,
        step_time_ms_iqr=None, step_times_ms=[], precision="fp32",
        tokens_per_s=config.batch_size / step * TOKENS,
    )  # fmt: skip
    row.update(config.as_dict())
    if style == "replay":
        row.update(backend="replay", parallel="simulate", comm_time_ms=0.0)
    else:
        comm = data if config.layout[:2] == (1, 1) else 0.0
        row.update(parallel="ddp", comm_time_ms=comm * 1e3, compute_time_ms=(step - comm) * 1e3)
    return row


def layout_configs(counts=(1, 2, 4, 8), batch=512, micro=(4, 8, 16)):
    found = []
    for n in counts:
        for t, p, schedule in LAYOUTS:
            for m in micro:
                if n % (t * p) == 0:
                    c = BatchConfig(batch, n, m, tensor_parallel=t, pipeline_parallel=p,
                                    pipeline_schedule=schedule)  # fmt: skip
                    if not layout_rule(n, t, p, schedule, c.grad_accum_steps):
                        found.append(c)
    return found


def layout_run(tmp_path, style="replay", plan=EXACT_PLAN, counts=(1, 2, 4, 8)):
    rows = [layout_row(c, style) for c in layout_configs(counts)]
    # the rows say how each was measured (a ddp row: timed); the experiment's parallel is
    # simulate, as config refuses ddp with a layout until real model-parallel trials land
    exp = experiment(plan, devices=counts, parallel="simulate")
    exp["search"]["space"].update(tensor_parallel=[1, 2], pipeline_parallel=[1, 2],
                                  pipeline_schedule=["1f1b", "interleaved_1f1b"])  # fmt: skip
    return make_run(tmp_path, rows, experiment=exp)


@pytest.mark.parametrize("style", ["replay", "ddp"])
def test_a_split_run_s_layouts_are_planned_at_more_devices_as_their_truth(tmp_path, style):
    """Every layout the run measured at 1 to 8 devices (one node), planned at 8 (measured),
    16, 64 and 256: each layout's best configuration there is the generator's step, its
    tensor-parallel group in a node, its data-parallel ring and its pipeline's sends
    across nodes as Megatron places them."""
    run = layout_run(tmp_path, style)
    plan = plan_run(run, ["plan.num_devices=[8, 16, 64, 256]"], grad_bytes=GRAD_BYTES,
                    shape=SHAPE, draws=50)  # fmt: skip
    assert "fitted to the collectives measured at 2, 4, 8 devices" in plan.link_basis
    seen = set()
    for layouts, candidates in zip(plan.layouts, plan.candidates, strict=True):
        assert {r.config.layout for r in layouts} == {c.layout for c in candidates}
        if layouts[0].config.num_devices < 256:  # 512 over 256 leaves no micro-batch of 4
            assert {r.config.layout for r in layouts} == set(LAYOUTS)
        for row in layouts:
            seen.add((row.config.num_devices, row.config.layout[:2]))
            truth = row.config.batch_size / truth_layout_step_s(row.config)
            assert row.samples_per_s.value == pytest.approx(truth, rel=1e-6)
            low, high = row.samples_per_s.low, row.samples_per_s.high
            assert low * (1 - 1e-9) <= truth <= high * (1 + 1e-9)
    assert {(256, (2, 2)), (64, (1, 2)), (16, (2, 1))} <= seen
    # the count's row is its fastest layout's best configuration
    for row, layouts in zip(plan.rows, plan.layouts, strict=True):
        assert layouts[0] is row
        assert all(row.hours.value <= other.hours.value for other in layouts)


def test_the_plan_at_a_measured_count_reproduces_each_layout_s_measurement(tmp_path):
    run = layout_run(tmp_path, plan={"samples": 1e9, "num_devices": [2, 4, 8]})
    plan = plan_run(run, grad_bytes=GRAD_BYTES, shape=SHAPE, draws=50)
    measured = {BatchConfig.of(r).canonical(): r.samples_per_s
                for r in read_trials(run / "trials.csv").records}  # fmt: skip
    frame = plan.as_frame()
    assert set(zip(frame.tensor_parallel, frame.pipeline_parallel, strict=True)) == {
        (1, 1), (2, 1), (1, 2), (2, 2)}  # fmt: skip
    assert len(frame) == sum(c.num_devices in (2, 4, 8) for c in measured)
    for row in plan.configurations():
        speed = measured[row.config.canonical()]
        low, high = row.samples_per_s.low, row.samples_per_s.high
        assert low * (1 - 1e-9) <= speed <= high * (1 + 1e-9)
        assert row.samples_per_s.value == pytest.approx(speed, rel=1e-6)


def test_a_layout_s_plan_grows_only_its_data_parallel_sync_with_the_replicas(tmp_path):
    """t 2 x p 2 measured at 4 and 8 devices, planned at 64 on one node of 64: the same
    micro-batches a replica (B grows with d), so the compute, the bubble, the
    tensor-parallel all-reduces and the pipeline's sends are those measured; the step
    grows by the data-parallel all-reduce's growth alone."""
    run = layout_run(tmp_path)
    plan = plan_run(run, ["plan.devices_per_node=64"], grad_bytes=GRAD_BYTES, shape=SHAPE,
                    draws=20)  # fmt: skip
    model = plan.model
    layout = {"tensor_parallel": 2, "pipeline_parallel": 2}
    at_8, at_64 = BatchConfig(512, 8, 16, **layout), BatchConfig(4096, 64, 16, **layout)
    assert at_8.grad_accum_steps == at_64.grad_accum_steps == 16
    grown = float(model.step_s(at_64)[0] - model.step_s(at_8)[0])
    shard = GRAD_BYTES / 4
    assert grown == pytest.approx(ring_s(shard, 16, INTRA) - ring_s(shard, 2, INTRA), rel=1e-6)
    assert grown > 0.5 * ring_s(shard, 16, INTRA)  # the sync's growth is most of it
    # on nodes of 8, at 64 the ring and the pipeline's sends leave the node: dearer
    eight = plan_run(run, grad_bytes=GRAD_BYTES, shape=SHAPE, draws=20).model
    assert float(eight.step_s(at_64)[0]) > float(model.step_s(at_64)[0])
    assert float(eight.step_s(at_64)[0]) == pytest.approx(truth_layout_step_s(at_64), rel=1e-6)


def test_a_split_run_plans_its_layouts_in_mbtune_plan_and_plan_csv(tmp_path, capsys,
                                                                   monkeypatch):  # fmt: skip
    monkeypatch.setattr("mbtune.plan.model_bytes.gradient_bytes", lambda model: GRAD_BYTES)
    monkeypatch.setattr("mbtune.plan.model_bytes.split_shape", lambda model: SHAPE)
    run = layout_run(tmp_path, plan={"samples": 1e9, "num_devices": [8, 64]})
    assert main(["plan", str(run), "--no-plots"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "devices" in line and "t x p" in line)
    assert header.split()[:4] == ["devices", "t", "x", "p"]
    for count in ("8", "64"):  # a count's row, then each other layout's best under it
        at = out.split(f"\n  {count:>7}  ")[1].split("\n")
        layouts = [at[0].split()[0]] + [line.split()[0] for line in at[1:5]]
        assert sorted(layouts) == ["1x1", "1x2", "1x2", "2x1", "2x2"]
    assert "interleaved_1f1b" in out and "fastest: " in out
    frame = pd.read_csv(run / "plan.csv")
    assert {"tensor_parallel", "pipeline_parallel", "pipeline_schedule"} <= set(frame.columns)
    assert main(["plan", str(run), "--json", "--no-plots"]) == 0
    report = json.loads(capsys.readouterr().out)
    for rows in report["layouts"]:  # each count: the row, then every other layout's best
        assert len(rows) == 5 and rows[0]["confidence"] is not None
        assert len({(r["tensor_parallel"], r["pipeline_parallel"], r["pipeline_schedule"])
                    for r in rows}) == 5  # fmt: skip
    assert set(frame.query("num_devices == 64").pipeline_schedule) == {"1f1b", "interleaved_1f1b"}


def test_a_split_run_whose_model_does_not_say_its_width_is_one_line(tmp_path, capsys,
                                                                    monkeypatch):  # fmt: skip
    monkeypatch.setattr("mbtune.plan.model_bytes.gradient_bytes", lambda model: GRAD_BYTES)
    run = layout_run(tmp_path)  # the mlp: no blocks, no width
    assert main(["plan", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mbtune: error: plan: the run split its model") and err.count("\n") == 1
    assert "(hidden) and layers" in err
    # a run that did not split its model needs no shape
    assert plan_run(exact_run(tmp_path / "b"), grad_bytes=GRAD_BYTES, draws=10).rows


def test_a_noisy_split_run_s_intervals_hold_what_it_measured(tmp_path):
    """Each trial 3% off the generator (its steps spread 2% about that), the run's noise
    floor a real run's: at the counts it measured, each layout's interval holds what it
    measured, and the point lies within the trials' spread of it."""
    rng = np.random.default_rng(3)
    rows = []
    for config in layout_configs():
        row = layout_row(config, "replay")
        step = row["step_time_ms_median"] * math.exp(0.03 * rng.standard_normal())
        steps = step * np.exp(0.02 * rng.standard_normal(5))
        median = float(np.median(steps))
        row.update(step_times_ms=steps.tolist(), step_time_ms_median=median,
                   samples_per_s=config.batch_size / median * 1e3,
                   tokens_per_s=config.batch_size / median * 1e3 * TOKENS)  # fmt: skip
        rows.append(row)
    exp = experiment({"samples": 1e9, "num_devices": [2, 4, 8]}, parallel="simulate")
    exp["search"].update(noise_floor=0.035)
    exp["search"]["space"].update(tensor_parallel=[1, 2], pipeline_parallel=[1, 2],
                                  pipeline_schedule=["1f1b", "interleaved_1f1b"])  # fmt: skip
    run = make_run(tmp_path, rows, experiment=exp)
    plan = plan_run(run, grad_bytes=GRAD_BYTES, shape=SHAPE, draws=300)
    measured = {BatchConfig.of(r).canonical(): r.samples_per_s
                for r in read_trials(run / "trials.csv").records}  # fmt: skip
    rows = plan.configurations()
    assert {r.config.layout[:2] for r in rows} == {(1, 1), (2, 1), (1, 2), (2, 2)}
    inside = [r.samples_per_s.low <= measured[r.config.canonical()] <= r.samples_per_s.high
              for r in rows]  # fmt: skip
    assert sum(inside) >= 0.9 * len(rows), f"{sum(inside)} of {len(rows)}"
    for r in rows:
        assert r.samples_per_s.value == pytest.approx(measured[r.config.canonical()], rel=0.12)


def test_a_run_of_split_layouts_alone_rests_on_the_link_prior_and_says_why(tmp_path):
    rows = [layout_row(c, "replay") for c in layout_configs() if c.layout[:2] == (2, 1)]
    exp = experiment({"samples": 1e9, "num_devices": [8, 64]}, devices=(2, 4, 8),
                     parallel="simulate")  # fmt: skip
    exp["search"]["space"].update(tensor_parallel=[2])
    plan = plan_run(make_run(tmp_path, rows, experiment=exp), grad_bytes=GRAD_BYTES,
                    shape=SHAPE, draws=50)  # fmt: skip
    assert "the link rests on the prior alone" in plan.link_basis
    assert "no layout without tensor or pipeline parallelism" in plan.link_basis
    assert {r.config.layout[:2] for r in plan.rows} == {(2, 1)}
