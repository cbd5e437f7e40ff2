"""`mbtune init`: a commented starter experiment that validates, never over another file."""

import pytest
import yaml

from mbtune.cli import main
from mbtune.config import trial
from mbtune.config.load import load_experiment
from mbtune.config.model_options import hf_config_key
from mbtune.config.starter import DEVICES, Sizing, write_starter
from mbtune.lattice import MODES, BatchConfig
from mbtune.trial import predict
from mbtune.trial import sizing as starter_sizing


def init(capsys, *argv):
    code = main(["init", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["gpt", "hf:gpt2", "mlp", "experiments.user_model:build"])
def test_the_starter_validates_with_what_was_asked(
    capsys, tmp_path, monkeypatch, model, device, mode
):
    # an hf: model's sizing (its own test, below) as one that fits one device unsharded
    monkeypatch.setattr(starter_sizing, "size_starter", lambda exp: Sizing(lines=("sized",)))
    path = tmp_path / "starter.yaml"
    code, out, err = init(capsys, path, "--model", model, "--device", device, "--mode", mode)
    assert (code, err) == (0, "")
    sized = "sized\n" if model.startswith("hf:") else ""
    assert out == f"{sized}mbtune: wrote {path}; check it with: mbtune validate {path}\n"
    exp = load_experiment(path)
    assert (exp.name, exp.model.name, exp.trial.device) == ("starter", model, device)
    assert exp.train_input.micro_batch_size == mode
    assert exp.trial.backend == "torch" and exp.search.space.num_devices == (1, 2)
    assert exp.trial.precision == "auto" and exp.trial.compile
    assert exp.gpus_per_trial == (1 if device == "cuda" else 0)  # the default follows it
    # on a CPU a memory budget (nothing else would say oom); on a GPU the card's own
    assert exp.trial.device_memory == (4 * 2**30 if device == "cpu" else None)
    assert len(exp.configs()) == {"auto": 11, "explore": 48, "none": 2}[mode]


def test_the_starter_is_commented_and_hf_gpt2_is_tiny(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(starter_sizing, "size_starter", lambda exp: Sizing())  # sized: below
    path = tmp_path / "gpt2.yaml"
    assert init(capsys, path, "--model", "hf:gpt2")[0] == 0
    text = path.read_text()
    assert text.startswith("# An mbtune experiment, written by `mbtune init`.")
    assert f"#   mbtune run {path}" in text
    assert "micro_batch_size: auto" in text and "# auto: the fastest divisor" in text
    model = yaml.safe_load(text)["model"]
    assert model == {"name": "hf:gpt2", "task": "causal-lm", "seq_len": 64, "n_layer": 2,
                     "n_embd": 128, "n_head": 4, "vocab_size": 512}  # fmt: skip


def test_the_starter_devices_are_the_trial_devices_but_auto():
    assert DEVICES == ("cpu", "cuda") and set(DEVICES) == set(trial.DEVICES) - {"auto"}


@pytest.mark.parametrize(
    ("model_type", "sizes"),
    [
        ("llama", {"num_hidden_layers": (2, 32), "hidden_size": (128, 4096),
                   "num_attention_heads": (4, 32), "num_key_value_heads": (4, None),
                   "intermediate_size": (256, 11008), "vocab_size": (512, 32000)}),
        ("t5", {"num_layers": (2, 6), "d_model": (128, 512), "num_heads": (4, 8),
                "vocab_size": (512, 32128)}),
        ("bloom", {"n_layer": (2, 2), "hidden_size": (128, 64), "n_head": (4, 8),
                   "vocab_size": (512, 250880)}),
    ],
)  # fmt: skip
@pytest.mark.parametrize("device", DEVICES)
def test_an_hf_starter_writes_its_config_s_own_keys(tmp_path, model_type, sizes, device):
    """Small on a CPU, the type's defaults on CUDA, each under the name its config gives
    it (read from transformers' source; without transformers, its common names)."""
    pytest.importorskip("transformers")
    path = tmp_path / "hf.yaml"
    write_starter(path, model=f"hf:{model_type}", device=device)  # not sized: its own test
    options = load_experiment(path).model.options
    at = 0 if device == "cpu" else 1
    expected = {k: v[at] for k, v in sizes.items() if v[at] is not None}
    assert options == {"task": "causal-lm", "seq_len": 64, **expected}


def test_the_layer_count_s_name_is_the_one_transformers_gives_without_importing_it(light_imports):
    transformers = pytest.importorskip("transformers")
    # conftest.LIGHT_IMPORTS: in a fresh process, the keys for gpt2, llama and clip
    assert light_imports.result("hf_keys") == ["n_layer", "num_hidden_layers", None]
    loaded = light_imports.loaded("hf_keys")
    assert not {"torch", "transformers"} & loaded.keys(), loaded
    # what transformers itself says (importing its configs imports torch: here only)
    for model_type in ("gpt2", "llama", "t5", "bloom", "bert", "mistral", "whisper"):
        config = transformers.AutoConfig.for_model(model_type)
        own = type(config).attribute_map.get("num_hidden_layers", "num_hidden_layers")
        assert hf_config_key(model_type, "num_hidden_layers") == own
        assert getattr(config, own) == config.num_hidden_layers


def test_an_hf_model_type_transformers_does_not_have_gets_the_common_name():
    assert hf_config_key("no_such_model", "num_hidden_layers") == "num_hidden_layers"


def test_init_never_overwrites_a_file(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\n")
    code, out, err = init(capsys, path)
    assert (code, out) == (2, "")
    assert err == (f"mbtune: error: init: {path} exists; mbtune init never overwrites a file: "
                   "name another PATH\n")  # fmt: skip
    assert path.read_text() == "name: mine\n"


def test_a_bad_model_is_one_line_and_writes_nothing(capsys, tmp_path):
    code, out, err = init(capsys, tmp_path / "x.yaml", "--model", "gtp")
    assert (code, out) == (2, "")
    assert err.startswith("mbtune: error: model.name: unknown model 'gtp'; valid: gpt, ")
    assert err.count("\n") == 1 and not (tmp_path / "x.yaml").exists()


def test_init_writes_experiment_yaml_by_default_named_after_its_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert init(capsys)[0] == 0
    assert load_experiment("experiment.yaml").name == "experiment"
    assert init(capsys, "odd name!.yaml")[0] == 0
    assert load_experiment("odd name!.yaml").name == "odd-name-"


def _fits(path, sizing) -> None:
    """The starter at ``path`` holds what ``sizing`` found, and its smallest configuration
    is predicted to fit the memory it declares, less its headroom."""
    exp = load_experiment(path)
    budget = exp.trial.device_memory
    assert budget is not None  # a starter declares the memory it was sized for
    assert (exp.train_input.num_devices, exp.trial.sharding) == (
        sizing.num_devices, "fsdp" if sizing.sharded else "none"
    )  # fmt: skip
    assert exp.search.space.num_devices == (sizing.num_devices, 2 * sizing.num_devices)
    assert sizing.peak_memory_bytes <= budget * (1 - exp.trial.headroom(budget))


@pytest.mark.slow
@pytest.mark.parametrize(("model", "device"), [("gpt", "cpu"), ("mlp", "cpu"),
                                               ("hf:gpt2", "cpu"), ("hf:llama", "cpu"),
                                               ("hf:gpt2", "cuda")])  # fmt: skip
def test_every_starter_is_predicted_to_fit_the_memory_it_declares(tmp_path, model, device):
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
        path, sizing = write_starter(tmp_path / "s.yaml", model=model, device=device,
                                     size=starter_sizing.size_starter)  # fmt: skip
        assert sizing.lines[0].startswith(f"mbtune: {model}: ")
        assert " parameters; " in sizing.lines[0]
        assert sizing.lines[1].startswith(f"mbtune: predicted peak memory of one {device} ")
    else:  # a built-in starter is not sized (its options are small): predicted here
        path, _ = write_starter(tmp_path / "s.yaml", model=model, device=device)
        exp = load_experiment(path)
        t = exp.train_input
        peak = predict.predict_memory(exp, BatchConfig(t.batch_size, t.num_devices, 1))
        sizing = Sizing(peak_memory_bytes=peak.peak_memory_bytes)
    _fits(path, sizing)


@pytest.mark.slow
def test_init_llama_on_cuda_writes_llamas_keys_and_shards_it_to_fit(capsys, tmp_path):
    """LlamaConfig's defaults: 6.7B parameters, whose fp32 weights, gradients and AdamW
    states (about 100 GiB) exceed an 80 GB card: sharded over 2 (about 65 GiB each)."""
    pytest.importorskip("transformers")
    path = tmp_path / "llama.yaml"
    code, out, err = init(capsys, path, "--model", "hf:llama", "--device", "cuda")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("mbtune: hf:llama: 6,738,415,616 parameters; ")
    assert "sharded (sharding: fsdp) over 2 devices" in lines[0]
    peak = float(lines[1].split(" on 2 devices: ")[1].split(" GiB")[0])
    exp = load_experiment(path)
    assert exp.model.options == {
        "task": "causal-lm", "seq_len": 64, "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
    }  # fmt: skip
    assert (exp.trial.parallel, exp.trial.sharding, exp.train_input.num_devices) == (
        "ddp", "fsdp", 2
    )  # fmt: skip
    sizing = Sizing(num_devices=2, sharded=True, peak_memory_bytes=int(peak * 2**30))
    _fits(path, sizing)
