"""The ``mbtune`` command. Each subcommand is a thin shell over one function."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from mbtune.config import Experiment, load_experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig

__all__ = ["main", "space_rows"]

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2) like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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

    experiment = _Parser(add_help=False)
    experiment.add_argument("experiment", metavar="EXPERIMENT.yaml", help="the experiment file")
    experiment.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY.PATH=VALUE",
        action="append",
        default=[],
        help="override one key of the experiment, e.g. --set train_input.batch_size=128 "
        "(repeatable; the value is read as YAML)",
    )

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except MbtuneError as e:
        print(f"mbtune: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("mbtune: interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------------------
# validate


def _validate(args: argparse.Namespace) -> int:
    exp = load_experiment(args.experiment, args.overrides)
    print(f"{args.experiment}: valid")
    for label, text in summary_lines(exp):
        print(f"  {label:<12} {text}")
    return 0


def summary_lines(exp: Experiment) -> list[tuple[str, str]]:
    """What an experiment will do, in a few labelled lines."""
    t, s, tr = exp.train_input, exp.search, exp.trial
    configs = exp.configs()
    distinct = len({c.canonical() for c in configs})
    options = ", ".join(f"{k}={v}" for k, v in exp.model.options.items())
    mode = {
        "int": f"micro_batch_size {t.micro_batch_size} (explicit)",
        "none": "micro_batch_size none (no accumulation: m = per-device batch)",
        "auto": "micro_batch_size auto (the fastest divisor of the per-device batch that fits)",
        "explore": "micro_batch_size explore (every size in the space, divisible or not)",
    }[t.mode]
    user = t.config
    yours = f"; yours runs {_split(user)}" if user is not None and user in set(configs) else ""
    memory = f"{tr.device_memory / 2**30:.2f} GiB" if tr.device_memory else "no budget"
    measure = (
        f"replay of {tr.table}" + (f" with {tr.noise:.0%} noise" if tr.noise else "")
        if tr.backend == "replay"
        else f"torch on {tr.device}, compile {'on' if tr.compile else 'off'}, "
        f"parallel {tr.parallel}"
    )
    budget = f"up to {s.num_samples} trials" + (
        f" or {s.time_budget_s:g} s" if s.time_budget_s else ""
    )
    return [
        ("name", exp.name),
        ("model", exp.model.name + (f" ({options})" if options else "")),
        (
            "train_input",
            f"batch_size {t.batch_size}, num_devices {t.num_devices}"
            + (f", pipeline_stages {t.pipeline_stages}" if t.pipeline_stages > 1 else "")
            + (", allow_uneven" if t.allow_uneven else ""),
        ),
        ("mode", mode + yours),
        (
            "space",
            f"{len(configs)} configurations ({distinct} distinct measurements) from "
            f"'{s.space.source}'",
        ),
        (
            "search",
            f"sampler {s.sampler}, objective {s.objective}, {budget}, stop at confidence "
            f"{s.confidence_target}, seed {s.seed}",
        ),
        (
            "trial",
            f"{measure}; {tr.warmup_steps} warm-up + {tr.measure_steps} timed steps, memory "
            f"{memory}, timeout {tr.timeout_s:g} s",
        ),
        ("ray", exp.ray.address or "embedded local Ray"),
        ("output_dir", str(exp.output_dir)),
    ]


def _split(c: BatchConfig) -> str:
    """How one configuration runs, e.g. '2 devices x 4 micro-batches of 8'."""
    micro = c.micro_batch_sizes
    sizes = f"of {micro[0]}" if len(set(micro)) == 1 else "of " + "+".join(map(str, micro))
    return (
        f"{c.num_devices} device{'s' if c.num_devices > 1 else ''} x "
        f"{c.grad_accum_steps} micro-batch{'es' if c.grad_accum_steps > 1 else ''} {sizes}"
    )


# ---------------------------------------------------------------------------
# space


def space_rows(exp: Experiment) -> list[dict[str, Any]]:
    """One row per configuration of the experiment's space."""
    rows = []
    for c in exp.configs():
        micro = c.micro_batch_sizes
        rows.append(
            {
                **c.as_dict(),
                "micro_batches": "+".join(map(str, micro))
                if len(set(micro)) > 1
                else f"{len(micro)}x{micro[0]}",
                "strict": c.is_strict,
                "runs_as": c.canonical_micro_batch_size,
            }
        )
    return rows


def _space(args: argparse.Namespace) -> int:
    import pandas as pd

    exp = load_experiment(args.experiment, args.overrides)
    rows = space_rows(exp)
    distinct = len({(r["batch_size"], r["num_devices"], r["runs_as"]) for r in rows})
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


if __name__ == "__main__":
    sys.exit(main())
