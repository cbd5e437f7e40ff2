"""`mbtune init` for a model that sharding alone does not hold (issue 40, item 7): the
starter splits its layers over t devices too, and its space lists t and p. The memory
prediction is replaced by one of known parts (a device's share of the states, 1/n, and one
sample's activations split over t), so that what the sizing decides is checked exactly and
fast; the prediction itself, split, is tests/test_memory_model_parallel.py's."""

from __future__ import annotations

import pytest

from mbtune.config.load import load_experiment
from mbtune.config.starter import write_starter
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.trial import sizing
from mbtune.trial.predict import MemoryPrediction

GIB = 2**30
CARD = 80 * GIB  # the starter's assumed card; usable: less the default headroom


def fake_predict(states_gib: float, activations_gib: float):
    """A prediction whose states are ``states_gib`` over every device and whose one
    sample's activations are ``activations_gib`` over the t devices each layer is split
    over (Megatron's sequence parallelism splits them all), whatever the device count; the
    configurations it was asked for in ``predict.seen``."""
    seen: list[BatchConfig] = []

    def predict(exp, config, *, spec=None):
        seen.append(config)
        n = config.num_devices
        parts = dict(parameters_bytes=int(states_gib * GIB / 4 / n),
                     gradients_bytes=int(states_gib * GIB / 4 / n),
                     optimizer_state_bytes=int(states_gib * GIB / 2 / n),
                     activations_bytes=int(activations_gib * GIB / config.tensor_parallel),
                     collective_buffers_bytes=0,
                     process_baseline_bytes=0)  # fmt: skip
        return MemoryPrediction(config=config, device="cuda", sharding=exp.trial.sharding,
                                precision="bf16", num_parameters=1,
                                peak_memory_bytes=sum(parts.values()), **parts)  # fmt: skip

    predict.seen = seen
    return predict


def starter(tmp_path, monkeypatch, states_gib, activations_gib):
    predict = fake_predict(states_gib, activations_gib)
    monkeypatch.setattr(sizing, "predict_memory", predict)
    path, sized = write_starter(tmp_path / "big.yaml", model="gpt", device="cuda",
                                size=sizing.size_starter)  # fmt: skip
    return load_experiment(path), sized, predict.seen


def test_activations_sharding_cannot_hold_are_split_over_tensor_parallel_devices(
    tmp_path, monkeypatch
):
    # 100 GiB of states and 160 GiB of one sample's activations: no device count holds
    # it sharded alone (the activations stay whole); on 4 devices split over t = 4, 25 +
    # 40 GiB, within the 72 GiB usable (on 2, t = 2: 50 + 80; on 4, t = 2: 25 + 80)
    exp, sized, seen = starter(tmp_path, monkeypatch, 100, 160)
    t = exp.train_input
    assert (t.num_devices, t.tensor_parallel, t.pipeline_parallel) == (4, 4, 1)
    assert sized.peak_memory_bytes == 65 * GIB
    # from one device up, each t predicted as split, the fewest first, m = 1
    assert [(c.num_devices, c.tensor_parallel) for c in seen] == [(1, 1), (2, 1), (2, 2), (4, 1),
                                                                 (4, 2), (4, 4)]  # fmt: skip
    assert {(c.batch_size, c.micro_batch_size, c.pipeline_parallel) for c in seen} == {(32, 1, 1)}
    assert (exp.trial.sharding, exp.trial.parallel) == ("fsdp", "ddp")
    # the space lists t and p where the model (the built-in gpt: 4 heads, 2 layers) allows
    assert exp.search.space.tensor_parallel == (4,)  # 8 does not divide its 4 heads
    assert exp.search.space.pipeline_parallel == (1, 2)
    assert exp.search.space.pipeline_schedule == ("1f1b", "interleaved_1f1b")
    layouts = {c.layout for c in exp.configs()}
    assert (4, 1, "1f1b") in layouts and (4, 2, "1f1b") in layouts
    assert all(c.tensor_parallel == 4 for c in exp.configs())
    assert "each layer split over 4 of them too (tensor_parallel: 4, 1 replicas)" in sized.lines[0]


def test_a_model_needing_more_replicas_than_samples_is_split(tmp_path, monkeypatch):
    # 4 TiB of states: 57 devices' worth of 72 GiB, so 64 devices, more than the starter's
    # 32 samples can give a replica each: FSDP over 32 replicas of 2 devices each (t = 2)
    exp, sized, seen = starter(tmp_path, monkeypatch, 4096, 1)
    t = exp.train_input
    assert (t.num_devices, t.tensor_parallel) == (64, 2)
    # 64 unsplit replicas, more than 32 samples: not predicted
    assert [(c.num_devices, c.tensor_parallel) for c in seen][-2:] == [(32, 4), (64, 2)]
    assert sized.peak_memory_bytes == 64 * GIB + GIB // 2
    assert exp.search.space.tensor_parallel == (2, 4) and exp.search.space.pipeline_parallel == (
        1,
        2,
    )
    # at 64 devices t = 2 leaves 32 replicas of one sample; t p = 4 or 8 fewer, larger
    assert {(c.layout[:2], c.data_parallel) for c in exp.configs() if c.num_devices == 64} == {
        ((2, 1), 32),
        ((2, 2), 16),
        ((4, 1), 16),
        ((4, 2), 8),
    }


def test_a_model_that_fits_sharded_alone_is_not_split(tmp_path, monkeypatch):
    exp, sized, seen = starter(tmp_path, monkeypatch, 100, 10)
    assert (exp.train_input.num_devices, exp.train_input.tensor_parallel) == (2, 1)
    assert exp.trial.parallel == "ddp" and exp.search.space.tensor_parallel is None
    assert [(c.num_devices, c.tensor_parallel) for c in seen] == [(1, 1), (2, 1)]


def test_what_nothing_holds_is_one_line_naming_the_split(tmp_path, monkeypatch):
    monkeypatch.setattr(sizing, "predict_memory", fake_predict(100, 1000))
    with pytest.raises(
        MbtuneError,
        match=r"each layer split over up to 8 of them as its heads allow\), more than",
    ):
        write_starter(tmp_path / "x.yaml", model="gpt", device="cuda", size=sizing.size_starter)
