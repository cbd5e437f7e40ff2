"""The ``mbtune`` command line: every command's arguments and help, and usage errors as one
line (exit code 2) like every other error. What each command does is mbtune.cli's.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from mbtune.config.starter import DEVICES
from mbtune.lattice import MODES

__all__ = ["EXIT_BAD_INPUT", "build_parser"]

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
    sizes = _size_arguments(_Parser(add_help=False))  # one configuration: trial, memory

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

    commands.add_parser(
        "validate",
        parents=[experiment],
        help="check an experiment and summarise it",
        description="Check an experiment file. Exit 0 with a short summary when it is valid; "
        "exit 2 with a one-line reason when it is not.",
    )

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

    commands.add_parser(
        "trial",
        parents=[experiment, sizes],
        help="measure one configuration, without a search",
        description="Build, compile, warm up and time one (batch_size, num_devices, "
        "micro_batch_size) of the experiment's model, and print what was measured. Sizes "
        "not given default to the experiment's train_input. Without Ray, except with "
        "trial.parallel: ddp, whose workers run on Ray (an embedded one unless ray.address "
        "names a cluster).",
    )

    commands.add_parser(
        "memory",
        parents=[experiment, sizes],
        help="predict one device's peak memory for a configuration, without measuring it",
        description="Predict the peak memory of one device (the busiest) when a (batch_size, "
        "num_devices, micro_batch_size) of the experiment is measured, by part: parameters, "
        "gradients, optimizer state, activations, collective buffers. The model is built on "
        "torch's meta device and rank 0 of N steps on fake tensors: no model memory is "
        "allocated and the device need not be here (trial.device: cuda on a laptop). Sizes "
        "not given default to the experiment's train_input.",
    )

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
        "deepspeed, hf, lightning, megatron, nemo or torchtitan, and write it to "
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

    plan = commands.add_parser(
        "plan",
        help="plan the real run: time to train, device-hours and cost at more devices",
        description="Fit the step time of a run's trials (the compute of a micro-batch, "
        "the all-reduce over two tiers of links) and plan the experiment's plan section: "
        "for each planned device count the best configuration, its samples/s, hours, "
        "device-hours and cost with 90% intervals; then the fastest, the cheapest, and the "
        "cheapest within plan.max_slowdown of the fastest; written to RUN_DIR/plan.csv and "
        "plot-plan.png, as mbtune analyze --set plan.KEY=VALUE does (docs/plan.md).",
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
    plan.add_argument(
        "--no-plots",
        action="store_true",
        help="write no plot-plan.png (plan.csv is written into RUN_DIR either way)",
    )

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
    return parser


def _size_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--batch-size", type=int, metavar="B", help="global batch size")
    parser.add_argument(
        "--num-devices", type=int, metavar="N",
        help="every device: replicas x tensor_parallel x pipeline_parallel",
    )  # fmt: skip
    parser.add_argument(
        "--micro-batch-size", type=int, metavar="M", help="micro-batch size (default: P)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
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
