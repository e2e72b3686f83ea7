"""Group-relative advantages of GRPO and Dr. GRPO, as small pure functions of torch tensors.

What :mod:`lightning_nb.credit.returns` turns rewards into before the algorithm hands the batch to the trainer
(GRPOTrainer's loss is in :mod:`lightning_nb.trainers.grpo.losses`; ``lightning_nb.trainers.advantages`` in earlier
versions). The function
here is verl's ``core_algos.compute_grpo_outcome_advantage`` for the options the trainers use, written out so
the GRPO trainer needs no verl; ``tests/test_advantages.py`` checks it equal to verl's on random inputs
wherever verl is installed.

torch is imported inside the function, so importing this module stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Sequence

from lightning_nb.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["group_relative_advantages"]


def group_relative_advantages(scores_E: "torch.Tensor", group_ids: Sequence[Hashable], *, norm_by_std: bool = True,
                              epsilon: float = 1e-6) -> "torch.Tensor":
    """GRPO's outcome advantage of each of ``E`` items (episodes, or transitions) against its group.

    For the items ``i`` of a group ``g`` (same ``group_ids`` entry) with scores ``r_i``::

        A_i = (r_i − mean_g r) / (std_g r + ε)     norm_by_std=True    GRPO (Shao et al. 2024,
                                                                         "DeepSeekMath", §4.1.2)
        A_i =  r_i − mean_g r                      norm_by_std=False   Dr. GRPO (Liu et al. 2025,
                                                                         "Understanding R1-Zero-Like
                                                                         Training", §3.1)

    with the unbiased (n − 1) standard deviation. A group of one item uses mean 0 and std 1, so
    its item keeps its raw score (``r_i / (1 + ε)`` with ``norm_by_std``): verl's rule, which
    the algorithm's credit never reaches since it drops groups under ``min_group_size`` (>= 2) first.
    A group whose scores are all equal gets advantage 0 (its std is 0, the numerator is 0).
    Scores ``[1, 0, 0, 0]`` in one group give ``[1.5, −0.5, −0.5, −0.5]``.

    Same result as verl's ``core_algos.compute_grpo_outcome_advantage`` with
    ``token_level_rewards = scores_E[:, None]``, ``response_mask`` of ones and ``index = group_ids``
    (verl sums the token-level rewards into one score per item and multiplies the advantage by the
    mask; give the summed score here and multiply by a mask yourself when needed).

    Args:
        scores_E: shape ``(E,)``, one score per item (reward units; float).
        group_ids: ``E`` hashable group ids (strings, ints), in the order of ``scores_E``.
        norm_by_std: divide by the group's standard deviation (GRPO) or not (Dr. GRPO).
        epsilon: added to the standard deviation, so a group of equal scores divides 0 by ε.

    Returns:
        ``adv_E``, shape ``(E,)``, the dtype and device of ``scores_E``, without grad (advantages are
        constants of the loss).

    Raises:
        ConfigError: ``scores_E`` is not one-dimensional, or ``group_ids`` is not as long as it.
    """
    import torch

    if scores_E.dim() != 1:
        raise ConfigError(f"scores_E must have shape (E,), got {tuple(scores_E.shape)}: give one score per item "
                          "(sum token-level rewards over the response first)")
    if len(group_ids) != scores_E.shape[0]:
        raise ConfigError(f"group_ids has {len(group_ids)} entries for {scores_E.shape[0]} scores; "
                          "give one group id per score")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    with torch.no_grad():
        adv_E = scores_E.detach().clone()
        for rows in members.values():
            idx = torch.tensor(rows, device=scores_E.device)
            group_G = scores_E.detach()[idx]
            if len(rows) == 1:  # no baseline: mean 0, std 1 (verl's rule)
                mean, std = torch.tensor(0.0), torch.tensor(1.0)
            else:
                mean, std = group_G.mean(), group_G.std()
            adv_E[idx] = (group_G - mean) / (std + epsilon) if norm_by_std else group_G - mean
    return adv_E
