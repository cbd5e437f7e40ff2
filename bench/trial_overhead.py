"""Trial overhead: a trial's wall time vs the model's bare timed loop for the same steps.

Method: in one process, compile off, the quickstart's small GPT at batch_size 32,
num_devices 1, micro_batch_size 8 (4 micro-batches per step). Two ways to do the same
work, alternated for R = 5 rounds (the order flips every round, so drift on the shared
machine hits both alike), after one untimed run of each (lazy imports, allocator):

  trial  ``run_trial(exp, BatchConfig(32, 1, 8))``; its ``TrialResult.wall_s``
         (build, data, the first step, warm-up and timed steps, bookkeeping);
  bare   a minimal hand-written loop timed with perf_counter from the start: build the
         same model with ``mbtune.models.build.build_model``, make the same data, slice the same
         micro-batches, AdamW, then 1 + warmup_steps untimed steps (the trial's first step
         plus its warm-up) and measure_steps timed ones, each micro-batch loss weighted by
         its share of the batch.

Before each round the script waits (up to 30 s) for the shared machine to be nearly idle.

Reported: the median wall time of each, their ratio (trial / bare), the median of the
per-round ratios, and both median step times (a check that both time the same work).
As a diagnostic, each round also times one full ``gc.collect()`` in this process: a CUDA
trial ends with one (``mbtune.trial.memory.release``; a CPU trial's process ends instead) and
the bare loop does not.

Target: trial wall time <= 1.2x the bare loop (compile off, so there is no compile time
to set aside).

``--processes`` (issue 41): the time a trial spends outside its compile and its steps when
it runs as a search runs it, in a process of its own, and the warm quickstart's wall time.
Each round runs, for each side (this tree; with ``--before TREE`` also the code in TREE, a
git worktree, first in every other round), two arms in fresh processes whose PYTHONPATH
puts the side's mbtune first:

  trials      the quickstart GPT (compiled, warm compile cache) at (32, 1, 8), (32, 1, 16),
              (32, 2, 8) and (32, 2, 16), each through
              ``mbtune.trial.launch.measure_in_subprocess``, timed around the call;
  quickstart  ``mbtune run experiments/quickstart.yaml`` (this tree's file for both sides),
              timed as a whole command, with a clock on every trial of it and on the
              driver's work between trials (bench/_trial_clock: each trial actor's call,
              the driver's record of each finished trial and each proposal, begun and
              ended), and each line of its stream timed as it came.

Per trial: outside = the call's wall time - compile_s - the steps' time ((1 + warm-up) x
the median step + every timed step); the first trial of a process or of a trial actor
apart (it starts what later trials reuse). Between trials (they run one at a time): the
gap from one trial's end to the next one's start, and how much of it the driver spent
recording the trial (``finish``: its row, the study told, the recommendation) and
proposing the next (``suggest``). The driver's start-up: when its first line, its
'searching' line (Ray started, the memory screened) and the first trial's start came;
its end: the summary's first line and the command's exit after the last trial's end. One
untimed quickstart per side first fills the compile cache. Medians per side, and after /
before per round.

``--processes --compile-off``: the trials arm only, with ``trial.compile=false`` (the
quickstart arm is the compiled quickstart's, so it is left out): what a trial of an
experiment that does not compile spends outside its steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import BENCH, QUICKSTART, ROOT, loadavg, machine, save, table, wait_for_quiet

from mbtune.config.load import load_experiment
from mbtune.lattice import BatchConfig
from mbtune.models.build import build_model
from mbtune.trial.trial import run_trial

NAME = "trial_overhead"
TARGET_RATIO = 1.2
CONFIG = BatchConfig(32, 1, 8)


def bare_loop(exp, config: BatchConfig) -> tuple[float, float]:
    """(wall seconds, median timed step seconds) of the hand-written loop."""
    t0 = time.perf_counter()
    spec = build_model(exp.model.name, exp.model.options, seed=exp.search.seed)
    module = spec.module
    module.train()
    p = config.per_device_batch
    data = spec.make_batch(p, torch.device("cpu"))
    batches, start = [], 0
    for m in config.micro_batch_sizes:
        batches.append(tuple(t[start : start + m] for t in data))
        start += m
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step() -> None:
        for batch in batches:
            (spec.loss_fn(module, batch) * (len(batch[0]) / p)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(1 + exp.trial.warmup_steps):
        step()
    steps = []
    for _ in range(exp.trial.measure_steps):
        s0 = time.perf_counter()
        step()
        steps.append(time.perf_counter() - s0)
    return time.perf_counter() - t0, statistics.median(steps)


def trial(exp, config: BatchConfig) -> tuple[float, float]:
    r = run_trial(exp, config)
    if r.status != "ok":
        raise SystemExit(f"trial failed: {r.status}: {r.reason}")
    return r.wall_s, r.step_time_ms_median / 1e3


# ---------------------------------------------------------------------------
# --processes: trials in processes of their own, and the quickstart (issue 41)

PROCESS_CONFIGS = [BatchConfig(32, 1, 8), BatchConfig(32, 1, 16), BatchConfig(32, 2, 8),
                   BatchConfig(32, 2, 16)]  # fmt: skip
CLOCK = BENCH / "_trial_clock"


def outside_s(wall_s: float, result: dict, warmup_steps: int) -> float | None:
    """A trial's time outside its compile and its steps; None where it measured nothing."""
    if result.get("status") != "ok" or not result.get("step_times_ms"):
        return None
    steps = (1 + warmup_steps) * result["step_time_ms_median"] + sum(result["step_times_ms"])
    return wall_s - (result.get("compile_s") or 0.0) - steps / 1e3


