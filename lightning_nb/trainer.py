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
from lightning_nb.engine import TransformersEngine
from lightning_nb.errors import ConfigError, LightningNbError
from lightning_nb.types import Triplet

if TYPE_CHECKING:
    from lightning_nb.algorithm import LightningRL

__all__ = ["GRPOConfig", "GRPOTrainer", "TrainerStopped", "pack_episode"]

log = logging.getLogger(__name__)


class TrainerStopped(LightningNbError):
    """Raised inside the training loop when :meth:`GRPOTrainer.stop` was called."""


@dataclass
class GRPOConfig:
    """Hyper-parameters of the GRPO update. Validated on construction."""

    learning_rate: float = field(default=2e-5, metadata={
        "help": "AdamW learning rate (2e-5 suits SmolLM2-135M: 5e-5 drifted, KL to the initial weights > 0.6 "
                "within 12 steps; use ~1e-6 for 1B+ models)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this value."})
    clip_ratio: float = field(default=0.2, metadata={"help": "PPO clip range epsilon for the importance ratio."})
    kl_coef: float = field(default=0.0, metadata={"help": "Weight of the KL-to-reference loss; 0 disables it."})
    kl_penalty: str = field(default="low_var_kl", metadata={"help": "verl KL estimator: kl, abs, mse, low_var_kl."})
    track_reference_kl: bool = field(default=True, metadata={
        "help": "Keep a frozen copy of the initial weights and report KL to it every step (costs one forward)."})
    norm_adv_by_std: bool = field(default=True, metadata={"help": "Divide group-relative advantages by the group std."})
    loss_agg_mode: str = field(default="token-mean", metadata={"help": "verl loss aggregation mode."})
    micro_batch_size: int = field(default=4, metadata={"help": "Sequences per forward/backward (memory bound)."})
    pack_turns: bool = field(default=True, metadata={
        "help": "Pack an episode's turns into one sequence when each prompt extends the previous turn."})
    skip_zero_advantage: bool = field(default=True, metadata={
        "help": "Skip sequences whose advantage is 0 when kl_coef == 0 (their gradient is exactly 0)."})

    def __post_init__(self) -> None:
        checks = {
            "learning_rate": self.learning_rate > 0, "weight_decay": self.weight_decay >= 0,
            "max_grad_norm": self.max_grad_norm > 0, "clip_ratio": 0 < self.clip_ratio < 1,
            "kl_coef": self.kl_coef >= 0, "micro_batch_size": self.micro_batch_size >= 1,
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


class GRPOTrainer:
    """Group Relative Policy Optimization on the engine's model.

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
        self.last_triplets: list[Triplet] = []
        self.last_advantages: dict[str, float] = {}
        self.error: Optional[BaseException] = None
        self._resume = threading.Event()
        self._resume.set()
        self._stop = threading.Event()
        self._updating = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    # ----- the RL step ----------------------------------------------------------------
    def update(self, triplets: Sequence[Triplet]) -> dict[str, Any]:
        """One GRPO step on ``triplets``; returns its metrics (also appended to :attr:`metrics`).

        Blocks first while the trainer is paused (the step boundary).

        Steps, top to bottom:
          1. episode reward per rollout → group-relative advantage (verl
             ``compute_grpo_outcome_advantage``, groups = ``Triplet.group_id``);
          2. every transition of an episode gets the episode's advantage (LightningRL);
          3. pack turns into sequences with a response mask;
          4. recompute log-probs of response tokens with gradients; clipped policy
             loss against the engine's behavior log-probs (verl ``compute_policy_loss_vanilla``),
             plus ``kl_coef`` × KL to the initial weights (verl ``kl_penalty``);
          5. one AdamW step with gradient-norm clipping; bump ``engine.weight_version``.

        Departures from the GRPO paper (Shao et al. 2024) and the Agent Lightning paper:
          * no KL penalty by default (``kl_coef=0``, as in DAPO / Dr. GRPO); KL to the
            initial weights is still measured (``track_reference_kl``);
          * one gradient step per batch (no PPO epochs); the "old" policy is the one
            that sampled (engine log-probs), so clipping only bites on engine/trainer
            numeric mismatch or stale weights;
          * advantages are normalized per episode, not per transition, so an
            episode with more LLM calls does not weigh more in the group statistics;
          * turns sharing a prefix are packed into one sequence (same gradient, fewer tokens);
          * token-mean loss over the whole batch (verl default), not mean-per-sequence.

        Raises:
            ConfigError: no triplets, or a triplet with an empty response.
            TrainerStopped: :meth:`stop` was called while waiting.
        """
        import torch
        from verl.trainer.ppo import core_algos

        self._wait_if_paused()
        if not triplets:
            raise ConfigError("update() got no triplets; check that rollouts succeeded and emitted rewards")
        bad = [t.rollout_id for t in triplets if not t.response_ids]
        if bad:
            raise ConfigError(f"triplets of rollouts {bad[:3]} have empty response_ids; drop them before update()")
        with self._updating:
            t0 = time.perf_counter()
            cfg = self.config
            # 1-2. group-relative advantage per episode
            episodes: dict[str, list[Triplet]] = {}
            for t in triplets:
                episodes.setdefault(t.rollout_id, []).append(t)
            rollout_ids = list(episodes)
            rewards_E = torch.tensor([episodes[r][0].reward for r in rollout_ids], dtype=torch.float32)
            groups = [episodes[r][0].group_id for r in rollout_ids]
            adv_E, _ = core_algos.compute_grpo_outcome_advantage(
                token_level_rewards=rewards_E[:, None], response_mask=torch.ones(len(rollout_ids), 1),
                index=groups, norm_adv_by_std_in_grpo=cfg.norm_adv_by_std)
            advantages = {r: float(a) for r, a in zip(rollout_ids, adv_E[:, 0])}
            # 3. sequences
            seqs = [s for r in rollout_ids for s in pack_episode(episodes[r], advantages[r], cfg.pack_turns)]
            if cfg.skip_zero_advantage and cfg.kl_coef == 0:
                trained = [s for s in seqs if s.advantage != 0.0]
            else:
                trained = seqs
            num_tokens = sum(sum(s.mask) for s in trained)
            metrics: dict[str, Any] = {"step": self.step + 1}
            stats = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "ppo_kl": 0.0, "pg_clipfrac": 0.0}
            grad_norm = 0.0
            with self.engine.lock:
                if trained:
                    view = _VerlActorView(cfg.clip_ratio, num_tokens, cfg.loss_agg_mode, len(trained))
                    for i in range(0, len(trained), cfg.micro_batch_size):
                        micro = trained[i: i + cfg.micro_batch_size]
                        part = self._micro_step(micro, view, num_tokens, core_algos)
                        for k in stats:
                            stats[k] += part[k]
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm))
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                self.engine.weight_version += 1
            seconds = time.perf_counter() - t0
            if not trained:  # nothing was forwarded, so nothing was measured
                stats.update(loss=math.nan, pg_loss=math.nan, kl=math.nan, ppo_kl=math.nan, pg_clipfrac=math.nan)
            metrics.update(stats)
            metrics.update({
                "reward_mean": float(rewards_E.mean()), "reward_std": float(rewards_E.std()) if len(rewards_E) > 1 else 0.0,
                "episodes": len(rollout_ids), "transitions": len(triplets), "sequences_trained": len(trained),
                "tokens_trained": num_tokens, "grad_norm": grad_norm, "update_seconds": seconds,
                "tokens_per_s": sum(len(s.input_ids) for s in trained) / seconds if seconds > 0 else 0.0,
                "lr": cfg.learning_rate,
            })
            self.last_triplets, self.last_advantages = list(triplets), advantages
            self.metrics.append(metrics)
            return metrics

    def _micro_step(self, micro: list[_Sequence], view: _VerlActorView, num_tokens: int, core_algos: Any) -> dict:
        """Forward/backward one micro-batch; returns its share of the step's metrics."""
        import torch

        T = max(len(s.input_ids) for s in micro)
        pad = self.engine.pad_token_id
        ids_B_T = torch.tensor([s.input_ids + [pad] * (T - len(s.input_ids)) for s in micro])
        attn_B_T = torch.tensor([[1] * len(s.input_ids) + [0] * (T - len(s.input_ids)) for s in micro])
        # targets are tokens 1..T-1; position t of the *_B_L tensors scores token t+1
        mask_B_L = torch.tensor([s.mask[1:] + [0] * (T - len(s.input_ids)) for s in micro], dtype=torch.float32)
        old_B_L = torch.tensor([s.old_logprobs[1:] + [0.0] * (T - len(s.input_ids)) for s in micro])
        temp_B = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s in micro])
        adv_B_L = torch.tensor([s.advantage for s in micro])[:, None] * mask_B_L
        logp_B_L = _response_logprobs(self.model, ids_B_T, attn_B_T, mask_B_L, temp_B)
        has_old_B = torch.tensor([s.has_old for s in micro])[:, None]
        old_B_L = torch.where(has_old_B, old_B_L, logp_B_L.detach())
        pg_loss, pg_metrics = core_algos.compute_policy_loss_vanilla(
            old_log_prob=old_B_L, log_prob=logp_B_L, advantages=adv_B_L, response_mask=mask_B_L,
            loss_agg_mode=view.loss_agg_mode, config=view)
        loss = pg_loss
        share = float(mask_B_L.sum()) / max(num_tokens, 1)
        kl_value = 0.0
        if self.reference is not None:
            with torch.no_grad():
                ref_B_L = _response_logprobs(self.reference, ids_B_T, attn_B_T, mask_B_L, temp_B)
            kl_B_L = core_algos.kl_penalty(logp_B_L, ref_B_L, self.config.kl_penalty)
            if self.config.kl_coef > 0:
                loss = loss + self.config.kl_coef * core_algos.agg_loss(
                    kl_B_L, mask_B_L, view.loss_agg_mode, **view.global_batch_info)
            kl_value = float((kl_B_L.detach() * mask_B_L).sum()) / max(num_tokens, 1)
        loss.backward()
        return {"loss": float(loss.detach()), "pg_loss": float(pg_loss.detach()), "kl": kl_value,
                "ppo_kl": pg_metrics["actor/ppo_kl"] * share, "pg_clipfrac": pg_metrics["actor/pg_clipfrac"] * share}

    # ----- background loop and control -------------------------------------------------
    def start(self, algorithm: "LightningRL", steps: Optional[int] = None) -> "GRPOTrainer":
        """Run ``algorithm.run(steps)`` in a background thread and return at once."""
        if self._thread is not None and self._thread.is_alive():
            raise LightningNbError("the trainer is already running; call stop() or wait() first")
        if getattr(algorithm, "trainer", self) is not self:
            raise ConfigError("algorithm.trainer is a different trainer; build the algorithm with this trainer")
        self._stop.clear()
        self._resume.set()
        self.error = None

        def target() -> None:
            try:
                algorithm.run(steps)
            except TrainerStopped:
                log.info("trainer stopped at step %d", self.step)
            except BaseException as exc:  # surfaced through .state and .error
                self.error = exc
                log.exception("training loop failed at step %d", self.step)

        self._thread = threading.Thread(target=target, name="lightning_nb-trainer", daemon=True)
        self._thread.start()
        return self

    def pause(self, wait: bool = True) -> None:
        """Stop before the next update; with ``wait``, also wait for an update in progress to end."""
        self._resume.clear()
        if wait:
            with self._updating:
                pass

    def resume(self) -> None:
        self._resume.set()

    def stop(self, timeout: float = 600.0) -> None:
        """Ask the background loop to end at the next step boundary and wait for it."""
        self._stop.set()
        self._resume.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the background loop ends; re-raise its error if it failed."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise self.error

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @property
    def state(self) -> str:
        """idle | running | paused | stopped | failed | finished."""
        alive = self._thread is not None and self._thread.is_alive()
        if self.error is not None:
            return "failed"
        if alive:
            return "paused" if not self._resume.is_set() else "running"
        if self._stop.is_set():
            return "stopped"
        return "finished" if self._thread is not None else "idle"

    def _wait_if_paused(self) -> None:
        while not self._resume.wait(0.2):
            pass
        if self._stop.is_set():
            raise TrainerStopped(f"stopped before step {self.step + 1}")

    # ----- inspection -------------------------------------------------------------------
    def add_metrics(self, step: int, **values: Any) -> None:
        """Attach values (e.g. val_reward, step_seconds) to the metrics row of ``step``."""
        for row in self.metrics:
            if row["step"] == step:
                row.update(values)
                return
        self.metrics.append({"step": step, **values})

    def metrics_df(self) -> pd.DataFrame:
        """One row per training step (see :meth:`update` for the columns)."""
        return pd.DataFrame(self.metrics)

    def last_batch_df(self) -> pd.DataFrame:
        """The triplets of the last update with their advantages."""
        return triplets_df(self.last_triplets, self.last_advantages)

    def _repr_html_(self) -> str:
        from lightning_nb._repr import trainer_html

        return trainer_html(self)

    # ----- checkpoints ------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write model, optimizer, step and metrics to ``path`` (a file). Returns the path."""
        import torch

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._updating, self.engine.lock:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                     "metrics": self.metrics, "config": asdict(self.config), "weight_version": self.engine.weight_version}
            tmp = path.with_suffix(path.suffix + ".tmp")
            torch.save(state, tmp)
            tmp.replace(path)
        return path

    def load(self, path: str | Path) -> None:
        """Restore a :meth:`save` checkpoint into this trainer's (and engine's) model.

        Raises:
            FileNotFoundError: ``path`` does not exist.
        """
        import torch

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} not found; write one with trainer.save(path)")
        state = torch.load(path, map_location="cpu", weights_only=False)
        with self._updating, self.engine.lock:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
            self.metrics = list(state["metrics"])
            self.engine.weight_version = int(state["weight_version"])


def _response_logprobs(model: Any, ids_B_T: Any, attn_B_T: Any, mask_B_L: Any, temp_B: Any) -> Any:
    """Log-probs (B, T-1) of tokens 1..T-1 at masked positions (0 elsewhere).

    The LM head runs only on masked positions: the vocabulary (49,152) makes it
    the costliest layer for prompt positions that are never scored.
    """
    import torch

    hidden_B_T_H = model.model(input_ids=ids_B_T, attention_mask=attn_B_T).last_hidden_state
    sel_B_L = mask_B_L.bool()
    hidden_N_H = hidden_B_T_H[:, :-1][sel_B_L]
    temp_N = temp_B[:, None].expand_as(mask_B_L)[sel_B_L]
    logits_N_V = model.lm_head(hidden_N_H).float() / temp_N[:, None]
    target_N = ids_B_T[:, 1:][sel_B_L]
    logp_N = torch.log_softmax(logits_N_V, dim=-1).gather(-1, target_N[:, None]).squeeze(-1)
    out_B_L = torch.zeros(mask_B_L.shape, dtype=logp_N.dtype)
    out_B_L[sel_B_L] = logp_N
    return out_B_L
