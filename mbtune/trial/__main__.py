"""``python -m mbtune.trial``: a trial's process of its own, for the search.

``python -m mbtune.trial --warm FD MODULE...``: the warm parent of a trial actor
(mbtune.trial.warm), which imports the modules once and forks a child per trial;
``--warm-ahead FD PID MODULE...``: one started by the search's driver (PID) before its
actor, which finds it on the listening socket FD's name.

``python -m mbtune.trial``: one trial, cold (where the actor has no warm parent). Reads a
pickled :class:`~mbtune.trial.trial.TrialRequest` on stdin (from mbtune.trial.launch, in
the search's own trial actor) and prints the result (with the objective) as one JSON line
on stdout. With ``--phase-fd N``, writes each phase to file descriptor N as it happens
(mbtune.progress).
"""

from __future__ import annotations

import pickle
import sys

from mbtune.progress import PHASE_FD_FLAG
from mbtune.trial.trial import TrialRequest
from mbtune.trial.warm import AHEAD_FLAG, WARM_FLAG, answer, serve, serve_ahead


def main() -> int:
    if sys.argv[1:2] == [WARM_FLAG]:
        return serve(int(sys.argv[2]), sys.argv[3:])
    if sys.argv[1:2] == [AHEAD_FLAG]:
        return serve_ahead(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    request: TrialRequest = pickle.load(sys.stdin.buffer)
    phase_fd = None
    if PHASE_FD_FLAG in sys.argv:
        phase_fd = int(sys.argv[sys.argv.index(PHASE_FD_FLAG) + 1])
    answer(request, phase_fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