def process_side(sets: list[str]) -> None:
    """One side's trials arm, in this process (its PYTHONPATH picks the side), with the
    quickstart's settings changed by ``sets`` (``--set`` items): JSON out."""
    import mbtune
    from mbtune.trial.launch import measure_in_subprocess
    from mbtune.trial.trial import TrialRequest

    tree = Path(mbtune.__file__).resolve().parents[1]  # the side's: ``python -m`` runs it
    exp = load_experiment(QUICKSTART, sets)
    rows = []
    for config in PROCESS_CONFIGS:
        t0 = time.perf_counter()
        result = measure_in_subprocess(TrialRequest(experiment=exp, config=config), cwd=str(tree))
        wall = time.perf_counter() - t0
        rows.append({"config": [config.batch_size, config.num_devices, config.micro_batch_size],
                     "status": result["status"], "wall_s": wall,
                     "compile_s": result.get("compile_s"),
                     "outside_s": outside_s(wall, result, exp.trial.warmup_steps)})  # fmt: skip
    print(json.dumps(rows))


def side_env(tree: Path, clock: Path | None = None) -> dict[str, str]:
    """The environment of a side's processes: its tree first on PYTHONPATH (and the clock).
    A ``python -m`` puts its working directory first: a side's runs there too."""
    paths = [str(CLOCK)] if clock else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(tree)])}
    if clock:
        env["MBTUNE_TRIAL_CLOCK"] = str(clock)
    return env


