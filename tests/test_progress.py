"""The live progress of a search: the display, the pipe from the trial process, and the line
in a real `mbtune run` on a terminal (a pseudo-terminal); its absence from piped output is
checked on the live search tests/test_watch.py follows (its `mbtune run` piped)."""

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
import yaml

from mbtune import progress
from mbtune.config.load import parse_experiment
from mbtune.lattice import BatchConfig
from mbtune.trial.launch import measure_in_subprocess
from mbtune.trial.trial import TrialRequest

STAMP = r"mbtune \d\d:\d\d:\d\d  "
MBTUNE = [sys.executable, "-m", "mbtune"]


def test_on_a_terminal_one_line_is_rewritten_and_a_printed_line_goes_above_it(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    out = io.StringIO()
    display = progress.Display(out, tty=True, finished=2)
    display.started("a", BatchConfig(32, 2, 4))
    display.phase("a", "timing", 3, 5)
    display.draw()
    display.echo("mbtune: a line of the search")
    display.ended("a")
    expected = [
        r"\r" + STAMP + r"trial   3  num_devices 2, batch_size 32, micro_batch_size 4: "
        r"starting, 0 s",
        r"\r\x1b\[K\r" + STAMP + r"trial   3  num_devices 2, batch_size 32, "
        r"micro_batch_size 4: timing 3 of 5, 0 s",
        r"\r\x1b\[Kmbtune: a line of the search\n\r" + STAMP + ".*timing 3 of 5, 0 s",
        r"\r\x1b\[K",  # ended: the line is cleared, and nothing is left running
    ]
    assert re.fullmatch("".join(expected), out.getvalue())
    assert display.finished == 3 and not display.due()


def test_several_running_trials_are_numbered_as_trials_csv_will_number_them(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = io.StringIO()
    display = progress.Display(out, tty=True, finished=4)
    display.started("b", BatchConfig(32, 1, 8))
    display.started("c", BatchConfig(32, 2, 16))
    display.phase("c", "compiling", 0, 0)
    display.draw()
    # two trials on one line of 80 columns: short, and cut at the 79th column
    assert (
        out.getvalue().rsplit("\r", 1)[-1]
        == ("trial 5 n 1, B 32, m 8: starting, 0 s | trial 6 n 2, B 32, m 16: compiling, 0 s"[:79])
    )
    display.ended("b")  # b is trial 5 now: c will be the sixth
    assert out.getvalue().rsplit("\r", 1)[-1] == "trial 6 n 2, B 32, m 16: compiling, 0 s"
    monkeypatch.setenv("COLUMNS", "120")  # where it fits, one trial's line is the whole one
    display.draw()
    assert re.fullmatch(STAMP + r"trial   6  num_devices 2, batch_size 32, micro_batch_size 16: "
                        r"compiling, 0 s", out.getvalue().rsplit("\r", 1)[-1])  # fmt: skip


def test_elsewhere_a_running_trial_says_so_in_plain_lines_only_when_it_runs_long(monkeypatch):
    out = io.StringIO()
    display = progress.Display(out, tty=False)
    display.started("a", BatchConfig(32, 1, 4))
    display.phase("a", "compiling", 0, 0)
    display.draw()
    display.echo("mbtune: a line")
    assert out.getvalue() == "mbtune: a line\n" and not display.due()  # a quick trial: nothing
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)
    assert display.due()
    display.draw()
    line = out.getvalue().splitlines()[-1]
    assert re.fullmatch(STAMP + r"trial   1  num_devices 1, batch_size 32, micro_batch_size 4: "
                        r"compiling, 0 s", line)  # fmt: skip
    display.ended("a")
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


@pytest.mark.slow
def test_the_trial_process_tells_each_phase_through_its_pipe(tmp_path):
    exp = parse_experiment(
        {
            "name": "x",
            "model": {"name": "mlp", "in_features": 8, "hidden": 8, "n_layer": 1},
            "train_input": {"batch_size": 4, "micro_batch_size": 2},
            "trial": {"compile": False, "warmup_steps": 1, "measure_steps": 2, "device": "cpu"},
        }
    )
    heard = []
    request = TrialRequest(experiment=exp, config=BatchConfig(4, 1, 2))
    result = measure_in_subprocess(request, cwd=str(tmp_path), on_phase=lambda *p: heard.append(p))
    assert result["status"] == "ok", result["reason"]
    assert heard == [("building", 0, 0), ("first step", 0, 0), ("warm-up", 1, 1),
                     ("timing", 1, 2), ("timing", 2, 2)]  # fmt: skip


# ---------------------------------------------------------------------------
# a real search


def experiment(tmp_path, model=None, **trial):
    """A one-trial search (of a small mlp unless ``model`` is given) whose trial times many
    small steps."""
    spec = {
        "name": "progress",
        "model": model or {"name": "mlp", "in_features": 8, "hidden": 8, "n_layer": 1},
        "train_input": {"batch_size": 4, "micro_batch_size": 4},
        "search": {"num_samples": 1},
        "trial": {"compile": False, "device": "cpu", "warmup_steps": 1,
                  "measure_steps": 200, **trial},
        "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip
    path = tmp_path / "progress.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def in_a_terminal(argv, cwd, timeout=240) -> str:
    """Run ``argv`` with a pseudo-terminal as its stdout and stderr; what it wrote."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                            cwd=cwd, env=env, start_new_session=True)  # fmt: skip
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([leader], [], [], 1.0)[0]:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the last writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    assert proc.wait(timeout=30) == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")


# the search joins the session's Ray: what it prints is the subject, not an embedded Ray's
# start-up


SLOW_BUILD = """
import sys, time
import torch, torch.nn as nn

def build():
    main = getattr(sys.modules["__main__"], "__spec__", None)
    if main is not None and main.name == "mbtune.trial.__main__":  # a trial, not the driver
        time.sleep(2)  # building outlasts the display's ticks (0.5 s), however fast the CPU
    return (nn.Linear(8, 1), lambda n, device: (torch.randn(n, 8, device=device),),
            lambda module, batch: module(batch[0]).pow(2).mean())
"""


@pytest.mark.ray
@pytest.mark.slow
def test_a_search_on_a_terminal_shows_the_running_trials_phase(tmp_path, shared_ray):
    (tmp_path / "slow_build.py").write_text(SLOW_BUILD)
    exp = experiment(tmp_path, model={"name": "slow_build:build"}, measure_steps=2)
    text = in_a_terminal([*MBTUNE, "run", str(exp), "--address", shared_ray.address], tmp_path)
    drawn = [d for d in re.split(r"\r\n|\r\x1b\[K|\r", text) if d]  # each line as drawn
    config = "trial   1  num_devices 1, batch_size 4, micro_batch_size 4"
    assert any(re.fullmatch(STAMP + config + r": starting, \d+ s", d) for d in drawn), text
    # the phase the trial process told came through the pipe, the trial actor and the board
    assert any(re.fullmatch(STAMP + config + r": building, \d+ s", d) for d in drawn), text
    assert any(re.fullmatch(STAMP + config + r".*: [\d,.]+ samples/s  ok", d) for d in drawn)
    assert "recommended: micro_batch_size 4" in text


@pytest.mark.slow
def test_mbtune_trial_on_a_terminal_shows_its_phase_and_then_the_result(tmp_path):
    text = in_a_terminal([*MBTUNE, "trial", str(experiment(tmp_path))], cwd=tmp_path)
    drawn = [d for d in re.split(r"\r\n|\r\x1b\[K|\r", text) if d]
    config = "trial   1  num_devices 1, batch_size 4, micro_batch_size 4"
    assert any(re.fullmatch(STAMP + config + r": building, \d+ s", d) for d in drawn), text
    assert drawn[-1].startswith("  wall time")  # the line is gone; the result is all that stays
