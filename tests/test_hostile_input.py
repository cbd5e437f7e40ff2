"""Hostile input: random, mutated and malicious YAML at the config loader and the CLI.

Whatever an experiment file holds, ``load_experiment`` either returns an Experiment or
raises MbtuneError, and the command line exits 0 or 2 with one clean line: never another
exception, never a traceback, never a hang. Every example runs under a time bound.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import io
import json
import signal
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pandas  # noqa: F401  (mbtune space imports it: also now)
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mbtune.models.build  # noqa: F401  (imports torch now, outside every example's time bound)
from mbtune.cli import main
from mbtune.config.experiment import Experiment
from mbtune.config.load import load_experiment, parse_experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["quickstart.yaml", "explore_mlp.yaml", "cerebras_style.yaml", "replay.yaml"]
BASES = {name: (ROOT / "experiments" / name).read_text() for name in EXAMPLES}
TIME_BOUND_S = 10.0
"""No example may take longer; a hang is a failure, not a stuck test run."""

FUZZ = settings(
    max_examples=200,
    deadline=None,  # timing is bounded by time_bound(), which also stops a real hang
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Hang(BaseException):
    """Raised by the alarm; a BaseException so that no handler under test can swallow it."""


@contextlib.contextmanager
def time_bound(seconds: float = TIME_BOUND_S):
    """Stop the block after ``seconds``; if C code does not return, end the process."""

    def on_alarm(signum, frame):
        raise Hang(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(6 * seconds, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- what hostile YAML looks like --------------------------------------------------------

LAUGHS = (  # "billion laughs": nine levels of ten aliases, 10**9 leaves once expanded
    "[&a [x, x, x, x, x, x, x, x, x, x], "
    + ", ".join(
        f"&{b} [{', '.join([f'*{a}'] * 10)}]" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
    )
    + "]"
)
SNIPPETS = [
    "", "\x00", "\ufeff", "\t", "\r", ": :", "- -", "[", "{", "]", "}", "'", '"', "&a", "*a",
    "*nope", "&a [*a]", "&a {k: *a}", "? [1]\n: 2", "---\n", "...\n", "%YAML 1.1\n---\n",
    "!!python/object/apply:os.system ['echo pwned']", "!!python/name:os.system",
    "!!python/object:__main__.X {}", "!!binary aGk=", "!!timestamp x", "!!int x", "!!float x",
    "!!set {a}", "!!omap [a: 1]", "!!str", "!!null x", "!!bool maybe",
    "1" + "0" * 5000, "1.0e99999", "-.inf", ".nan", "0x7fffffffffffffffffff", "0o777", "1_000",
    "2001-02-30", "9999-12-31 23:59:59.9999999999 +99:99", "[" * 3000, "{a: " * 1500,
    "[" * 300 + "]" * 300, '"\\0"', '"\\x1b[31m"', "\u202e", "🙂" * 50, "a" * 100_000,
    LAUGHS, "*i",
]  # fmt: skip
KEYS = [
    "name", "model", "train_input", "search", "trial", "ray", "output_dir", "batch_size",
    "micro_batch_size", "num_devices", "num_csx", "allow_uneven", "pipeline_parallel", "space",
    "sampler", "objective", "num_samples", "time_budget_s", "confidence_target", "seed",
    "start_points", "backend", "table", "noise", "device", "parallel", "compile",
    "device_memory", "on_oom", "link_bandwidth", "timeout_s", "min", "max", "address",
    "max_concurrent_trials", "n_layer", "d_model",
]  # fmt: skip
WORDS = [
    "auto", "explore", "none", "8GiB", "1e999GB", "1" + "9" * 400 + "GB", "-1", "0", "tpe",
    "grid", "replay", "torch", "cuda", "mlp", "gpt", "default", "wide", "powers_of_two",
    "../../etc/passwd", "/dev/zero", "a\x00b", "\x1b[2J", "\u202eevil", "ray://h:99999",
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.integers(min_value=2**31 - 3, max_value=2**200),
    st.sampled_from([2**31 - 1, 2**30, 10**9, 99_999, 100_000]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(WORDS),
    st.dates(),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


def _paths(node, prefix=()):
    """Every path (a tuple of keys and indices) inside a parsed YAML document."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


