"""`mbtune init`: a commented starter experiment that validates, never over another file."""

import subprocess
import sys

import pytest
import yaml

from mbtune.cli import main
from mbtune.config import schema
from mbtune.config.load import load_experiment
from mbtune.config.model_options import hf_config_key
from mbtune.config.starter import DEVICES
from mbtune.lattice import MODES


def init(capsys, *argv):
    code = main(["init", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["gpt", "hf:gpt2", "mlp", "experiments.user_model:build"])
def test_the_starter_validates_with_what_was_asked(capsys, tmp_path, model, device, mode):
    path = tmp_path / "starter.yaml"
    code, out, err = init(capsys, path, "--model", model, "--device", device, "--mode", mode)
    assert (code, err) == (0, "")
    assert out == f"mbtune: wrote {path}; check it with: mbtune validate {path}\n"
    exp = load_experiment(path)
    assert (exp.name, exp.model.name, exp.trial.device) == ("starter", model, device)
    assert exp.train_input.micro_batch_size == mode
    assert exp.trial.backend == "torch" and exp.search.space.num_devices == (1, 2)
    assert exp.trial.precision == "auto" and exp.trial.compile
    assert exp.ray.gpus_per_trial == (1 if device == "cuda" else 0)
    # on a CPU a memory budget (nothing else would say oom); on a GPU the card's own
    assert exp.trial.device_memory == (4 * 2**30 if device == "cpu" else None)
    assert len(exp.configs()) == {"auto": 11, "explore": 48, "none": 2}[mode]


def test_the_starter_is_commented_and_hf_gpt2_is_tiny(capsys, tmp_path):
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
    assert DEVICES == ("cpu", "cuda") and set(DEVICES) == set(schema.DEVICES) - {"auto"}


@pytest.mark.parametrize(
    ("model_type", "hint"),
    [("llama", "num_hidden_layers"), ("t5", "num_layers"), ("bloom", "n_layer")],
)
def test_an_hf_starter_hints_the_layer_count_by_its_config_s_own_name(
    capsys, tmp_path, model_type, hint
):
    pytest.importorskip("transformers")  # without it the hint is transformers' common name
    path = tmp_path / "hf.yaml"
    assert init(capsys, path, "--model", f"hf:{model_type}")[0] == 0
    lines = path.read_text().splitlines()
    assert [line.split("#")[1].strip() for line in lines if line.startswith("  # ")] == [
        f"{hint}: 2"
    ]
    assert load_experiment(path).model.options == {"task": "causal-lm", "seq_len": 64}


def test_the_layer_count_s_name_is_the_one_transformers_gives_without_importing_it():
    transformers = pytest.importorskip("transformers")
    code = (
        "import sys; from mbtune.config.model_options import hf_config_key; "
        "print([hf_config_key(t, 'num_hidden_layers') for t in ('gpt2', 'llama', 'clip')], "
        "sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['n_layer', 'num_hidden_layers', None] []"
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
