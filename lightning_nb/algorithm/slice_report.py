"""``SliceReport``: held-out reward overall and per slice, what ``LightningRL.evaluate(by=...)`` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from lightning_nb.types import html_view

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["SliceReport"]


@dataclass(frozen=True)
class SliceReport:
    """Held-out reward overall and per slice, as :meth:`LightningRL.evaluate(by=...) <LightningRL.evaluate>` returns it.

    Attributes:
        by: the field name or the function's name the tasks were sliced by.
        mean: mean final reward over every finished rollout (failed ones count 0): what
            ``evaluate()`` without ``by`` returns. NaN when none finished.
        n: finished rollouts (one per task; cancelled ones are left out).
        solved: rollouts whose final reward is exactly 1.0.
        slices: ``{label: (mean, n, solved)}`` per slice, in the order of the slice values
            (``"ops=1"`` before ``"ops=2"``); a slice whose rollouts were all cancelled has
            mean NaN and n 0.

    ``to_frame()`` / ``.df`` is the table (columns slice, n, solved, mean; a last row
    ``"all"``), shown as HTML in a notebook cell; ``str(report)`` is the same as text;
    :meth:`metrics` gives the ``val_reward/<slice>`` values of a metrics row.
    """

    by: str
    mean: float
    n: int
    solved: int
    slices: dict[str, tuple[float, int, int]]

    def to_frame(self) -> "pd.DataFrame":
        """One row per slice, then ``"all"``: columns slice (str), n (int), solved (int), mean (float)."""
        import pandas as pd

        rows = [(label, n, solved, mean) for label, (mean, n, solved) in self.slices.items()]
        rows.append(("all", self.n, self.solved, self.mean))
        df = pd.DataFrame(rows, columns=["slice", "n", "solved", "mean"])
        return df.astype({"n": "int64", "solved": "int64", "mean": "float64"})

    @property
    def df(self) -> "pd.DataFrame":
        """:meth:`to_frame`."""
        return self.to_frame()

    def metrics(self, prefix: str = "val_reward") -> dict[str, float]:
        """``{f"{prefix}/{label}": mean}`` per slice: the columns :meth:`LightningRL.step` adds to its row."""
        return {f"{prefix}/{label}": mean for label, (mean, _, _) in self.slices.items()}

    def __float__(self) -> float:
        return float(self.mean)

    def __str__(self) -> str:
        width = max([len(label) for label in self.slices] + [3])
        lines = [f"reward by {self.by}: {self.mean:.3f} ({self.solved}/{self.n} solved)"]
        lines += [f"  {label:<{width}}  {mean:.3f} ({solved}/{n} solved)"
                  for label, (mean, n, solved) in self.slices.items()]
        return "\n".join(lines)

    def _repr_html_(self) -> Optional[str]:
        return html_view(self)