@st.composite
def mutated_documents(draw):
    """A valid example experiment with one to three values replaced, removed or added."""
    doc = copy.deepcopy(yaml.safe_load(BASES[draw(st.sampled_from(EXAMPLES))]))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(doc))))
        if not path:
            continue
        *parents, last = path
        parent = doc
        for key in parents:
            parent = parent[key]
        op = draw(st.sampled_from(["replace", "delete", "add"]))
        if op == "replace":
            parent[last] = draw(values)
        elif op == "delete":
            del parent[last]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS) | st.text(max_size=8))] = draw(values)
    # never a user model (package.module:function) here: validating one imports it
    model = doc.get("model")
    if isinstance(model, dict) and isinstance(model.get("name"), str) and ":" in model["name"]:
        model["name"] = "gpt"
    return yaml.safe_dump(doc, allow_unicode=draw(st.booleans()))


@st.composite
def edited_texts(draw):
    """An example experiment's text with a few characters or hostile snippets spliced in."""
    text = BASES[draw(st.sampled_from(EXAMPLES))]
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text)))
        j = draw(st.integers(i, min(len(text), i + 40)))
        insert = draw(st.sampled_from(SNIPPETS) | st.text(max_size=10))
        text = text[:i] + insert + text[j:]
    return text


@st.composite
def snippet_values(draw):
    """A valid example with one line's value replaced by a hostile snippet."""
    lines = BASES[draw(st.sampled_from(EXAMPLES))].splitlines()
    candidates = [i for i, line in enumerate(lines) if ": " in line and not line.startswith("#")]
    i = draw(st.sampled_from(candidates))
    key = lines[i].split(": ", 1)[0]
    lines[i] = f"{key}: {draw(st.sampled_from(SNIPPETS))}"
    return "\n".join(lines) + "\n"


