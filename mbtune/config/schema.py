"""The experiment's sections: frozen keyword-only dataclasses, each rule in its class.

Every choice is a ``Literal``, every default is stated once (on its field) and every rule
runs in ``__post_init__``: a section built in code refuses what the YAML refuses, with the
same one-line :class:`~mbtune.config.rules.ConfigError`. mbtune.config.load only turns YAML into
these types; mbtune.config.experiment joins them into an Experiment. Here: ``model:``,
``ray:`` and ``plan:``; the others in modules of their own: ``train_input:``
(mbtune.config.train_input), ``search:`` (mbtune.config.search) and ``trial:``
(mbtune.config.trial).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mbtune.config.model_options import (
    MODEL_OPTIONS,
    check_model_name,
    check_options,
    hf_model_type,
    split_hf_options,
    split_user_options,
)
from mbtune.config.rules import (
    SIZE,
    ConfigError,
    check_fields,
    check_number,
    memory,
    number,
    show,
)

__all__ = [
    "BUILTIN_MODELS",
    "INTER_NODE",
    "INTRA_NODE",
    "LinkTier",
    "ModelConfig",
    "PlanConfig",
    "RayConfig",
]

BUILTIN_MODELS = tuple(MODEL_OPTIONS)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model a trial builds: ``model:``."""

    name: str
    """``gpt``, ``mlp``, ``cnn_bn``, ``hf:<model_type>`` for a Hugging Face transformers
    model, or ``package.module:function`` for a user model."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Model-specific keys (every key under ``model:`` but ``name``), checked without
    building the model: a built-in's options, mbtune's own keys of the others."""

    def __post_init__(self) -> None:
        check_fields(self, "model")
        check_model_name(self.name)
        if not isinstance(self.options, Mapping):
            raise ConfigError("model", f"options must be a mapping, got {show(self.options)}")
        if self.is_builtin:
            check_options(self.name, self.options)
        elif hf_model_type(self.name) is not None:
            split_hf_options(self.options)  # the model type and the config's keys: when built
        else:
            split_user_options(self.options)

    @property
    def is_builtin(self) -> bool:
        return self.name in BUILTIN_MODELS


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """Where trials run: ``ray:``."""

    address: str | None = None
    """None: start an embedded local Ray (or join RAY_ADDRESS, as ray.init does); ``auto``
    or ``host:port`` (the head's GCS port): join a cluster. ``ray://`` is refused."""
    dashboard: bool = False
    """Start the Ray dashboard on 127.0.0.1 and print its URL."""
    cpus_per_trial: float = number(1.0, minimum=0.0)
    """CPUs of one trial. With ``trial.parallel: ddp``: of each of its num_devices workers
    (the trial itself, which only waits for them, takes none)."""
    gpus_per_trial: float | None = number(None, minimum=0.0)
    """GPUs of one trial; with ``trial.parallel: ddp``, of each worker (a whole number).
    None: one where ``trial.device`` is cuda, else none (``Experiment.gpus_per_trial``)."""
    max_concurrent_trials: int = number(1)
    """Trials run at once."""
    resource_wait_s: float = number(120.0, minimum=0.0)
    """On a cluster: how long the search waits, once the cluster no longer has what one
    trial needs (its nodes with them went away), for them to come back (an autoscaler's
    replacement node); then it stops, as an interrupted search that ``--resume`` continues."""

    def __post_init__(self) -> None:
        check_fields(self, "ray")


@dataclass(frozen=True, kw_only=True)
class LinkTier:
    """One tier of the planned cluster's links: ``plan.intra_node`` or ``plan.inter_node``
    (its errors name its own keys, under the tier that holds it). A field left unset takes
    the tier's default (:data:`INTRA_NODE`, :data:`INTER_NODE`; docs/plan.md says where
    they come from)."""

    bandwidth: int | None = memory()
    """Bytes/s (YAML: ``370GB`` or bytes). intra_node: the all-reduce bus bandwidth one
    node reaches (nccl-tests' busbw); inter_node: each device's own bandwidth off the node
    (its NIC): a ring across nodes runs at the slower of intra_node and devices_per_node x
    this."""
    latency_us: float | None = number(None, minimum=0.0)
    """Latency of one hop of the ring, in microseconds."""
    uncertainty: float | None = number(None, minimum=0.0, maximum=3.0)
    """The sd of the log of the bandwidth and of the latency (0.3: about 30%): how far the
    real link may be from these figures. The plan draws the link from it."""

    def __post_init__(self) -> None:
        check_fields(self, "")

    def resolved(self, default: LinkTier) -> tuple[float, float, float]:
        """(bytes/s, latency in seconds, uncertainty), each unset field from ``default``."""
        bandwidth = self.bandwidth if self.bandwidth is not None else default.bandwidth
        latency_us = self.latency_us if self.latency_us is not None else default.latency_us
        spread = self.uncertainty if self.uncertainty is not None else default.uncertainty
        return float(bandwidth or 0), float(latency_us or 0) / 1e6, float(spread or 0)


