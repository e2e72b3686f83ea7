"""GRPO (and Dr. GRPO, DAPO) on CPU or one GPU, updating the engine's model in place: the default trainer.

The trainer is the only thing that updates weights. It shares the ``nn.Module``
with :class:`~lightning_nb.engines.transformers.TransformersEngine` (no weight copy) and holds
the engine's lock while it changes them. :meth:`GRPOTrainer.update` reads top to bottom: build the
batch (:mod:`~lightning_nb.trainers.batch`: kept episodes, packed sequences carrying the advantages the
algorithm gave, :mod:`lightning_nb.credit`), then PPO epochs over mini-batches of micro-batches
(the losses of :mod:`~lightning_nb.trainers.grpo.losses`), then the new weights to the engine.
The loop around it (pause, resume, checkpoints of the run) is the algorithm's
(:class:`~lightning_nb.algorithm.lightning_rl.LightningRL`), as are the notebook verbs ``algo.start()``,
``algo.pause()``, ``algo.save()`` ...
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from lightning_nb.credit import group_advantages, overlong_penalty, reward_to_go, transition_advantages
from lightning_nb.engines.transformers import TransformersEngine
from lightning_nb.trainers.agreement import agreement_metrics
from lightning_nb.trainers.base import ProgressCallback, Update, progress_ticker
from lightning_nb.trainers.batch import Batch, build_batch, check_batch, per_triplet_turn
from lightning_nb.trainers.config import lr_factor
from lightning_nb.trainers.grpo.config import GRPOConfig
from lightning_nb.trainers.grpo.logprobs import response_logprobs, shift_pad, tree_response_logprobs
from lightning_nb.trainers.grpo.losses import aggregate_loss, kl_estimate, policy_loss, truncated_is_weights
from lightning_nb.trainers.inplace import InPlaceTrainer
from lightning_nb.trainers.metrics import batch_metrics
from lightning_nb.trainers.microbatch import MicroBatcher, auto_micro_batch_tokens
from lightning_nb.trainers.packing import PackedSequence, pack_episode
from lightning_nb.trainers.prefix_tree import PrefixTree, build_prefix_tree, tree_path
from lightning_nb.types import Triplet

# the names this module has always exported (their homes: trainers.config, lightning_nb.credit, trainers.packing,
# grpo.config, grpo.logprobs)
__all__ = ["GRPOConfig", "GRPOTrainer", "group_advantages", "lr_factor", "overlong_penalty", "pack_episode",
           "response_logprobs", "reward_to_go", "transition_advantages"]


log = logging.getLogger(__name__)


def _no_progress(done: int, total: int, unit: str) -> None:
    pass


def _tokens(seqs: Sequence[PackedSequence]) -> list[list[int]]:
    return [s.input_ids for s in seqs]


@dataclass
class _Micro:
    """One micro-batch's tensors: padded rows (``ids_B_T``, ``attn_B_T``) or a prefix tree (``tree``), and what
    both forwards share: ``mask_B_L`` and ``temp_B`` (see :func:`response_logprobs`), ``T`` its longest row."""

    seqs: list[PackedSequence]
    T: int
    device: Any
    mask_B_L: Any
    temp_B: Any
    ids_B_T: Any = None
    attn_B_T: Any = None
    tree: Optional[PrefixTree] = None

    def logprobs(self, model: Any) -> Any:
        """(B, T − 1) log-probs of the response tokens under ``model`` (:func:`response_logprobs`, or
        :func:`tree_response_logprobs` over the tree)."""
        if self.tree is not None:
            return tree_response_logprobs(model, self.tree, _tokens(self.seqs), self.mask_B_L, self.temp_B)
        return response_logprobs(model, self.ids_B_T, self.attn_B_T, self.mask_B_L, self.temp_B)


def _lengths(seqs: Sequence[PackedSequence]) -> list[int]:
    return [len(s.input_ids) for s in seqs]


class GRPOTrainer(InPlaceTrainer):
    """Group Relative Policy Optimization on the engine's model.

    One of the two implementations of :class:`~lightning_nb.trainers.base.Trainer` (the other is
    :class:`~lightning_nb.trainers.verl.trainer.VerlTrainer`). The run is the algorithm's:
    ``algo.start(steps=...)`` runs its loop in the background; ``algo.pause()`` returns once the loop is
    parked at a step boundary; edits to :attr:`config` (or the algorithm's config) made while paused take
    effect on ``algo.resume()``, which validates them first; ``algo.save()`` / ``algo.load()`` continue a run
    exactly, in the same or a new process (:meth:`LightningRL.save <lightning_nb.algorithm.lightning_rl.LightningRL.save>`).

    Args:
        engine: serves the policy; its ``model`` is updated in place, and moved to
            ``config.device`` / ``config.dtype`` on construction (the engine follows it).
        config: :class:`GRPOConfig`.

    Raises:
        ConfigError: ``config.device`` is not available here, or ``config.gradient_checkpointing``
            is set for a model without transformers decoder layers.
    """

    config: GRPOConfig

    def __init__(self, engine: TransformersEngine, config: Optional[GRPOConfig] = None) -> None:
        super().__init__(engine, config or GRPOConfig())
        self._batcher = MicroBatcher()  # the micro-batch rule of the running update (_micro_batcher)

    # ----- the RL step ----------------------------------------------------------------
    def update(self, triplets: Sequence[Triplet], *, on_progress: Optional[ProgressCallback] = None,
               left_out: Sequence[Triplet] = ()) -> Update:
        """One GRPO step on ``triplets``, which carry the algorithm's advantages (``left_out``: the batch's triplets
        its credit does not train, counted in the metrics; :meth:`Trainer.update
        <lightning_nb.trainers.base.Trainer.update>`); returns its :class:`~lightning_nb.trainers.base.Update` (indexing it reads
        the metrics row).

        Steps, top to bottom:
          1. :func:`~lightning_nb.trainers.batch.build_batch`: drop episodes sampled more than
             ``max_staleness`` weight versions ago; pack each episode's turns into sequences with a
             response mask (:func:`~lightning_nb.trainers.packing.pack_episode`; forks are counted, or
             refused with ``fail_on_fork``); each token gets the advantage its triplet carries
             (:attr:`Triplet.advantages <lightning_nb.types.Triplet.advantages>`, the algorithm's credit:
             :mod:`lightning_nb.credit`; a deprecated batch without them is credited from this config's credit
             fields, as in earlier versions, with the KL penalty of ``kl_mode="reward"``);
          2. :meth:`_optimize`: ``ppo_epochs`` passes over mini-batches of ``mini_batch_size``
             sequences, one AdamW step each with gradient-norm clipping; each mini-batch is
             forwarded in micro-batches (:meth:`_micro_step`, gradients accumulated), each one
             prefix tree with ``prefix_tree`` (the default: every token shared by several sequences
             after the same tokens forwarded once, :mod:`~lightning_nb.trainers.prefix_tree`; sequences
             sorted by their tokens and cut where the tree would pass ``micro_batch_tokens`` nodes), else
             right-padded rows (sorted by length and packed to at most ``micro_batch_tokens``, padding
             counted); ``"auto"``: sized from free device memory at the start of the update, 2,048 on
             CPU (:mod:`~lightning_nb.trainers.microbatch`); ``None``: ``micro_batch_size`` rows in batch
             order; π_start's and the reference's scoring
             forwards are split the same way; each micro-batch done (also those
             of π_start's scoring forwards) calls ``on_progress(done, total, "micro-batches")``
             (the algorithm's loop shows it as ``progress``, phase ``"update"``);
          3. ``engine.load_weights(model)`` serves the new weights and bumps
             ``engine.weight_version`` (only when the weights changed); the learning rate
             moves one step along its schedule (:func:`~lightning_nb.trainers.config.lr_factor`).

        The loss of a mini-batch M, over the response tokens t of its sequences i, with
        ``r = π_θ(t) / π_old(t)`` and A_it the advantage of the turn token t came with::

            ℓ_it = w_it · max(−A_it r, −A_it clip(r, 1 − ε_low, 1 + ε_high))  PPO (Schulman et al. 2017)
                   (for A_it < 0 also capped at −3 A_it: dual-clip, Ye et al. 2020; verl's clip_ratio_c)
            token-mean               Σ_it ℓ_it / N_M                         verl default, DAPO
            seq-mean-token-mean      (1/G_M) Σ_i (1/|o_i|) Σ_t ℓ_it          GRPO paper
            seq-mean-token-sum       (1/G_M) Σ_i Σ_t ℓ_it
            seq-mean-token-sum-norm  (1/G_M) Σ_i Σ_t ℓ_it / max_response_len  Dr. GRPO (Liu et al. 2025, §3.2)
            + kl_coef · (the same aggregation of the KL estimator to the reference)   kl_mode="loss"

        computed by :func:`~lightning_nb.trainers.grpo.losses.policy_loss`, ``aggregate_loss`` and ``kl_estimate``
        (the same values as verl's ``compute_policy_loss_vanilla``, ``agg_loss`` and ``kl_penalty``; tests/test_advantages.py).
        N_M and G_M are the response tokens and sequences of the whole mini-batch, also the
        zero-advantage ones that ``skip_zero_advantage`` does not forward, so the micro-batch
        losses add up to the mini-batch's (gradient accumulation does not change the step).

        * π_old is fixed at the start of the update: the engine's log-probs (the policy that
          sampled), or the trainer's before the first optimizer step (π_start) for triplets
          without engine log-probs. With one optimizer step per batch (the default) π_start
          comes from the gradient forward itself; with more, :meth:`_score_at_start` records it first.
        * ε_low, ε_high: ``clip_ratio_low`` / ``clip_ratio_high``, both ``clip_ratio`` unless set
          (DAPO's clip-higher, Yu et al. 2025, §3.1: ε_high 0.28 leaves room for
          low-probability tokens to grow).
        * w_it = 1, or with ``tis_cap`` C, ``min(π_start(t) / π_engine(t), C)``: truncated importance
          sampling (Yao et al. 2025, "Your efficient RL framework secretly brings you
          off-policy RL training"; verl's ``compute_rollout_correction_weights``, token level);
          π_old is then π_start (decoupled PPO, as verl does it).

        The Update's ``batch`` holds one dict per sequence of the kept episodes
        (also those not forwarded): ``rollout_id``, ``group_id``, ``input_ids``,
        ``response_mask``, ``advantage`` (the mean of ``advantages`` over the trained tokens),
        ``advantages`` (per token), ``engine_logprobs`` and ``trainer_logprobs`` (π_start, or None
        when the sequence was not forwarded), the per-token lists as long as ``input_ids`` with 0.0
        where the mask is 0. Its ``advantages`` holds each kept episode's advantage and
        ``turn_advantages`` each triplet's, keyed ``(rollout_id, turn)``.

        Metrics (one row): ``step``, ``loss``, ``pg_loss`` and ``grad_norm`` (means over the
        optimizer steps), ``kl`` (the ``kl_penalty`` estimator to the reference; measured on every update
        while ``kl_coef > 0``, with ``track_reference_kl`` on the steps that are multiples of ``kl_every``,
        NaN on the others), ``ppo_kl``, ``pg_clipfrac`` and ``tis_weight_mean`` (NaN without
        ``tis_cap``) (means over the forwarded tokens of all epochs), ``logprob_diff_max``
        (largest per-token |π_start − engine| log-prob on the trained tokens of on-policy episodes, nats),
        ``logprob_diff_outliers``, ``logprob_diff_max_stale``, ``stale_tokens_trained``,
        ``tokens_without_engine_logprobs`` (:func:`~lightning_nb.trainers.agreement.agreement_metrics`),
        ``reward_mean``/``reward_std`` over the kept episodes' rewards as emitted,
        ``episodes``, ``groups``, ``groups_with_signal``, ``groups_dropped``,
        ``episodes_dropped``, ``transitions``, ``stale_episodes_dropped``, ``staleness_max``,
        ``sequences_trained``, ``tokens_trained``, ``optimizer_steps``, ``turn_forks``
        (sequences started because a turn's prompt did not extend the previous turn's
        tokens), ``truncated_responses`` (triplets with ``finish_reason == "length"``),
        ``intermediate_rewards`` (triplets with ``step_reward != 0``),
        ``update_seconds``, ``tokens_per_s``, ``lr`` (the learning rate this update used),
        ``micro_batches`` (forwards this update made: training micro-batches of every epoch plus π_start's
        and the reference's scoring forwards), ``padding_fraction`` (padding tokens / all tokens those
        forwards held, rows × the longest row each; 0 for prefix trees), ``forwarded_tokens`` (tokens those
        forwards held: a prefix tree's nodes, or rows × the longest row), ``prefix_shared_tokens`` (tokens of the
        forwarded sequences that a prefix tree did not forward again; 0 with ``prefix_tree=False``),
        ``micro_batch_tokens`` (the token budget used, tokens: ``"auto"`` resolved; NaN with fixed rows,
        ``micro_batch_tokens=None``),
        ``config_changes`` (edits applied at this step, or "").

        Departures from the GRPO paper (Shao et al. 2024) and the Agent Lightning paper:
          * no KL penalty by default (``kl_coef=0``, as in DAPO / Dr. GRPO), and no reference model: KL to
            the initial weights is measured only when asked (``track_reference_kl``, every ``kl_every`` steps);
          * one optimizer step per batch by default (``ppo_epochs=1``,
            ``mini_batch_size=None``), so clipping only bites on engine/trainer numeric
            mismatch or stale weights;
          * advantages are normalized per episode, not per transition, so an
            episode with more LLM calls does not weigh more in the group statistics
            (``credit="reward_to_go"`` normalizes per transition, so there it does);
          * groups smaller than ``min_group_size`` are dropped, not trained with verl's
            size-1 rule;
          * turns sharing a prefix are packed into one sequence, and sequences sharing a prefix are
            forwarded as one prefix tree (same gradient, fewer tokens);
          * token-mean loss over the whole batch (verl default), not mean-per-sequence.

        Raises:
            ConfigError: no triplets, a triplet with an empty response, a triplet sampled
                with ``top_p < 1`` (the engine's log-probs are of the untruncated
                distribution), ``kl_coef > 0`` without a reference model, or a fork with
                ``fail_on_fork``.
        """
        check_batch(triplets, left_out)
        report = on_progress or _no_progress
        with self._updating:
            changes = self._sync_config()
            lr = float(self.optimizer.param_groups[0]["lr"])
            t0 = time.perf_counter()
            report(0, 0, "micro-batches")
            # a VLLMEngine sharing the GPU sleeps meanwhile (Engine.released_for_update), so "auto" sees its memory free
            with self.engine.lock, self.engine.released_for_update():
                self._batcher = self._micro_batcher()
                batch = build_batch(self.config, triplets, self.engine.weight_version,
                                    score_kl=lambda seqs: self._score_at_start(
                                        seqs, progress_ticker(report, self._batcher.count_sequences(_tokens(seqs)),
                                                        "micro-batches"),
                                        with_reference=True), left_out=left_out)
                stats = self._optimize(batch.seqs, report)
                if stats["optimizer_steps"]:
                    self.engine.load_weights(self.model)  # in place, or pushed to a server (VLLMEngine)
                self._advance_schedule()
                self.updates_applied += 1
            metrics = self._step_metrics(list(triplets) + list(left_out), batch, stats, time.perf_counter() - t0, lr,
                                         [c.text for c in changes])
            self._last = Update(metrics, changes, list(triplets) + list(left_out), batch.advantages,
                                per_triplet_turn(triplets, batch.turn_advantages), [s.as_row() for s in batch.seqs])
            return self._last

    def _optimize(self, seqs: list[PackedSequence], report: ProgressCallback) -> dict[str, float]:
        """``ppo_epochs`` passes over mini-batches of ``seqs``, one optimizer step each (step 2 of :meth:`update`).

        Mini-batches are ``mini_batch_size`` consecutive sequences in batch order (no shuffle,
        as verl's default); one with nothing to forward takes no step. Returns the sums over
        micro-batches of ``loss``, ``pg_loss`` and the token-weighted ``kl``, ``ppo_kl``,
        ``pg_clipfrac``, ``tis_weight`` with the forwarded ``tokens``; ``grad_norm`` summed over
        the steps; and ``optimizer_steps`` (the engine/trainer agreement is read from the sequences afterwards,
        :func:`~lightning_nb.trainers.agreement.agreement_metrics`).
        """
        import torch

        cfg = self.config
        skip = cfg.skip_zero_advantage and (cfg.kl_coef == 0 or cfg.kl_mode == "reward")
        for s in seqs:  # without a KL loss term a zero advantage on every trained token has exactly zero gradient
            s.trained = any(s.mask) and not (skip and all(a == 0.0 for a, m in zip(s.token_advantages, s.mask) if m))
        size = cfg.mini_batch_size or max(len(seqs), 1)
        minis = [m for m in (seqs[i: i + size] for i in range(0, len(seqs), size)) if any(s.trained for s in m)]
        scored = ([s for s in seqs if s.trained and s.trainer_logprobs is None]
                  if cfg.ppo_epochs * len(minis) > 1 else [])
        count = self._batcher.count_sequences
        tick = progress_ticker(report, count(_tokens(scored)) + cfg.ppo_epochs * sum(
            count(_tokens([s for s in m if s.trained])) for m in minis), "micro-batches")
        if scored:  # fix π_start before the first step changes the weights
            self._score_at_start(scored, tick)
        stats = dict.fromkeys(("loss", "pg_loss", "kl", "ppo_kl", "pg_clipfrac", "tis_weight", "tokens",
                               "grad_norm"), 0.0)
        stats["optimizer_steps"] = 0
        for _ in range(cfg.ppo_epochs):
            for mini in minis:
                agg = {"mode": cfg.loss_agg_mode, "num_tokens": sum(sum(s.mask) for s in mini),  # the mini-batch's
                       "num_sequences": sum(1 for s in mini if any(s.mask)), "norm_len": cfg.max_response_len}
                trained = [s for s in mini if s.trained]
                for micro in self._batcher.split_sequences(trained, _tokens(trained)):
                    part = self._micro_step(micro, agg)
                    tick()
                    for k, v in part.items():
                        stats[k] += v
                stats["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(self._trainable,
                                                                           cfg.max_grad_norm))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                stats["optimizer_steps"] += 1
        return stats

    def _micro_batcher(self) -> MicroBatcher:
        """This update's micro-batch rule: ``micro_batch_tokens`` (``"auto"`` resolved now, from free device memory)
        and ``micro_batch_size`` (rows: the split without a budget, a cap with one)."""
        cfg = self.config
        budget: Optional[int]
        if cfg.micro_batch_tokens != "auto":
            budget = None if cfg.micro_batch_tokens is None else int(cfg.micro_batch_tokens)
        else:
            params = self._trainable
            pending = sum(p.numel() * p.element_size() for p in params if p.grad is None)
            if not self.optimizer.state:  # AdamW's two float32 moments, created by the first step
                pending += 8 * sum(p.numel() for p in params)
            budget = auto_micro_batch_tokens(self.model, gradient_checkpointing=cfg.gradient_checkpointing,
                                             lora=self.peft_model is not None, pending_bytes=pending)
        return MicroBatcher(max_tokens=budget, max_rows=cfg.micro_batch_size, tree=self._tree_forward())

    def _tree_forward(self) -> bool:
        """Whether this update forwards prefix trees: ``prefix_tree`` is set and the model's attention takes the
        tree mask (else padded rows, with one warning per trainer naming why)."""
        if not getattr(self.config, "prefix_tree", False):
            return False
        path = tree_path(self.model)
        if path != "tree" and not getattr(self, "_tree_warned", False):
            self._tree_warned = True
            log.warning("GRPOConfig.prefix_tree=True, but this update forwards padded rows: %s; set "
                        "prefix_tree=False to silence this, or load the model with attn_implementation='sdpa'",
                        path.split(": ", 1)[1])
        return path == "tree"

    def _step_metrics(self, triplets: Sequence[Triplet], batch: Batch, stats: dict[str, float], seconds: float,
                      lr: float, changes: list[str]) -> dict[str, Any]:
        """The metrics row of one update (see :meth:`update`)."""
        steps, tokens = int(stats.pop("optimizer_steps")), stats.pop("tokens")
        tis_weight, grad_norm = stats.pop("tis_weight"), stats.pop("grad_norm")
        trained = [s for s in batch.seqs if s.trained]
        if not steps:  # nothing was forwarded, so nothing was measured
            stats = {k: math.nan for k in stats}
        else:  # means over the optimizer steps, and over the forwarded tokens
            for k in ("loss", "pg_loss"):
                stats[k] = stats[k] / steps
            for k in ("kl", "ppo_kl", "pg_clipfrac"):
                stats[k] = stats[k] / max(tokens, 1)
        groups = batch.groups
        signal = {groups[r] for r, advs in batch.turn_advantages.items() if any(a != 0.0 for a in advs.values())}
        head, tail = batch_metrics(triplets, batch, signal, changes)
        return {"step": self.updates_applied, **stats, **agreement_metrics(batch.seqs), **head,
                "sequences_trained": len(trained), "tokens_trained": sum(sum(s.mask) for s in trained),
                "grad_norm": grad_norm / steps if steps else 0.0, "update_seconds": seconds,
                "tokens_per_s": sum(len(s.input_ids) for s in trained) / seconds if seconds > 0 else 0.0,
                "lr": lr, "optimizer_steps": steps, "micro_batches": self._batcher.forwards,
                "padding_fraction": self._batcher.padding_fraction, "forwarded_tokens": self._batcher.padded,
                "prefix_shared_tokens": self._batcher.shared,
                "micro_batch_tokens": (self._batcher.max_tokens if self._batcher.max_tokens is not None
                                       else math.nan),
                "tis_weight_mean": tis_weight / tokens if self.config.tis_cap is not None and tokens else math.nan,
                **tail}

    def _inputs(self, micro: list[PackedSequence]) -> _Micro:
        """The tensors of a micro-batch: its prefix tree when the batcher forwards trees, else its rows right-padded
        to the longest T; and ``mask_B_L``, ``temp_B`` either way. Counts the forward in the batcher."""
        import torch

        T = max(len(s.input_ids) for s in micro)
        device = next(self.model.parameters()).device
        # targets are tokens 1..T-1; position t of the *_B_L tensors scores token t+1
        mask_B_L = shift_pad([s.mask for s in micro], T, device)
        temp_B = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in micro], device=device)
        m = _Micro(micro, T, device, mask_B_L, temp_B)
        if self._batcher.tree:
            m.tree = build_prefix_tree(_tokens(micro))
            self._batcher.record(_lengths(micro), nodes=m.tree.nodes)
            return m
        self._batcher.record(_lengths(micro))
        pad = self.engine.pad_token_id
        m.ids_B_T = torch.tensor([s.input_ids + [pad] * (T - len(s.input_ids)) for s in micro], device=device)
        m.attn_B_T = torch.tensor([[1] * len(s.input_ids) + [0] * (T - len(s.input_ids)) for s in micro],
                                  device=device)
        return m

    def _score_at_start(self, seqs: list[PackedSequence], tick: Optional[Callable[[], None]] = None,
                        with_reference: bool = False) -> None:
        """Record π_start, the log-probs of ``seqs`` under the weights before any step of this update, without grad.

        Sets each sequence's ``trainer_logprobs``; ``with_reference`` also sets ``kl_sum``,
        the ``kl_penalty`` estimator to the reference summed over its response tokens. ``tick()`` is
        called after each micro-batch.
        """
        import torch

        with torch.no_grad():
            for micro in self._batcher.split_sequences(seqs, _tokens(seqs)):
                m = self._inputs(micro)
                logp_B_L = m.logprobs(self.model)
                if with_reference:
                    ref_B_L = self._reference_logprobs(m)
                    kl_B = (kl_estimate(logp_B_L, ref_B_L, self.config.kl_penalty) * m.mask_B_L).sum(-1)
                for b, s in enumerate(micro):
                    s.trainer_logprobs = [0.0] + logp_B_L[b, : len(s.input_ids) - 1].tolist()
                    if with_reference:
                        s.kl_sum = float(kl_B[b])
                if tick is not None:
                    tick()

    def _reference_logprobs(self, m: _Micro) -> Any:
        """Log-probs (B, T-1) of micro-batch ``m`` under the reference policy, without grad (see :func:`response_logprobs`).

        With LoRA that is the model itself with its adapters disabled (peft's ``disable_adapter``;
        the engine lock held by :meth:`update` keeps the engine from generating meanwhile).
        """
        import torch

        with torch.no_grad():
            if self.peft_model is None:
                return m.logprobs(self.reference)
            with self.peft_model.disable_adapter():
                return m.logprobs(self.model)

    def _micro_step(self, micro: list[PackedSequence], agg: dict[str, Any]) -> dict:
        """Forward/backward one micro-batch; returns its token-weighted sums of the step's metrics.

        π_start is this forward's log-probs, detached, when the update takes one optimizer
        step (and records them in ``trainer_logprobs``), else what :meth:`_score_at_start` recorded.
        """
        import torch

        cfg = self.config
        m = self._inputs(micro)
        T, device, mask_B_L = m.T, m.device, m.mask_B_L
        adv_B_L = shift_pad([s.token_advantages for s in micro], T, device) * mask_B_L  # per token: turns differ
        logp_B_L = m.logprobs(self.model)
        if micro[0].trainer_logprobs is None:  # no step yet in this update: this forward is π_start
            start_B_L = logp_B_L.detach()
            for b, s in enumerate(micro):
                s.trainer_logprobs = [0.0] + start_B_L[b, : len(s.input_ids) - 1].tolist()
        else:
            start_B_L = shift_pad([s.trainer_logprobs or [] for s in micro], T, device)  # (all set: micro[0]'s is)
        has_old_B = torch.tensor([s.has_old for s in micro], device=device)[:, None]
        engine_B_L = torch.where(has_old_B, shift_pad([s.old_logprobs for s in micro], T, device), start_B_L)
        old_B_L, is_B_L = engine_B_L, None
        if cfg.tis_cap is not None:  # PPO against π_start; π_start/π_engine, capped, weighs each token
            old_B_L = start_B_L
            is_B_L = truncated_is_weights(start_B_L - engine_B_L, mask_B_L, cfg.tis_cap)
        pg_loss, pg_metrics = policy_loss(
            old_B_L, logp_B_L, adv_B_L, mask_B_L, weights_B_L=is_B_L, **agg,
            clip_low=cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low,
            clip_high=cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high)
        loss = pg_loss
        tokens = float(mask_B_L.sum())
        kl_sum = math.nan  # the reference is not scored on this update (InPlaceTrainer._reference_active): kl is NaN
        if self._reference_active():
            ref_B_L = self._reference_logprobs(m)
            kl_B_L = kl_estimate(logp_B_L, ref_B_L, cfg.kl_penalty)
            if cfg.kl_coef > 0 and cfg.kl_mode == "loss":
                loss = loss + cfg.kl_coef * aggregate_loss(kl_B_L, mask_B_L, **agg)
            kl_sum = float((kl_B_L.detach() * mask_B_L).sum())
        loss.backward()
        return {"loss": float(loss.detach()), "pg_loss": float(pg_loss.detach()), "kl": kl_sum,
                "ppo_kl": pg_metrics["ppo_kl"] * tokens, "pg_clipfrac": pg_metrics["pg_clipfrac"] * tokens,
                "tis_weight": float((is_B_L * mask_B_L).sum()) if is_B_L is not None else 0.0, "tokens": tokens}
