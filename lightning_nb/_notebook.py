"""Whether the code runs in a notebook kernel, and what follows from it: where a person waits, they see it.

Every wait of the kit (``algo.wait()``, ``algo.pause()``, ``algo.step()``, ``store.wait_for_rollouts()``) takes
``progress=None`` by default: :func:`show_progress` turns that into a bar in a notebook kernel (the cell's own
thread) and none in a script, while ``progress=True``/``False`` is honoured as given. :func:`info_line` is a
notice that is news but no problem (a runner group replaced on a cell's re-run): a plain line under the cell in
a kernel, a log record (INFO) everywhere.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Optional

__all__ = ["in_kernel", "show_progress", "info_line"]


def in_kernel() -> bool:
    """True inside an IPython kernel (Jupyter, JupyterLab, VS Code, Colab: ipykernel's ``ZMQInteractiveShell`` or a
    subclass of it); False in a script, a terminal IPython or a test. Imports nothing: IPython is only asked
    when it is already loaded."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if get is not None else None
    return shell is not None and any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)


def show_progress(progress: Optional[bool]) -> bool:
    """Whether a wait shows its bar: ``progress`` as given when True or False; None (the default of every wait):
    yes in a notebook kernel on the thread that runs the cells (a background loop's own waits show nothing),
    no in a script."""
    if progress is None:
        return in_kernel() and threading.current_thread() is threading.main_thread()
    return bool(progress)


def info_line(message: str, logger: logging.Logger) -> None:
    """``message`` as news that needs nothing done: logged at INFO on ``logger``, and printed as a plain line
    under the running cell when called from a notebook kernel's cell thread (no warning box)."""
    logger.info("%s", message)
    if show_progress(None):
        print(message, flush=True)
