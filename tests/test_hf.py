"""Hugging Face models: `hf:<model_type>` built from a config with random weights, their
dict batches, exact accumulation, checkpointing, and the errors of a wrong name or option.
Tiny configs (one layer, width 32, vocabulary 128, 16 tokens) and no compile."""

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mbtune.cli import main  # noqa: E402
from mbtune.config.load import load_experiment, parse_experiment  # noqa: E402
from mbtune.config.model_options import ModelError  # noqa: E402
from mbtune.errors import MbtuneError  # noqa: E402
from mbtune.lattice import BatchConfig  # noqa: E402
from mbtune.models import hf  # noqa: E402
from mbtune.models.batch import split_batch  # noqa: E402
from mbtune.models.build import build_model, check_model  # noqa: E402
from mbtune.models.hf import build_hf_model  # noqa: E402
from mbtune.trial.step import accumulate_gradients  # noqa: E402
from mbtune.trial.trial import run_trial  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")

TINY = {
    "gpt2": dict(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=128, seq_len=16),
    "llama": dict(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=128, seq_len=16,
    ),
    "bert": dict(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        max_position_embeddings=64, vocab_size=128, seq_len=16,
    ),
    "t5": dict(
        num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16,
        vocab_size=128, seq_len=16,
    ),
    "resnet": dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], image_size=32),
}  # fmt: skip
NO_DROPOUT = {
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "llama": {},
}


def tiny(model_type: str, **options) -> dict:
    return {**TINY[model_type], **options}


# --- what each task builds -------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "task", "module_class", "labels_shape"),
    [
        ("gpt2", None, "GPT2LMHeadModel", (3, 16)),
        ("llama", None, "LlamaForCausalLM", (3, 16)),
        ("bert", None, "BertForMaskedLM", (3, 16)),
        ("t5", None, "T5ForConditionalGeneration", (3, 16)),
        ("gpt2", "seq-classification", "GPT2ForSequenceClassification", (3,)),
        ("bert", "seq-classification", "BertForSequenceClassification", (3,)),
        ("t5", "seq-classification", "T5ForSequenceClassification", (3,)),
        ("bert", "causal-lm", "BertLMHeadModel", (3, 16)),
    ],
)
def test_each_task_builds_its_model_and_a_dict_batch_with_labels(
    model_type, task, module_class, labels_shape
):
    options = tiny(model_type, **({"task": task} if task else {}))
    if task == "causal-lm":
        options["is_decoder"] = True
    spec = build_model(f"hf:{model_type}", options)
    assert type(spec.module).__name__ == module_class
    assert spec.module.training
    batch = spec.make_batch(3, CPU)
    assert type(batch) is dict
    assert batch.keys() == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == (3, 16) and batch["labels"].shape == labels_shape
    loss = spec.loss_fn(spec.module, batch)
    assert loss.shape == () and torch.isfinite(loss)
    assert spec.tokens_per_sample == 16
    assert spec.mixes_batch is None


def test_an_image_model_gets_images_and_its_batchnorm_is_detected():
    spec = build_model("hf:resnet", tiny("resnet"))
    assert type(spec.module).__name__ == "ResNetForImageClassification"
    batch = spec.make_batch(2, CPU)
    assert batch["pixel_values"].shape == (2, 3, 32, 32) and batch["labels"].shape == (2,)
    assert torch.isfinite(spec.loss_fn(spec.module, batch))
    assert spec.tokens_per_sample is None
    assert spec.mixes_batch.startswith("the model has BatchNorm layers (resnet.embedder.")


@pytest.mark.parametrize(
    ("options", "check"),
    [
        ({"n_layer": 2}, lambda s: len(s.module.transformer.h) == 2),
        ({"n_embd": 64}, lambda s: s.module.transformer.wte.weight.shape == (128, 64)),
        ({"seq_len": 8}, lambda s: s.make_batch(2, CPU)["input_ids"].shape == (2, 8)
         and s.tokens_per_sample == 8),
        ({"vocab_size": 50}, lambda s: int(s.make_batch(64, CPU)["input_ids"].max()) < 50),
        # gpt2's special tokens (50256) do not fit a vocabulary of 128: dropped, no warning
        ({}, lambda s: s.module.config.bos_token_id is None),
        ({}, lambda s: s.module.config.use_cache is False),  # training keeps no KV cache
        ({"use_cache": True}, lambda s: s.module.config.use_cache is True),
    ],
)  # fmt: skip
def test_every_key_under_model_goes_to_the_config(options, check):
    assert check(build_model("hf:gpt2", tiny("gpt2", **options)))


