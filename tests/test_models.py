"""Tests for mbtune.models.build: the built-ins, user models, batch mixing, exact accumulation."""

import copy
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from mbtune.config.load import parse_experiment
from mbtune.config.model_options import MODEL_OPTIONS, ModelError
from mbtune.models import build as models
from mbtune.models.batch import num_samples, slice_batch, split_batch
from mbtune.models.build import BUILTIN_MODELS, build_from_config, build_model, check_model
from mbtune.models.spec import ModelSpec, batch_mixing_reason
from mbtune.trial.step import accumulate_gradients

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a module into tmp_path and return its importable name."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # undo build_model's cwd insertion
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(source: str) -> str:
        name = f"user_model_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


# --- built-ins --------------------------------------------------------------------------


def test_model_options_lists_every_builtin_with_its_defaults():
    assert dict(MODEL_OPTIONS) == {name: defaults for name, (_, defaults) in BUILTIN_MODELS.items()}
    assert dict(MODEL_OPTIONS["gpt"]) == dict(
        n_layer=2, n_head=4, d_model=128, seq_len=64, vocab_size=512, dropout=0.0
    )
    assert dict(MODEL_OPTIONS["mlp"]) == dict(
        in_features=256, hidden=512, n_layer=3, num_classes=10
    )
    assert dict(MODEL_OPTIONS["cnn_bn"]) == dict(
        image_size=32, channels=3, width=16, num_classes=10
    )


@pytest.mark.parametrize(
    ("name", "shapes", "dtypes", "tokens_per_sample"),
    [
        ("gpt", [(3, 64), (3, 64)], [torch.int64, torch.int64], 64),
        ("mlp", [(3, 256), (3,)], [torch.float32, torch.int64], None),
        ("cnn_bn", [(3, 3, 32, 32), (3,)], [torch.float32, torch.int64], None),
    ],
)
def test_builtin_builds_batch_and_finite_scalar_loss(name, shapes, dtypes, tokens_per_sample):
    spec = build_model(name, {})
    assert isinstance(spec, ModelSpec)
    assert spec.module.training
    batch = spec.make_batch(3, CPU)
    assert isinstance(batch, tuple)
    assert [tuple(t.shape) for t in batch] == shapes
    assert [t.dtype for t in batch] == dtypes
    assert all(t.device == CPU for t in batch)
    loss = spec.loss_fn(spec.module, batch)
    assert loss.shape == ()
    assert torch.isfinite(loss)
    assert spec.tokens_per_sample == tokens_per_sample


def test_gpt_targets_and_tokens_lie_in_the_vocab():
    spec = build_model("gpt", {"vocab_size": 7, "seq_len": 5})
    idx, targets = spec.make_batch(50, CPU)
    assert idx.min() >= 0 and idx.max() < 7
    assert targets.min() >= 0 and targets.max() < 7


@pytest.mark.parametrize(
    ("name", "options", "check"),
    [
        ("gpt", {"n_layer": 3}, lambda s: len(s.module.blocks) == 3),
        ("gpt", {"n_head": 8}, lambda s: s.module.blocks[0].attn.n_head == 8),
        ("gpt", {"d_model": 64}, lambda s: s.module.wte.weight.shape == (512, 64)),
        ("gpt", {"vocab_size": 100}, lambda s: s.module(s.make_batch(2, CPU)[0]).shape[-1] == 100),
        (
            "gpt",
            {"seq_len": 16},
            lambda s: s.make_batch(2, CPU)[0].shape == (2, 16) and s.tokens_per_sample == 16,
        ),
        ("gpt", {"dropout": 0.25}, lambda s: s.module.blocks[0].attn.dropout == 0.25),
        ("mlp", {"in_features": 5}, lambda s: s.make_batch(2, CPU)[0].shape == (2, 5)),
        ("mlp", {"hidden": 7}, lambda s: s.module.net[0].out_features == 7),
        (
            "mlp",
            {"n_layer": 1},
            lambda s: sum(isinstance(m, nn.Linear) for m in s.module.modules()) == 2,
        ),
        ("mlp", {"num_classes": 4}, lambda s: s.module(s.make_batch(2, CPU)[0]).shape == (2, 4)),
        ("cnn_bn", {"image_size": 8}, lambda s: s.make_batch(2, CPU)[0].shape == (2, 3, 8, 8)),
        ("cnn_bn", {"channels": 1}, lambda s: s.make_batch(2, CPU)[0].shape == (2, 1, 32, 32)),
        ("cnn_bn", {"width": 4}, lambda s: s.module.features[0].out_channels == 4),
        (
            "cnn_bn",
            {"num_classes": 3},
            lambda s: s.module(s.make_batch(2, CPU)[0]).shape == (2, 3),
        ),
    ],
)
def test_every_builtin_option_is_honoured(name, options, check):
    assert check(build_model(name, options))


