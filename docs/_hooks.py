"""MkDocs hook (mkdocs.yml ``hooks:``): lets two known docstring forms through ``mkdocs build --strict``.

Griffe (mkdocstrings' Python parser) warns on two forms our Google-style docstrings use on purpose or by slip;
both are let through here by exact pattern, and every other warning still fails the strict build:

* an ``Args:`` entry that documents several parameters at once (``temperature, api_key, timeout_s: ...`` or
  ``train_tasks / val_tasks: ...``): griffe reads it as one parameter named ``"a, b"`` and warns that it has no
  annotation and is not in the signature. tests/test_docs.py checks instead that each name of such an entry is a
  real parameter, so a renamed parameter is still caught;
* a sentence after the entries of a ``Raises:`` section (``In each case the store is unchanged.``,
  ``In each case nothing is written.``, lightning_nb/store/base.py): griffe cannot read it as an
  ``exception: description`` pair and leaves it out of the page. Listed by its exact text (KNOWN_RAISES_PROSE).
"""

from __future__ import annotations

import logging
import re

# Raises-section prose griffe cannot parse, by exact text; remove an entry once its docstring is reworded
KNOWN_RAISES_PROSE = ("In each case the store is unchanged.", "In each case nothing is written.")

_GROUPED = re.compile(r"(No type or annotation for parameter|Parameter) '[^']*(, | / )[^']*'"
                      r"( does not appear in the function signature)?$")
_RAISES = re.compile(r"Failed to get 'exception: description' pair from '(?P<text>.*)'$")


class _KnownDocstringForms(logging.Filter):
    """Demote the two forms above to INFO (still in ``mkdocs build --verbose``); let everything else through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING:
            message = record.getMessage()
            raises = _RAISES.search(message)
            if _GROUPED.search(message) or (raises and raises.group("text") in KNOWN_RAISES_PROSE):
                record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def on_startup(command: str, dirty: bool) -> None:
    """Install the filter on the logger griffe writes to inside MkDocs (``mkdocs.plugins.griffe``)."""
    logger = logging.getLogger("mkdocs.plugins.griffe")
    if not any(isinstance(f, _KnownDocstringForms) for f in logger.filters):
        logger.addFilter(_KnownDocstringForms())
