"""Our triplets as verl's PPO batch, and verl's own actor update run in this process without Ray.

Three pieces, the groundwork of a verl trainer (issue 11):

* :func:`triplets_to_dataproto`: episodes (packed exactly as :class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer`
  packs them, through :func:`~lightning_nb.trainers.packing.pack_episode`) → the ``verl.DataProto`` that
  verl's PPO trainer consumes (the layout of verl 0.9's agent loop, ``AgentLoopWorker._postprocess``).
* :func:`grpo_advantages`: GRPO advantages of that batch through verl's
  ``core_algos.compute_grpo_outcome_advantage``.
* :class:`~lightning_nb.trainers.verl.actor.VerlActor` (its own module, re-exported here): verl's FSDP
  training engine (``FSDPEngineWithLMHead``) and PPO loss (``verl.workers.utils.losses.ppo_loss``)
  around a plain Hugging Face model that is already in memory (e.g. ``TransformersEngine.model``,
  updated in place), with verl's configuration composed from its own Hydra defaults
  (:func:`ppo_config`). No Ray cluster, no FSDP wrapping, no model loaded from disk; CPU or one CUDA
  device.

verl is imported inside the functions (``import verl`` needs the ``ray`` *package*, but nothing here
starts or contacts Ray); :func:`require_verl` names the extra to install when it is missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning_nb.trainers.packing import pack_episode
from lightning_nb.trainers.verl.actor import IN_PROCESS_OVERRIDES, VerlActor, ppo_config
from lightning_nb.trainers.verl.patches import require_verl
from lightning_nb.types import GROUP_ID_KEY, Triplet

__all__ = ["triplets_to_dataproto", "grpo_advantages", "ppo_config", "VerlActor", "IN_PROCESS_OVERRIDES",
           "require_verl"]


# ----- triplets -> DataProto ------------------------------------------------------------
def triplets_to_dataproto(triplets: Sequence[Triplet], *, pad_token_id: int, max_prompt_len: Optional[int] = None,
                          max_response_len: Optional[int] = None, pack_turns: bool = True,
                          advantages: Optional[Mapping[Any, float]] = None, device: Any = None) -> Any:
    """The ``verl.DataProto`` verl's PPO trainer consumes, one row per packed sequence.

    Each episode (the triplets of one ``rollout_id``, ordered by ``turn``) is packed by
    :func:`lightning_nb.trainers.packing.pack_episode`, exactly as ``GRPOTrainer`` packs it: a turn whose
    prompt extends the previous sequence is appended to it (the tool/user tokens in between get
    response mask 0), otherwise (a fork, or ``pack_turns=False``) it starts a new row. A row's
    **prompt** is the prompt of the first turn it holds; its **response** is everything after it.

    ``batch`` (B rows, P = the longest prompt or ``max_prompt_len``, R = the longest response or
    ``max_response_len``):

    ============================ ========= ======= ================================================
    key                          shape     dtype   content
    ============================ ========= ======= ================================================
    ``prompts``                  (B, P)    int64   first turn's prompt, LEFT-padded with pad_token_id
    ``responses``                (B, R)    int64   the rest of the row, RIGHT-padded
    ``input_ids``                (B, P+R)  int64   prompts ‖ responses
    ``attention_mask``           (B, P+R)  int64   1 on real tokens, 0 on padding
    ``position_ids``             (B, P+R)  int64   cumsum(attention_mask) − 1, clipped at 0
                                                   (verl's ``compute_position_id_with_mask``)
    ``response_mask``            (B, R)    int64   1 on model tokens, 0 on tool/user tokens and padding
    ``token_level_scores``       (B, R)    float32 each turn's ``step_reward`` on its last response
                                                   token; the episode's final ``reward`` added on the
                                                   last response token of the episode's LAST row
                                                   (verl's agent loop puts the score on the last
                                                   response token); 0 elsewhere
    ``rollout_log_probs``        (B, R)    float32 the engine's log-probs (0 off the mask); only when
                                                   every triplet has ``logprobs``
    ``temperature``              (B,)      float32 the sampling temperature (1.0 for greedy), which
                                                   verl's forward divides the logits by, per row
    ``advantages``               (B, R)    float32 with ``advantages=`` (the value of the row's
                                                   episode, or of the turn a token came with), or when
                                                   every triplet carries ``Triplet.advantages`` (each
                                                   token's own); × mask
    ============================ ========= ======= ================================================

    ``non_tensor_batch`` (numpy object arrays of length B): ``uid`` (= ``Triplet.group_id``, verl's
    GRPO group key), ``rollout_id``, ``turn`` (the ``Triplet.turn`` of the row's first turn).
    ``meta_info``: ``{"pad_token_id": pad_token_id}``.

    Summed over an episode's rows, ``token_level_scores`` is ``reward + Σ step_reward``, the
    episode reward of ``GRPOTrainer`` (``credit="episode"``, without overlong or KL penalties).
    An episode packed into one row is a complete verl trajectory; the earlier rows of a forked
    episode carry no final reward, so compute advantages per episode with :func:`grpo_advantages`.

    Args:
        triplets: the batch; every triplet has a non-empty ``response_ids``.
        pad_token_id: the token padding is filled with (masked out everywhere).
        max_prompt_len, max_response_len: fixed P / R (verl pads to ``data.max_prompt_length`` /
            ``rollout.response_length``); None: the batch's longest.
        pack_turns: pack turns that extend each other into one row (``GRPOConfig.pack_turns``).
        advantages: optional precomputed advantages, keyed by ``rollout_id`` (one per episode) or by
            ``(rollout_id, turn)`` (one per triplet, e.g. ``Update.turn_advantages``).
        device: where the tensors go (``VerlActor.device``: verl's actor returns its log-probs there, and
            they are compared with ``rollout_log_probs``); None: the CPU.

    Raises:
        ValueError: no triplets, an empty response, an episode whose triplets name two groups,
            a prompt or response longer than ``max_prompt_len`` / ``max_response_len``, or an
            ``advantages`` mapping without an entry for some episode or turn.
    """
    import numpy as np
    import torch
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask

    rows = _rows(triplets, pack_turns, advantages)
    P = _width([len(r["prompt"]) for r in rows], max_prompt_len, "max_prompt_len", "prompt", rows)
    R = _width([len(r["response"]) for r in rows], max_response_len, "max_response_len", "response", rows)

    def right(values: list, width: int, fill: Any) -> list:
        return list(values) + [fill] * (width - len(values))

    prompts_B_P = torch.tensor([[pad_token_id] * (P - len(r["prompt"])) + r["prompt"] for r in rows], dtype=torch.int64)
    prompt_attn_B_P = torch.tensor([[0] * (P - len(r["prompt"])) + [1] * len(r["prompt"]) for r in rows],
                                   dtype=torch.int64)
    responses_B_R = torch.tensor([right(r["response"], R, pad_token_id) for r in rows], dtype=torch.int64)
    response_attn_B_R = torch.tensor([right([1] * len(r["response"]), R, 0) for r in rows], dtype=torch.int64)
    attention_mask = torch.cat([prompt_attn_B_P, response_attn_B_R], dim=1)
    tensors = {
        "prompts": prompts_B_P,
        "responses": responses_B_R,
        "input_ids": torch.cat([prompts_B_P, responses_B_R], dim=1),
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": torch.tensor([right(r["mask"], R, 0) for r in rows], dtype=torch.int64),
        "token_level_scores": torch.tensor([right(r["scores"], R, 0.0) for r in rows], dtype=torch.float32),
        "temperature": torch.tensor([r["temperature"] for r in rows], dtype=torch.float32),
    }
    if all(r["has_logprobs"] for r in rows):
        tensors["rollout_log_probs"] = torch.tensor([right(r["logprobs"], R, 0.0) for r in rows], dtype=torch.float32)
    if all(r["advantages"] for r in rows):
        tensors["advantages"] = torch.tensor([right(r["advantages"], R, 0.0) for r in rows], dtype=torch.float32)
    non_tensors = {
        "uid": np.array([r[GROUP_ID_KEY] for r in rows], dtype=object),
        "rollout_id": np.array([r["rollout_id"] for r in rows], dtype=object),
        "turn": np.array([r["turn"] for r in rows], dtype=object),
    }
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"pad_token_id": int(pad_token_id)})
    return data.to(device) if device is not None else data


def _rows(triplets: Sequence[Triplet], pack_turns: bool,
          advantages: Optional[Mapping[Any, float]]) -> list[dict[str, Any]]:
    """One dict per packed sequence: prompt/response ids, mask, log-probs, scores, advantages, keys."""
    if not triplets:
        raise ValueError("triplets_to_dataproto() got no triplets")
    empty = [t.rollout_id for t in triplets if not t.response_ids]
    if empty:
        raise ValueError(f"triplets of rollouts {empty[:3]} have empty response_ids; drop them before conversion")
    episodes: dict[str, list[Triplet]] = {}
    for t in triplets:
        episodes.setdefault(t.rollout_id, []).append(t)
    rows: list[dict[str, Any]] = []
    for rollout_id, ts in episodes.items():
        ordered = sorted(ts, key=lambda t: t.turn)
        groups = {t.group_id for t in ordered}
        if len(groups) > 1:
            raise ValueError(f"rollout {rollout_id!r} has triplets in groups {sorted(groups)}; "
                             "an episode has one group")
        seqs = pack_episode(ordered, 0.0, pack_turns)
        for i, s in enumerate(seqs):
            first = ordered[s.token_turns[0]]
            # one temperature per row: pack_episode starts a new sequence for a turn sampled at another one
            p = len(first.prompt_ids)
            turns = s.token_turns[p:]
            mask = s.mask[p:]
            scores = [0.0] * len(turns)
            for k in dict.fromkeys(turns):  # each turn's step reward on its last model token
                scores[max(j for j, (kk, m) in enumerate(zip(turns, mask)) if kk == k and m)] += ordered[k].step_reward
            if i == len(seqs) - 1:  # the final reward once per episode, on its last model token
                scores[max(j for j, m in enumerate(mask) if m)] += ordered[-1].reward
            rows.append({
                "prompt": list(s.input_ids[:p]), "response": list(s.input_ids[p:]), "mask": list(mask),
                "logprobs": [lp if m else 0.0 for lp, m in zip(s.old_logprobs[p:], mask)],
                "has_logprobs": s.has_old, "scores": scores,
                "temperature": _temperature(first),
                "advantages": _row_advantages(advantages, rollout_id, ordered, turns, mask, s.token_advantages[p:]),
                GROUP_ID_KEY: first.group_id, "rollout_id": rollout_id, "turn": first.turn,
            })
    return rows


def _temperature(t: Triplet) -> float:
    """The temperature the logits are divided by: the sampling one, 1.0 for greedy (the engine's log-probs then)."""
    return t.temperature if t.temperature > 0 else 1.0


def _row_advantages(advantages: Optional[Mapping[Any, float]], rollout_id: str, ordered: list[Triplet],
                    turns: list[int], mask: list[int], carried: list[float]) -> list[float]:
    """The row's response advantages × mask: from ``advantages`` when given, else those the triplets carry
    (``carried``, the packed sequence's per-token ones; [] when a triplet carries none)."""
    if advantages is None:
        if any(t.advantages is None for t in ordered):
            return []
        return [a * m for a, m in zip(carried, mask)]
    out = []
    for k, m in zip(turns, mask):
        key = rollout_id if rollout_id in advantages else (rollout_id, ordered[k].turn)
        if key not in advantages:
            raise ValueError(f"advantages has no entry for rollout {rollout_id!r} (nor for its turn "
                             f"{ordered[k].turn}); key it by rollout_id or by (rollout_id, turn)")
        out.append(float(advantages[key]) * m)
    return out


def _width(lengths: list[int], limit: Optional[int], name: str, what: str, rows: list[dict[str, Any]]) -> int:
    longest = max(lengths)
    if limit is None:
        return longest
    if longest > limit:
        r = rows[lengths.index(longest)]
        raise ValueError(f"rollout {r['rollout_id']!r} (turn {r['turn']}) has a {what} of {longest} tokens, more than "
                         f"{name}={limit}; raise {name} (tokens are never cut: they are the engine's own)")
    return int(limit)


# ----- advantages through verl ----------------------------------------------------------
def grpo_advantages(data: Any, *, norm_adv_by_std: bool = True, min_group_size: int = 2) -> Any:
    """GRPO advantages (B, R) float32 of a :func:`triplets_to_dataproto` batch, by verl's own code.

    An episode's reward is the sum of ``token_level_scores`` over its rows (``rollout_id``); the
    episodes of a group (``uid``) go through ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage``
    (``(r − mean) / (std + 1e-6)``, unbiased std; ``norm_adv_by_std=False``: ``r − mean``), one item
    per episode, and every row of the episode gets its advantage times its ``response_mask``. With one
    row per episode this is the same as calling verl on the batch's ``token_level_scores``,
    ``response_mask`` and ``uid`` directly; per episode, a forked episode does not count twice in its
    group. The values equal :func:`lightning_nb.credit.group_advantages` of the episodes' rewards.
    The result is on the batch's device (that of ``token_level_scores``).

    Raises:
        ValueError: a group has fewer than ``min_group_size`` episodes (verl would train a lone
            episode on its raw reward, with mean 0 and std 1; drop such groups first, as
            ``GRPOTrainer`` does, or pass ``min_group_size=1`` for verl's rule).
    """
    import numpy as np
    import torch
    from verl.trainer.ppo import core_algos

    rollout_ids = list(data.non_tensor_batch["rollout_id"])
    uids = list(data.non_tensor_batch["uid"])
    episodes = list(dict.fromkeys(rollout_ids))
    index = {e: i for i, e in enumerate(episodes)}
    scores_B_R = data.batch["token_level_scores"]
    device = scores_B_R.device
    row_episode = torch.tensor([index[r] for r in rollout_ids], device=device)
    scores_E = torch.zeros(len(episodes), dtype=torch.float32, device=device).index_add_(
        0, row_episode, scores_B_R.float().sum(-1))
    group_E = [uids[rollout_ids.index(e)] for e in episodes]
    sizes: dict[Any, int] = {}
    for g in group_E:
        sizes[g] = sizes.get(g, 0) + 1
    small = {g: n for g, n in sizes.items() if n < min_group_size}
    if small:
        g, n = next(iter(small.items()))
        raise ValueError(f"group {g!r} has {n} episode(s), fewer than min_group_size={min_group_size} "
                         f"({len(small)} such group(s)); drop them before computing advantages")
    adv_E, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=scores_E[:, None], response_mask=torch.ones(len(episodes), 1, device=device),
        index=np.array(group_E, dtype=object), norm_adv_by_std_in_grpo=norm_adv_by_std)
    return adv_E[row_episode, 0][:, None] * data.batch["response_mask"].float()

