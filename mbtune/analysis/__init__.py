"""A finished run analysed: ranking, pivots, the spread of repeats, two runs compared,
the plots (the plan's too), the exports to other frameworks' configuration, and ``mbtune
analyze``; and a run followed while it is written (``mbtune watch``).

May import: mbtune, mbtune.errors, mbtune.lattice, mbtune.config, mbtune.runs,
mbtune.report, mbtune.plan. Pure: no torch, no ray (but for the model's bytes that
``mbtune analyze`` counts, through mbtune.plan, to plan a run).
"""
