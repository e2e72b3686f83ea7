"""Live reward curve: a plotly ``FigureWidget`` fed from the store by polling.

Left panel, x = training step: mean final reward of the training rollouts of each
step with min/max as error bars (the step is the prefix of the rollout's GRPO
``group_id``, ``"<step>:<task id>"``, set by :class:`~lightning_nb.algorithm.lightning_rl.LightningRL`),
and the mean reward of validation rollouts at the weights they ran with (x = the
``weight_version`` their LLM calls report, i.e. after that many updates).
Right panel, x = batch: mean/min/max over each ``batch_size`` consecutive finished
rollouts of any mode, in the order they finished; it grows while the runners work,
before any training step ends. With ``slice_by`` (a task field such as ``"ops"``, or a
function ``task -> label``) the left panel also draws one validation line per slice
(``val ops=1``, ``val ops=2``), the labels of :meth:`LightningRL.evaluate(by=...)`.
Named intermediate rewards (shaping terms such as ``calc_uses_all_numbers``,
:func:`lightning_nb.emit_intermediate_reward`) get one dashed line each in the left panel,
``train <component>``: their mean sum per training rollout of each step (0 for a rollout
without it), apart from the final reward, which they never change. Given the ``trainer``, the
left panel plots a training step only once its update is done (``step <= trainer.updates_applied``): a
step still collecting, or paused inside (``before update``, ``between sample rounds``), has
rollouts still to come, so its mean is not final yet.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from lightning_nb.errors import ConfigError
from lightning_nb.semconv import REWARD, REWARD_SPAN, WEIGHT_VERSION
from lightning_nb.slices import slice_labels
from lightning_nb.store.base import LightningStore
from lightning_nb.store.rules import component_sums, final_reward, reward_or_zero
from lightning_nb.types import GROUP_ID_KEY
from widgets._live import LivePanel

__all__ = ["RewardCurve", "rollout_point"]


def rollout_point(store: LightningStore, rollout: Any) -> Optional[tuple[str, Optional[int], float]]:
    """``(mode, x, reward)`` of one finished rollout for the curve, or None to skip it.

    ``x`` is the training step for ``train`` rollouts (None without a step-prefixed
    ``group_id``) and the weight version for the others (None without LLM spans).
    ``reward`` is the rollout's final reward as the store defines it
    (:func:`lightning_nb.store.rules.final_reward`): a failed rollout counts 0.0, as in
    :meth:`LightningRL.evaluate`; cancelled and unfinished rollouts are skipped.
    """
    return _point_and_spans(store, rollout)[0]


def _point_and_spans(store: LightningStore, rollout: Any) -> tuple[Optional[tuple[str, Optional[int], float]], list]:
    """:func:`rollout_point` and the latest attempt's spans it read (``[]`` when it read none)."""
    if rollout.status not in ("succeeded", "failed"):
        return None, []
    spans = store.query_spans(rollout.rollout_id, "latest")
    reward = reward_or_zero(final_reward(rollout.status, [s.attributes.get(REWARD) for s in spans
                                                          if s.name == REWARD_SPAN]))
    x: Optional[int] = None
    if rollout.mode == "train":
        group = str(rollout.metadata.get(GROUP_ID_KEY, ""))
        head = group.split(":", 1)[0].split(".", 1)[0]  # "<step>:<task>" or "<step>.<round>:<task>"
        x = int(head) if ":" in group and head.isdigit() else None
    else:
        versions = [s.attributes[WEIGHT_VERSION] for s in spans if WEIGHT_VERSION in s.attributes]
        x = int(max(versions)) if versions else None
    return (rollout.mode, x, reward), spans


