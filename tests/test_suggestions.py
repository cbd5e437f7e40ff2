"""Every suggestion mbtune prints can be followed.

A user who is told "nearest valid batch_size: 99 (below) or 102 (above)" and sets 99 must
not meet a second error. So, over random explicit inputs: every value that a message of
:class:`TrainInput` or the closing summary names is fed back (numbers parsed out of the
text) and must pass every rule; and every exported configuration must keep its own
framework's batch rule (``export.RULES``).
"""

from __future__ import annotations

import itertools
import json
import re

import yaml
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from test_export import READ_BACK

from mbtune import lattice
from mbtune.analysis import export
from mbtune.config.rules import ConfigError
from mbtune.config.train_input import TrainInput
from mbtune.lattice import BatchConfig
from mbtune.recommend.reporter import Reporter

LIST = r"\d+(?:\.\.\d+|(?:, \d+)*)"
BATCH = (
    r"nearest valid batch_size(?: for micro_batch_size \d+)?: "
    r"(?:(?P<below>\d+) \(below\) or )?(?P<above>\d+) \(above\)"
)
CHANGE = r"\w+: \w+(?: or \w+)*"
SET = re.compile(rf"set (?P<changes>{CHANGE}(?: and {CHANGE})*)(?: with {BATCH})?")
MICRO = re.compile(rf"valid micro_batch_size for batch_size \d+: (?P<values>{LIST})")
DEVICES = re.compile(
    rf"valid num_devices for batch_size \d+(?: and micro_batch_size \d+)?: (?P<values>{LIST})"
)


def fields(b, n, m, allow_uneven=False, pipeline_parallel=1):
    return {"batch_size": b, "num_devices": n, "micro_batch_size": m,
            "allow_uneven": allow_uneven, "pipeline_parallel": pipeline_parallel}  # fmt: skip


def why_not(given: dict) -> str | None:
    """None where ``given`` is a valid train_input that leaves a search something to try
    (a space that lists nothing: the user's own B and n); else the reason."""
    try:
        t = TrainInput(**given)
    except ConfigError as e:
        return str(e)
    configs = lattice.enumerate_configs(
        mode=t.micro_batch_size, batch_sizes=[t.batch_size], num_devices=[t.num_devices],
        allow_uneven=t.allow_uneven, layouts=[(1, t.pipeline_parallel, "gpipe")],
    )  # fmt: skip
    return None if configs else "valid, but no configuration to try"


def values(text: str) -> list[int]:
    """'1, 2, 4' or '1..5' as the numbers it names."""
    if ".." in text:
        lo, hi = map(int, text.split(".."))
        return list(range(lo, hi + 1))
    return [int(v) for v in text.split(", ")]


def batch_sizes(match: re.Match) -> list[int]:
    return [int(v) for v in (match["below"], match["above"]) if v is not None]


def as_value(text: str) -> int | bool | str:
    return {"true": True, "false": False}.get(text, int(text) if text.isdigit() else text)


def suggestions(message: str) -> list[dict]:
    """Each way out the message names, as the train_input fields it changes together."""
    out = []
    for match in SET.finditer(message):  # set k: v [or v] [and k: v] [with batch sizes]
        choices = []
        for change in match["changes"].split(" and "):
            key, options = change.split(": ")
            choices.append([(key, as_value(v)) for v in options.split(" or ")])
        if match["above"]:
            choices.append([("batch_size", b) for b in batch_sizes(match)])
        out += [dict(combo) for combo in itertools.product(*choices)]
    rest = SET.sub("", message)
    out += [{"batch_size": b} for match in re.finditer(BATCH, rest) for b in batch_sizes(match)]
    out += [{"micro_batch_size": m} for match in MICRO.finditer(rest) for m in values(match[1])]
    out += [{"num_devices": n} for match in DEVICES.finditer(rest) for n in values(match[1])]
    return out


def check_every_listing_is_exact(message: str, given: dict) -> None:
    """A listed batch size is the nearest (none valid lies between below and above), and a
    list of micro-batch sizes or device counts holds every one that is valid."""
    for match in re.finditer(BATCH, SET.sub("", message)):
        below, above = int(match["below"] or 0), int(match["above"])
        between = [b for b in range(below + 1, above) if b != given["batch_size"]]
        assert all(why_not({**given, "batch_size": b}) for b in between), message
    p = lattice.per_device_batch(
        given["batch_size"], given["num_devices"] // given["pipeline_parallel"]
    )
    for pattern, key, most in ((MICRO, "micro_batch_size", p), (DEVICES, "num_devices", 2 * 200)):
        for match in pattern.finditer(message):
            valid = [v for v in range(1, most + 1) if not why_not({**given, key: v})]
            assert values(match["values"]) == valid, message


sizes = st.builds(
    fields,
    b=st.integers(1, 200),
    n=st.integers(1, 12),
    m=st.one_of(st.integers(1, 32), st.sampled_from(lattice.MODES)),
    allow_uneven=st.booleans(),
    pipeline_parallel=st.sampled_from([1, 1, 1, 2]),
)


