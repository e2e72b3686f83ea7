"""Packing an episode's turns into training sequences, the step both trainers share.

:func:`pack_episode` turns one episode's triplets (one per LLM call, ordered by turn) into
:class:`PackedSequence` objects: when a turn's prompt extends the previous turn's prompt + response
token for token, the turns share one sequence (the tool results and user text in between get
response mask 0, the model's tokens 1: the response mask of multi-turn RL); otherwise a new sequence
starts (a *fork*). :class:`~lightning_nb.trainers.grpo.trainer.GRPOTrainer` trains these sequences;
:func:`lightning_nb.trainers.verl.bridge.triplets_to_dataproto` turns them into verl's rows.
Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_nb.credit import episodes_of
from lightning_nb.types import GROUP_ID_KEY, Triplet

__all__ = ["PackedSequence", "pack_episode", "first_difference", "episodes_of"]  # episodes_of: lightning_nb.credit


@dataclass
class PackedSequence:
    """One training sequence: tokens, response mask (1 = trained token), behavior logprobs, advantage.

    ``old_logprobs``, ``mask`` and ``input_ids`` have one length; ``trainer_logprobs`` (same
    length) are the trainer's log-probs at the start of the update, once it has scored the
    sequence. ``fork_at`` is set on a sequence that :func:`pack_episode` started because the
    turn's prompt did not extend the previous sequence: the first differing token position.

    ``weight_version`` is the oldest weight version among its turns but replayed ones (None when no such turn recorded
    one), and
    ``staleness`` how many versions before the update's weights that is (set by
    :func:`~lightning_nb.trainers.batch.build_batch`; 0 for a sequence sampled by the weights the update
    starts from, and for an unknown version).

    Advantages are per token, since one sequence can hold several turns: ``token_turns[j]`` is
    the index (0..T−1, in turn order among the episode's T triplets) of the transition token j
    came with (its prompt or its response), and ``token_advantages[j]`` that transition's
    advantage; both as long as ``input_ids``. ``advantage`` is their mean over the response
    tokens (mask 1), for displays; the loss uses ``token_advantages``.
    """

    input_ids: list[int]
    mask: list[int]
    old_logprobs: list[float]
    has_old: bool
    advantage: float
    temperature: float
    rollout_id: str = ""
    group_id: str = ""
    turn: int = 0
    fork_at: Optional[int] = None
    trained: bool = False
    trainer_logprobs: Optional[list[float]] = None
    kl_sum: float = 0.0
    token_turns: list[int] = field(default_factory=list)
    token_advantages: list[float] = field(default_factory=list)
    weight_version: Optional[int] = None
    staleness: int = 0

    def set_advantages(self, by_turn: dict[int, float]) -> None:
        """Give token j the advantage ``by_turn[token_turns[j]]``; ``advantage`` becomes their response-token mean."""
        self.token_advantages = [by_turn[k] for k in self.token_turns]
        self.summarize_advantages()

    def summarize_advantages(self) -> None:
        """Set ``advantage`` to the mean of ``token_advantages`` over the response tokens (mask 1; all tokens when
        none is), exactly their value when all are equal."""
        trained = [a for a, m in zip(self.token_advantages, self.mask) if m] or self.token_advantages
        # one value exactly when all are equal (credit="episode"): a float mean of n copies can round
        self.advantage = trained[0] if len(set(trained)) == 1 else (sum(trained) / len(trained) if trained else 0.0)

    def as_row(self) -> dict[str, Any]:
        """The sequence as :attr:`Update.batch <lightning_nb.trainers.base.Update.batch>` holds it: engine/trainer log-probs 0.0 off the mask;
        ``engine_logprobs`` None when a turn of it came without the engine's log-probs (``has_old`` False: 0.0
        there would read as a log-prob, probability 1), ``weight_version`` and ``staleness`` as above."""
        return {"rollout_id": self.rollout_id, GROUP_ID_KEY: self.group_id, "input_ids": list(self.input_ids),
                "response_mask": list(self.mask), "advantage": float(self.advantage),
                "advantages": [a if m else 0.0 for a, m in zip(self.token_advantages, self.mask)],
                "weight_version": self.weight_version, "staleness": self.staleness,
                "engine_logprobs": ([lp if m else 0.0 for lp, m in zip(self.old_logprobs, self.mask)]
                                    if self.has_old else None),
                "trainer_logprobs": ([lp if m else 0.0 for lp, m in zip(self.trainer_logprobs, self.mask)]
                                     if self.trained and self.trainer_logprobs is not None else None)}


def pack_episode(triplets: Sequence[Triplet], advantage: float, pack: bool = True, *,
                 mask_truncated: bool = False) -> list[PackedSequence]:
    """Turn one episode's triplets (ordered by turn) into training sequences.

    When a turn's prompt starts with the previous sequence (prompt + response),
    the new tokens are appended: tool results/user text get mask 0, the response
    mask 1 (the response_mask of multi-turn RL). Otherwise a new sequence starts; with
    ``pack`` that is a fork, and the new sequence's ``fork_at`` is the first position where
    the prompt differs from the previous sequence (an episode packed into k sequences has
    k − 1 forks). With ``mask_truncated`` the response of a turn the engine cut at
    ``max_tokens`` (``finish_reason == "length"``) gets mask 0 (DAPO's overlong filtering). A replayed turn
    (:attr:`Triplet.replayed`: answered from a parent rollout's record by a branch) gets mask 0 always: its tokens
    are the branch's context, trained once, in the parent.
    A turn sampled at another temperature than the sequence it extends starts a new sequence
    (not a fork: ``fork_at`` stays None), since a sequence is scored at one temperature.
    Each token's ``token_turns`` entry is its transition's index in turn order (0..T−1). A triplet that carries
    :attr:`Triplet.advantages` gives its response tokens those and the context tokens it brings (its prompt, or
    the part of it that extends the sequence) the first of them; every token of a triplet without gets
    ``advantage`` (:meth:`PackedSequence.set_advantages` sets per-turn ones).
    """
    out: list[PackedSequence] = []
    for k, t in enumerate(sorted(triplets, key=lambda t: t.turn)):
        lp = list(t.logprobs) if t.logprobs is not None else [0.0] * len(t.response_ids)
        given = t.advantages
        context_adv = given[0] if given else advantage  # the tokens before this turn's response
        response_adv = list(given) if given is not None else [advantage] * len(t.response_ids)
        keep = 0 if (mask_truncated and t.finish_reason == "length") or t.replayed else 1  # response mask value
        cur = out[-1] if out else None
        extends = cur is not None and t.prompt_ids[: len(cur.input_ids)] == cur.input_ids
        if pack and extends and cur is not None and t.temperature == cur.temperature:
            extra = t.prompt_ids[len(cur.input_ids):]
            cur.input_ids += extra + t.response_ids
            cur.mask += [0] * len(extra) + [keep] * len(t.response_ids)
            cur.old_logprobs += [0.0] * len(extra) + lp
            cur.has_old = cur.has_old and t.logprobs is not None
            cur.weight_version = _oldest(cur.weight_version, None if t.replayed else t.weight_version)
            cur.token_turns += [k] * (len(extra) + len(t.response_ids))
            cur.token_advantages += [context_adv] * len(extra) + response_adv
        else:
            fork_at = (first_difference(cur.input_ids, t.prompt_ids) if pack and cur is not None and not extends
                       else None)
            out.append(PackedSequence(list(t.prompt_ids) + list(t.response_ids),
                                 [0] * len(t.prompt_ids) + [keep] * len(t.response_ids),
                                 [0.0] * len(t.prompt_ids) + lp, t.logprobs is not None, advantage, t.temperature,
                                 rollout_id=t.rollout_id, group_id=t.group_id, turn=t.turn, fork_at=fork_at,
                                 weight_version=None if t.replayed else t.weight_version,
                                 token_turns=[k] * (len(t.prompt_ids) + len(t.response_ids)),
                                 token_advantages=[context_adv] * len(t.prompt_ids) + response_adv))
    return out


def _oldest(a: Optional[int], b: Optional[int]) -> Optional[int]:
    """The older of two weight versions, either of which may be unknown (None)."""
    return b if a is None else a if b is None else min(a, b)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """First index where ``a`` and ``b`` differ (the shorter length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