@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn_bn"])
def test_same_seed_gives_identical_weights(name):
    a = build_model(name, {}, seed=3).module.state_dict()
    b = build_model(name, {}, seed=3).module.state_dict()
    c = build_model(name, {}, seed=4).module.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert any(not torch.equal(a[key], c[key]) for key in a if a[key].is_floating_point())


def test_gpt_lm_head_is_tied_to_token_embedding():
    module = build_model("gpt", {}).module
    assert module.lm_head.weight is module.wte.weight
    # counted once: the tied weight is one parameter
    names = [name for name, _ in module.named_parameters()]
    assert "lm_head.weight" not in names and "wte.weight" in names


def test_gpt_is_causal():
    # changing a later token must not change the logits at earlier positions
    spec = build_model("gpt", {"seq_len": 8})
    idx, _ = spec.make_batch(1, CPU)
    changed = idx.clone()
    changed[0, 5] = (idx[0, 5] + 1) % 512
    with torch.no_grad():
        a, b = spec.module(idx), spec.module(changed)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5], b[:, 5])


# --- batch mixing -----------------------------------------------------------------------


def test_cnn_bn_mixes_batch_with_a_sentence_naming_batchnorm():
    spec = build_model("cnn_bn", {})
    assert spec.mixes_batch == (
        "the model has BatchNorm layers (features.1: BatchNorm2d, features.4: BatchNorm2d), "
        "whose statistics mix the samples of a batch, so gradient accumulation is not exact"
    )


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_gpt_and_mlp_do_not_mix_batch(name):
    assert build_model(name, {}).mixes_batch is None


@pytest.mark.parametrize(
    "layer",
    [
        nn.BatchNorm1d(4),
        nn.BatchNorm3d(4),
        nn.SyncBatchNorm(4),
        nn.LazyBatchNorm1d(),
    ],
)
def test_every_batchnorm_kind_is_detected(layer):
    reason = batch_mixing_reason(nn.Sequential(nn.Linear(4, 4), layer))
    assert reason is not None
    assert f"1: {type(layer).__name__}" in reason


def test_batchnorm_as_the_root_module_is_named_model():
    assert "(model: BatchNorm1d)" in batch_mixing_reason(nn.BatchNorm1d(3))


def test_many_batchnorms_are_summarised():
    module = nn.Sequential(*[nn.BatchNorm1d(2) for _ in range(5)])
    assert "(0: BatchNorm1d, 1: BatchNorm1d, 2: BatchNorm1d, and 2 more)" in batch_mixing_reason(
        module
    )


def test_layer_and_group_norm_do_not_mix_batch():
    module = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.GroupNorm(2, 4))
    assert batch_mixing_reason(module) is None


def test_declared_mixing_on_a_submodule_is_detected():
    inner = nn.Linear(3, 3)
    inner.mbtune_mixes_batch = "the loss uses in-batch negatives."
    module = nn.Sequential(nn.Linear(3, 3), inner)
    assert batch_mixing_reason(module) == "the loss uses in-batch negatives (declared by 1)"


def test_declared_mixing_must_be_a_sentence():
    module = nn.Linear(3, 3)
    module.mbtune_mixes_batch = True
    with pytest.raises(ModelError, match=r"^model\.mbtune_mixes_batch: must be a non-empty"):
        batch_mixing_reason(module)


def test_user_module_declaring_mixing_is_detected(user_module):
    name = user_module(
        """
        import torch, torch.nn as nn, torch.nn.functional as F

        def build():
            module = nn.Linear(4, 1)
            module.mbtune_mixes_batch = "the loss compares every pair of samples in the batch"
            return module, lambda n, d: torch.randn(n, 4, device=d), lambda m, b: m(b).mean()
        """
    )
    spec = build_model(f"{name}:build", {})
    assert spec.mixes_batch == (
        "the loss compares every pair of samples in the batch (declared by model)"
    )


# --- exact gradient accumulation ----------------------------------------------------------


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def _full_and_accumulated_grads(spec: ModelSpec, batch, sizes):
    """Gradients of the full-batch loss, and of the trial's accumulation over micro-batches
    of ``sizes`` (sum of loss(micro) * len(micro) / P)."""
    module = spec.module
    module.zero_grad()
    spec.loss_fn(module, batch).backward()
    full = _grads(module)

    module.zero_grad()
    accumulate_gradients(spec.loss_fn, module, split_batch(batch, list(sizes)))
    return full, _grads(module)


