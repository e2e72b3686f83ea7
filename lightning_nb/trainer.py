"""GRPO trainer on CPU (or one GPU) that updates the engine's model in place.

The trainer is the only thing that updates weights. It shares the ``nn.Module``
with :class:`~lightning_nb.engine.TransformersEngine` (no weight copy) and holds
the engine's lock while it changes them. It can run an algorithm's loop in a
background thread (:meth:`GRPOTrainer.start`) and be paused, inspected and
resumed from a notebook cell; :meth:`save` / :meth:`load` continue across kernels.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import pandas as pd

from lightning_nb.adapter import triplets_df
from lightning_nb.checkpoint import (CHECKPOINT_FORMAT, check_signature, model_signature, plain, rng_state,
                                     set_rng_state, weights_fingerprint)
from lightning_nb.control import BackgroundLoop, TrainerStopped, config_edits
from lightning_nb.engine import TransformersEngine
from lightning_nb.errors import ConfigError
from lightning_nb.types import Triplet

if TYPE_CHECKING:
    from lightning_nb.algorithm import LightningRL

__all__ = ["GRPOConfig", "GRPOTrainer", "TrainerStopped", "group_advantages", "pack_episode", "response_logprobs"]

log = logging.getLogger(__name__)


@dataclass
class GRPOConfig:
    """Hyper-parameters of the GRPO update. Validated on construction and again on :meth:`GRPOTrainer.resume`.

    Fields may be edited while the trainer is paused; the edit takes effect at the next
    update and is recorded in the metrics (``config_changes``, and :attr:`GRPOTrainer.config_changes`).
    """

    learning_rate: float = field(default=2e-5, metadata={
        "help": "AdamW learning rate (2e-5 suits SmolLM2-135M: 5e-5 drifted, KL to the initial weights > 0.6 "
                "within 12 steps; use ~1e-6 for 1B+ models)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this value."})
    clip_ratio: float = field(default=0.2, metadata={"help": "PPO clip range epsilon for the importance ratio."})
    kl_coef: float = field(default=0.0, metadata={
        "help": "Weight of the KL-to-reference loss; 0 disables it. > 0 needs the reference model, kept when "
                "kl_coef > 0 or track_reference_kl is set at construction."})
    kl_penalty: str = field(default="low_var_kl", metadata={"help": "verl KL estimator: kl, abs, mse, low_var_kl."})
    track_reference_kl: bool = field(default=True, metadata={
        "help": "Keep a frozen copy of the initial weights and report KL to it every step (costs one forward)."})
    norm_adv_by_std: bool = field(default=True, metadata={"help": "Divide group-relative advantages by the group std."})
    min_group_size: int = field(default=2, metadata={
        "help": "Groups with fewer episodes than this (after failures, timeouts and adapter skips) are dropped "
                "from the update and counted in groups_dropped; must be >= 2 (a group of one has no baseline)."})
    max_staleness: int = field(default=1, metadata={
        "help": "Episodes sampled more than this many weight versions before the current one are dropped "
                "(stale_episodes_dropped); fresher off-policy samples are corrected by the clipped importance "
                "ratio against the engine's behavior log-probs (PPO). 0 = strictly on-policy."})
    loss_agg_mode: str = field(default="token-mean", metadata={"help": "verl loss aggregation mode."})
    micro_batch_size: int = field(default=4, metadata={"help": "Sequences per forward/backward (memory bound)."})
    pack_turns: bool = field(default=True, metadata={
        "help": "Pack an episode's turns into one sequence when each prompt extends the previous turn."})
    skip_zero_advantage: bool = field(default=True, metadata={
        "help": "Skip the forward/backward of sequences whose advantage is 0 when kl_coef == 0 (their gradient "
                "is exactly 0); they still count in the loss denominator, so the step size is unchanged."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field out of range."""
        checks = {
            "learning_rate": self.learning_rate > 0, "weight_decay": self.weight_decay >= 0,
            "max_grad_norm": self.max_grad_norm > 0, "clip_ratio": 0 < self.clip_ratio < 1,
            "kl_coef": self.kl_coef >= 0, "micro_batch_size": self.micro_batch_size >= 1,
            "min_group_size": self.min_group_size >= 2, "max_staleness": self.max_staleness >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"GRPOConfig.{name}={getattr(self, name)!r} is out of range; "
                                  f"see GRPOConfig.__dataclass_fields__['{name}'].metadata['help']")
        if self.kl_penalty not in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"):
            raise ConfigError(f"GRPOConfig.kl_penalty={self.kl_penalty!r}; use one of kl, abs, mse, low_var_kl")
        if self.loss_agg_mode not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
            raise ConfigError(f"GRPOConfig.loss_agg_mode={self.loss_agg_mode!r}; use token-mean, "
                              "seq-mean-token-sum or seq-mean-token-mean")


