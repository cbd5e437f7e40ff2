"""``python -m mbtune.trial``: one trial in a process of its own, for the search.

Reads a pickled :class:`~mbtune.trial.trial.TrialRequest` on stdin (from
mbtune.trial.launch, in the search's own trial actor) and prints the result (with the
objective) as one JSON line on stdout. With ``--phase-fd N``, writes each phase to file
descriptor N as it happens (mbtune.progress).
"""

from __future__ import annotations

import json
import pickle
import sys

from mbtune.progress import PHASE_FD_FLAG, phase_writer
from mbtune.trial.trial import TrialRequest, trial_metrics


def main() -> int:
    request: TrialRequest = pickle.load(sys.stdin.buffer)
    on_phase = None
    if PHASE_FD_FLAG in sys.argv:
        on_phase = phase_writer(int(sys.argv[sys.argv.index(PHASE_FD_FLAG) + 1]))
    metrics = trial_metrics(
        request.experiment, request.config, repeat=request.repeat, on_phase=on_phase
    )
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