def trials_arm(tree: Path, sets: list[str]) -> list[dict]:
    done = subprocess.run([sys.executable, __file__, "--side", *sets], env=side_env(tree),
                          cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def quickstart_arm(tree: Path) -> dict:
    """``mbtune run experiments/quickstart.yaml`` with the side's mbtune, clocked: every
    trial in its actor, the driver's record of each finished trial and each proposal
    (bench/_trial_clock), and each line of the stream as it came."""
    with tempfile.TemporaryDirectory() as tmp:
        clock = Path(tmp) / "clock.jsonl"
        errors = Path(tmp) / "stderr.txt"
        t0 = time.time()
        with errors.open("w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "mbtune", "run", str(QUICKSTART),
                                     "--set", f"output_dir={tmp}/runs"], env=side_env(tree, clock),
                                    cwd=tree, stdout=subprocess.PIPE, stderr=err,
                                    text=True)  # fmt: skip
            lines = [(time.time() - t0, line.rstrip("\n")) for line in proc.stdout]
            proc.wait()
        wall = time.time() - t0
        if proc.returncode != 0:
            raise SystemExit(f"the quickstart from {tree} exited {proc.returncode}: "
                             f"{errors.read_text()[-2000:]}")  # fmt: skip
        (run_dir,) = (Path(tmp) / "runs").iterdir()
        summary = json.loads((run_dir / "summary.json").read_text())
        clocked = [json.loads(line) for line in clock.read_text().splitlines()]
    for c in clocked:  # seconds from the command's start
        c["start"], c["end"] = c["start"] - t0, c["end"] - t0
    trials = sorted((c for c in clocked if c.get("kind", "trial") == "trial"),
                    key=lambda t: t["start"])  # fmt: skip
    wrong = {t["code"] for t in trials} - {str(tree / "mbtune" / "trial" / "launch.py")}
    if wrong:
        raise SystemExit(f"the quickstart from {tree} ran another mbtune: {wrong}")
    first_of_actor, gaps = set(), []
    for pid in {t["pid"] for t in trials}:
        mine = [t for t in trials if t["pid"] == pid]
        first_of_actor.add(id(mine[0]))
        gaps += [b["start"] - a["end"] for a, b in zip(mine, mine[1:], strict=False)]
    for t in trials:
        t["first_of_actor"] = id(t) in first_of_actor
        t["outside_s"] = outside_s(t["end"] - t["start"], t, t["warmup_steps"])
    rec = summary["recommended"]
    return {"wall_s": wall, "trials": len(trials), "actors": len({t["pid"] for t in trials}),
            "recommended": [rec["batch_size"], rec["num_devices"], rec["micro_batch_size"]],
            "confidence": summary.get("confidence"), "reason": summary.get("reason"),
            "gaps_s": gaps, "between": between_trials(trials, clocked),
            "driver": driver_phases(lines, trials, wall), "clock": trials,
            "stream": lines}  # fmt: skip


def between_trials(trials: list[dict], clocked: list[dict]) -> list[dict]:
    """From each trial's end to the next one's start (the search's trials run one at a
    time): how long, and how much of it the driver spent recording the trial that ended
    (``finish``) and proposing (``suggest``), where the clock has those (seconds)."""
    out = []
    for a, b in zip(trials, trials[1:], strict=False):
        inside = [c for c in clocked if c.get("kind") in ("finish", "suggest")
                  and a["end"] <= c["start"] < b["start"]]  # fmt: skip
        spent = {k: sum(c["end"] - c["start"] for c in inside if c["kind"] == k)
                 for k in ("finish", "suggest")}  # fmt: skip
        out.append({"gap_s": b["start"] - a["end"], **{f"{k}_s": v for k, v in spent.items()}})
    return out


def driver_phases(lines: list[tuple[float, str]], trials: list[dict], wall: float) -> dict:
    """When the driver got where, from the command's start (seconds): its first line, its
    'searching' line (Ray started, the memory screened: Tune's fit next), the first trial's
    start in its actor; after the last trial's end, the summary's first line and the
    command's exit."""

    def first(prefix: str) -> float | None:
        return next((t for t, line in lines if line.startswith(prefix)), None)

    last_end = max(t["end"] for t in trials)
    stopping = first("mbtune: stopping") or first("mbtune: interrupted")
    return {
        "first_line_s": lines[0][0] if lines else None,
        "searching_s": first("mbtune: searching"),
        "first_trial_start_s": trials[0]["start"],
        "last_trial_end_s": last_end,
        "summary_after_last_s": None if stopping is None else stopping - last_end,
        "exit_after_last_s": wall - last_end,
        "exit_after_summary_s": None if stopping is None else wall - lines[-1][0],
    }


def _median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def trials_figures(rounds: list[dict]) -> dict:
    """One side's medians of its trials arm over its rounds."""
    trials = [r for rnd in rounds for r in rnd["trials"]]
    return {
        "trials_first_outside_s": _median([rnd["trials"][0]["outside_s"] for rnd in rounds]),
        "trials_later_outside_s": _median(
            [r["outside_s"] for rnd in rounds for r in rnd["trials"][1:]]
        ),  # fmt: skip
        "trials_later_wall_s": _median([r["wall_s"] for rnd in rounds for r in rnd["trials"][1:]]),
        "trials_compile_s": _median([r["compile_s"] for r in trials]),
    }