@settings(max_examples=300, deadline=None)
@given(given=sizes)
@example(given=fields(100, 3, 4))  # was: 99 (below) or 102 (above)
@example(given=fields(87, 8, 4))  # was: 80 and 88
@example(given=fields(22, 8, 7))  # was: 16 and 24
@example(given=fields(8, 1, 16))  # was: valid 1..8, with 3, 5, 6, 7 among them
@example(given=fields(2, 4, 3))  # was: use batch_size >= 4
@example(given=fields(65, 4, "auto", allow_uneven=True, pipeline_parallel=2))
@example(given=fields(65, 4, "explore", pipeline_parallel=2))  # was: use auto
def test_every_value_a_message_names_passes_every_rule(given):
    # num_devices a multiple of t x p is a rule of its own (tests/test_config.py): one way
    # out cannot mend it and a batch that no device count runs at once
    assume(given["num_devices"] % given["pipeline_parallel"] == 0)
    message = why_not(given)
    if message is None or message.startswith("valid"):
        return  # valid as given: nothing to suggest
    ways_out = suggestions(message)
    assert ways_out, f"{message}: names no way out"
    for change in ways_out:
        assert why_not({**given, **change}) is None, f"{message}: {change}"
    check_every_listing_is_exact(message, given)


@given(
    user=st.integers(1, 300),
    batch_size=st.integers(1, 200),
    n=st.integers(1, 12),
    m=st.integers(1, 32),
)
@example(user=100, batch_size=96, n=3, m=4)
def test_the_batch_size_nearest_yours_passes_every_rule(user, batch_size, n, m):
    if batch_size < n or m > lattice.per_device_batch(batch_size, n):
        return  # not a configuration a search measures
    c = BatchConfig(batch_size, n, m)
    nearest = Reporter([c], user_batch_size=user).recommended_batch_size(c)
    assert why_not(fields(nearest, n, m)) is None
    closer = range(user - abs(nearest - user) + 1, user + abs(nearest - user))
    assert all(why_not(fields(b, n, m)) for b in closer if b >= 1)


def rule_holds(e: export.Export) -> bool:
    """``export.RULES[e.framework]``, checked on the numbers of the snippet itself."""
    n, text = e.config.num_devices, e.text
    if e.framework in ("accelerate", "torchtitan"):  # each reader asserts its framework's rule
        return READ_BACK[e.framework](text, n)["batch_size"] == e.config.batch_size
    if e.framework == "cerebras":
        data = yaml.safe_load(text)
        b, m = data["train_input"]["batch_size"], data["train_input"]["micro_batch_size"]
        n = data["runconfig"]["num_csx"]
        return b % n == 0 and (b // n) % m == 0
    if e.framework == "composer":
        data = yaml.safe_load(text)
        b, m = data["global_train_batch_size"], data["device_train_microbatch_size"]
        return b % n == 0 and m <= b // n
    if e.framework == "deepspeed":
        data = json.loads(text)
        per_step = data["train_micro_batch_size_per_gpu"] * data["gradient_accumulation_steps"]
        return data["train_batch_size"] == per_step * n
    if e.framework == "hf":
        data = json.loads(text)
        per_step = data["per_device_train_batch_size"] * data["gradient_accumulation_steps"]
        return per_step * n == e.config.batch_size
    if e.framework == "lightning":
        number = {k: int(re.search(rf"\b{k}=(\d+)", text)[1])
                  for k in ("devices", "accumulate_grad_batches", "batch_size")}  # fmt: skip
        per_step = number["batch_size"] * number["accumulate_grad_batches"]
        return per_step * number["devices"] == e.config.batch_size
    if e.framework == "nemo":  # a recipe's fields: the same rule as megatron's arguments
        m = int(re.search(r"recipe\.data\.micro_batch_size = (\d+)", text)[1])
        b = int(re.search(r"recipe\.data\.global_batch_size = (\d+)", text)[1])
        return b % (m * n) == 0
    m = int(re.search(r"--micro-batch-size (\d+)", text)[1])
    b = int(re.search(r"--global-batch-size (\d+)", text)[1])
    return b % (m * n) == 0


@given(
    batch_size=st.integers(1, 200),
    n=st.integers(1, 12),
    m=st.integers(1, 32),
    recommended=st.one_of(st.none(), st.integers(1, 300)),
    framework=st.sampled_from(export.FRAMEWORKS),
)
def test_every_export_keeps_its_frameworks_batch_rule(batch_size, n, m, recommended, framework):
    if batch_size < n or m > lattice.per_device_batch(batch_size, n):
        return  # not a configuration a search measures
    e = export.export_config(
        framework, BatchConfig(batch_size, n, m), recommended_batch_size=recommended
    )
    assert e.config.num_devices == n
    assert rule_holds(e), (export.RULES[framework], e.text, e.notes)