def _float64(spec: ModelSpec, P: int):
    spec.module.double()
    batch = spec.make_batch(P, CPU)
    return tuple(t.double() if t.is_floating_point() else t for t in batch)


@pytest.mark.parametrize("name", ["gpt", "mlp"])
@pytest.mark.parametrize("sizes", [(4, 4), (3, 2, 2)], ids=["8=4+4", "7=3+2+2"])
def test_accumulated_gradient_equals_full_batch_gradient(name, sizes):
    spec = build_model(name, {"n_layer": 2, "hidden": 32} if name == "mlp" else {})
    batch = _float64(spec, sum(sizes))
    full, accumulated = _full_and_accumulated_grads(spec, batch, sizes)
    assert full.keys() == accumulated.keys()
    for key in full:
        torch.testing.assert_close(accumulated[key], full[key], atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.parametrize("sizes", [(4, 4), (3, 2, 2)], ids=["8=4+4", "7=3+2+2"])
def test_cnn_bn_accumulated_gradient_differs_which_is_why_it_is_detected(sizes):
    spec = build_model("cnn_bn", {"image_size": 8, "width": 4})
    batch = _float64(spec, sum(sizes))
    full, accumulated = _full_and_accumulated_grads(spec, batch, sizes)
    worst = max((accumulated[k] - full[k]).abs().max().item() for k in full)
    assert worst > 1e-3


# --- every batch form: the loss gets micro-batches in the form make_batch returned ------

FORMS_MODEL = """
import collections, torch, torch.nn as nn, torch.nn.functional as F

Pair = collections.namedtuple("Pair", "x y")
SEEN = []  # every batch the loss was given

def build(form):
    module = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def make_batch(n, device):
        x = torch.randn(n, 3, dtype=torch.float64, device=device)
        y = torch.randn(n, 1, dtype=torch.float64, device=device)
        forms = {"tensor": x, "tuple": (x, y), "list": [x, y], "dict": {"x": x, "y": y},
                 "namedtuple": Pair(x, y)}
        return forms[form]

    def loss(module, batch):
        SEEN.append(batch)
        if form == "tensor":
            return module(batch).pow(2).mean()
        x, y = (batch["x"], batch["y"]) if form == "dict" else batch
        return F.mse_loss(module(x), y)

    return module, make_batch, loss
"""


@pytest.mark.parametrize("form", ["tensor", "tuple", "list", "dict", "namedtuple"])
def test_every_batch_form_reaches_the_loss_as_made_and_accumulates_exactly(user_module, form):
    name = user_module(FORMS_MODEL)
    spec = build_model(f"{name}:build", {"form": form})
    batch = spec.make_batch(7, CPU)
    seen = sys.modules[name].SEEN
    seen.clear()

    full, accumulated = _full_and_accumulated_grads(spec, batch, (3, 2, 2))

    assert [type(b) for b in seen] == [type(batch)] * 4
    assert [num_samples(b) for b in seen] == [7, 3, 2, 2]
    for key in full:
        torch.testing.assert_close(accumulated[key], full[key], atol=1e-12, rtol=1e-10)


def test_a_dict_micro_batch_holds_the_same_rows_of_every_tensor():
    batch = {"x": torch.arange(10).view(5, 2), "y": torch.arange(5)}
    first, second = split_batch(batch, [3, 2])
    assert first.keys() == {"x", "y"} and first["y"].tolist() == [0, 1, 2]
    assert second["x"].tolist() == [[6, 7], [8, 9]] and second["y"].tolist() == [3, 4]


# --- slice_batch ----------------------------------------------------------------------


def test_slice_batch_takes_the_same_rows_of_every_tensor():
    batch = (torch.arange(10).view(5, 2), torch.arange(5))
    x, y = slice_batch(batch, 1, 4)
    assert x.tolist() == [[2, 3], [4, 5], [6, 7]]
    assert y.tolist() == [1, 2, 3]


@pytest.mark.parametrize(("start", "stop"), [(2, 2), (-1, 2), (3, 6), (4, 1)])
def test_slice_batch_rejects_empty_or_out_of_range(start, stop):
    batch = (torch.zeros(5, 2),)
    with pytest.raises(ValueError, match=r"need 0 <= start < stop <= 5"):
        slice_batch(batch, start, stop)


# --- user models ----------------------------------------------------------------------


def test_example_user_model_loads_from_the_project_directory(monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(REPO))])
    monkeypatch.chdir(REPO)
    spec = build_model("experiments.user_model:build", {"hidden": 8}, seed=1)
    assert spec.module[0].out_features == 8
    x, y = spec.make_batch(3, CPU)
    assert x.shape == (3, 16) and y.shape == (3, 1)
    loss = spec.loss_fn(spec.module, (x, y))
    assert loss.shape == () and torch.isfinite(loss)
    assert spec.tokens_per_sample is None and spec.mixes_batch is None