def side_figures(rounds: list[dict]) -> dict:
    """One side's medians over its rounds."""
    clocked = [t for rnd in rounds for t in rnd["quickstart"]["clock"]]
    return {
        **trials_figures(rounds),
        "quickstart_wall_s": _median([rnd["quickstart"]["wall_s"] for rnd in rounds]),
        "quickstart_trials": _median([rnd["quickstart"]["trials"] for rnd in rounds]),
        "quickstart_outside_s": _median([t["outside_s"] for t in clocked]),
        "quickstart_first_of_actor_outside_s": _median(
            [t["outside_s"] for t in clocked if t["first_of_actor"]]
        ),
        "quickstart_later_outside_s": _median(
            [t["outside_s"] for t in clocked if not t["first_of_actor"]]
        ),
        "quickstart_gap_s": _median([g for rnd in rounds for g in rnd["quickstart"]["gaps_s"]]),
        **{f"between_{k}": _median([b[k] for rnd in rounds for b in rnd["quickstart"]["between"]])
           for k in ("gap_s", "finish_s", "suggest_s")},
        **{f"driver_{k}": _median([rnd["quickstart"]["driver"][k] for rnd in rounds])
           for k in ("searching_s", "first_trial_start_s", "summary_after_last_s",
                     "exit_after_last_s", "exit_after_summary_s")},
    }  # fmt: skip