class RewardCurve(LivePanel):
    """Reward per training step, validation reward, and reward per batch of finished rollouts.

    Args:
        store: the store the runners write to.
        batch_size: finished rollouts per point of the right panel.
        interval_s: seconds between polls; the figure is redrawn at most once per poll
            and only when new rollouts finished.
        height, width: figure size in pixels (``width=None`` lets plotly choose).
        slice_by: a task field name or a function ``task -> label``: one more validation
            line per slice (trace name ``val <label>``, e.g. ``val ops=2``). Validation rollouts
            whose input has no such field (or on which the function raises) are left out of
            the slice lines, not of ``val mean``.
        trainer: the trainer whose steps the training rollouts belong to (anything with a
            ``step`` attribute, the count of updates done): the left panel's training lines
            then stop at ``trainer.updates_applied``, so a step whose update has not run is not drawn (the
            right panel still counts its rollouts). None: every step with finished rollouts is
            drawn, the last one possibly before all its rollouts (later sample rounds) finished.
    """

    def __init__(self, store: LightningStore, *, batch_size: int = 8, interval_s: float = 1.0, height: int = 330,
                 width: Optional[int] = 900, autostart: bool = True,
                 slice_by: Optional[Union[str, Callable[[Any], Any]]] = None, trainer: Any = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 rollout, got {batch_size}")
        self.store, self.batch_size, self.slice_by, self.trainer = store, batch_size, slice_by, trainer
        self._drawn_step: Optional[int] = None
        self.val_slices: dict[str, dict[int, list[float]]] = {}
        self.train_components: dict[int, list[dict[str, float]]] = {}
        base = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4], horizontal_spacing=0.09,
                             subplot_titles=("reward per training step", f"reward per batch of {batch_size} rollouts"))
        self.fig = go.FigureWidget(base)
        self.fig.add_scatter(name="train mean (min–max)", mode="lines+markers", x=[], y=[], row=1, col=1)
        self.fig.add_scatter(name="val mean", mode="markers", marker={"symbol": "square", "size": 10}, x=[], y=[],
                             row=1, col=1)
        self.fig.add_scatter(name="batch mean (min–max)", mode="lines+markers", x=[], y=[], row=1, col=2)
        self.fig.update_layout(height=height, width=width, margin={"l": 45, "r": 10, "t": 40, "b": 40},
                               legend={"orientation": "h", "y": -0.22}, template="plotly_white")
        self.fig.update_yaxes(range=[-0.05, 1.05], title_text="reward", row=1, col=1)
        self.fig.update_yaxes(range=[-0.05, 1.05], row=1, col=2)
        self.fig.update_xaxes(title_text="training step", row=1, col=1)
        self.fig.update_xaxes(title_text=f"batch ({batch_size} finished rollouts)", row=1, col=2)
        self.train: dict[int, list[float]] = {}
        self.val: dict[int, list[float]] = {}
        self.finished: list[float] = []
        self._after = 0.0
        self._seen: set[str] = set()
        super().__init__([self.fig], interval_s=interval_s, autostart=autostart)
        self.add_class("lnb-reward-curve")

    def _refresh(self) -> None:
        fresh = [r for r in self.store.completed_since(self._after - 1.0) if r.rollout_id not in self._seen]
        if not fresh and self.refresh_count and self._last_step() == self._drawn_step:
            return
        for r in fresh:
            self._seen.add(r.rollout_id)
            self._after = max(self._after, r.end_time or 0.0)
            point, spans = _point_and_spans(self.store, r)
            if point is None:
                continue
            mode, x, reward = point
            self.finished.append(reward)
            if x is not None:
                (self.train if mode == "train" else self.val).setdefault(x, []).append(reward)
                if mode == "train":
                    self.train_components.setdefault(x, []).append(component_sums(spans))
                label = self._slice(r) if mode != "train" else None
                if label is not None:
                    self.val_slices.setdefault(label, {}).setdefault(x, []).append(reward)
        self._draw()

    def _slice(self, rollout: Any) -> Optional[str]:
        if self.slice_by is None:
            return None
        try:
            return slice_labels([rollout.input], self.slice_by)[0]
        except ConfigError:
            return None

    def _last_step(self) -> Optional[int]:
        """The last training step the left panel may draw: ``trainer.updates_applied`` (None without a trainer)."""
        return None if self.trainer is None else int(self.trainer.updates_applied)

    def series(self) -> dict[str, dict[str, list]]:
        """The plotted values: ``{"train"|"val"|"batch": {"x", "mean", "min", "max", "n"}}``, with
        ``slice_by`` one ``"val <label>"`` entry per slice (in the slices' sorted order), and one
        ``"train <component>"`` entry per named intermediate reward seen (sorted by name). With a
        ``trainer``, the ``train`` entries hold the steps up to ``trainer.updates_applied`` only."""
        last = self._last_step()
        train = {x: v for x, v in self.train.items() if last is None or x <= last}
        components = {x: rows for x, rows in self.train_components.items() if last is None or x <= last}
        batches = {i + 1: self.finished[i * self.batch_size:(i + 1) * self.batch_size]
                   for i in range(math.ceil(len(self.finished) / self.batch_size))}
        out = {"train": _stats(train), "val": _stats(self.val), "batch": _stats(batches)}
        for label in sorted(self.val_slices):
            out[f"val {label}"] = _stats(self.val_slices[label])
        names = sorted({name for rows in components.values() for c in rows for name in c})
        for name in names:
            out[f"train {name}"] = _stats({x: [c.get(name, 0.0) for c in rows] for x, rows in components.items()})
        return out

    def _draw(self) -> None:
        self._drawn_step = self._last_step()
        s = self.series()
        names = {t.name for t in self.fig.data}
        for key in s:
            if key.startswith("val ") and key not in names:  # a new slice: its own line, in the left panel
                self.fig.add_scatter(name=key, mode="lines+markers", line={"dash": "dot"}, x=[], y=[], row=1, col=1)
            elif key.startswith("train ") and key not in names:  # a new reward component (shaping term)
                self.fig.add_scatter(name=key, mode="lines", line={"dash": "dash"}, x=[], y=[], row=1, col=1)
        with self.fig.batch_update():
            for trace in self.fig.data[3:]:
                d = s[trace.name]
                trace.x, trace.y = d["x"], d["mean"]
                trace.customdata = d["n"]
                trace.hovertemplate = f"{trace.name}<br>x=%{{x}}<br>mean %{{y:.3f}}<br>n=%{{customdata}}<extra></extra>"
            for col, xs in ((1, s["train"]["x"] + s["val"]["x"]), (2, s["batch"]["x"])):
                top = max(xs, default=1)
                self.fig.update_xaxes(range=[-0.3, max(top, 1) + 0.3], tick0=0, dtick=max(1, math.ceil(top / 10)),
                                      row=1, col=col)
            for trace, key in ((self.fig.data[0], "train"), (self.fig.data[1], "val"), (self.fig.data[2], "batch")):
                d = s[key]
                trace.x, trace.y = d["x"], d["mean"]
                trace.customdata = d["n"]
                trace.hovertemplate = "x=%{x}<br>mean %{y:.3f}<br>n=%{customdata}<extra></extra>"
                if key != "val":
                    trace.error_y = {"type": "data", "symmetric": False, "thickness": 1,
                                     "array": [hi - m for hi, m in zip(d["max"], d["mean"])],
                                     "arrayminus": [m - lo for lo, m in zip(d["min"], d["mean"])]}


def _stats(groups: dict[int, list[float]]) -> dict[str, list]:
    xs = sorted(k for k, v in groups.items() if v)
    return {"x": xs, "mean": [sum(groups[x]) / len(groups[x]) for x in xs], "min": [min(groups[x]) for x in xs],
            "max": [max(groups[x]) for x in xs], "n": [len(groups[x]) for x in xs]}
