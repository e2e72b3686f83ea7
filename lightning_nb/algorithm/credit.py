"""Rewards → credit → advantages: the algorithm's step before each update, and its options.

:class:`CreditOptions` are the config fields (``AlgorithmConfig`` and ``TrafficConfig`` take them: ``credit``,
``gamma``, ``norm_adv_by_std``, ``min_group_size``, ``overlong_buffer_len``, ``overlong_penalty_factor``).
:class:`CreditAssignment` is what a trainer-based algorithm does with them: :meth:`~CreditAssignment.assign_credit`
turns a batch into triplets that carry their per-token advantages (:func:`lightning_nb.credit.assign`, leaving out
what the trainer would drop as stale first), :meth:`~CreditAssignment.signal_groups` says which groups have a
non-zero advantage (dynamic sampling, preflight, TrafficLearner), and :meth:`~CreditAssignment.train` hands the
credited batch to ``trainer.update``. An algorithm with its own credit (RLOO, a learned value) overrides
:meth:`~CreditAssignment.assign_credit` and nothing else (``docs/write-an-algorithm.md``).

Earlier versions kept these options on the trainer config (``GRPOConfig.credit`` ...): set there, they are forwarded
here for one release with a DeprecationWarning, unless this config sets the field itself.

Where each rule of the old trainer-side batch went:

* **credit, gamma, norm_adv_by_std, min_group_size, the soft overlong penalty, baselines**: here (the algorithm).
* **stale episodes** (``GRPOConfig.max_staleness``): the trainer's rule (its importance ratio can correct only so
  much); the algorithm asks :meth:`Trainer.stale_rollouts <lightning_nb.trainers.base.Trainer.stale_rollouts>` and
  leaves them out of the group statistics, so the numbers are those of earlier versions; the trainer drops them.
* **kl_mode="reward"**: needs the reference model's log-probs, which only the trainer has, before the group
  statistics. With it set (and ``kl_coef > 0``) :meth:`CreditAssignment.train` hands the trainer the batch without
  advantages, the deprecated path where the trainer credits it as before (a DeprecationWarning); use
  ``kl_mode="loss"``.
"""

from __future__ import annotations

import warnings
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from lightning_nb.algorithm.base import Algorithm
from lightning_nb.algorithm.credit_options import CreditOptions
from lightning_nb.credit import CREDIT_FIELDS, Credit, CreditRule, assign, groups_with_signal
from lightning_nb.types import Triplet

if TYPE_CHECKING:
    from lightning_nb.trainers.base import Trainer, Update

__all__ = ["CreditOptions", "CreditAssignment"]


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(CreditOptions)}


class CreditAssignment(Algorithm):
    """A trainer-based algorithm's credit step (see the module docstring). Its ``config`` has :class:`CreditOptions`.

    Subclasses override :meth:`assign_credit` to bring their own credit, and :meth:`max_response_len` to give the
    soft overlong penalty its L_max.
    """

    trainer: "Trainer"

    def max_response_len(self) -> Optional[int]:
        """L_max of the soft overlong penalty, tokens: the trainer config's ``max_response_len`` when set, else None
        (LightningRL: its ``max_tokens``)."""
        return getattr(self.trainer.config, "max_response_len", None)

    def credit_rule(self) -> CreditRule:
        """The :class:`~lightning_nb.credit.CreditRule` of this algorithm's config; a field left at its default whose
        deprecated twin on the trainer config is set takes the trainer's (DeprecationWarning)."""
        values: dict[str, Any] = {}
        for name in CREDIT_FIELDS:
            mine = getattr(self.config, name, _DEFAULTS[name])
            theirs = getattr(self.trainer.config, name, mine)
            if mine == _DEFAULTS[name] and theirs != _DEFAULTS[name]:
                warnings.warn(f"{type(self.trainer.config).__name__}.{name}={theirs!r} is deprecated: credit is the "
                              f"algorithm's, set {type(self.config).__name__}.{name} (forwarded there for now; the "
                              "trainer field goes in the next release)", DeprecationWarning, stacklevel=3)
                mine = theirs
            values[name] = mine
        return CreditRule(**values, max_response_len=self.max_response_len())

    def assign_credit(self, triplets: Sequence[Triplet]) -> Credit:
        """``triplets`` with their per-token advantages (:func:`lightning_nb.credit.assign` under
        :meth:`credit_rule`), the episodes the trainer would drop as stale left out first. Override it to bring
        your own credit: return a :class:`~lightning_nb.credit.Credit` whose ``triplets`` carry
        ``Triplet.advantages`` (:func:`lightning_nb.credit.with_advantages`) and whose ``left_out`` holds the rest.

        Raises:
            ConfigError: a credit field out of range.
        """
        return assign(self.credit_rule(), triplets, exclude=sorted(self.trainer.stale_rollouts(triplets)))

    def signal_groups(self, triplets: Sequence[Triplet]) -> set[str]:
        """Group ids of ``triplets`` that an update would learn from: those where :meth:`assign_credit` gives some
        turn a non-zero advantage (the KL penalty of the deprecated ``kl_mode="reward"`` is left out: it needs a
        forward pass). ``trainer.signal_groups`` in earlier versions."""
        return groups_with_signal(self.assign_credit(triplets).triplets) if triplets else set()

    def train(self, triplets: Sequence[Triplet], on_progress: Optional[Callable[[int, int, str], None]] = None
              ) -> "Update":
        """One trainer update on ``triplets`` credited by :meth:`assign_credit` (``trainer.update(credited,
        left_out=...)``); returns the trainer's :class:`~lightning_nb.trainers.base.Update`."""
        cfg: Any = self.trainer.config
        if getattr(cfg, "kl_coef", 0) > 0 and getattr(cfg, "kl_mode", "loss") == "reward":
            # the in-reward KL needs the reference log-probs before the group statistics: the deprecated path
            return self.trainer.update(triplets, on_progress=on_progress)
        credit = self.assign_credit(triplets)
        return self.trainer.update(credit.triplets, on_progress=on_progress, left_out=credit.left_out)
