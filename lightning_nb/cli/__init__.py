"""Command line: ``python -m lightning_nb demo --steps N --out DIR`` and ``python -m lightning_nb eval``.

:mod:`~lightning_nb.cli.commands` parses and checks the options (:func:`main`); :mod:`~lightning_nb.cli.demo` runs
them (:func:`run_demo` with one :class:`DemoSettings`, :func:`run_eval`).
"""

from lightning_nb.cli.commands import DEVICE_DEFAULTS, build_parser, main, resolve_device_settings
from lightning_nb.cli.demo import DemoSettings, run_demo, run_eval

__all__ = ["DEVICE_DEFAULTS", "DemoSettings", "build_parser", "main", "resolve_device_settings", "run_demo",
           "run_eval"]
