"""What the measurements say: the search model (a Gaussian process over log throughput),
the confidence score it gives, and the recommendation after each finished trial with the
end-of-run summary's numbers (``mbtune.report`` says them in words).

May import: mbtune.errors, mbtune.lattice, mbtune.comm, mbtune.config, mbtune.runs,
mbtune.report.
Pure: no torch, no ray.
"""