def processes(rounds: int, before: Path | None, after: Path, compile_off: bool) -> None:
    info = machine()
    sets = ["trial.compile=false"] if compile_off else []
    sides = {"after": after, **({"before": before} if before else {})}
    for tree in sides.values():
        packaged = tree / "mbtune" / "search_spaces"  # as the editable install maps it
        if tree != ROOT and (tree / "search_spaces").is_dir() and not packaged.exists():
            packaged.symlink_to(Path("..") / "search_spaces")
    for tree in sides.values():
        if compile_off:
            trials_arm(tree, sets)  # untimed: the side's imports cached
        else:
            quickstart_arm(tree)  # untimed: the compile cache filled, the side's imports cached
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for i in range(rounds):
        order = list(sides) if i % 2 else list(reversed(sides))
        for label in order:
            load = loadavg()
            runs[label].append({"loadavg": load, "trials": trials_arm(sides[label], sets)})
            if not compile_off:
                runs[label][-1]["quickstart"] = quickstart_arm(sides[label])
            r = runs[label][-1]
            said = f"round {i + 1} {label} (load {load}): trials outside " + str(
                [round(t["outside_s"] or -1, 2) for t in r["trials"]]) + " s"  # fmt: skip
            if not compile_off:
                q = r["quickstart"]
                said += (f"; quickstart {q['wall_s']:.1f} s, {q['trials']} trials, "
                         f"{q['recommended']} at {q['confidence']}")  # fmt: skip
            print(said, flush=True)
    figures = {k: (trials_figures if compile_off else side_figures)(v) for k, v in runs.items()}
    print(table(["figure", *figures], [(name, *(f[name] for f in figures.values()))
                                       for name in figures["after"]]))  # fmt: skip
    paired = {}
    if before:
        arms = [("trials_wall_s", lambda r: sum(t["wall_s"] for t in r["trials"]))]
        if not compile_off:
            arms.insert(0, ("quickstart_wall_s", lambda r: r["quickstart"]["wall_s"]))
        for arm, key in arms:
            ratios = [key(a) / key(b) for a, b in zip(runs["after"], runs["before"], strict=True)]
            paired[arm] = {"after_over_before": ratios, "median": statistics.median(ratios)}
            print(
                f"{arm}: after / before per round {[round(x, 2) for x in ratios]}, "
                f"median {paired[arm]['median']:.2f}"
            )
    name = "trial_overhead_processes" + ("_compile_off" if compile_off else "")
    path = save(name, info, {
        "rounds": rounds, "sets": sets,
        "before": str(before) if before else None, "after": str(after),
        "configs": [c.as_dict() for c in PROCESS_CONFIGS],
        "figures": figures, "paired": paired, "runs": runs,
    })  # fmt: skip
    print(f"raw figures: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each (default 5)")
    parser.add_argument(
        "--processes",
        action="store_true",
        help="trials in processes of their own and the quickstart (issue 41)",
    )
    parser.add_argument(
        "--before",
        type=Path,
        metavar="TREE",
        help="with --processes: the code before, a git worktree, interleaved",
    )
    parser.add_argument(
        "--after", type=Path, metavar="TREE", default=ROOT,
        help="with --processes: the code after (default: this tree)",
    )  # fmt: skip
    parser.add_argument(
        "--compile-off", action="store_true",
        help="with --processes: the trials arm only, compile off",
    )  # fmt: skip
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    opts, sets = parser.parse_known_args()
    if opts.side:
        return process_side(sets)
    if sets:
        parser.error(f"unrecognized arguments: {' '.join(sets)}")
    if opts.processes:
        return processes(opts.rounds, opts.before, opts.after, opts.compile_off)
    info = machine()
    exp = load_experiment(QUICKSTART, ["trial.compile=false"])

    trial(exp, CONFIG)  # untimed: first-use costs of either path
    bare_loop(exp, CONFIG)
    runs: dict[str, list[tuple[float, float]]] = {"trial": [], "bare": []}
    gc_s, busy = [], []
    for i in range(opts.rounds):
        busy.append(wait_for_quiet())
        g0 = time.perf_counter()
        gc.collect()
        gc_s.append(time.perf_counter() - g0)
        order = ("trial", "bare") if i % 2 == 0 else ("bare", "trial")
        for name in order:
            runs[name].append((trial if name == "trial" else bare_loop)(exp, CONFIG))
        print(
            f"round {i + 1}/{opts.rounds}: trial {runs['trial'][-1][0]:.3f} s, "
            f"bare {runs['bare'][-1][0]:.3f} s",
            flush=True,
        )

    wall = {k: [w for w, _ in v] for k, v in runs.items()}
    step = {k: [s for _, s in v] for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_step = {k: statistics.median(v) for k, v in step.items()}
    ratio = med["trial"] / med["bare"]
    paired = statistics.median(t / b for t, b in zip(wall["trial"], wall["bare"], strict=True))
    med_gc = statistics.median(gc_s)
    met = ratio <= TARGET_RATIO

    print(
        f"\nquickstart GPT, batch_size {CONFIG.batch_size}, micro_batch_size "
        f"{CONFIG.micro_batch_size}, compile off, {exp.trial.warmup_steps} warm-up + "
        f"{exp.trial.measure_steps} timed steps (+1 first step), {opts.rounds} rounds"
    )
    rows = [
        (
            i + 1,
            wall["trial"][i],
            wall["bare"][i],
            wall["trial"][i] / wall["bare"][i],
            step["trial"][i] * 1e3,
            step["bare"][i] * 1e3,
            gc_s[i],
        )
        for i in range(opts.rounds)
    ]
    rows.append(
        (
            "median",
            med["trial"],
            med["bare"],
            ratio,
            med_step["trial"] * 1e3,
            med_step["bare"] * 1e3,
            med_gc,
        )
    )
    headers = [
        "round",
        "trial wall s",
        "bare wall s",
        "ratio",
        "trial step ms",
        "bare step ms",
        "gc s",
    ]
    print(table(headers, rows))
    print(
        f"\ntrial / bare: {ratio:.3f}x of medians, {paired:.3f}x median per-round ratio "
        f"(target <= {TARGET_RATIO}x: {'met' if met else 'NOT met'})\n"
        f"one gc.collect() here: {med_gc:.3f} s median; trial - bare: "
        f"{med['trial'] - med['bare']:.3f} s; (trial - gc.collect) / bare: "
        f"{(med['trial'] - med_gc) / med['bare']:.3f}x"
    )
    path = save(
        NAME,
        info,
        {
            "config": CONFIG.as_dict(),
            "compile": False,
            "rounds": opts.rounds,
            "target_ratio": TARGET_RATIO,
            "wall_s": wall,
            "step_s_median": step,
            "median_wall_s": med,
            "median_step_s": med_step,
            "ratio_of_medians": ratio,
            "median_paired_ratio": paired,
            "target_met": met,
            "gc_collect_s": gc_s,
            "median_gc_collect_s": med_gc,
            "busy_before_round": busy,
        },
    )
    print(f"raw figures: {path}")


if __name__ == "__main__":
    main()
