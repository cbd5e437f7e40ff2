"""A link tier read from an nccl-tests ``all_reduce_perf`` output (``plan.nccl_tests``).

nccl-tests prints the ranks it ran (``#  Rank  0 Group  0 Pid 313 on HOST device 0 ...``),
then a header naming its columns (``size count type redop root time algbw busbw #wrong``,
out-of-place then in-place; older versions have no ``root``) and one row per buffer size.
The tier's bandwidth is the out-of-place bus bandwidth at the largest size; its latency per
hop the smallest size's time over the ring's 2 (n - 1) hops (a rough figure: NCCL runs
small buffers on other algorithms). One host: the intra-node tier. Several: the
inter-node tier, whose bandwidth is each device's own, the bus bandwidth over a node's
devices (mbtune.plan.fit's ring across nodes runs at k x that).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from mbtune.config.rules import ConfigError
from mbtune.config.schema import PlanConfig

__all__ = ["MEASURED_UNCERTAINTY", "NcclTier", "plan_links", "read_nccl_tests"]

_RANK = re.compile(r"^#\s*Rank\s+\d+\b.*?\bon\s+(\S+)\s+device\b")
_WHERE = "plan.nccl_tests"


@dataclass(frozen=True, kw_only=True)
class NcclTier:
    """What one nccl-tests output says about a tier."""

    path: Path
    tier: str
    """``intra_node`` (one host) or ``inter_node`` (several)."""
    bandwidth: float
    """Bytes/s: the tier's bandwidth as mbtune.config.schema.LinkTier means it."""
    latency_s: float
    ranks: int
    hosts: int


def read_nccl_tests(path: Path) -> NcclTier:
    """The tier ``path`` measured (see the module's docstring); a file that holds no
    all_reduce_perf results is a one-line error naming ``plan.nccl_tests``."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ConfigError(_WHERE, f"cannot read {str(path)}: {e.strerror}") from None
    hosts: Counter[str] = Counter()
    columns: list[str] | None = None
    rows: list[tuple[int, float, float]] = []  # (size in bytes, time in us, busbw in GB/s)
    for line in text.splitlines():
        rank = _RANK.match(line.strip())
        if rank:
            hosts[rank[1]] += 1
            continue
        tokens = line.split()
        if line.lstrip().startswith("#"):
            named = line.lstrip("# \t").split()
            if columns is None and "busbw" in named and "size" in named:
                columns = named
            continue
        if columns is None or len(tokens) < len(columns) or not tokens[0].isdigit():
            continue
        try:
            rows.append((
                int(tokens[columns.index("size")]),
                float(tokens[columns.index("time")]),
                float(tokens[columns.index("busbw")]),
            ))  # fmt: skip
        except ValueError:
            continue  # a line that only looks like a row (a warning with a number first)
    if not rows or not hosts:
        raise ConfigError(
            _WHERE,
            f"{str(path)} holds no all_reduce_perf results (its '# Rank ... on HOST' "
            "lines and a table of size, time, busbw); give the output of nccl-tests' "
            "all_reduce_perf",
        )
    ranks = sum(hosts.values())
    largest = max(rows)
    smallest = min(rows)
    hops = max(1, 2 * (ranks - 1))
    bus = largest[2] * 1e9
    if len(hosts) == 1:
        tier, bandwidth = "intra_node", bus
    else:
        tier, bandwidth = "inter_node", bus / max(hosts.values())
    if not bandwidth > 0:
        raise ConfigError(_WHERE, f"{str(path)}: the bus bandwidth at the largest size is 0")
    return NcclTier(
        path=Path(path),
        tier=tier,
        bandwidth=bandwidth,
        latency_s=smallest[1] * 1e-6 / hops,
        ranks=ranks,
        hosts=len(hosts),
    )


MEASURED_UNCERTAINTY = 0.1
"""The uncertainty of a tier read from nccl-tests, where the tier sets none: the spread
of one cluster's all-reduce over runs and days, smaller than the defaults' 0.3 spread
between clusters."""


def plan_links(plan: PlanConfig) -> tuple[tuple[tuple[float, float, float], ...], list[str]]:
    """The two tiers (bytes/s, latency s, uncertainty): a tier's own keys, else what an
    nccl-tests output says of it, else the defaults; and the sentences naming the files."""
    intra, inter = plan.links()
    tiers = {"intra_node": intra, "inter_node": inter}
    read: dict[str, Path] = {}
    sources = []
    for path in plan.nccl_tests:
        found = read_nccl_tests(path)
        if found.tier in read:
            raise ConfigError(
                "plan.nccl_tests",
                f"{read[found.tier].name} and {path.name} both measured the {found.tier} "
                "tier; give one output per tier (one node, and several)",
            )
        read[found.tier] = path
        own = getattr(plan, found.tier)
        tiers[found.tier] = (
            float(own.bandwidth) if own.bandwidth is not None else found.bandwidth,
            own.latency_us / 1e6 if own.latency_us is not None else found.latency_s,
            own.uncertainty if own.uncertainty is not None else MEASURED_UNCERTAINTY,
        )
        sources.append(
            f"plan.{found.tier} from nccl-tests {path.name} ({found.ranks} ranks on "
            f"{found.hosts} host{'s' * (found.hosts > 1)}: {found.bandwidth / 1e9:,.1f} GB/s, "
            f"{found.latency_s * 1e6:,.1f} us a hop)"
        )
    return (tiers["intra_node"], tiers["inter_node"]), sources
