"""A split trial's rank materialises only what it keeps, with the whole model's values.

A rank of a tensor- or pipeline-parallel trial builds the whole model on torch's meta device
(no memory), makes its stages, shards and places them there (mbtune.trial.parallelize, in
torchtitan's order), gives them memory with ``to_empty`` and only then initialises them
(:func:`initialise_kept`): its host never holds the whole model, only its stages' shards and
one parameter whole at a time (an 8-rank node held 8 whole copies before).

The values are the one-process model's of the same seed, exactly: the whole model's own
initialisation (``ParallelParts.init``) runs on the meta model, in its own order, under a
dispatch mode (:class:`_KeptWrites`) that redirects every write to a parameter or buffer:

- one the rank keeps is written into a scratch tensor of the whole parameter (as the whole
  model's own parameter would be), and its value goes to each stage's copy of it (a tied
  embedding and head on one rank: both), cut to the rank's shard where the copy is a
  DTensor (tensor parallelism, FSDP2), when the init moves on to another parameter;
- a random fill of one it does not keep is drawn into a scratch of the same shape and
  dropped, so torch's RNG stream advances as the whole build's did.

Why the stream's order and not a seed derived from each parameter's name: a seed per name
would give other weights than the model's own init in one process (the quickstart's figures,
a Hugging Face model's init), so no trial would match its one-process loss; replaying the
stream costs the whole model's init time on each rank (seconds for a 7B model's random
fills on one core), not its memory.

What an init must do to be replayed: write its parameters in place (torch.nn.init's fills,
``fill_``, ``copy_`` from a real tensor); a write whose value comes from another meta tensor
(``w.copy_(w * 2)``) cannot be, and raises. torch.nn.init's functions that skip meta tensors
(trunc_normal_, orthogonal_, sparse_, dirac_) are run on a CPU scratch during the replay
(:data:`SKIP_META`), else they would draw nothing where the whole build drew. A model whose init
is not offered (``ParallelParts.init`` None: a user model) is built whole on the CPU instead
and its stages copy it (mbtune.trial.parallelize.rank_spec): exact too, for its memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from mbtune.trial.tracking import to_empty_tied

__all__ = ["initialise_kept", "source_name"]

RANDOM_FILLS = frozenset(
    ["normal_", "uniform_", "random_", "bernoulli_", "exponential_", "log_normal_", "cauchy_",
     "geometric_"]
)  # fmt: skip
"""In-place random fills (aten): each draws from torch's RNG as many values as its target
holds."""

SKIP_META = ("_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_")
"""torch.nn.init's functions that return at once on a meta tensor (torch 2.13): on the CPU
they write, and all but dirac_ draw (trunc_normal_ through this helper), so the replay runs
them on a CPU scratch (:func:`_drawn_on_the_cpu`)."""

_OVERWRITES = RANDOM_FILLS | {"fill_", "zero_", "copy_"}
"""In-place writes that set every element of their target (nothing of it read)."""


def initialise_kept(
    whole: Any, stages: Sequence[Any], init: Callable[[Any], None], device: Any, *, seed: int
) -> None:
    """Give ``stages`` (built from ``whole`` on the meta device, sharded and placed there;
    each with ``copied_from``: its module paths -> the whole model's) memory on ``device``
    and the values ``init(whole)`` gives the whole model after ``torch.manual_seed(seed)``."""
    import torch

    for stage in stages:
        to_empty_tied(stage, device)
    targets: dict[int, list[Any]] = {}
    names: dict[int, str] = {}
    for stage in stages:
        for name, tensor in _tensors(stage):
            source = source_name(name, stage.copied_from)
            key = _key(_whole_tensor(whole, source))
            names.setdefault(key, source)  # a tied weight: its first name
            held = targets.setdefault(key, [])
            if all(t is not tensor for t in held):  # a weight tied inside a stage: once
                held.append(tensor)
    torch.manual_seed(seed)
    writes = _KeptWrites(targets, {key: _whole_tensor(whole, n) for key, n in names.items()})
    with torch.no_grad():
        with writes, _drawn_on_the_cpu():
            init(whole)
        writes.flush()
    unset = sorted(names[key] for key in targets if key not in writes.written)
    if unset:
        raise RuntimeError(
            f"the model's init left {', '.join(unset[:3])} unset: the rank cannot give its "
            "stages the one-process model's values"
        )


def source_name(name: str, copied_from: Mapping[str, str]) -> str:
    """The whole model's name of a stage's parameter or buffer ``name``: the stage module it
    is in is a copy of the whole model's module at ``copied_from``'s path for it."""
    for path in sorted(copied_from, key=len, reverse=True):
        if name == path or name.startswith(path + "."):
            return copied_from[path] + name[len(path) :]
    raise KeyError(f"{name}: no part of the stage is a copy of the model's")


@contextlib.contextmanager
def _drawn_on_the_cpu() -> Iterator[None]:
    """torch.nn.init's fills that do nothing on a meta tensor (:data:`SKIP_META`), made to
    draw as on the CPU: each fills a CPU scratch of the tensor's shape and copies it in (a
    write the replay redirects, or drops where the rank does not keep the tensor), so they
    advance torch's RNG as the whole build's did. Only through ``torch.nn.init``'s module:
    a reference to one of them taken before (``from torch.nn.init import orthogonal_``)
    still skips (trunc_normal_ is caught through its module's helper whatever the
    reference)."""
    import torch
    import torch.nn.init as init

    saved = {name: getattr(init, name) for name in SKIP_META}

    def drawn(original: Callable) -> Callable:
        def fill(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not tensor.is_meta:
                return original(tensor, *args, **kwargs)
            scratch = _real_like(tensor)
            original(scratch, *args, **kwargs)
            with torch.no_grad():
                tensor.copy_(scratch)
            return tensor

        return fill

    for name, original in saved.items():
        setattr(init, name, drawn(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(init, name, original)


def _tensors(stage: Any) -> Iterator[tuple[str, Any]]:
    yield from stage.named_parameters(remove_duplicate=False)
    yield from stage.named_buffers(remove_duplicate=False)


def _whole_tensor(whole: Any, name: str) -> Any:
    module, _, attr = name.rpartition(".")
    owner = whole.get_submodule(module)
    tensor = getattr(owner, attr)
    if not tensor.is_meta or tensor.storage_offset() or not tensor.is_contiguous():
        raise RuntimeError(f"{name}: expected the whole model's own tensor on the meta device")
    return tensor


def _key(tensor: Any) -> int:
    """One parameter's storage (its views', and a tied weight's other name's, too)."""
    return tensor.untyped_storage()._cdata


def _writes_in_place(func: Any) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


class _KeptWrites:
    """A dispatch mode over the whole model's init on the meta device: writes to the kept
    tensors go to a scratch of the whole tensor, one at a time, then to the stages' copies;
    random fills of the others are drawn and dropped (the module's docstring)."""

    def __init__(self, targets: dict[int, list[Any]], wholes: dict[int, Any]) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                return outer.dispatch(func, args, kwargs or {})

        self.mode = Mode()
        self.targets, self.wholes = targets, wholes
        self.written: set[int] = set()
        self.scratch: tuple[int, Any] | None = None

    def __enter__(self) -> _KeptWrites:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        import torch

        target = args[0] if args else None
        if not (isinstance(target, torch.Tensor) and target.is_meta and _writes_in_place(func)):
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        key = _key(target)
        if key not in self.targets:  # not kept: only the RNG's stream matters
            if name in RANDOM_FILLS:
                func(_real_like(target), *args[1:], **kwargs)
            return target
        rest = args[1:]
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in (*rest, *kwargs.values())):
            raise RuntimeError(
                f"aten.{name}: the model's init writes a value computed on the meta device "
                "into a parameter; it cannot be replayed on the rank's share"
            )
        whole = self._scratch(key, target, overwrites=name in _OVERWRITES)
        view = whole.as_strided(target.size(), target.stride(), target.storage_offset())
        func(view, *rest, **kwargs)
        self.written.add(key)
        return target

    def _scratch(self, key: int, target: Any, *, overwrites: bool) -> Any:
        """The whole tensor ``key`` as the init has written it so far (written back to
        the stages and dropped when the init moves to another tensor)."""
        import torch

        if self.scratch is not None and self.scratch[0] == key:
            return self.scratch[1]
        self.flush()
        meta = self.wholes[key]
        whole_view = (meta.shape, meta.stride(), 0)
        covers = (target.shape, target.stride(), target.storage_offset()) == whole_view
        if key in self.written and not (overwrites and covers):
            whole = _gathered(self.targets[key][0])  # written before, read now: rebuilt
        else:
            whole = torch.empty(meta.shape, dtype=meta.dtype)
        self.scratch = (key, whole)
        return whole

    def flush(self) -> None:
        """The scratch's value into every stage copy of it, each its own shard."""
        if self.scratch is None:
            return
        key, whole = self.scratch
        self.scratch = None
        for tensor in self.targets[key]:
            _assign(tensor, whole)


def _real_like(tensor: Any) -> Any:
    """A CPU tensor of ``tensor``'s shape, strides and dtype (a random fill of it draws as
    many values, in the same order, as one of the meta tensor would have)."""
    import torch

    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype)


def _assign(tensor: Any, whole: Any) -> None:
    """``whole``'s value into ``tensor``: all of it, or a DTensor's shard of it (each rank
    cuts its own: no collective)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(tensor, DTensor):
        mine = distribute_tensor(
            whole.to(tensor.device), tensor.device_mesh, tensor.placements, src_data_rank=None
        )
        tensor.to_local().copy_(mine.to_local())
    else:
        tensor.copy_(whole)


def _gathered(tensor: Any) -> Any:
    """A stage copy's whole value on the CPU (a DTensor's gathered from its shards: every
    rank of its mesh replays the same init, so each gathers here too)."""
    from torch.distributed.tensor import DTensor

    value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return value.detach().to("cpu", copy=True)