def test_example_user_model_accumulates_exactly(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(REPO)
    spec = build_model("experiments.user_model:build", {})
    batch = _float64(spec, 7)
    full, accumulated = _full_and_accumulated_grads(spec, batch, (3, 2, 2))
    for key in full:
        torch.testing.assert_close(accumulated[key], full[key], atol=1e-6, rtol=1e-5)


def test_user_model_bare_tensor_batch_stays_a_tensor(user_module):
    name = user_module(
        """
        import torch, torch.nn as nn

        def build(width=3):
            make_batch = lambda n, d: torch.ones(n, width, device=d)
            return nn.Linear(width, 1), make_batch, lambda m, b: m(b).mean()
        """
    )
    spec = build_model(f"{name}:build", {"width": 5})
    batch = spec.make_batch(4, CPU)
    assert isinstance(batch, torch.Tensor) and batch.shape == (4, 5)


def test_user_model_is_seeded(user_module):
    name = user_module(
        """
        import torch, torch.nn as nn

        def build():
            make_batch = lambda n, d: torch.randn(n, 4, device=d)
            return nn.Linear(4, 4), make_batch, lambda m, b: m(b).mean()
        """
    )
    a = build_model(f"{name}:build", {}, seed=5).module.weight
    b = build_model(f"{name}:build", {}, seed=5).module.weight
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        (
            "gtp",
            {},
            r"^model\.name: unknown model 'gtp'; valid: gpt, mlp, cnn_bn, or "
            r"package\.module:function \(did you mean 'gpt'\?\); or hf:<model_type> for a "
            r"Hugging Face transformers model \(e\.g\. hf:gpt2\)$",
        ),
        (
            "resnet",
            {},
            r"^model\.name: unknown model 'resnet'; valid: gpt, mlp, cnn_bn, or "
            r"package\.module:function; or hf:<model_type> for a Hugging Face",
        ),
        (3, {}, r"^model\.name: must be a string, got 3"),
        (
            "gpt",
            {"n_layers": 3},
            r"^model\.n_layers: unknown option for model 'gpt'; valid: "
            r"n_layer, n_head, d_model, seq_len, vocab_size, dropout \(did you mean 'n_layer'\?\)$",
        ),
        (
            "gpt",
            {"d_model": 130},
            r"^model\.d_model: must be divisible by model\.n_head "
            r"\(d_model=130, n_head=4\); valid d_model near 130: 128, 132$",
        ),
        (
            "gpt",
            {"n_layer": 0},
            r"^model\.n_layer: must be a positive integer, got 0; "
            r"the default is 2$",
        ),
        ("gpt", {"n_layer": True}, r"^model\.n_layer: must be a positive integer, got True"),
        ("mlp", {"hidden": "512"}, r"^model\.hidden: must be a positive integer, got '512'"),
        ("cnn_bn", {"width": 2.0}, r"^model\.width: must be a positive integer, got 2\.0"),
        (
            "gpt",
            {"dropout": 1.0},
            r"^model\.dropout: must be a float in \[0, 1\), got 1\.0; "
            r"the default is 0\.0$",
        ),
        ("gpt", {"dropout": -0.1}, r"^model\.dropout: must be a float in \[0, 1\), got -0\.1"),
        ("gpt", {"dropout": False}, r"^model\.dropout: must be a float in \[0, 1\), got False"),
        ("a.b:c:d", {}, r"^model\.name: 'a\.b:c:d' is not of the form package\.module:function"),
        ("pkg..mod:f", {}, r"^model\.name: 'pkg\.\.mod:f' is not of the form package\.module:f"),
        (".mod:f", {}, r"^model\.name: '\.mod:f' is not of the form package\.module:function"),
    ],
)
def test_bad_builtin_name_or_option(name, options, match):
    with pytest.raises(ModelError, match=match):
        build_model(name, options)


def test_dropout_accepts_an_int_zero():
    assert build_model("gpt", {"dropout": 0}).module.blocks[0].attn.dropout == 0.0


def parsed_model(model: dict):
    """The model of an experiment parsed as the command line parses it."""
    return parse_experiment({"name": "m", "model": model, "train_input": {"batch_size": 8}}).model