def test_synthetic_tokens_never_use_the_padding_id():
    # gpt2 has no padding token; a classifier needs one to find each sample's last token
    spec = build_model("hf:gpt2", tiny("gpt2", vocab_size=8, task="seq-classification"))
    assert spec.module.config.pad_token_id == 7
    assert int(spec.make_batch(200, CPU)["input_ids"].max()) < 7
    bert = build_model("hf:bert", tiny("bert", vocab_size=8))  # bert's pad is 0
    assert int(bert.make_batch(200, CPU)["input_ids"].min()) > 0


def test_a_config_without_padding_or_end_tokens_builds():
    # transformers 5's RwkvConfig has no pad_token_id or eos_token_id attribute at all
    options = dict(num_hidden_layers=2, hidden_size=32, attention_hidden_size=32,
                   intermediate_size=64, vocab_size=64, seq_len=8)  # fmt: skip
    spec = build_model("hf:rwkv", options)
    assert torch.isfinite(spec.loss_fn(spec.module, spec.make_batch(2, CPU)))


def test_a_model_whose_class_names_no_loss_gets_its_task_s_without_transformers_warning():
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    transformers.utils.logging.warning_once.cache_clear()  # it warns once a process
    logger.addHandler(handler)
    try:
        spec = build_model("hf:gpt2", tiny("gpt2"))  # GPT2LMHeadModel: transformers finds none
        loss = spec.loss_fn(spec.module, spec.make_batch(2, CPU))
    finally:
        logger.removeHandler(handler)
    assert spec.module.loss_type == "ForCausalLM" and torch.isfinite(loss)
    assert [r.getMessage() for r in records if "loss_type" in r.getMessage()] == []


def test_the_same_seed_gives_the_same_weights():
    a = build_model("hf:llama", tiny("llama"), seed=3).module.state_dict()
    b = build_model("hf:llama", tiny("llama"), seed=3).module.state_dict()
    c = build_model("hf:llama", tiny("llama"), seed=4).module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_a_pretrained_directory_gives_the_config_and_options_override_it(tmp_path):
    config = transformers.GPT2Config(n_layer=3, n_embd=48, n_head=3, vocab_size=100)
    config.save_pretrained(tmp_path)
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "torch_dtype": "bfloat16"}))
    spec = build_model("hf:gpt2", {"pretrained": str(tmp_path), "n_layer": 1, "seq_len": 8})
    config = spec.module.config
    assert (config.n_layer, config.n_embd, config.vocab_size) == (1, 48, 100)
    # random weights in fp32, whatever the checkpoint was saved in: the trial sets the precision
    assert {p.dtype for p in spec.module.parameters()} == {torch.float32}


# --- exact accumulation and checkpointing ------------------------------------------------


def _grads(spec, batch, sizes):
    spec.module.zero_grad()
    accumulate_gradients(spec.loss_fn, spec.module, split_batch(batch, sizes))
    return {k: p.grad.clone() for k, p in spec.module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("model_type", "task"), [("gpt2", None), ("bert", None), ("bert", "seq-classification")]
)
def test_accumulated_gradient_equals_the_full_batch_gradient(model_type, task):
    options = tiny(model_type, **NO_DROPOUT[model_type], **({"task": task} if task else {}))
    spec = build_model(f"hf:{model_type}", options)
    spec.module.double()
    batch = spec.make_batch(7, CPU)
    full, accumulated = _grads(spec, batch, [7]), _grads(spec, batch, [3, 2, 2])
    assert full.keys() == accumulated.keys()
    for key in full:
        torch.testing.assert_close(accumulated[key], full[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_checkpointing_uses_the_models_own_and_keeps_the_gradients(model_type):
    options = tiny(model_type, n_layer=2, **NO_DROPOUT[model_type]) if model_type == "gpt2" else (
        tiny(model_type, num_hidden_layers=2))  # fmt: skip
    plain = build_model(f"hf:{model_type}", options)
    checkpointed = build_model(f"hf:{model_type}", options, activation_checkpointing=True)
    layers = [m for m in checkpointed.module.modules() if hasattr(m, "gradient_checkpointing")]
    assert layers and all(m.gradient_checkpointing for m in layers)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in plain.module.modules())
    batch = plain.make_batch(4, CPU)
    expected, got = _grads(plain, batch, [2, 2]), _grads(checkpointed, batch, [2, 2])
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], msg=key)