INTRA_NODE = LinkTier(bandwidth=370 * 10**9, latency_us=5.0, uncertainty=0.3)
"""One node of 8 H100 SXM on NVLink: the ring all-reduce's bus bandwidth nccl-tests
reports there, about 370 GB/s (docs/plan.md cites the published figures)."""
INTER_NODE = LinkTier(bandwidth=45 * 10**9, latency_us=10.0, uncertainty=0.3)
"""One 400 Gb/s InfiniBand NIC per device (50 GB/s line rate) at the 85-95% of line
rate published nccl-tests runs reach across nodes (docs/plan.md)."""


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """The real run to plan: ``plan:`` (optional; ``mbtune plan RUN_DIR``)."""

    samples: float | None = number(None, positive=True)
    """Samples the real run trains on (give one of samples, tokens, steps)."""
    tokens: float | None = number(None, positive=True)
    """Tokens the real run trains on: samples = tokens / the tokens of one sample, which
    the run's trials counted (a model with a seq_len)."""
    steps: int | None = number(None)
    """Optimizer steps of the real run: samples = steps x each configuration's batch_size."""
    num_devices: tuple[int, ...] = (8, 64, 256)
    """The device counts to plan for."""
    batch_size: int | None = number(None)
    """The global batch of the real run, at every planned device count (the micro-batch
    sizes those of the run's space); None: the run's own (its space's). A larger one plans
    device counts the run's batch cannot be split over."""
    devices_per_node: int = number(8)
    """Devices in one node: a device count above it crosses the inter-node tier."""
    price_per_device_hour: float | None = number(None, minimum=0.0, maximum=1e6)
    """The price of one device for one hour, in your currency; None: no cost."""
    max_slowdown: float = number(0.10, minimum=0.0, maximum=100.0)
    """"The cheapest within 10% of the fastest": 0.10."""
    intra_node: LinkTier = LinkTier()
    """The links within a node (see LinkTier; unset fields: INTRA_NODE)."""
    inter_node: LinkTier = LinkTier()
    """The links between nodes (see LinkTier; unset fields: INTER_NODE)."""
    nccl_tests: tuple[Path, ...] = ()
    """nccl-tests ``all_reduce_perf`` outputs to read the tiers from (YAML: a path or a
    list, relative to the experiment file): one run within a node gives intra_node, one
    across nodes inter_node (its bus bandwidth over the devices of a node). A tier's own
    keys win over what a file says."""

    def __post_init__(self) -> None:
        check_fields(self, "plan")
        given = [k for k in ("samples", "tokens", "steps") if getattr(self, k) is not None]
        if not given:
            raise ConfigError(
                "plan",
                "give one of samples, tokens or steps: how much the real run trains "
                "(e.g. --set plan.samples=1e9)",
            )
        if len(given) > 1:
            raise ConfigError(
                f"plan.{given[1]}",
                f"give one of samples, tokens or steps, not {' and '.join(given)}",
            )
        where = "plan.num_devices"
        if not isinstance(self.num_devices, tuple) or not self.num_devices:
            raise ConfigError(
                where, f"expected a list of device counts, got {show(self.num_devices)}"
            )
        for item in self.num_devices:
            check_number(item, where, SIZE, integer=True)
        paths = self.nccl_tests
        if not isinstance(paths, tuple) or not all(
            isinstance(p, Path) and str(p) and "\0" not in str(p) for p in paths
        ):
            raise ConfigError(
                "plan.nccl_tests",
                f"expected a path or a list of paths of nccl-tests outputs, got {show(paths)}",
            )
        for key in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, key), LinkTier):
                raise ConfigError(
                    f"plan.{key}", f"expected a LinkTier, got {show(getattr(self, key))}"
                )

    def links(self) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """(intra-node, inter-node) tiers resolved: (bytes/s, latency s, uncertainty)."""
        return self.intra_node.resolved(INTRA_NODE), self.inter_node.resolved(INTER_NODE)