@pytest.mark.parametrize(
    ("name", "options"), [("gpt", {"n_layer": 1, "dropout": 0}), ("mlp", {}), ("cnn_bn", {})]
)
def test_an_experiments_model_is_built_as_given_without_checking_its_options_again(
    monkeypatch, name, options
):
    expected = build_model(name, options, seed=2, activation_checkpointing=name == "gpt")
    model = parsed_model({"name": name, **options})

    def checked_twice(*args):
        raise AssertionError("the config checked these options already")

    monkeypatch.setattr(models, "check_options", checked_twice)
    spec = build_from_config(model, seed=2, activation_checkpointing=name == "gpt")
    assert type(spec.module) is type(expected.module)
    assert spec.module.state_dict().keys() == expected.module.state_dict().keys()
    for key, value in expected.module.state_dict().items():
        assert torch.equal(spec.module.state_dict()[key], value), key
    assert spec.tokens_per_sample == expected.tokens_per_sample
    assert spec.mixes_batch == expected.mixes_batch
    if name == "gpt":  # YAML's int 0 reaches the model as the float check_options gives
        assert spec.module.blocks[0].attn.dropout == 0.0
        assert isinstance(spec.module.blocks[0].attn.dropout, float)
        assert [b.forward.__func__.__name__ for b in spec.module.blocks] == [
            "_checkpointed_forward"
        ]
    with pytest.raises(AssertionError, match="checked these options already"):
        build_model(name, options)  # a direct caller's options are still checked


def test_checking_a_builtin_builds_nothing(monkeypatch):
    def build_gpt(**options):
        raise AssertionError("the config checked a built-in's options; nothing to build")

    monkeypatch.setitem(models.BUILTIN_MODELS, "gpt", (build_gpt, MODEL_OPTIONS["gpt"]))
    with pytest.raises(AssertionError, match="nothing to build"):
        build_model("gpt", {})
    check_model(parsed_model({"name": "gpt", "n_layer": 1}))


def test_checking_a_user_model_runs_it_and_its_contract(user_module):
    name = user_module("""
        import torch
        calls = []
        def build(width=3):
            calls.append(width)
            return torch.nn.Linear(width, 1), lambda n, device: torch.zeros(n + 1, width), None
    """)
    with pytest.raises(ModelError, match=r"^model\.name: '.*:build' returned a NoneType as loss"):
        check_model(parsed_model({"name": f"{name}:build", "width": 5}))
    assert sys.modules[name].calls == [5]


def test_model_error_is_a_value_error():
    assert issubclass(ModelError, ValueError)