def group_advantages(rewards: dict[str, float], groups: dict[str, str], *, min_group_size: int = 2,
                     norm_by_std: bool = True) -> tuple[dict[str, float], dict[str, int]]:
    """GRPO's group-relative outcome advantage per episode, with undersized groups dropped.

    For the episodes ``i`` of a group ``g`` with rewards ``r_i``:
    ``A_i = (r_i - mean_g(r)) / (std_g(r) + 1e-6)`` with the unbiased std (``norm_by_std``;
    GRPO, Shao et al. 2024, "DeepSeekMath", section 4.1.2; computed by verl's
    ``compute_grpo_outcome_advantage``), or ``A_i = r_i - mean_g(r)`` without it (Dr. GRPO,
    Liu et al. 2025). Rewards ``[1, 0, 0, 0]`` give ``[1.5, -0.5, -0.5, -0.5]``.

    A group with fewer than ``min_group_size`` episodes (failures, timeouts and adapter
    skips shrink groups) is dropped: with one episode verl would use mean 0 and std 1,
    training the survivor on its raw reward, and two or three samples make a poor baseline.

    Args:
        rewards: episode (rollout) id -> final reward.
        groups: episode id -> group id (same keys as ``rewards``).
        min_group_size: smallest group kept (>= 2).
        norm_by_std: divide by the group std.

    Returns:
        ``(advantages, dropped)``: episode id -> advantage for the kept episodes, and
        group id -> size for the dropped groups.

    Raises:
        ConfigError: ``min_group_size`` < 2, or ``groups`` lacks an episode of ``rewards``.
    """
    import torch
    from verl.trainer.ppo import core_algos

    if min_group_size < 2:
        raise ConfigError(f"min_group_size must be >= 2, got {min_group_size}: a group of one has no baseline")
    missing = [e for e in rewards if e not in groups]
    if missing:
        raise ConfigError(f"groups has no group for episode {missing[0]!r}")
    sizes: dict[str, int] = {}
    for e in rewards:
        sizes[groups[e]] = sizes.get(groups[e], 0) + 1
    dropped = {g: n for g, n in sizes.items() if n < min_group_size}
    kept = [e for e in rewards if groups[e] not in dropped]
    if not kept:
        return {}, dropped
    rewards_E = torch.tensor([rewards[e] for e in kept], dtype=torch.float32)
    adv_E, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=rewards_E[:, None], response_mask=torch.ones(len(kept), 1),
        index=[groups[e] for e in kept], norm_adv_by_std_in_grpo=norm_by_std)
    return {e: float(a) for e, a in zip(kept, adv_E[:, 0])}, dropped


@dataclass
class _Sequence:
    """One training sequence: tokens, response mask (1 = trained token), behavior logprobs, advantage."""

    input_ids: list[int]
    mask: list[int]
    old_logprobs: list[float]
    has_old: bool
    advantage: float
    temperature: float


