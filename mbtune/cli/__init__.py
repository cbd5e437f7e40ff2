"""The ``mbtune`` command: each subcommand a thin shell over one function of the rooms.

:func:`console` is the installed command, :func:`main` the same without its quick exit
(``python -m mbtune.cli``); the command line itself, every command's arguments and help, is
mbtune.cli._parser's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from mbtune.cli._parser import EXIT_BAD_INPUT, _printable, build_parser
from mbtune.config.experiment import Experiment
from mbtune.config.load import load_experiment
from mbtune.config.model_options import hf_model_type
from mbtune.config.rules import ConfigError
from mbtune.config.starter import write_starter
from mbtune.errors import MbtuneError
from mbtune.lattice import LAYOUT, SETTINGS, BatchConfig, divisors
from mbtune.report import experiment_lines, micro_batches, result_lines

__all__ = ["main", "space_rows"]


def console() -> NoReturn:
    """The ``mbtune`` command: :func:`main`, then a quick exit. A search leaves its Ray
    connected; it is shut down here (an embedded Ray's processes stop), and then the
    interpreter's own teardown, about a second spent on Ray's native threads, is skipped:
    every file is written and flushed by then."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # a reader that stopped early (`| head`): nothing to tell it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except MbtuneError as e:
        print(f"mbtune: error: {_printable(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("mbtune: interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------------------
# init


def _init(args: argparse.Namespace) -> int:
    size = None
    if hf_model_type(args.model) is not None:  # a model whose size the starter cannot know
        from mbtune.trial.sizing import size_starter as size
    path, sizing = write_starter(
        args.path, model=args.model, device=args.device, mode=args.mode, size=size
    )
    for line in sizing.lines:
        print(line)
    print(f"mbtune: wrote {path}; check it with: mbtune validate {path}")
    return 0


# ---------------------------------------------------------------------------
# validate


def experiment(path: Any, overrides: Any = ()) -> Experiment:
    """The experiment of a command: loaded, and where a layout splits its model, held to
    Megatron's rules for the model's shape (built on the meta device, only then)."""

    def shape_of(model: Any) -> Any:
        from mbtune.models.shape import shape_of  # torch

        return shape_of(model)

    return load_experiment(path, overrides, shape_of=shape_of)


def _validate(args: argparse.Namespace) -> int:
    exp = experiment(args.experiment, args.overrides)
    check_user_model(exp)
    print(f"{args.experiment}: valid")
    for label, text in experiment_lines(exp):
        print(f"  {label:<12} {text}")
    return 0


def check_user_model(exp: Experiment) -> None:
    """Import a user model and check its contract now, before anything is measured (a
    Hugging Face model is built on torch's meta device: its size costs nothing)."""
    if not exp.model.is_builtin:
        from mbtune.models.build import check_model

        check_model(exp.model)


# ---------------------------------------------------------------------------
# space


def space_rows(exp: Experiment) -> list[dict[str, Any]]:
    """One row per configuration of the experiment's space (a setting of a step, such as
    activation_checkpointing, only where some configuration has it off its default)."""
    configs = exp.configs()
    default = BatchConfig(1, 1, 1)
    quiet = [k for k in (*SETTINGS, *LAYOUT) if all(getattr(c, k) == getattr(default, k)
                                                    for c in configs)]  # fmt: skip
    if "tensor_parallel" in quiet and "pipeline_parallel" in quiet:
        quiet.append("data_parallel")  # n itself
    rows = []
    for c in configs:
        row = {
            **c.as_dict(),
            "micro_batches": micro_batches(c),
            "strict": c.is_strict,
            "runs_as": c.canonical_micro_batch_size,
        }
        for key in quiet:
            del row[key]
        rows.append(row)
    return rows


def _space(args: argparse.Namespace) -> int:
    import pandas as pd

    exp = experiment(args.experiment, args.overrides)
    rows = space_rows(exp)
    distinct = len(
        {
            (r["batch_size"], r["num_devices"], r["runs_as"], *map(r.get, (*SETTINGS, *LAYOUT)))
            for r in rows
        }  # fmt: skip
    )
    unused = exp.unused_values()  # the space's values that leave nothing, and why
    if args.format == "json":
        print(json.dumps({"count": len(rows), "distinct": distinct, "configurations": rows,
                          "not_searched": unused}))  # fmt: skip
    elif args.format == "csv":
        print(pd.DataFrame(rows).to_csv(index=False), end="")
        for line in unused:
            print(f"mbtune: not searched: {line}", file=sys.stderr)
    else:
        print(pd.DataFrame(rows).to_string(index=False))
        print(
            f"{len(rows)} configurations, {distinct} distinct measurements "
            f"(mode {exp.train_input.micro_batch_size}, space '{exp.search.space.source}')"
        )
        for line in unused:
            print(f"not searched: {line}")
    return 0


# ---------------------------------------------------------------------------
# run


def _run(args: argparse.Namespace) -> int:
    from mbtune.cluster import prepare_ray
    from mbtune.runs.rundir import RunDir

    where = {"address": args.address, "dashboard": args.dashboard, "verbose": args.verbose}
    if args.resume:
        if args.experiment or args.overrides or args.warm_start:
            raise MbtuneError("--resume: give only the run directory; it holds its experiment")
        exp = experiment(RunDir.open(args.resume, flag="--resume").experiment_file)
    elif not args.experiment:
        raise MbtuneError("run: give EXPERIMENT.yaml, or --resume RUN_DIR")
    else:
        exp = experiment(args.experiment, args.overrides)
        check_user_model(exp)
    # Ray reads RAY_AUTH_MODE once, when it is imported, and mbtune.search imports it: the
    # cluster named here, and its token, come first
    prepare_ray(args.address if args.address is not None else exp.ray.address)
    from mbtune.search import resume_search, run_search

    if args.resume:
        outcome = resume_search(args.resume, **where)
    else:
        outcome = run_search(exp, warm_start=args.warm_start, **where)
    if outcome.summary["status"] == "interrupted":
        return 130  # as a shell reports a command stopped by Ctrl-C
    if exp.plan is not None and outcome.best():
        _plan_block(outcome.run.path)
    return 0 if outcome.best() else 1


def _plan_block(run_dir: Any) -> None:
    """The plan of a finished run whose experiment has a plan section (after the search:
    counting the model's bytes imports torch, which the driver keeps out while it runs). A
    plan that cannot be made is one line; the run itself succeeded."""
    from mbtune.plan import plan_lines, plan_run

    try:
        lines = plan_lines(plan_run(run_dir))
    except MbtuneError as e:
        lines = [f"mbtune: no plan: {_printable(str(e))}"]
    print("\n".join(lines))


# ---------------------------------------------------------------------------
# analyze


def _analyze(args: argparse.Namespace) -> int:
    from mbtune.analysis.analyze import analyze

    analyze(
        args.runs,
        fmt=args.format,
        export=args.export,
        plots=not args.no_plots,
        plan_overrides=args.overrides,
    )
    return 0


# ---------------------------------------------------------------------------
# watch


def _watch(args: argparse.Namespace) -> int:
    from mbtune.analysis.watch import watch

    return watch(args.run, interval_s=args.interval)


# ---------------------------------------------------------------------------
# plan


def _plan(args: argparse.Namespace) -> int:
    from mbtune.analysis.analyze import write_plan
    from mbtune.plan import plan_lines, plan_run
    from mbtune.runs.load import run_info

    plan = plan_run(args.run, args.overrides)
    if args.json:
        print(json.dumps(plan.as_json(), indent=2))
        print(f"mbtune: {plan.link_basis}", file=sys.stderr)
    else:
        print("\n".join(plan_lines(plan)))
    notes = sys.stderr if args.json else sys.stdout
    write_plan(plan, run_info(args.run), plot=not args.no_plots, notes=notes)
    return 0


# ---------------------------------------------------------------------------
# trial


def _trial(args: argparse.Namespace) -> int:
    from mbtune.progress import one_trial
    from mbtune.trial.trial import run_trial

    exp = experiment(args.experiment, args.overrides)
    config = trial_config(exp, args.batch_size, args.num_devices, args.micro_batch_size)
    if exp.trial.parallel == "ddp":  # its Ray Train run imports Ray: the cluster comes first
        from mbtune.cluster import prepare_ray

        prepare_ray(exp.ray.address)
    with one_trial(config) as on_phase:  # a progress line, on a terminal
        result = run_trial(exp, config, on_phase=on_phase)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        for line in result_lines(result, threads=exp.cpu_threads):
            print(line)
    return 0 if result.status == "ok" else 1


# ---------------------------------------------------------------------------
# memory


def _memory(args: argparse.Namespace) -> int:
    from mbtune.trial.predict import predict_memory, prediction_lines

    exp = experiment(args.experiment, args.overrides)
    config = trial_config(exp, args.batch_size, args.num_devices, args.micro_batch_size)
    prediction = predict_memory(exp, config)
    if args.json:
        print(json.dumps(prediction.as_dict()))
    else:
        print("\n".join(prediction_lines(prediction)))
    return 0


def trial_config(
    exp: Experiment, batch_size: int | None, num_devices: int | None, micro: int | None
) -> BatchConfig:
    """The configuration ``mbtune trial`` measures: flags over the experiment's own, held
    to train_input's rules (uneven where the experiment allows it); an error names the
    flag that gave the value. Without a micro-batch size from either, m = P, or with a
    pipeline the largest m whose micro-batches its schedule runs."""
    t = exp.train_input
    flags = {
        "batch_size": ("--batch-size", batch_size),
        "num_devices": ("--num-devices", num_devices),
        "micro_batch_size": ("--micro-batch-size", micro),
    }
    given: dict[str, Any] = {key: value for key, (_, value) in flags.items() if value is not None}
    if micro is None and not isinstance(t.micro_batch_size, int):
        given["micro_batch_size"] = "none"
    uneven = (t.allow_uneven or t.mode == "explore") and t.replicas == t.num_devices
    try:
        own = dataclasses.replace(t, allow_uneven=uneven, **given)
    except ConfigError as e:
        # the experiment's own sizes are valid: a flag given broke the rule, the field's
        # own, else the device count or the batch that meets it (--num-devices 3)
        where = e.where.removeprefix("train_input.")
        blamed = [flags[k][0] for k in (where, "num_devices", "batch_size")
                  if where in flags and flags[k][1] is not None]  # fmt: skip
        if not blamed:
            raise
        raise ConfigError(blamed[0], e.rule) from None
    assert own.config is not None  # an int m or none: the mode fixes m
    config = dataclasses.replace(own.config.with_settings(exp.trial.settings),
                                 pipeline_schedule=exp.trial.pipeline_schedule)  # fmt: skip
    why = config.schedule_problem
    if why and micro is None and not isinstance(t.micro_batch_size, int):
        # the mode chooses m: the largest its pipeline's schedule runs (g >= p, ...)
        for m in reversed(divisors(config.per_device_batch)):
            fits = dataclasses.replace(config, micro_batch_size=m)
            if not fits.schedule_problem:
                return fits
    if why:
        flag = "--micro-batch-size" if micro is not None else "trial.pipeline_schedule"
        raise ConfigError(flag, why)
    return config


_COMMANDS = {
    "init": _init,
    "validate": _validate,
    "space": _space,
    "trial": _trial,
    "memory": _memory,
    "run": _run,
    "analyze": _analyze,
    "plan": _plan,
    "watch": _watch,
}
"""What each command of :func:`mbtune.cli._parser.build_parser` runs."""