def test_checkpointing_a_model_transformers_cannot_checkpoint():
    with pytest.raises(
        ModelError,
        match=r"^trial\.activation_checkpointing: hf:resnet \(ResNetForImageClassification\) "
        r"does not support gradient checkpointing in transformers; turn it off for this model$",
    ):
        build_model("hf:resnet", tiny("resnet"), activation_checkpointing=True)


# --- wrong names and options: one line each ------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("hf:gtp2", {}, r"^model\.name: transformers \S+ has no model type 'gtp2' \(did you mean "
         r"hf:gpt2\b.*\?\); e\.g\. hf:gpt2, hf:llama, hf:bert, hf:t5$"),
        ("hf:", {}, r"^model\.name: 'hf:' names no Hugging Face model type; expected "
         r"hf:<model_type>"),
        ("hf:gpt2", {"n_layers": 1}, r"^model\.n_layers: GPT2Config has no option 'n_layers' "
         r"\(did you mean 'n_layer'\?\); mbtune's own keys: task, seq_len, pretrained$"),
        ("hf:gpt2", {"task": "masked-lm"}, r"^model\.task: transformers has no masked-lm head for "
         r"hf:gpt2; valid tasks for it: causal-lm, seq-classification$"),
        ("hf:gpt2", {"task": "causal"}, r"^model\.task: unknown task 'causal'; valid: causal-lm, "
         r"masked-lm, seq-classification, seq2seq-lm, image-classification \(did you mean "
         r"'causal-lm'\?\)$"),
        ("hf:gpt2", {"seq_len": 100}, r"^model\.seq_len: 100 is more than the model's 64 "
         r"positions; use seq_len <= 64, or set model\.max_position_embeddings$"),
        ("hf:gpt2", {"seq_len": 0}, r"^model\.seq_len: must be a positive integer, got 0$"),
        ("hf:gpt2", {"n_embd": 30, "n_head": 4}, r"^model: transformers cannot build hf:gpt2 for "
         r"causal-lm from these options \(ValueError: "),
        ("hf:gpt2", {"checkpoint_blocks": "GPT2Block"}, r"^model\.checkpoint_blocks: only for "
         r"user models; an hf: model checkpoints its own layers"),
        ("hf:siglip", {}, r"^model\.name: hf:siglip has no num_channels in its SiglipConfig, "
         r"which mbtune makes its image-classification batch from \(a composite model"),
        ("hf:gpt2", {"pretrained": "/no/such/dir"}, r"^model\.pretrained: cannot read "
         r"'/no/such/dir/config\.json' \(FileNotFoundError: .*\); expected a local model "
         r"directory holding its config\.json$"),
    ],
)  # fmt: skip
def test_a_wrong_name_or_option_is_one_line_with_what_would_be_valid(name, options, match):
    with pytest.raises(ModelError, match=match):
        build_model(name, {**TINY["gpt2"], **options} if name == "hf:gpt2" else options)


def test_a_pretrained_config_of_another_model_type(tmp_path):
    transformers.BertConfig().save_pretrained(tmp_path)
    with pytest.raises(
        ModelError,
        match=r"^model\.pretrained: '.*config\.json' is the config of model type 'bert', not "
        r"'gpt2'; set model\.name: hf:bert$",
    ):
        build_model("hf:gpt2", {"pretrained": str(tmp_path)})


def test_without_transformers_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    with pytest.raises(
        ModelError,
        match=r"^model\.name: hf:gpt2 needs Hugging Face transformers, which is not installed: "
        r"pip install 'mbtune\[hf\]'$",
    ):
        build_model("hf:gpt2", {})


# --- the experiment, the trial and the command line ------------------------------------------


def experiment(model: dict, **trial) -> dict:
    return {
        "name": "hf",
        "model": model,
        "train_input": {"batch_size": 8, "micro_batch_size": 4},
        "trial": {"device": "cpu", "compile": False, "warmup_steps": 1, "measure_steps": 2,
                  **trial},
    }  # fmt: skip