def pack_episode(triplets: Sequence[Triplet], advantage: float, pack: bool = True) -> list[_Sequence]:
    """Turn one episode's triplets (ordered by turn) into training sequences.

    When a turn's prompt starts with the previous sequence (prompt + response),
    the new tokens are appended: tool results/user text get mask 0, the response
    mask 1 (the response_mask of multi-turn RL). Otherwise a new sequence starts.
    """
    out: list[_Sequence] = []
    for t in sorted(triplets, key=lambda t: t.turn):
        lp = list(t.logprobs) if t.logprobs is not None else [0.0] * len(t.response_ids)
        cur = out[-1] if out else None
        if pack and cur is not None and t.prompt_ids[: len(cur.input_ids)] == cur.input_ids:
            extra = t.prompt_ids[len(cur.input_ids):]
            cur.input_ids += extra + t.response_ids
            cur.mask += [0] * len(extra) + [1] * len(t.response_ids)
            cur.old_logprobs += [0.0] * len(extra) + lp
            cur.has_old = cur.has_old and t.logprobs is not None
        else:
            out.append(_Sequence(list(t.prompt_ids) + list(t.response_ids),
                                 [0] * len(t.prompt_ids) + [1] * len(t.response_ids),
                                 [0.0] * len(t.prompt_ids) + lp, t.logprobs is not None, advantage, t.temperature))
    return out


class _VerlActorView:
    """The few ActorConfig fields verl's ``compute_policy_loss_vanilla`` reads."""

    def __init__(self, clip_ratio: float, batch_num_tokens: int, loss_agg_mode: str, num_sequences: int) -> None:
        self.clip_ratio = self.clip_ratio_low = self.clip_ratio_high = clip_ratio
        self.global_batch_info = {"dp_size": 1, "batch_num_tokens": batch_num_tokens, "global_batch_size": num_sequences}
        self.loss_agg_mode = loss_agg_mode

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