def test_non_importable_module(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(
        ModelError,
        match=r"^model\.name: cannot import 'no_such_pkg\.mod' \(ModuleNotFoundError: No module "
        r"named 'no_such_pkg'\); expected package\.module:function importable from the "
        r"current directory$",
    ):
        build_model("no_such_pkg.mod:build", {})


def test_module_that_fails_on_import(user_module):
    name = user_module("raise RuntimeError('needs a GPU\\nto import')\n")
    with pytest.raises(
        ModelError, match=rf"^model\.name: cannot import '{name}' \(RuntimeError: needs a GPU to "
    ):
        build_model(f"{name}:build", {})


def test_current_directory_is_made_importable(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    name = f"cwd_model_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch, torch.nn as nn\n"
        "def build():\n"
        "    return nn.Linear(2, 1), lambda n, d: torch.zeros(n, 2), lambda m, b: m(b).mean()\n"
    )
    monkeypatch.chdir(tmp_path)
    try:
        assert build_model(f"{name}:build", {}).module.in_features == 2
    finally:
        sys.modules.pop(name, None)


def test_missing_function(user_module):
    name = user_module("def build_model():\n    pass\n")
    with pytest.raises(
        ModelError,
        match=rf"^model\.name: module '{name}' has no attribute 'build' \(did you mean "
        r"'build_model'\?\); expected package\.module:function where function\(\*\*options\)",
    ):
        build_model(f"{name}:build", {})


def test_not_callable(user_module):
    name = user_module("build = 3\n")
    with pytest.raises(ModelError, match=rf"^model\.name: '{name}:build' is a int, not a function"):
        build_model(f"{name}:build", {})


@pytest.mark.parametrize(
    ("returns", "match"),
    [
        ("nn.Linear(2, 1)", r"returned a Linear, not a 3-tuple"),
        ("[nn.Linear(2, 1), mb, loss]", r"returned a list of 3 items, not a 3-tuple"),
        ("(nn.Linear(2, 1), mb)", r"returned a tuple of 2 items, not a 3-tuple"),
        ("('linear', mb, loss)", r"returned a str as first item, not a torch\.nn\.Module"),
        ("(nn.Linear(2, 1), 4, loss)", r"returned a int as make_batch, not a function"),
        ("(nn.Linear(2, 1), mb, None)", r"returned a NoneType as loss, not a function"),
    ],
)
def test_function_returning_the_wrong_things(user_module, returns, match):
    name = user_module(
        f"""
        import torch, torch.nn as nn

        def mb(n, device):
            return torch.zeros(n, 2, device=device)

        def loss(module, batch):
            return module(batch).mean()

        def build():
            return {returns}
        """
    )
    with pytest.raises(
        ModelError, match=rf"^model\.name: '{name}:build' {match}; expected package\.module"
    ):
        build_model(f"{name}:build", {})


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        (
            "(torch.zeros(n, 2), torch.zeros(3))",
            r"returned tensors of shapes \(2, 2\), \(3,\); every tensor must have leading "
            r"dimension 2 \(one row per sample\)$",
        ),
        ("torch.zeros(())", r"returned tensors of shapes \(\); every tensor must have leading"),
        (
            "{'x': torch.zeros(n), 'mask': [1, 1]}",
            r"returned a dict whose 'mask' is a list, not a tensor named by a string; expected "
            r"a tensor, a tuple or list of tensors, or a mapping of names to tensors, each with "
            r"leading dimension 2$",
        ),
        ("{0: torch.zeros(n)}", r"returned a dict whose 0 is a Tensor, not a tensor named by a"),
        ("{'x': torch.zeros(n, 3), 'y': torch.zeros(3)}", r"returned tensors of shapes \(2, 3\), "),
        ("[torch.zeros(n), 'y']", r"returned a list whose item 1 is a str, not a tensor; expected"),
        ("{}", r"returned an empty dict; expected a tensor, a tuple or list of tensors, or a map"),
        ("()", r"returned an empty tuple; expected a tensor, a tuple or list of tensors"),
        ("'abc'", r"returned a str; expected a tensor, a tuple or list of tensors, or a mapping"),
    ],
)
def test_make_batch_returning_the_wrong_batch(user_module, batch, match):
    name = user_module(
        f"""
        import torch, torch.nn as nn

        def build():
            return nn.Linear(2, 1), lambda n, device: {batch}, lambda m, b: m(b).mean()
        """
    )
    with pytest.raises(
        ModelError, match=rf"^model\.name: make_batch\(2, device\) from '{name}:build' {match}"
    ):
        build_model(f"{name}:build", {})


def test_make_batch_checked_at_every_call(user_module):
    name = user_module(
        """
        import torch, torch.nn as nn

        def build():
            return nn.Linear(2, 1), lambda n, d: torch.zeros(min(n, 2), 2), lambda m, b: m(b)
        """
    )
    spec = build_model(f"{name}:build", {})
    with pytest.raises(ModelError, match=r"make_batch\(5, device\) .* leading dimension 5"):
        spec.make_batch(5, CPU)


def test_function_that_raises(user_module):
    name = user_module(
        """
        def build(depth=1, tag=None):
            raise RuntimeError(f"depth {depth} is too deep\\nsee the docs")
        """
    )
    with pytest.raises(
        ModelError,
        match=rf"^model\.name: '{name}:build' \(called with depth=9, tag='x'\) raised "
        r"RuntimeError: depth 9 is too deep see the docs$",
    ):
        build_model(f"{name}:build", {"depth": 9, "tag": "x", "checkpoint_blocks": "Block"})


def test_make_batch_that_raises(user_module):
    name = user_module(
        """
        import torch.nn as nn

        def make_batch(n, device):
            raise KeyError("x")

        def build():
            return nn.Linear(2, 1), make_batch, lambda m, b: m(b).mean()
        """
    )
    with pytest.raises(
        ModelError, match=rf"^model\.name: make_batch\(2, cpu\) from '{name}:build' raised KeyError"
    ):
        build_model(f"{name}:build", {})


def test_user_option_the_function_does_not_take(user_module):
    name = user_module(
        """
        def build(hidden=4, depth=2):
            pass
        """
    )
    with pytest.raises(
        ModelError,
        match=rf"^model\.hiden: unknown option for model '{name}:build'; valid: hidden, depth "
        r"\(did you mean 'hidden'\?\)$",
    ):
        build_model(f"{name}:build", {"hiden": 8})


