"""Tests for mbtune.models.batch: a micro-batch keeps the form of the batch it is cut from."""

import collections
from collections import UserDict

import pytest
import torch

from mbtune.models.batch import batch_tensors, num_samples, slice_batch

Pair = collections.namedtuple("Pair", "x y")
X, Y = torch.arange(10).view(5, 2), torch.arange(5)


@pytest.mark.parametrize(
    ("batch", "form"),
    [
        (X, torch.Tensor),
        ((X, Y), tuple),
        ([X, Y], list),
        ({"x": X, "y": Y}, dict),
        (Pair(X, Y), Pair),
        (UserDict(x=X, y=Y), UserDict),  # as transformers' BatchEncoding
    ],
    ids=["tensor", "tuple", "list", "dict", "namedtuple", "mapping"],
)
def test_a_slice_keeps_the_form_and_takes_the_same_rows_of_every_tensor(batch, form):
    part = slice_batch(batch, 1, 4)
    assert type(part) is form
    assert num_samples(part) == 3
    assert [t.tolist() for t in batch_tensors(part)] == [
        t[1:4].tolist() for t in batch_tensors(batch)
    ]


def test_a_mapping_keeps_its_keys_in_order():
    assert list(slice_batch({"b": X, "a": Y}, 0, 2)) == ["b", "a"]


def test_a_slice_is_a_view():
    assert slice_batch({"x": X}, 1, 3)["x"].data_ptr() == X[1:].data_ptr()


@pytest.mark.parametrize(("start", "stop"), [(2, 2), (-1, 2), (3, 6), (4, 1)])
def test_an_empty_or_out_of_range_slice_is_refused(start, stop):
    with pytest.raises(ValueError, match=r"^slice_batch: need 0 <= start < stop <= 5 \(the batch"):
        slice_batch({"x": X}, start, stop)


def test_the_module_does_not_import_torch(light_imports):
    loaded = light_imports.loaded("batch")  # conftest.LIGHT_IMPORTS: the module imported
    assert "torch" not in loaded, loaded
