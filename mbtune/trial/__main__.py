"""``python -m mbtune.trial``: a trial's process of its own, for the search.

``python -m mbtune.trial --warm FD MODULE...``: the warm parent of a trial actor
(mbtune.trial.warm), which imports the modules once and forks a child per trial.

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
from mbtune.trial.warm import WARM_FLAG, answer, serve


def main() -> int:
    if sys.argv[1:2] == [WARM_FLAG]:
        return serve(int(sys.argv[2]), sys.argv[3:])
    request: TrialRequest = pickle.load(sys.stdin.buffer)
    phase_fd = None
    if PHASE_FD_FLAG in sys.argv:
        phase_fd = int(sys.argv[sys.argv.index(PHASE_FD_FLAG) + 1])
    answer(request, phase_fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
