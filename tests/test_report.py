"""Tests for mbtune.report: each sentence about a configuration, one way, exactly."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mbtune import report
from mbtune.analysis.frames import RunRecommendation
from mbtune.lattice import BatchConfig
from mbtune.recommend.reporter import StreamRecommendation
from mbtune.runs.record import TrialRecord


@pytest.mark.parametrize(
    ("config", "micro", "devices", "per_device"),
    [
        (BatchConfig(64, 2, 8), "4x8", "2 devices x 4 micro-batches of 8",
         "per device 32 samples as 4 x 8"),
        (BatchConfig(7, 1, 3), "3+2+2", "1 device x 3 micro-batches of 3+2+2",
         "per device 7 samples as 3+2+2"),
        (BatchConfig(30, 2, 4), "4+4+4+3", "2 devices x 4 micro-batches of 4+4+4+3",
         "per device 15 samples as 4+4+4+3"),
        (BatchConfig(33, 2, 4), "4+4+3+3+3", "2 devices x 5 micro-batches of 4+4+3+3+3",
         "per device 17 or 16 samples, the busiest as 4+4+3+3+3"),
        (BatchConfig(100, 1, 9), "4x9+8x8", "1 device x 12 micro-batches of 4x9+8x8",
         "per device 100 samples as 4x9+8x8"),
        (BatchConfig(2**31, 1, 1), f"{2**31}x1", f"1 device x {2**31} micro-batches of 1",
         f"per device {2**31} samples as {2**31} x 1"),
    ],
)  # fmt: skip
def test_a_configuration_splits_into_micro_batches_said_one_way(config, micro, devices, per_device):
    assert report.micro_batches(config) == micro
    assert report.devices_split(config) == devices
    assert report.per_device_split(config) == per_device


def test_sizes_name_a_configuration_in_the_order_of_the_columns():
    assert report.sizes(BatchConfig(64, 2, 8)) == "num_devices 2, batch_size 64, micro_batch_size 8"
    assert report.step_suffix("bf16", True) == ", bf16, with activation checkpointing"
    assert report.step_suffix(None, False) == ""


def test_the_stream_line_keeps_the_cerebras_order():
    rec = StreamRecommendation(
        time="2026-01-01T19:41:11", trials=3, config=BatchConfig(64, 2, 4, True), objective=1.0,
        samples_per_s=None, estimated_performance=1.234, confidence=90, precision="bf16",
        mfu=0.412,
    )  # fmt: skip
    assert (
        rec.line()
        == report.stream_line(
            made_at=rec.time,
            config=rec.config,
            estimated_performance=1.234,
            confidence=90,
            precision="bf16",
            mfu=0.412,
        )  # fmt: skip
        == (
            "mbtune 19:41:11  recommended micro_batch_size: 4 (num_devices: 2, batch_size: 64, "
            "bf16, with activation checkpointing), estimated performance: 1.23x base, MFU 41%, "
            "confidence score: 90 (out of 100)"
        )
    )


def test_analyze_and_export_say_the_recommendation():
    config = BatchConfig(32, 2, 8)
    rec = RunRecommendation(
        config=config, samples_per_s=630.0, source="summary.json",
        confidence=92, recommended_batch_size=34,
    )  # fmt: skip
    assert rec.line() == (
        "recommended (summary.json, confidence 92): num_devices 2, batch_size 32, "
        "micro_batch_size 8 (2 micro-batches per device, fp32): 630.0 samples/s; recommended "
        "global batch 34"
    )
    rec = RunRecommendation(
        config=BatchConfig(32, 2, 16), samples_per_s=None,
        source="best ok trial", precision="",
    )  # fmt: skip
    assert rec.line() == (
        "recommended (best ok trial): num_devices 2, batch_size 32, micro_batch_size 16 "
        "(1 micro-batch per device)"
    )
    assert report.export_header(
        config, samples_per_s=1234.5, run_path=Path("runs/x"), source="summary.json"
    ) == (
        "mbtune: num_devices 2, batch_size 32, micro_batch_size 8: 1,234.5 samples/s in runs/x "
        "(summary.json)"
    )


def test_a_trial_line_says_a_record():
    record = TrialRecord(
        trial=3, batch_size=64, num_devices=2, micro_batch_size=8, status="oom",
        reason="over budget", precision="bf16", activation_checkpointing=True,
    )  # fmt: skip
    line = report.trial_line(record)
    assert line.endswith(
        "  trial   3  num_devices 2, batch_size 64, micro_batch_size 8, bf16, with activation "
        "checkpointing: -  oom (over budget)"
    )
    ok = dataclasses.replace(record, status="ok", reason=None, samples_per_s=1234.5, mfu=0.41)
    assert report.trial_line(ok).endswith(": 1,234.5 samples/s, MFU 41%  ok")


def test_the_table_of_the_best_keeps_its_columns_under_a_long_schedule():
    row = {"micro_batch_size": 4, "num_devices": 4, "batch_size": 32, "grad_accum_steps": 2,
           "samples_per_s": 150.0, "compile_s": None, "estimated_samples_per_s": 149.0}
    top = [{**row, "pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b"},
           {**row, "tensor_parallel": 2}]  # fmt: skip
    summary = {"recommended": top[0], "speedup_over_base": 1.0, "speedup_over_user": None,
               "confidence": 90, "recommended_batch_size": 32, "top": top,
               "compile_break_even": []}  # fmt: skip
    sizes = {"batch_size": 32, "num_devices": 4, "micro_batch_size": 4}
    lines = report.summary_lines([TrialRecord(trial=1, status="ok", **sizes)], summary, Path("r"))
    table = lines[lines.index("best configurations:") + 1 :]
    assert len({len(line) for line in table}) == 1  # every row as wide as the header
    assert table[1].split()[2:4] == ["1x2", "interleaved_1f1b"] and table[2].split()[2] == "2x1"


def test_the_summary_of_a_search():
    best = {"micro_batch_size": 8, "num_devices": 2, "batch_size": 32, "grad_accum_steps": 2,
            "samples_per_s": 672.7, "compile_s": 3.0, "mfu": None, "precision": None,
            "estimated_samples_per_s": 668.1}  # fmt: skip
    other = {**best, "micro_batch_size": 16, "grad_accum_steps": 1, "samples_per_s": 600.0,
             "compile_s": 1.0, "estimated_samples_per_s": None}  # fmt: skip
    summary = {
        "recommended": best, "speedup_over_base": 1.25, "speedup_over_user": None,
        "confidence": 95, "recommended_batch_size": 32, "top": [best, other],
        "compile_break_even": [{"against": other, "extra_compile_s": 2.0,
                                "break_even_steps": 1234}],
    }  # fmt: skip
    sizes = {"batch_size": 32, "num_devices": 2, "micro_batch_size": 8}
    rows = [TrialRecord(trial=1, status="ok", **sizes), TrialRecord(trial=2, status="oom", **sizes)]
    assert report.summary_lines(rows, summary, Path("runs/x")) == [
        "mbtune: 2 trials finished (1 not ok); results in runs/x",
        "recommended: micro_batch_size 8, num_devices 2, batch_size 32 (grad_accum_steps 2): "
        "672.7 samples/s, 1.25x base, confidence score 95 (out of 100)",
        "  measured once",
        "  it compiles 2.0 s slower than micro_batch_size 16 on 2 device(s), and pays off "
        "after 1,234 training steps",
        "best configurations:",
        "  rank  num_devices  batch_size  micro_batch_size  grad_accum   samples/s   estimated"
        "  compile_s",
        "     1            2          32                 8           2       672.7       668.1"
        "        3.0",
        "     2            2          32                16           1       600.0           -"
        "        1.0",
    ]
    # a sharded search's settings, where one is off its default, are columns of their own:
    # else two rows that differ only in them would read as one configuration twice
    kept = {**other, "reshard_after_forward": False, "grad_sync": "every"}
    table = report.summary_lines(rows, {**summary, "top": [best, kept]}, Path("runs/x"))[-3:]
    assert table == [
        "  rank  num_devices  batch_size  micro_batch_size  reshard_after_forward  grad_sync"
        "  grad_accum   samples/s   estimated  compile_s",
        "     1            2          32                 8                   true       last"
        "           2       672.7       668.1        3.0",
        "     2            2          32                16                  false      every"
        "           1       600.0           -        1.0",
    ]
    # a compile time that was a load from torch's compile cache is marked, and said so
    loaded = {**other, "compile_s": 0.6, "compile_from_cache": True}
    table = report.summary_lines(rows, {**summary, "top": [best, loaded]}, Path("runs/x"))[-2:]
    assert table == [
        "     2            2          32                16           1       600.0           -"
        "       0.6*",
        "  * its graphs came from torch's compile cache (compiled by an earlier trial or run): "
        "less than a cold compile",
    ]
    # a compile difference that would print as 0.0 s is left out; one step is one step
    summary["compile_break_even"] = [
        {"against": other, "extra_compile_s": 0.04, "break_even_steps": 2},
        {"against": other, "extra_compile_s": 0.3, "break_even_steps": 1},
    ]
    lines = report.summary_lines(rows, summary, Path("runs/x"))
    assert [line for line in lines if "compiles" in line] == [
        "  it compiles 0.3 s slower than micro_batch_size 16 on 2 device(s), and pays off "
        "after 1 training step"
    ]
    # the drift the score allowed for: what the repeats showed beyond their steps' noise
    drift = {"relative": 0.029, "repeats": 2, "prior": 0.035}
    lines = report.summary_lines(rows, {**summary, "drift": drift}, Path("runs/x"))
    assert lines[2] == ("  measured once; drift between trials 2.9% beyond the steps' own noise, "
                        "estimated from 2 repeats (prior 3.5%)")  # fmt: skip
    nothing = {"recommended": None}
    assert report.summary_lines(rows, nothing, Path("r")) == [
        "mbtune: 2 trials finished (1 not ok); results in r",
        "mbtune: no configuration ran successfully",
    ]
