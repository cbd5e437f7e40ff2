"""One trial: a configuration measured for real (or answered from a table).

Owns the trial protocol (build, precision, FLOPs, compile, warm-up, timed steps), the one
measurement loop for one process and for every ``ddp`` rank, precision, memory and out of
memory as a result, FLOPs and MFU, the replay backend, halving on out of memory, timeouts,
and the process boundary a trial runs behind (``python -m mbtune.trial``, or a Ray Train
run for ``parallel: ddp``).

May import: mbtune.errors, mbtune.lattice, mbtune.config, mbtune.models, mbtune.progress,
mbtune.cluster. Imports torch and Ray where it uses them, never at import time.
"""