def test_an_experiment_takes_hf_names_and_checks_mbtunes_own_keys_without_transformers():
    exp = parse_experiment(experiment({"name": "hf:gpt2", "n_layer": 1, "task": "causal-lm"}))
    assert exp.model.name == "hf:gpt2" and not exp.model.is_builtin
    assert dict(exp.model.options) == {"n_layer": 1, "task": "causal-lm"}
    with pytest.raises(MbtuneError, match=r"^model\.task: unknown task 'clm'"):
        parse_experiment(experiment({"name": "hf:gpt2", "task": "clm"}))


def test_a_trial_of_a_tiny_gpt2_measures_tokens():
    exp = parse_experiment(experiment({"name": "hf:gpt2", **TINY["gpt2"]}))
    result = run_trial(exp, BatchConfig(8, 1, 4))
    assert result.status == "ok", result.reason
    assert result.tokens_per_s == pytest.approx(result.samples_per_s * 16)


BERT_USER_MODEL = """
import torch
import transformers

def build(layers=1):
    config = transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=128, max_position_embeddings=64)
    module = transformers.BertForSequenceClassification(config)

    def make_batch(n, device):
        input_ids = torch.randint(1, 128, (n, 16), device=device)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "labels": torch.randint(2, (n,), device=device)}

    return module, make_batch, lambda module, batch: module(**batch).loss
"""


def test_a_user_model_with_a_dict_batch_measures(tmp_path, monkeypatch):
    (tmp_path / "bert_user_model.py").write_text(textwrap.dedent(BERT_USER_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    exp = parse_experiment(experiment({"name": "bert_user_model:build"}))
    try:
        result = run_trial(exp, BatchConfig(8, 1, 3))  # uneven: 3 + 3 + 2
    finally:
        sys.modules.pop("bert_user_model", None)
    assert result.status == "ok", result.reason


def test_an_unknown_model_type_exits_2_in_one_line(tmp_path, capsys):
    path = tmp_path / "e.yaml"
    path.write_text(json.dumps(experiment({"name": "hf:gtp2"})))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mbtune: error: model.name: transformers ") and "hf:gpt2" in err
    assert err.count("\n") == 1 and "Traceback" not in err


LLAMA_7B = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, vocab_size=32000,
)  # fmt: skip


def test_checking_an_experiment_builds_its_hf_model_on_the_meta_device(monkeypatch):
    built = []

    def build(*args, **kwargs):
        built.append(build_hf_model(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(hf, "build_hf_model", build)
    check_model(parse_experiment(experiment({"name": "hf:llama", **LLAMA_7B})).model)
    module = built[0].module  # 27 GB of fp32 weights if it were real
    assert type(module).__name__ == "LlamaForCausalLM" and module.config.num_hidden_layers == 32
    assert {p.device.type for p in module.parameters()} == {"meta"}
    assert sum(p.numel() for p in module.parameters()) > 6.7e9
    # what the config cannot tell, the meta build still does: heads that do not divide
    with pytest.raises(ModelError, match=r"^model: transformers cannot build hf:gpt2 for "):
        check_model(parse_experiment(experiment({"name": "hf:gpt2", "n_embd": 30})).model)


def test_the_example_experiment_builds(monkeypatch):
    monkeypatch.chdir(REPO)
    exp = load_experiment("experiments/hf_gpt2.yaml", [])
    spec = build_model(exp.model.name, exp.model.options)
    assert type(spec.module).__name__ == "GPT2LMHeadModel"


@pytest.mark.ray
@pytest.mark.slow
def test_a_search_of_a_tiny_gpt2_recommends_and_exports_training_arguments(
    ray_session, tmp_path, capsys
):
    from mbtune.search import run_search

    pytest.importorskip("accelerate")  # TrainingArguments needs it
    exp = parse_experiment({
        **experiment({"name": "hf:gpt2", **TINY["gpt2"]}),
        "train_input": {"batch_size": 8, "micro_batch_size": "auto"},
        "search": {"space": {"num_devices": [1, 2]}, "sampler": "grid", "num_samples": 3},
        "output_dir": str(tmp_path),
    })  # fmt: skip
    lines = []
    outcome = run_search(exp, echo=lines.append)
    assert [r["status"] for r in outcome.rows] == ["ok"] * 3
    assert any("recommended micro_batch_size:" in line for line in lines)

    capsys.readouterr()
    assert main(["analyze", str(outcome.run.path), "--export", "hf"]) == 0
    kwargs = json.loads(capsys.readouterr().out)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **kwargs)
    best = outcome.best(1)[0]
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    assert per_step * int(best["num_devices"]) == int(best["batch_size"]) == 8
