"""The file the elastic agent logs to, which never fails the run it records."""

from __future__ import annotations

import contextlib
import logging


class LogFileThatNeverFailsTheRun(logging.FileHandler):
    """On a full disk its writes fail, and logging's own report of each (a traceback per record on
    stderr) and the flush as it closed (an exception in the launcher's clean-up) hid the failure
    the run stopped for: the records that cannot be written are dropped, and paratrain's own line
    names the cause."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            super().close()
