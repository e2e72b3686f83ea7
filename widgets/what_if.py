"""The what-if figure: each episode's advantage under the recorded reward against the new one (plotly).

The library computes the table (:func:`lightning_nb.replay.what_if`); this package draws it, since the library
imports no UI package.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from lightning_nb.replay import what_if_groups
from lightning_nb.types import GROUP_ID_KEY

__all__ = ["what_if_figure"]


def what_if_figure(df: pd.DataFrame) -> Any:
    """A plotly figure of a :func:`what_if` table: each trained episode's old advantage against its new one, coloured
    by its group's change of signal (hover: rollout, group, old and new reward). Points off the diagonal are the
    episodes the new reward moves."""
    import plotly.graph_objects as go

    change = what_if_groups(df).set_index(GROUP_ID_KEY)["change"]
    fig = go.Figure()
    data = df[df["trained"]]
    for what, colour in (("keeps signal", "#1f77b4"), ("gains signal", "#2ca02c"), ("loses signal", "#d62728"),
                         ("no signal", "#7f7f7f")):
        part = data[data[GROUP_ID_KEY].map(change) == what]
        if part.empty:
            continue
        fig.add_trace(go.Scatter(
            x=part["old_advantage"], y=part["new_advantage"], mode="markers",
            name=f"{what} ({part[GROUP_ID_KEY].nunique()} groups)",
            marker={"color": colour, "size": 8, "opacity": 0.7},
            customdata=part[["rollout_id", GROUP_ID_KEY, "old_reward", "new_reward"]].to_numpy(),
            hovertemplate="%{customdata[0]}<br>group %{customdata[1]}<br>reward %{customdata[2]:.3g} → "
                          "%{customdata[3]:.3g}<br>advantage %{x:.3f} → %{y:.3f}<extra></extra>"))
    lo = float(min(data["old_advantage"].min(), data["new_advantage"].min(), -1.0)) if len(data) else -1.0
    hi = float(max(data["old_advantage"].max(), data["new_advantage"].max(), 1.0)) if len(data) else 1.0
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line={"dash": "dot", "color": "#999"},
                             showlegend=False, hoverinfo="skip"))
    fig.update_layout(title="what-if: advantage under the recorded reward (x) and the new one (y)",
                      xaxis_title="old advantage", yaxis_title="new advantage", height=420)
    return fig