TYPED_USER_MODEL = """
    from __future__ import annotations

    from pathlib import Path
    from typing import Literal, Sequence

    def build(hidden: int = 4, rate: float = 0.5, tag: str | None = None,
              sizes: list[int] = [1], pair: tuple[int, int] = (1, 2),
              mode: Literal["a", "b"] = "a", depth=2, scale=1.0, shape=(8, 8), where: Path = None,
              dims: Sequence[int] = (), **extra):
        raise RuntimeError("called")
"""


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hidden": "abc"}, "model.hidden: expected int, got 'abc' (a str); '{}' takes "
                            "hidden: int = 4"),
        ({"hidden": True}, "model.hidden: expected int, got True (a bool)"),
        ({"hidden": 4.0}, "model.hidden: expected int, got 4.0 (a float)"),
        ({"rate": "fast"}, "model.rate: expected float, got 'fast' (a str); '{}' takes "
                           "rate: float = 0.5"),
        ({"tag": 3}, "model.tag: expected str or None, got 3 (an int)"),
        ({"sizes": [1, "a"]}, "model.sizes: expected list[int], got [1, 'a'] (a list)"),
        ({"pair": [1, 2, 3]}, "model.pair: expected tuple[int, int], got [1, 2, 3] (a list)"),
        ({"mode": "c"}, "model.mode: expected 'a' or 'b', got 'c' (a str)"),
        ({"dims": 3}, "model.dims: expected Sequence[int], got 3 (an int)"),
        ({"depth": 2.5}, "model.depth: expected int, got 2.5 (a float); '{}' takes depth=2 "
                         "(its default's type)"),
        ({"shape": "8x8"}, "model.shape: expected tuple, got '8x8' (a str)"),
        ({"hidden": "x" * 100},  # shortened
         "model.hidden: expected int, got 'xxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxx' (a str)"),
    ],
)  # fmt: skip
def test_a_user_option_of_another_type_than_the_signature_s_is_named_before_the_call(
    user_module, options, message
):
    name = f"{user_module(TYPED_USER_MODEL)}:build"
    with pytest.raises(ModelError) as raised:
        build_model(name, options)
    assert str(raised.value).startswith(message.format(name))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "options",
    [
        {"rate": 1, "scale": 2},  # an int is a float
        {"tag": None, "sizes": [], "pair": [3, 4], "shape": [2, 2], "mode": "b"},
        {"where": "a/path", "dims": [1, 2]},  # a Path is the function's to make from a str
        {"other": "anything"},  # **extra takes it, unchecked
    ],
)
def test_a_user_option_of_the_signature_s_type_reaches_the_call(user_module, options):
    name = f"{user_module(TYPED_USER_MODEL)}:build"
    with pytest.raises(ModelError, match=r"\) raised RuntimeError: called$"):
        build_model(name, options)


def test_the_example_user_model_names_a_wrong_option_on_the_command_line(capsys, monkeypatch):
    from mbtune.cli import main

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))
    argv = ["validate", "experiments/user_model.yaml", "--set", "model.hidden=abc"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "mbtune: error: model.hidden: expected int, got 'abc' (a str); "
        "'experiments.user_model:build' takes hidden: int = 64\n"
    )


def test_validation_does_not_shift_the_callers_rng(user_module):
    name = user_module(
        """
        import torch, torch.nn as nn

        def build():
            return nn.Linear(2, 1), lambda n, d: torch.randn(n, 2), lambda m, b: m(b).mean()
        """
    )
    build_model(f"{name}:build", {}, seed=0)
    after_build = torch.rand(3)
    torch.manual_seed(0)
    nn.Linear(2, 1)  # what building consumed
    assert torch.equal(after_build, torch.rand(3))


# --- activation checkpointing -----------------------------------------------------------

BLOCKS_MODEL = """
import torch, torch.nn as nn

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))

class Net(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x))

def build(width=16, depth=3):
    make_batch = lambda n, d: torch.randn(n, width, dtype=torch.float64, device=d)
    return Net(width, depth).double(), make_batch, lambda m, b: m(b).pow(2).mean()
"""


