"""Credit: how an episode's rewards become the per-token advantages a trainer trains on. The algorithm's step.

The algorithm owns the option (``AlgorithmConfig.credit``, ``gamma``, ``norm_adv_by_std``, ``min_group_size``,
the soft overlong penalty) and the call (:meth:`LightningRL.assign_credit
<lightning_nb.algorithm.credit.CreditAssignment.assign_credit>` before each update); a trainer takes triplets that
already carry :attr:`Triplet.advantages <lightning_nb.types.Triplet.advantages>` and does not compute them again.

* :mod:`~lightning_nb.credit.normalize`: GRPO's group-relative advantage of a score tensor (checked equal to verl's
  ``compute_grpo_outcome_advantage``);
* :mod:`~lightning_nb.credit.returns`: group advantages with undersized groups dropped, reward-to-go, per-transition
  advantages, DAPO's soft overlong penalty;
* :mod:`~lightning_nb.credit.assign`: the rule (:class:`CreditRule`) applied to a batch of triplets
  (:func:`assign`), and :func:`with_advantages` for an algorithm that brings its own numbers.

This package sits one layer below the trainers (``.importlinter``) only so that, for one release, ``Trainer.update``
on triplets without advantages (the path of earlier versions, deprecated) and the old import paths
``lightning_nb.trainers.credit`` / ``.advantages`` still reach it; nothing in it imports a trainer or an algorithm.
"""

from lightning_nb.credit.assign import (CREDIT_FIELDS, Credit, CreditRule, advantages, assign, episode_rewards,
                                        episodes_of, groups_with_signal, with_advantages)
from lightning_nb.credit.normalize import group_relative_advantages
from lightning_nb.credit.returns import group_advantages, overlong_penalty, reward_to_go, transition_advantages

__all__ = ["CreditRule", "Credit", "assign", "advantages", "episode_rewards", "episodes_of", "with_advantages",
           "groups_with_signal", "group_relative_advantages", "group_advantages", "overlong_penalty", "reward_to_go",
           "transition_advantages", "CREDIT_FIELDS"]
