"""torchrun's agent with its own output kept in a file: what launch.py runs as torchrun.

torchrun prints its log lines and, when a worker fails or a signal stops it, a report of 30 to
40 lines (a `ChildFailedError` or `SignalException` traceback) after everything its workers
said: the last lines on the screen were torchrun's, not the training's. Here torchrun runs as
`python -m torch.distributed.run` runs it, its workers writing where they always did, while
what torchrun itself writes goes to the file launch.py names (launch.py then says the gist of
it and keeps it in the run directory).

`python -m <package>.cluster.agent REPORT [torchrun options] ENTRY [arguments]`; exit status 1
when torchrun fails, as torchrun's.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path


def main(argv: list[str]) -> int:
    report_path, arguments = Path(argv[0]), argv[1:]
    with report_path.open("a", buffering=1) as report:
        # Before torch is imported: its log handler writes to the sys.stderr of that moment. The
        # workers, other processes, keep this process's standard error.
        sys.stderr = report
        from torch.distributed import run as torchrun

        try:
            torchrun.main(arguments)
        except Exception:  # a worker failed, a signal stopped torchrun, the rendezvous failed
            traceback.print_exc(file=report)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
