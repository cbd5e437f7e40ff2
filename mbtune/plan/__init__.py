"""The plan of the real run: a run's trials fitted to a model of the step (the compute
of a micro-batch, the collectives of the gradients over two tiers of links), and from it,
for the device counts the user will rent, the best configuration, its samples/s, time to
train, device-hours and cost, each with a 90% interval (``mbtune plan``; docs/plan.md).

May import: mbtune.errors, mbtune.lattice, mbtune.config, mbtune.runs, mbtune.report, and
mbtune.models inside :func:`~mbtune.plan.model_bytes.gradient_bytes` alone (the one place
torch is imported, lazily: the model counted on the meta device). The fit is pure: numpy
and scipy.
"""

from mbtune.plan.fit import StepModel, fit_step_model, observations
from mbtune.plan.load import load_plan, plan_run
from mbtune.plan.planner import Interval, Plan, PlanRow, make_plan, plan_lines

__all__ = [
    "Interval",
    "Plan",
    "PlanRow",
    "StepModel",
    "fit_step_model",
    "load_plan",
    "make_plan",
    "observations",
    "plan_lines",
    "plan_run",
]