class GRPOTrainer(BackgroundLoop):
    """Group Relative Policy Optimization on the engine's model.

    Control from a notebook (:class:`~lightning_nb.control.BackgroundLoop`): :meth:`start`
    runs an algorithm's loop in the background; :meth:`pause` returns once the loop is
    parked at a step boundary; edits to :attr:`config` (or the algorithm's config) made
    while paused take effect on :meth:`resume`, which validates them first; :meth:`save` /
    :meth:`load` continue a run exactly, in the same or a new process.

    Args:
        engine: serves the policy; its ``model`` is updated in place.
        config: :class:`GRPOConfig`.
    """

    def __init__(self, engine: TransformersEngine, config: Optional[GRPOConfig] = None) -> None:
        import torch

        self.engine = engine
        self.model = engine.model
        self.config = config or GRPOConfig()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.config.learning_rate,
                                           weight_decay=self.config.weight_decay)
        self.reference = None
        if self.config.track_reference_kl or self.config.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.step = 0
        self.metrics: list[dict[str, Any]] = []
        self.config_changes: list[dict[str, Any]] = []  # {"step", "field", "old", "new"} per edit applied
        self.last_triplets: list[Triplet] = []
        self.last_advantages: dict[str, float] = {}
        self.algorithm: Optional["LightningRL"] = None
        self._pending_algorithm_state: Optional[dict[str, Any]] = None
        self._applied_config = asdict(self.config)
        self._updating = threading.Lock()
        self._init_loop()

    # ----- the RL step ----------------------------------------------------------------
    def update(self, triplets: Sequence[Triplet]) -> dict[str, Any]:
        """One GRPO step on ``triplets``; returns its metrics (also appended to :attr:`metrics`).

        Steps, top to bottom:
          1. episode reward per rollout → group-relative advantage (:func:`group_advantages`;
             groups = ``Triplet.group_id``); groups under ``min_group_size`` are dropped;
          2. every transition of an episode gets the episode's advantage (LightningRL);
          3. pack turns into sequences with a response mask;
          4. recompute log-probs of response tokens with gradients through the model's own
             ``forward``; clipped policy loss against the engine's behavior log-probs (verl
             ``compute_policy_loss_vanilla``), plus ``kl_coef`` × KL to the initial weights
             (verl ``kl_penalty``); the token-mean denominator counts every kept sequence,
             also the zero-advantage ones that ``skip_zero_advantage`` does not forward;
          5. one AdamW step with gradient-norm clipping; ``engine.load_weights(model)`` serves
             the new weights and bumps ``engine.weight_version`` (only when the weights changed).

        Episodes sampled more than ``max_staleness`` weight versions ago are dropped
        (``stale_episodes_dropped``; ``staleness_max`` is the oldest kept or dropped).

        Metrics (one row): ``step``, ``loss``, ``pg_loss``, ``kl``, ``ppo_kl``, ``pg_clipfrac``,
        ``logprob_diff_max`` (largest per-token |trainer − engine| log-prob on the trained
        tokens, nats), ``reward_mean``/``reward_std`` over the batch's episodes,
        ``episodes``, ``groups``, ``groups_with_signal``, ``groups_dropped``,
        ``episodes_dropped``, ``transitions``, ``sequences_trained``, ``tokens_trained``,
        ``grad_norm``, ``update_seconds``, ``tokens_per_s``, ``lr`` (read from the
        optimizer), ``config_changes`` (edits applied at this step, or "").

        Departures from the GRPO paper (Shao et al. 2024) and the Agent Lightning paper:
          * no KL penalty by default (``kl_coef=0``, as in DAPO / Dr. GRPO); KL to the
            initial weights is still measured (``track_reference_kl``);
          * one gradient step per batch (no PPO epochs); the "old" policy is the one
            that sampled (engine log-probs), so clipping only bites on engine/trainer
            numeric mismatch or stale weights;
          * advantages are normalized per episode, not per transition, so an
            episode with more LLM calls does not weigh more in the group statistics;
          * groups smaller than ``min_group_size`` are dropped, not trained with verl's
            size-1 rule;
          * turns sharing a prefix are packed into one sequence (same gradient, fewer tokens);
          * token-mean loss over the whole batch (verl default), not mean-per-sequence.

        Raises:
            ConfigError: no triplets, a triplet with an empty response, a triplet sampled
                with ``top_p < 1`` (the engine's log-probs are of the untruncated
                distribution), or ``kl_coef > 0`` without a reference model.
        """
        import torch
        from verl.trainer.ppo import core_algos

        self._check_batch(triplets)
        with self._updating:
            changes = self._sync_config()
            t0 = time.perf_counter()
            cfg = self.config
            episodes: dict[str, list[Triplet]] = {}
            for t in triplets:
                episodes.setdefault(t.rollout_id, []).append(t)
            staleness = {r: max((self.engine.weight_version - t.weight_version for t in ts
                                 if t.weight_version is not None), default=0) for r, ts in episodes.items()}
            stale = [r for r, age in staleness.items() if age > cfg.max_staleness]
            for r in stale:  # too old to correct by importance weighting
                del episodes[r]
            rewards = {r: ts[0].reward for r, ts in episodes.items()}
            groups = {r: ts[0].group_id for r, ts in episodes.items()}
            advantages, dropped = group_advantages(rewards, groups, min_group_size=cfg.min_group_size,
                                                   norm_by_std=cfg.norm_adv_by_std)
            seqs = [s for r in advantages for s in pack_episode(episodes[r], advantages[r], cfg.pack_turns)]
            skip = cfg.skip_zero_advantage and cfg.kl_coef == 0
            trained = [s for s in seqs if s.advantage != 0.0] if skip else seqs
            num_tokens = sum(sum(s.mask) for s in seqs)  # the denominator covers skipped sequences too
            stats = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "ppo_kl": 0.0, "pg_clipfrac": 0.0,
                     "logprob_diff_max": 0.0}
            grad_norm = 0.0
            with self.engine.lock:
                if trained:
                    view = _VerlActorView(cfg.clip_ratio, num_tokens, cfg.loss_agg_mode, len(seqs))
                    for i in range(0, len(trained), cfg.micro_batch_size):
                        part = self._micro_step(trained[i: i + cfg.micro_batch_size], view, core_algos)
                        for k in stats:
                            stats[k] = max(stats[k], part[k]) if k == "logprob_diff_max" else stats[k] + part[k]
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    self.engine.load_weights(self.model)  # in place, or pushed to a server (VLLMEngine)
                self.step += 1
            seconds = time.perf_counter() - t0
            trained_tokens = sum(sum(s.mask) for s in trained)
            if not trained:  # nothing was forwarded, so nothing was measured
                stats = {k: math.nan for k in stats}
            else:  # the forwarded tokens' share of the token-weighted means
                for k in ("kl", "ppo_kl", "pg_clipfrac"):
                    stats[k] = stats[k] / max(trained_tokens, 1)
            kept_rewards = [rewards[r] for r in advantages]
            signal = {groups[r] for r, a in advantages.items() if a != 0.0}
            metrics: dict[str, Any] = {"step": self.step, **stats}
            metrics.update({
                "reward_mean": _mean(kept_rewards), "reward_std": _std(kept_rewards),
                "episodes": len(advantages), "groups": len({groups[r] for r in advantages}),
                "groups_with_signal": len(signal), "groups_dropped": len(dropped),
                "episodes_dropped": sum(dropped.values()), "transitions": len(triplets),
                "stale_episodes_dropped": len(stale), "staleness_max": max(staleness.values(), default=0),
                "sequences_trained": len(trained), "tokens_trained": trained_tokens, "grad_norm": grad_norm,
                "update_seconds": seconds,
                "tokens_per_s": sum(len(s.input_ids) for s in trained) / seconds if seconds > 0 else 0.0,
                "lr": float(self.optimizer.param_groups[0]["lr"]), "config_changes": "; ".join(changes),
            })
            self.last_triplets, self.last_advantages = list(triplets), advantages
            self.metrics.append(metrics)
            return metrics

    def signal_groups(self, triplets: Sequence[Triplet]) -> set[str]:
        """Group ids of ``triplets`` that :meth:`update` would learn from: kept groups with a non-zero advantage.

        The same rule as :meth:`update` (:func:`group_advantages` with this config), so the
        algorithm's ``groups_with_signal`` counts exactly what the trainer can use.
        """
        rewards = {t.rollout_id: t.reward for t in triplets}
        groups = {t.rollout_id: t.group_id for t in triplets}
        advantages, _ = group_advantages(rewards, groups, min_group_size=self.config.min_group_size,
                                         norm_by_std=self.config.norm_adv_by_std)
        return {groups[r] for r, a in advantages.items() if a != 0.0}

    def _check_batch(self, triplets: Sequence[Triplet]) -> None:
        if not triplets:
            raise ConfigError("update() got no triplets; check that rollouts succeeded and emitted rewards")
        bad = [t.rollout_id for t in triplets if not t.response_ids]
        if bad:
            raise ConfigError(f"triplets of rollouts {bad[:3]} have empty response_ids; drop them before update()")
        truncated = [t.rollout_id for t in triplets if t.top_p < 1.0]
        if truncated:
            raise ConfigError(
                f"triplets of rollouts {truncated[:3]} were sampled with top_p < 1; the engine's log-probs are of "
                "the untruncated distribution, so the PPO ratio would be wrong: sample training rollouts with "
                "top_p=1 (the default; do not pass top_p in the agent's training calls)")

    def _micro_step(self, micro: list[_Sequence], view: _VerlActorView, core_algos: Any) -> dict:
        """Forward/backward one micro-batch; returns its token-weighted sums of the step's metrics."""
        import torch

        T = max(len(s.input_ids) for s in micro)
        pad = self.engine.pad_token_id
        device = next(self.model.parameters()).device
        ids_B_T = torch.tensor([s.input_ids + [pad] * (T - len(s.input_ids)) for s in micro], device=device)
        attn_B_T = torch.tensor([[1] * len(s.input_ids) + [0] * (T - len(s.input_ids)) for s in micro], device=device)
        # targets are tokens 1..T-1; position t of the *_B_L tensors scores token t+1
        mask_B_L = torch.tensor([s.mask[1:] + [0] * (T - len(s.input_ids)) for s in micro], dtype=torch.float32,
                                device=device)
        old_B_L = torch.tensor([s.old_logprobs[1:] + [0.0] * (T - len(s.input_ids)) for s in micro], device=device)
        temp_B = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in micro], device=device)
        adv_B_L = torch.tensor([s.advantage for s in micro], device=device)[:, None] * mask_B_L
        logp_B_L = response_logprobs(self.model, ids_B_T, attn_B_T, mask_B_L, temp_B)
        has_old_B = torch.tensor([s.has_old for s in micro], device=device)[:, None]
        old_B_L = torch.where(has_old_B, old_B_L, logp_B_L.detach())
        pg_loss, pg_metrics = core_algos.compute_policy_loss_vanilla(
            old_log_prob=old_B_L, log_prob=logp_B_L, advantages=adv_B_L, response_mask=mask_B_L,
            loss_agg_mode=view.loss_agg_mode, config=view)
        loss = pg_loss
        tokens = float(mask_B_L.sum())
        kl_sum = 0.0
        if self.reference is not None:
            with torch.no_grad():
                ref_B_L = response_logprobs(self.reference, ids_B_T, attn_B_T, mask_B_L, temp_B)
            kl_B_L = core_algos.kl_penalty(logp_B_L, ref_B_L, self.config.kl_penalty)
            if self.config.kl_coef > 0:
                loss = loss + self.config.kl_coef * core_algos.agg_loss(
                    kl_B_L, mask_B_L, view.loss_agg_mode, **view.global_batch_info)
            kl_sum = float((kl_B_L.detach() * mask_B_L).sum())
        loss.backward()
        diff_B_L = (logp_B_L.detach() - old_B_L).abs() * mask_B_L * has_old_B
        return {"loss": float(loss.detach()), "pg_loss": float(pg_loss.detach()), "kl": kl_sum,
                "ppo_kl": pg_metrics["actor/ppo_kl"] * tokens, "pg_clipfrac": pg_metrics["actor/pg_clipfrac"] * tokens,
                "logprob_diff_max": float(diff_B_L.max())}

    # ----- config edits while paused ----------------------------------------------------
    def _sync_config(self) -> list[str]:
        """Apply edits of :attr:`config` since the last update (lock held); returns them as text.

        ``learning_rate`` and ``weight_decay`` go into the optimizer's param groups; every
        other field is read at each update. Each edit is appended to :attr:`config_changes`.

        Raises:
            ConfigError: the edited config is invalid, or ``kl_coef > 0`` without a reference model.
        """
        self._check_config()
        now = asdict(self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.learning_rate
            group["weight_decay"] = self.config.weight_decay
        edits = config_edits(self._applied_config, now)
        for k, old, new, text in edits:
            self.config_changes.append({"step": self.step + 1, "field": k, "old": old, "new": new})
            log.info("config changed at step %d: %s", self.step + 1, text)
        self._applied_config = now
        return [text for *_, text in edits]

    def _check_config(self) -> None:
        self.config.validate()
        if self.config.kl_coef > 0 and self.reference is None:
            raise ConfigError(
                f"GRPOConfig.kl_coef={self.config.kl_coef} needs a reference model, and this trainer was built "
                "with kl_coef=0 and track_reference_kl=False, so it kept none; set kl_coef back to 0, or build "
                "the trainer with GRPOConfig(track_reference_kl=True) (and load() a checkpoint to continue)")

    def _check_before_resume(self) -> None:
        self._check_config()
        if self.algorithm is not None:
            self.algorithm.config.validate()

    # ----- background loop --------------------------------------------------------------
    def attach(self, algorithm: "LightningRL") -> None:
        """Make ``algorithm`` the one whose state :meth:`save` and :meth:`load` carry (LightningRL calls this)."""
        self.algorithm = algorithm
        if self._pending_algorithm_state is not None:
            algorithm.load_state_dict(self._pending_algorithm_state)
            self._pending_algorithm_state = None

    def start(self, algorithm: "LightningRL", steps: Optional[int] = None) -> "GRPOTrainer":
        """Run ``algorithm.run(steps)`` in a background thread and return at once.

        Raises:
            LightningNbError: a loop started earlier is still running (even if a wait() was interrupted).
            ConfigError: ``algorithm`` was built with another trainer.
        """
        if getattr(algorithm, "trainer", self) is not self:
            raise ConfigError("algorithm.trainer is a different trainer; build the algorithm with this trainer")
        n = steps if steps is not None else getattr(getattr(algorithm, "config", None), "steps", None)
        self._start_loop(lambda: algorithm.run(steps), self.step, None if n is None else self.step + n)
        return self

    # ----- inspection -------------------------------------------------------------------
    def add_metrics(self, step: int, **values: Any) -> None:
        """Attach values (e.g. val_reward, step_seconds) to the metrics row of ``step``."""
        for row in self.metrics:
            if row["step"] == step:
                row.update(values)
                return
        self.metrics.append({"step": step, **values})

    def metrics_df(self) -> pd.DataFrame:
        """One row per training step (see :meth:`update` and :meth:`LightningRL.step` for the columns)."""
        return pd.DataFrame(self.metrics)

    def last_batch_df(self) -> pd.DataFrame:
        """The triplets of the last update with their advantages (NaN for dropped groups)."""
        return triplets_df(self.last_triplets, self.last_advantages)

    def _repr_html_(self) -> str:
        from lightning_nb._repr import trainer_html

        return trainer_html(self)

    # ----- checkpoints ------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write everything a continued run needs to ``path`` (a file, written atomically). Returns the path.

        The checkpoint holds: model weights and optimizer state; the torch, numpy and
        Python RNG states; the step, metrics, config edits and config; the attached
        algorithm's state (task sampler RNG, ``val_history``: :meth:`LightningRL.state_dict`);
        the weight version; the store's latest resources id; the reference model's
        weights fingerprint and how to rebuild it (the initial weights of the default
        model); a model signature. It loads with ``torch.load(weights_only=True)``.
        Call it at a step boundary (paused, or after ``wait()``); it takes the update lock.
        Size: weights + 2 × weights for AdamW (about 1.6 GB for SmolLM2-135M in float32).
        """
        import torch

        from lightning_nb import __version__

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._updating, self.engine.lock:
            store = getattr(self.algorithm, "store", None)
            latest = store.get_latest_resources() if store is not None else None
            state = {
                "format": CHECKPOINT_FORMAT, "lightning_nb_version": __version__,
                "model_signature": model_signature(self.model), "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "step": self.step, "metrics": plain(self.metrics),
                "config": asdict(self.config), "config_changes": plain(self.config_changes),
                "weight_version": self.engine.weight_version, "rng": rng_state(),
                "reference": None if self.reference is None else {
                    "fingerprint": weights_fingerprint(self.reference),
                    "source": getattr(self.engine, "model_source", None)},
                "algorithm": plain(self.algorithm.state_dict()) if self.algorithm is not None else None,
                "resources_id": latest.resources_id if latest is not None else None,
            }
            tmp = path.with_suffix(path.suffix + ".tmp")
            torch.save(state, tmp)
            tmp.replace(path)
        return path

    def load(self, path: str | Path) -> None:
        """Restore a :meth:`save` checkpoint into this trainer, its engine's model and its algorithm.

        The algorithm's state is applied to the attached algorithm, or to the next one built
        with this trainer. The RNG states are restored too, so the continued run samples
        what the uninterrupted run would have. ``resources_id`` of the checkpoint is kept in
        :attr:`checkpoint_resources_id` (the proxy URL of a new process differs: publish the
        new one with ``store.add_resources``).

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ConfigError: the file is not a lightning-nb GRPO checkpoint of this format, was
                saved from another model, or its reference model differs from this trainer's
                and cannot be rebuilt.
        """
        import torch

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} not found; write one with trainer.save(path)")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConfigError(f"{path} is not a lightning-nb checkpoint that loads with weights_only=True "
                              f"({type(exc).__name__}: {str(exc)[:200]}); write one with trainer.save(path)") from exc
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            found = state.get("format", "no format tag") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(f"checkpoint {path} has format {found!r}, this version reads {CHECKPOINT_FORMAT!r}; "
                              "save it again with this version's trainer.save()")
        check_signature(state["model_signature"], self.model, path)
        with self._updating, self.engine.lock:
            self._restore_reference(state.get("reference"), path)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
            self.metrics = list(state["metrics"])
            self.config_changes = list(state.get("config_changes", []))
            self.engine.load_weights(self.model, version=int(state["weight_version"]))
            self.checkpoint_resources_id = state.get("resources_id")
            set_rng_state(state["rng"])
            self._applied_config = asdict(self.config)
        if state.get("algorithm") is not None:
            if self.algorithm is not None:
                self.algorithm.load_state_dict(state["algorithm"])
            else:
                self._pending_algorithm_state = state["algorithm"]

    def _restore_reference(self, saved: Optional[dict[str, Any]], path: Path) -> None:
        """Make this trainer's reference model the one the checkpoint was trained against."""
        if saved is None or self.reference is None:
            return
        import torch

        if torch.equal(weights_fingerprint(self.reference), saved["fingerprint"]):
            return
        if saved.get("source") == "default":  # rebuild the initial weights of the default model
            from lightning_nb.engine import load_default_model

            rebuilt, _ = load_default_model()
            rebuilt = rebuilt.to(next(self.model.parameters()).device).eval().requires_grad_(False)
            if torch.equal(weights_fingerprint(rebuilt), saved["fingerprint"]):
                self.reference = rebuilt
                return
        raise ConfigError(
            f"checkpoint {path} was trained against a reference model (the initial weights) that differs from "
            "this trainer's, and it cannot be rebuilt; build this trainer on the same starting weights as the "
            "run that saved it, or use GRPOConfig(track_reference_kl=False, kl_coef=0)")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0 if values else math.nan
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def response_logprobs(model: Any, ids_B_T: Any, attn_B_T: Any, mask_B_L: Any, temp_B: Any) -> Any:
    """Log-probs (B, T-1) of tokens 1..T-1 under ``model`` at masked positions (0 elsewhere).

    Goes through the model's own ``forward`` (so logit scaling or soft-capping a model
    applies is kept), asking it only for the logits from the first masked position on
    (``logits_to_keep``): the vocabulary (49,152) makes the LM head the costliest layer
    for prompt positions that are never scored. Logits are divided by ``temp_B`` (B,),
    the sampling temperature of each sequence.
    """
    import torch

    L = mask_B_L.shape[1]
    cols = mask_B_L.any(dim=0).nonzero()
    first = int(cols[0]) if len(cols) else L - 1
    keep = L + 1 - first  # positions first..T-1 (T = L + 1); the last one predicts nothing
    logits_B_K_V = model(input_ids=ids_B_T, attention_mask=attn_B_T, logits_to_keep=keep).logits
    logits_B_K_V = logits_B_K_V[:, :-1].float() / temp_B[:, None, None]
    sel_B_K = mask_B_L[:, first:].bool()
    target_N = ids_B_T[:, 1:][:, first:][sel_B_K]
    logp_N = torch.log_softmax(logits_B_K_V[sel_B_K], dim=-1).gather(-1, target_N[:, None]).squeeze(-1)
    out_B_L = torch.zeros(mask_B_L.shape, dtype=logp_N.dtype, device=logp_N.device)
    out_B_L[:, first:][sel_B_K] = logp_N
    return out_B_L
