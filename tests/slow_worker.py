"""`kvfleet worker` whose every model forward takes at least STEP_S more, for tests/integration/test_abandoned_requests.py:
the real worker, with generations slow enough to outlast a lease TTL on the tiny model.

    python tests/slow_worker.py --model DIR --worker-id W [kvfleet worker flags]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEP_S = 0.03


def install() -> None:
    from gpu_worker.executor.model_runner import ModelRunner

    execute = ModelRunner.execute

    def slow_execute(self, sched):
        time.sleep(STEP_S)
        return execute(self, sched)

    ModelRunner.execute = slow_execute


if __name__ == "__main__":
    install()
    from services.cli import main

    sys.exit(main(["worker", *sys.argv[1:]]))
