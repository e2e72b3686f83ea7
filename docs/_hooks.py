"""MkDocs hook (mkdocs.yml ``hooks:``): lets one known docstring form through ``mkdocs build --strict``.

Griffe (mkdocstrings' Python parser) warns on an ``Args:`` entry that documents several parameters at once
(``temperature, api_key, timeout_s: ...`` or ``train_tasks / val_tasks: ...``), which our Google-style docstrings
use on purpose: it reads it as one parameter named ``"a, b"`` and warns that it has no annotation and is not in
the signature. Those warnings are let through here by exact pattern, and tests/test_docs.py checks instead that
each name of such an entry is a real parameter, so a renamed parameter is still caught. Every other warning still
fails the strict build.
"""

from __future__ import annotations

import logging
import re

_GROUPED = re.compile(r"(No type or annotation for parameter|Parameter) '[^']*(, | / )[^']*'"
                      r"( does not appear in the function signature)?$")


class _KnownDocstringForms(logging.Filter):
    """Demote the grouped-parameter warnings to INFO (still in ``mkdocs build --verbose``); let everything else
    through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING:
            if _GROUPED.search(record.getMessage()):
                record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def on_startup(command: str, dirty: bool) -> None:
    """Install the filter on the logger griffe writes to inside MkDocs (``mkdocs.plugins.griffe``)."""
    logger = logging.getLogger("mkdocs.plugins.griffe")
    if not any(isinstance(f, _KnownDocstringForms) for f in logger.filters):
        logger.addFilter(_KnownDocstringForms())