def _saved_bytes(spec: ModelSpec, batch) -> tuple[int, torch.Tensor]:
    """The loss, and the bytes of the tensors autograd keeps for the backward pass once the
    forward pass is done (each storage once, the parameters not counted)."""
    params = {p.untyped_storage().data_ptr() for p in spec.module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = spec.loss_fn(spec.module, batch)
    return sum(saved.values()), loss


def _checkpointing_pair(name: str, options: dict, n: int):
    """(saved bytes, gradients) without and with activation checkpointing, same weights
    and batch."""
    results = []
    for checkpointing in (False, True):
        spec = build_model(name, options, seed=0, activation_checkpointing=checkpointing)
        torch.manual_seed(1)
        batch = spec.make_batch(n, CPU)
        saved, loss = _saved_bytes(spec, batch)
        loss.backward()
        results.append((saved, _grads(spec.module)))
    return results


def test_gpt_with_checkpointing_keeps_fewer_activations_and_the_same_gradients():
    options = dict(n_layer=4, n_head=2, d_model=16, seq_len=256, vocab_size=64)
    (plain, grads), (checkpointed, grads_ckpt) = _checkpointing_pair("gpt", options, 32)
    # a checkpointed block keeps its input for the recompute (outside autograd's hooks)
    block_inputs = 4 * 32 * 256 * 16 * 4  # n_layer x (n, seq_len, d_model) fp32
    assert checkpointed + block_inputs <= 0.85 * plain
    assert grads.keys() == grads_ckpt.keys()
    for key in grads:
        torch.testing.assert_close(grads_ckpt[key], grads[key], msg=key)


def test_gpt_checkpoints_its_blocks_only_when_asked_and_only_in_training():
    plain = build_model("gpt", {"n_layer": 2})
    assert all("forward" not in vars(block) for block in plain.module.blocks)
    spec = build_model("gpt", {"n_layer": 2}, activation_checkpointing=True)
    assert all("forward" in vars(block) for block in spec.module.blocks)
    batch = spec.make_batch(2, CPU)
    with torch.no_grad():  # an evaluation pass runs the blocks as they are
        assert _saved_bytes(spec, batch)[0] == 0


def test_a_deep_copy_checkpoints_its_own_blocks():
    module = build_model("gpt", {"n_layer": 1}, activation_checkpointing=True).module
    clone = copy.deepcopy(module)
    assert clone.blocks[0].forward.__self__ is clone.blocks[0]


def test_user_model_checkpoints_the_blocks_it_names(user_module):
    name = user_module(BLOCKS_MODEL)
    options = {"width": 32, "depth": 4, "checkpoint_blocks": "Block"}
    (plain, grads), (checkpointed, grads_ckpt) = _checkpointing_pair(f"{name}:build", options, 64)
    assert checkpointed + 4 * 64 * 32 * 8 <= 0.85 * plain  # the blocks' fp64 inputs kept
    for key in grads:
        torch.testing.assert_close(grads_ckpt[key], grads[key], msg=key)


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("mlp", {}, r"^trial\.activation_checkpointing: the built-in model 'mlp' has no blocks to"
         r" checkpoint; turn it off, or measure gpt, an hf: model, or your own model with "
         r"model\.checkpoint_blocks$"),
        ("cnn_bn", {}, r"^trial\.activation_checkpointing: the built-in model 'cnn_bn' has no"),
        ("USER", {}, r"^trial\.activation_checkpointing: user model '.*:build' does not say what "
         r"to checkpoint; set model\.checkpoint_blocks to the class name of its repeated block "
         r"\(its repeated submodules: Block \(x3\)\), or turn checkpointing off$"),
        ("USER", {"checkpoint_blocks": "Blok"}, r"^trial\.activation_checkpointing: "
         r"model\.checkpoint_blocks 'Blok' matches no submodule of '.*:build' \(did you mean "
         r"'Block'\?\); its repeated submodules: Block \(x3\)$"),
        ("USER", {"checkpoint_blocks": ["Block", "Linearr"]}, r"'Linearr' matches no submodule"),
    ],
)  # fmt: skip
def test_checkpointing_a_model_that_cannot_says_how_to_make_it_work(
    user_module, name, options, match
):
    if name == "USER":
        name = f"{user_module(BLOCKS_MODEL)}:build"
    with pytest.raises(ModelError, match=match):
        build_model(name, options, activation_checkpointing=True)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("Blok", r"^model\.checkpoint_blocks: model\.checkpoint_blocks 'Blok' matches no "
         r"submodule of '.*:build' \(did you mean 'Block'\?\)"),
        (3, r"^model\.checkpoint_blocks: must be the class name of the model's repeated block "
         r"\(e\.g\. Block\), or a list of class names, got 3$"),
        ([], r"^model\.checkpoint_blocks: must be the class name"),
        ("my.Block", r"^model\.checkpoint_blocks: must be the class name"),
    ],
)  # fmt: skip
def test_checkpoint_blocks_is_checked_even_when_checkpointing_is_off(user_module, value, match):
    # a search may turn checkpointing on for some trials: a typo fails when the model is built
    name = user_module(BLOCKS_MODEL)
    with pytest.raises(ModelError, match=match):
        build_model(f"{name}:build", {"checkpoint_blocks": value})


def test_checkpoint_blocks_is_not_passed_to_the_users_function(user_module):
    name = user_module(BLOCKS_MODEL)  # build() takes no checkpoint_blocks
    spec = build_model(f"{name}:build", {"checkpoint_blocks": "Block", "depth": 2})
    assert len(spec.module.blocks) == 2
    assert all("forward" not in vars(block) for block in spec.module.blocks)
