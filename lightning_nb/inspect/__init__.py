"""Inspection: the HTML views of the kit's objects, token fidelity and the optimizer's-eye batch view.

The public API the widgets and notebooks build on. The views are plain HTML strings made from an
object's public state; nothing here imports the layers above (algorithm, trainers): the package
root, ``import lightning_nb``, registers these views for the kit's classes
(:func:`lightning_nb.types.register_html_view`), which their ``_repr_html_`` then show. The
preflight, which drives the algorithm, is :mod:`lightning_nb.algorithm.preflight`.
"""

from lightning_nb.inspect.audit import BATCH_COLUMNS, FIDELITY_COLUMNS, batch_df, batch_html, token_fidelity
from lightning_nb.inspect.html import (BOX_STYLE, STATE_COLORS, badge, esc, fmt, kv_table, rollout_html,
                                       run_html, run_summary, runner_group_html, slice_report_html,
                                       span_tree_html, store_html, trainer_html, trainer_summary)

__all__ = [
    "BATCH_COLUMNS", "BOX_STYLE", "FIDELITY_COLUMNS", "STATE_COLORS", "badge", "batch_df", "batch_html", "esc",
    "fmt", "kv_table", "rollout_html", "run_html", "run_summary", "runner_group_html", "slice_report_html",
    "span_tree_html", "store_html",
    "token_fidelity", "trainer_html", "trainer_summary",
]