yaml_alphabet = st.text(alphabet="{}[]:,-?&*!|>'\"#%@` \n\tax01.~\\", max_size=200)
documents = st.one_of(
    mutated_documents(),
    edited_texts(),
    snippet_values(),
    yaml_alphabet,
    st.text(max_size=300),
    st.binary(max_size=300),
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("hostile")


def write(workdir: Path, content: str | bytes) -> Path:
    path = workdir / "e.yaml"
    if isinstance(content, str):
        content = content.encode("utf-8", "surrogatepass")
    path.write_bytes(content)
    return path


def load(path: Path, overrides=()) -> Experiment | None:
    """load_experiment: an Experiment, or None for a clean MbtuneError; anything else fails."""
    with time_bound():
        try:
            exp = load_experiment(path, overrides)
        except MbtuneError as e:
            text = str(e)
            assert text and "Traceback" not in text
            return None
        # what a run does with it next: the resolved experiment is written as YAML and sent
        # to every trial process as JSON, where it is parsed again
        resolved = exp.to_dict()
        yaml.safe_dump(resolved)
        again = parse_experiment(json.loads(json.dumps(resolved)))
        assert again.configs() == exp.configs()
        return exp


# -- the config loader -------------------------------------------------------------------


@FUZZ
@given(content=documents)
def test_the_loader_gives_an_experiment_or_a_clean_error(workdir, content):
    load(write(workdir, content))


@settings(FUZZ, max_examples=100)
@given(
    content=mutated_documents() | st.sampled_from([BASES[name] for name in EXAMPLES]),
    overrides=st.lists(
        st.builds(
            "{}={}".format,
            st.lists(st.sampled_from(KEYS) | st.text(max_size=5), min_size=1, max_size=4).map(
                ".".join
            ),
            st.sampled_from(SNIPPETS) | st.text(max_size=20),
        )
        | st.text(max_size=20),
        max_size=3,
    ),
)
def test_set_overrides_give_an_experiment_or_a_clean_error(workdir, content, overrides):
    load(write(workdir, content), overrides)


# -- the command line, in-process --------------------------------------------------------


def refuse_user_models(exp: Experiment) -> None:
    if not exp.model.is_builtin:
        raise MbtuneError("model.name: user models are not imported here")


def run_cli(argv):
    """``mbtune ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    # a fuzzed model name must never import a module: the user-model path has its own tests
    refuse = mock.patch("mbtune.cli.check_user_model", side_effect=refuse_user_models)
    with refuse, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), time_bound():
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_clean(code, out, err):
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err and "Traceback" not in out
    if code == 2:
        assert err.startswith("mbtune") and ": error: " in err, err
        assert err.count("\n") == 1 and err.endswith("\n"), err
        assert err[:-1].isprintable(), repr(err)


@settings(FUZZ, max_examples=100)
@given(
    content=documents,
    command=st.sampled_from(
        [["validate"], ["space", "--format", "json"], ["space", "--format", "csv"], ["space"]]
    ),
    overrides=st.lists(
        st.sampled_from(
            ["train_input.batch_size", "search.space.num_devices", "name", "model"]
        ).flatmap(lambda key: st.sampled_from(SNIPPETS + WORDS).map(f"{key}={{}}".format))
        | st.text(max_size=12),
        max_size=2,
    ),
)
def test_the_cli_exits_0_or_2_with_one_clean_line(workdir, content, command, overrides):
    path = write(workdir, content)
    argv = [command[0], path, *command[1:]]
    for item in overrides:
        argv += ["--set", item]
    assert_clean(*run_cli(argv))


# -- the command line, as a user runs it -------------------------------------------------

DOOMED = Path("/tmp/mbtune-hostile-input-pwned")

HOSTILE_FILES = {
    "binary": bytes(range(256)) * 4,
    "empty": b"",
    "billion laughs": f"name: *i\nlaughs: {LAUGHS}\n".encode(),
    "laughs in model options": (
        f"name: x\nmodel: {{name: mlp, n_layer: {LAUGHS}}}\ntrain_input: {{batch_size: 8}}\n"
    ).encode(),
    "python object": f"name: !!python/object/apply:os.system ['touch {DOOMED}']\n".encode(),
    "deep nesting": b"name: " + b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "huge integer": b"name: x\nmodel: mlp\ntrain_input: {batch_size: 1" + b"0" * 10_000 + b"}\n",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_FILES))
def test_the_command_exits_2_without_a_traceback(tmp_path, case):
    path = tmp_path / "e.yaml"
    path.write_bytes(HOSTILE_FILES[case])
    exe = Path(sys.executable).with_name("mbtune")
    proc = subprocess.run(
        [exe, "validate", path], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("mbtune: error: ") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr
    assert not DOOMED.exists()


# -- regressions: each a bug that the fuzzing above (or reading for it) found ----------

VALID = "name: x\nmodel: mlp\ntrain_input: {batch_size: 8}\n"


def bad(workdir, text, match, overrides=()):
    with time_bound(), pytest.raises(MbtuneError, match=match):
        load_experiment(write(workdir, text), overrides)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("1" + "0" * 5000, r"invalid YAML: Exceeds the limit \(4300 digits\)"),  # ValueError
        ("!!timestamp x", r"invalid YAML: 'NoneType' object has no attribute"),  # AttributeError
        ("2001-02-30", r"invalid YAML: day is out of range for month"),
        ("!!int x", r"invalid YAML: invalid literal for int\(\)"),
    ],
)
def test_a_scalar_its_tag_cannot_build_is_invalid_yaml(workdir, value, match):
    bad(workdir, f"{VALID}output_dir: {value}\n", match)
    bad(workdir, VALID, match, [f"output_dir={value}"])


def test_an_alias_bomb_or_a_cycle_is_refused_at_once(workdir):
    # check_options printed the value with repr(): 10**9 items, a hang
    bad(workdir, f"{VALID}model: {{name: mlp, n_layer: {LAUGHS}}}\n", r"more than 100,000 values")
    bad(workdir, f"{VALID}model: {{name: a:b, opts: &c [*c]}}\n", r"nested more than 50 levels")
    bad(workdir, VALID, r"--set model: more than 100,000", [f"model={LAUGHS}"])


def test_deep_nesting_is_refused(workdir):
    deep = "[" * 60 + "]" * 60
    bad(workdir, f"{VALID}model: {{name: a:b, opts: {deep}}}\n", r"nested more than 50 levels")
    # built from --set key paths, not from the YAML parser
    bad(workdir, VALID, r"nested more than 50 levels", ["model." + ".".join(["k"] * 60) + "=1"])


def test_a_memory_size_too_large_for_a_float_is_refused(workdir):
    # int(float("1" + 400 digits) * 10**9) raised OverflowError
    huge = "1" + "0" * 400
    bad(workdir, f"{VALID}trial: {{device_memory: {huge}GB}}\n", r"device_memory: .* too large")
    bad(workdir, f"{VALID}trial: {{link_bandwidth: {2**70}}}\n", r"link_bandwidth: .* too large")


def test_a_path_with_a_nul_character_is_refused(workdir):
    # Path.resolve() and the file system raised ValueError: embedded null byte
    bad(workdir, f'{VALID}trial: {{backend: replay, table: "t\\0.csv"}}\n', r"trial\.table: .*NUL")
    bad(workdir, f'{VALID}output_dir: "runs\\0"\n', r"output_dir: .*NUL")
    with pytest.raises(MbtuneError, match=r"cannot read 'e\\x00\.yaml'"):
        load_experiment("e\0.yaml")


def test_an_explicit_null_means_the_default(workdir):
    # name: null reached re.fullmatch(None) (TypeError); output_dir: null reached Path(None)
    exp = load(write(workdir, "name:\nmodel: mlp\ntrain_input: {batch_size: 8}\noutput_dir:\n"))
    assert exp.name == "e" and exp.output_dir == Path("runs")
    bad(workdir, VALID.replace("model: mlp", "model: {name: null}"), r"model\.name: expected")


def test_a_batch_range_over_huge_device_and_micro_batch_ranges_is_refused(workdir):
    # the lattice visited every (n, m) with n x m <= max B: about 5 x 10**9 pairs, minutes
    space = (
        "search: {space: {batch_size: {min: 2000000000, max: 2000000000}, "
        "num_devices: {min: 1, max: 99999}, micro_batch_size: {min: 1, max: 99999}}}\n"
    )
    bad(workdir, VALID + space, r"search\.space: with a batch_size range, num_devices")


def test_a_huge_batch_is_shown_without_listing_its_micro_batches(workdir):
    # validate and space built the list of 2**31 micro-batch sizes: 17 GB, a MemoryError or
    # the kernel's OOM killer; now the display never asks for the list
    listing = mock.patch.object(
        BatchConfig, "micro_batch_sizes", property(lambda c: pytest.fail(f"listed {c}"))
    )
    path = write(workdir, "name: x\nmodel: mlp\ntrain_input: {batch_size: 2147483647}\n")
    with listing:
        code, out, _ = run_cli(["space", path, "--format", "csv"])
    assert code == 0
    assert out.splitlines()[1] == "2147483647,1,1,2147483647,2147483647,2147483647x1,True,1"
    uneven = "batch_size: 100, micro_batch_size: 9, allow_uneven: true"
    path = write(workdir, VALID.replace("batch_size: 8", uneven))
    with listing:
        code, out, _ = run_cli(["validate", path])
    assert code == 0 and "yours runs 1 device x 12 micro-batches of 4x9+8x8" in out


def test_errors_are_one_printable_line(workdir):
    # a key with a newline or an escape sequence went to the terminal as it was
    path = write(workdir, VALID + '"a\\nb\\x1b[2J": 1\n')
    code, out, err = run_cli(["validate", path])
    assert code == 2 and err == "mbtune: error: a\\nb\\x1b[2J: unknown key; valid keys: " + (
        "name, model, train_input, search, trial, ray, plan, output_dir\n"
    )


@pytest.mark.parametrize(
    ("address", "match"),
    [
        ("h:99999", r"is not 'auto' or host:port \(a port from 1 to 65535\)"),
        ("h:²", r"is not 'auto' or host:port"),  # int("²") raised ValueError
        ("a..b:1", r"nothing answers at a\.\.b:1 \(encoding with 'idna' codec failed"),
        ("x" * 300 + ":1", r"nothing answers at x+:1"),  # UnicodeError: label too long
    ],
)
def test_a_hostile_address_is_a_clean_error(address, match):
    from mbtune.cluster import check_reachable

    with pytest.raises(MbtuneError, match=match):
        check_reachable(address)
