"""The ``mbtune`` command. Each subcommand is a thin shell over one function."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from mbtune.config.experiment import Experiment
from mbtune.config.load import load_experiment
from mbtune.config.model_options import hf_model_type
from mbtune.config.rules import ConfigError
from mbtune.config.starter import DEVICES, write_starter
from mbtune.errors import MbtuneError
from mbtune.lattice import MODES, SETTINGS, BatchConfig
from mbtune.report import experiment_lines, micro_batches, result_lines

__all__ = ["main", "space_rows"]

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2) like every other error."""

    def error(self, message: str) -> NoReturn:
        message = _printable(message)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _printable(text: str) -> str:
    """``text`` on one line, control characters escaped: a hostile YAML key or flag cannot
    add lines to an error or send escape sequences to the terminal."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mbtune",
        description=(
            "Find the fastest (batch_size, num_devices, micro_batch_size) for a PyTorch "
            "model: build the lattice of valid configurations, measure them, and recommend "
            "one with an estimated speed-up and a confidence score."
        ),
        epilog="Run 'mbtune COMMAND --help' for the options of one command.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True

    experiment = _experiment_arguments(_Parser(add_help=False))
    optional_experiment = _experiment_arguments(_Parser(add_help=False), optional=True)

    init = commands.add_parser(
        "init",
        help="write a commented starter experiment",
        description="Write a starter experiment with comments: the keys you are most likely "
        "to change, for your model, device and micro-batch mode. It validates as written; an "
        "existing file is never overwritten.",
    )
    init.add_argument(
        "path", metavar="PATH", nargs="?", default="experiment.yaml",
        help="the file to write (default: experiment.yaml)",
    )  # fmt: skip
    init.add_argument(
        "--model", default="gpt",
        help="gpt (a small GPT), hf:gpt2 (a small Hugging Face GPT-2), another built-in or "
        "hf:<model_type>, or package.module:function (your own; default: gpt)",
    )  # fmt: skip
    init.add_argument("--device", choices=DEVICES, default="cpu", help="default: cpu")
    init.add_argument(
        "--mode", choices=MODES, default="auto",
        help="train_input.micro_batch_size: auto (the fastest divisor that fits), explore "
        "(every size, divisible or not) or none (no accumulation); default: auto",
    )  # fmt: skip
    init.set_defaults(handler=_init)

    validate = commands.add_parser(
        "validate",
        parents=[experiment],
        help="check an experiment and summarise it",
        description="Check an experiment file. Exit 0 with a short summary when it is valid; "
        "exit 2 with a one-line reason when it is not.",
    )
    validate.set_defaults(handler=_validate)

    space = commands.add_parser(
        "space",
        parents=[experiment],
        help="list the valid configurations an experiment would search",
        description="List every valid (batch_size, num_devices, micro_batch_size) the "
        "experiment's search may try, with the split each one runs and the count. "
        "Micro-batch sizes with the same grad_accum_steps run identical micro-batches: "
        "'runs_as' names the one measurement they share.",
    )
    space.add_argument(
        "--format", choices=("table", "csv", "json"), default="table", help="output format"
    )
    space.set_defaults(handler=_space)

    trial = commands.add_parser(
        "trial",
        parents=[experiment],
        help="measure one configuration, without a search",
        description="Build, compile, warm up and time one (batch_size, num_devices, "
        "micro_batch_size) of the experiment's model, and print what was measured. Sizes "
        "not given default to the experiment's train_input. Without Ray, except with "
        "trial.parallel: ddp, whose workers run on Ray (an embedded one unless ray.address "
        "names a cluster).",
    )
    trial.add_argument("--batch-size", type=int, metavar="B", help="global batch size")
    trial.add_argument("--num-devices", type=int, metavar="N", help="data-parallel devices")
    trial.add_argument(
        "--micro-batch-size", type=int, metavar="M", help="micro-batch size (default: P)"
    )
    trial.add_argument("--json", action="store_true", help="print one JSON object")
    trial.set_defaults(handler=_trial)

    memory = commands.add_parser(
        "memory",
        parents=[experiment],
        help="predict one device's peak memory for a configuration, without measuring it",
        description="Predict the peak memory of one device (the busiest) when a (batch_size, "
        "num_devices, micro_batch_size) of the experiment is measured, by part: parameters, "
        "gradients, optimizer state, activations, collective buffers. The model is built on "
        "torch's meta device and rank 0 of N steps on fake tensors: no model memory is "
        "allocated and the device need not be here (trial.device: cuda on a laptop). Sizes "
        "not given default to the experiment's train_input.",
    )
    memory.add_argument("--batch-size", type=int, metavar="B", help="global batch size")
    memory.add_argument("--num-devices", type=int, metavar="N", help="data-parallel devices")
    memory.add_argument(
        "--micro-batch-size", type=int, metavar="M", help="micro-batch size (default: P)"
    )
    memory.add_argument("--json", action="store_true", help="print one JSON object")
    memory.set_defaults(handler=_memory)

    run = commands.add_parser(
        "run",
        parents=[optional_experiment],
        help="search the experiment's space with Ray Tune and Optuna",
        description="Search the valid configurations of the experiment: Optuna proposes, "
        "Ray Tune runs each trial in a process of its own, and every finished trial is "
        "appended to trials.csv in a new run directory under output_dir.",
    )
    run.add_argument(
        "--address",
        metavar="ADDRESS",
        help="join an existing Ray cluster ('auto', or HOST:PORT of its head) instead of "
        "starting an embedded one",
    )
    run.add_argument(
        "--dashboard",
        action="store_true",
        default=None,
        help="start the Ray dashboard on 127.0.0.1 and print its URL",
    )
    run.add_argument("--verbose", action="store_true", help="show Ray's own log output")
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue an interrupted search in RUN_DIR (no EXPERIMENT.yaml needed)",
    )
    run.add_argument(
        "--warm-start",
        metavar="RUN_DIR",
        help="teach the sampler the results of an earlier run before it proposes",
    )
    run.set_defaults(handler=_run)

    analyze = commands.add_parser(
        "analyze",
        help="rank, pivot and plot a run's trials; compare two runs; export the winner",
        description="Read a run directory (finished, interrupted or killed): print its "
        "trials best first, the failed ones, and samples/s over micro_batch_size x "
        "num_devices, and write PNG plots into it. Two run directories: set them side by "
        "side (b against a). --export: print the recommended configuration as FRAMEWORK's "
        "snippet and write it into the run directory.",
    )
    analyze.add_argument(
        "runs", metavar="RUN_DIR", nargs="+", help="a run directory; give two to compare them"
    )
    analyze.add_argument(
        "--format",
        choices=("table", "csv", "json", "markdown"),
        default="table",
        help="table and markdown: the whole report; csv and json: the ranked (or compared) "
        "table alone, every column",
    )
    analyze.add_argument(
        "--export",
        metavar="FRAMEWORK",
        help="print the recommended configuration for accelerate, cerebras, composer, "
        "deepspeed, hf, lightning, megatron or torchtitan, and write it to "
        "RUN_DIR/export-FRAMEWORK.*",
    )
    analyze.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    analyze.add_argument(
        "--set",
        dest="overrides",
        metavar="plan.KEY=VALUE",
        action="append",
        default=[],
        help="plan the run (as mbtune plan does; the experiment's plan section, if any, "
        "with this key set): the plan is printed and written to RUN_DIR/plan.csv and "
        "plot-plan.png (repeatable; docs/plan.md)",
    )
    analyze.set_defaults(handler=_analyze)

    plan = commands.add_parser(
        "plan",
        help="plan the real run: time to train, device-hours and cost at more devices",
        description="Fit the step time of a run's trials (the compute of a micro-batch, "
        "the all-reduce over two tiers of links) and plan the experiment's plan section: "
        "for each planned device count the best configuration, its samples/s, hours, "
        "device-hours and cost with 90% intervals; then the fastest, the cheapest, and the "
        "cheapest within plan.max_slowdown of the fastest (docs/plan.md).",
    )
    plan.add_argument("run", metavar="RUN_DIR", help="a run directory")
    plan.add_argument(
        "--set",
        dest="overrides",
        metavar="plan.KEY=VALUE",
        action="append",
        default=[],
        help="set or override one key of the plan, e.g. --set plan.samples=1e9 "
        "(repeatable; the value is read as YAML)",
    )
    plan.add_argument(
        "--json",
        action="store_true",
        help='print one object: {"rows": [...], "fastest", "cheapest", "cheapest_within"}',
    )
    plan.set_defaults(handler=_plan)

    watch = commands.add_parser(
        "watch",
        help="follow a run directory: its recommendation, best configurations and progress",
        description="Follow a run directory as its search writes it (here, or on another "
        "machine of a shared filesystem), or show a finished one: the current "
        "recommendation, the best configurations, the trials against search.num_samples "
        "and the confidence score against its target. It reads only the run directory's "
        "files and exits 0 once the run's summary.json is written, or on Ctrl-C.",
    )
    watch.add_argument("run", metavar="RUN_DIR", help="the run directory to follow")
    watch.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS",
        help="how often the files are read (default: 1)",
    )  # fmt: skip
    watch.set_defaults(handler=_watch)
    return parser


def _experiment_arguments(parser: argparse.ArgumentParser, optional: bool = False):
    parser.add_argument(
        "experiment",
        metavar="EXPERIMENT.yaml",
        nargs="?" if optional else None,
        help="the experiment file",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY.PATH=VALUE",
        action="append",
        default=[],
        help="override one key of the experiment, e.g. --set train_input.batch_size=128 "
        "(repeatable; the value is read as YAML)",
    )
    return parser


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
        return args.handler(args)
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


def _validate(args: argparse.Namespace) -> int:
    exp = load_experiment(args.experiment, args.overrides)
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
    quiet = [k for k in SETTINGS if all(getattr(c, k) == getattr(default, k) for c in configs)]
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

    exp = load_experiment(args.experiment, args.overrides)
    rows = space_rows(exp)
    distinct = len(
        {(r["batch_size"], r["num_devices"], r["runs_as"], *map(r.get, SETTINGS)) for r in rows}
    )
    if args.format == "json":
        print(json.dumps({"count": len(rows), "distinct": distinct, "configurations": rows}))
    elif args.format == "csv":
        print(pd.DataFrame(rows).to_csv(index=False), end="")
    else:
        print(pd.DataFrame(rows).to_string(index=False))
        print(
            f"{len(rows)} configurations, {distinct} distinct measurements "
            f"(mode {exp.train_input.micro_batch_size}, space '{exp.search.space.source}')"
        )
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
        exp = load_experiment(RunDir.open(args.resume, flag="--resume").experiment_file)
    elif not args.experiment:
        raise MbtuneError("run: give EXPERIMENT.yaml, or --resume RUN_DIR")
    else:
        exp = load_experiment(args.experiment, args.overrides)
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
    from mbtune.plan import plan_lines, plan_run

    plan = plan_run(args.run, args.overrides)
    if args.json:
        print(json.dumps(plan.as_json(), indent=2))
        print(f"mbtune: {plan.link_basis}", file=sys.stderr)
    else:
        print("\n".join(plan_lines(plan)))
    return 0


# ---------------------------------------------------------------------------
# trial


def _trial(args: argparse.Namespace) -> int:
    from mbtune.progress import one_trial
    from mbtune.trial.trial import run_trial

    exp = load_experiment(args.experiment, args.overrides)
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

    exp = load_experiment(args.experiment, args.overrides)
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
    flag that gave the value. Without a micro-batch size from either, m = P."""
    t = exp.train_input
    flags = {
        "batch_size": ("--batch-size", batch_size),
        "num_devices": ("--num-devices", num_devices),
        "micro_batch_size": ("--micro-batch-size", micro),
    }
    given: dict[str, Any] = {key: value for key, (_, value) in flags.items() if value is not None}
    if micro is None and not isinstance(t.micro_batch_size, int):
        given["micro_batch_size"] = "none"
    try:
        own = dataclasses.replace(t, allow_uneven=t.allow_uneven or t.mode == "explore", **given)
    except ConfigError as e:
        flag, value = flags.get(e.where.removeprefix("train_input."), ("", None))
        if value is None:
            raise
        raise ConfigError(flag, e.rule) from None
    assert own.config is not None  # an int m or none: the mode fixes m
    return own.config.with_settings(exp.trial.settings)


if __name__ == "__main__":
    sys.exit(main())
