"""``VerlTrainer``: the GRPO update done by verl's own actor, the second implementation of the Trainer contract.

The agent, the runners, the LLM proxy, the store and the algorithm (:class:`~lightning_nb.LightningRL`)
are the same as with :class:`~lightning_nb.GRPOTrainer`: the engine behind the proxy (in-process
transformers, or vLLM through :class:`~lightning_nb.engines.vllm.VLLMEngine`) serves the policy,
spans become triplets, and each :meth:`VerlTrainer.update` hands the batch to verl
(Agent Lightning's "Inside an RL Algorithm (VERL Example)", reference doc 000):

1. the kept episodes (fresh enough: the same rule as ``GRPOTrainer``) → verl's ``DataProto`` (:func:`~lightning_nb.trainers.verl.bridge.triplets_to_dataproto`:
   the engine's token IDs, multi-turn packing under ``response_mask``, ``token_level_scores``,
   ``uid`` = group);
2. the reference policy's log-probs (``ref_log_prob``) when KL is penalised, or measured on this step
   (``track_reference_kl``, every ``kl_every`` steps); with more than one optimizer step, the old
   log-probs recomputed by verl's actor first (``compute_log_prob``, as verl's ``_compute_old_log_prob`` does);
3. the advantages the triplets carry (the algorithm's credit, :mod:`lightning_nb.credit`), per token;
4. verl's PPO update (``FSDPEngineWithLMHead.train_batch`` with ``ppo_loss``: PPO clip with dual
   clip, the KL loss, verl's loss aggregation, gradient clipping, the optimizer step); with one
   optimizer step π_old is that update's own forward, detached (no scoring pass before it);
5. the new weights to the engine through the engine contract (``engine.load_weights``).

The verl pieces run in this process without Ray (:class:`~lightning_nb.trainers.verl.actor.VerlActor`;
:mod:`lightning_nb.trainers.verl.patches` lists the six patches). Everything else is shared with
``GRPOTrainer`` through :class:`~lightning_nb.trainers.inplace.InPlaceTrainer` (the model placement,
LoRA through peft, the reference, the optimizer, config edits while paused, ``state_dict``) and
:class:`~lightning_nb.trainers.base.Trainer` (the :class:`~lightning_nb.trainers.base.Update` it returns, the
widgets); the run's verbs (``algo.start()``, ``algo.pause()``, ``algo.metrics_df()``, ...) are the algorithm's.
VerlTrainer does not subclass
GRPOTrainer. Importing this module needs no verl; building a VerlTrainer does. Checkpoints use verl's
layout: ``<folder>/global_step_N/`` and ``<folder>/latest_checkpointed_iteration.txt``, with verl's
``resume_mode`` (``auto``, ``resume_path``, ``disable``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_nb.errors import ConfigError
from lightning_nb.trainers.base import ProgressCallback, Update, progress_ticker
from lightning_nb.trainers.checkpoint import write_file
from lightning_nb.trainers.batch import Batch, build_batch, check_batch, per_triplet_turn
from lightning_nb.trainers.inplace import InPlaceTrainer
from lightning_nb.trainers.metrics import batch_metrics
from lightning_nb.trainers.verl.config import MAPPED_KEYS, VerlConfig
from lightning_nb.types import GROUP_ID_KEY, Triplet

__all__ = ["VerlConfig", "VerlTrainer", "MAPPED_KEYS"]

log = logging.getLogger(__name__)


def _no_progress(done: int, total: int, unit: str) -> None:
    pass


class VerlTrainer(InPlaceTrainer):
    """GRPO with verl's actor update, with the same notebook surface as :class:`~lightning_nb.GRPOTrainer`.

    The run is the algorithm's: ``algo.start(steps=...)`` runs its loop in the background; ``algo.pause()``
    returns at a step boundary (no update running, no rollout being enqueued); ``algo.resume()`` validates
    config edits (and verl's checks) first; ``algo.stop()`` and ``algo.metrics_df()`` are the algorithm's, and
    the :class:`~lightning_nb.trainers.base.Update` that :meth:`update` returns (``algo.last_update``) shows its
    batch as for ``GRPOTrainer``. See the module docstring for what one :meth:`update` does.

    Args:
        engine: serves the policy (``TransformersEngine``, or ``VLLMEngine`` whose server gets each
            update's weights); its ``model`` is what verl trains, in place.
        config: :class:`VerlConfig` (a plain ``GRPOConfig`` is refused: its defaults differ).

    Raises:
        ConfigError: ``config`` is not a ``VerlConfig``, verl refuses it, or a ``GRPOTrainer`` error
            (device not available, ...).
        MissingDependencyError: verl is not installed (``pip install 'lightning-nb[verl]'``).
    """

    config: VerlConfig

    def __init__(self, engine: Any, config: Optional[VerlConfig] = None) -> None:
        config = config if config is not None else VerlConfig()
        if not isinstance(config, VerlConfig):
            raise ConfigError(f"VerlTrainer takes a VerlConfig, got {type(config).__name__}; build one with "
                              "VerlConfig(...) (same field names as GRPOConfig)")
        verl_cfg = config.verl_config()  # before anything is moved or adapted
        self._verl_checked: Optional[dict[str, Any]] = asdict(config)  # the fields verl last accepted
        super().__init__(engine, config)
        self.verl_config = verl_cfg
        self._build_actors()

    def _build_actors(self) -> None:
        from lightning_nb.trainers.verl.actor import VerlActor

        tree = self.config.prefix_tree
        self.actor = VerlActor(self.model, self.verl_config, optimizer=self.optimizer, lr_scheduler=self.scheduler,
                               prefix_tree=tree)
        self.reference_actor = (VerlActor(self.reference, self.verl_config, forward_only=True, prefix_tree=tree)
                                if self.reference is not None else None)

    # ----- the RL step ----------------------------------------------------------------
    def update(self, triplets: Sequence[Triplet], *, on_progress: Optional[ProgressCallback] = None,
               left_out: Sequence[Triplet] = ()) -> Update:
        """One PPO step by verl on ``triplets``, which carry the algorithm's advantages (``left_out``: as
        :meth:`Trainer.update <lightning_nb.trainers.base.Trainer.update>`); returns its
        :class:`~lightning_nb.trainers.base.Update`.

        Episodes are kept as :meth:`GRPOTrainer.update` keeps them (``max_staleness``, forks counted or refused
        with ``fail_on_fork``), converted by
        :func:`~lightning_nb.trainers.verl.bridge.triplets_to_dataproto` (one row per packed sequence, its
        ``advantages`` the triplets' own per token), scored by
        verl's actor (π_ref when the reference is active; π_old recomputed as verl does when the update takes more
        than one optimizer step, else taken from the update's own forward), and updated by verl
        (:meth:`~lightning_nb.trainers.verl.bridge.VerlActor.update_policy`: ``ppo_epochs`` × mini-batches of
        ``mini_batch_size`` rows, or the whole batch). Then ``engine.load_weights(model)``.

        Metrics: those of ``GRPOTrainer.update`` where the concept is the same (``loss``, ``pg_loss``,
        ``grad_norm``, ``ppo_kl``, ``pg_clipfrac`` (verl's, means over the mini-batches), ``kl`` (the
        ``kl_penalty`` estimator of π_old vs π_ref, mean over response tokens; NaN on the steps that do not
        score the reference: all while ``kl_coef == 0`` unless ``track_reference_kl``, then all but every
        ``kl_every``-th), ``logprob_diff_max`` (largest |π_old − engine| log-prob on the trained tokens, nats),
        ``tis_weight_mean`` (with ``tis_cap``: the mean of verl's rollout-correction weights
        min(π_old / π_engine, tis_cap) over the response tokens; NaN when off or without engine log-probs),
        ``reward_mean``, ``reward_std``, ``episodes``, ``groups``, ``groups_with_signal``,
        ``groups_dropped``, ``episodes_dropped``, ``transitions``, ``stale_episodes_dropped``,
        ``staleness_max``, ``sequences_trained``, ``tokens_trained``, ``optimizer_steps``,
        ``turn_forks``, ``truncated_responses``, ``intermediate_rewards``, ``update_seconds``,
        ``tokens_per_s``, ``lr``, ``config_changes``, ``forwarded_tokens`` and ``prefix_shared_tokens`` (of the
        policy's forwards: tree nodes or padded rows' tokens, and what prefix trees saved, patch 7 of
        :mod:`~lightning_nb.trainers.verl.patches`)), plus every metric verl's loss reported under its
        own name (``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``,
        ``kl_loss`` with the KL loss, ...) and ``trainer`` = ``"verl"``.

        Raises:
            ConfigError: as ``GRPOTrainer.update`` (no triplets, empty responses, ``top_p < 1``, a fork
                with ``fail_on_fork``), or verl refuses a config edited while paused.
        """
        check_batch(triplets, left_out)
        report = on_progress or _no_progress
        with self._updating:
            # verl's loss reads its own config: an edited config is composed and checked by verl first (nothing is
            # applied if verl refuses it), then verl's actor is rebuilt from it
            edited = self.config.verl_config() if self.config_watch.edited(self.config) else None
            changes = self._sync_config()
            if edited is not None:
                self.verl_config = edited
                self._build_actors()
            lr = float(self.optimizer.param_groups[0]["lr"])
            t0 = time.perf_counter()
            # the kept episodes, as GRPOTrainer keeps them; a VLLMEngine sharing the GPU sleeps meanwhile
            with self.engine.lock, self.engine.released_for_update():
                batch = build_batch(self.config, triplets, self.engine.weight_version, left_out=left_out)
                turns = per_triplet_turn([t for t in triplets if t.rollout_id in batch.advantages],
                                         batch.turn_advantages)
                kept = [t if t.advantages is not None else  # the deprecated path credited them in build_batch
                        t.model_copy(update={"advantages": [turns[(t.rollout_id, t.turn)]] * len(t.response_ids)})
                        for t in triplets if t.rollout_id in batch.advantages]
                if kept:
                    data, stats = self._verl_step(kept, report)
                    self.engine.load_weights(self.model)  # in place, or pushed to a server (VLLMEngine)
                else:
                    data, stats = None, {}
                    self._advance_schedule()  # the schedule counts updates
                self.updates_applied += 1
            seconds = time.perf_counter() - t0
            rows = _batch_rows(data) if data is not None else []
            metrics = self._verl_metrics(list(triplets) + list(left_out), batch, stats, rows, seconds, lr,
                                         [c.text for c in changes])
            self._last = Update(metrics, changes, list(triplets) + list(left_out), batch.advantages, turns, rows)
            return self._last

    def _verl_step(self, kept: list[Triplet], on_progress: ProgressCallback) -> tuple[Any, dict[str, float]]:
        """DataProto (with the triplets' advantages) → π_old and π_ref → verl's PPO update.

        π_old: with one optimizer step (:meth:`_old_from_forward`) the update's own forward, detached (verl's actor
        takes it from there, :meth:`VerlActor.update_policy`), so no pass runs before the update; otherwise verl's
        ``compute_log_prob`` before it (verl's ``_compute_old_log_prob``). π_ref: only when the reference is active
        (``kl_coef > 0``, or ``track_reference_kl`` on every ``kl_every``-th update). Returns ``(data, stats)``: the
        DataProto with ``old_log_probs``, ``advantages`` (and ``ref_log_prob``), and verl's metrics plus ``kl``,
        ``logprob_diff_max`` and ``tis_weight_mean``. Each stage done calls ``on_progress(done, total, "stages")``
        (π_old when it is a pass of its own, π_ref when active, verl's policy update).
        """
        from lightning_nb.trainers.verl.bridge import triplets_to_dataproto

        cfg = self.config
        # on the actor's device: verl returns its log-probs there, and they meet the batch's rollout_log_probs
        data = triplets_to_dataproto(kept, pad_token_id=self.engine.pad_token_id, pack_turns=cfg.pack_turns,
                                     device=self.actor.device)
        max_tokens = self._max_tokens(data)
        mask = data.batch["response_mask"].bool()  # before verl's rejection sampling (overrides) may change it
        from_forward, with_reference = self._old_from_forward(len(data)), self._reference_active()
        stages = [not from_forward, with_reference, True]  # π_old pass, π_ref pass, the update
        report = progress_ticker(on_progress, sum(stages), "stages")
        self.actor.forward_counts = counts = [0, 0]  # the policy actor's forwards (a copied reference's not)
        if not from_forward:
            data = data.union(self.actor.compute_log_prob(data, max_token_len=max_tokens))
            report()
        if with_reference:
            data.batch["ref_log_prob"] = self._reference_log_prob(data, max_tokens)
            report()
        stats: dict[str, float] = {}
        if not from_forward:  # the IS weights from the π_old pass, before the update reads them
            data = self._rollout_correction(data, stats)
        stats.update(self.actor.update_policy(
            data, mini_batch_size=cfg.mini_batch_size, max_token_len=max_tokens, old_from_forward=from_forward,
            rollout_correction=self.verl_config.algorithm.rollout_correction if cfg.tis_cap is not None else None))
        if from_forward:  # the same weights, from the update's π_old: for the metrics
            data = self._rollout_correction(data, stats)
        report()
        self.actor.forward_counts = None
        stats["forwarded_tokens"], stats["prefix_shared_tokens"] = counts
        self._old_log_prob_stats(data, mask, stats)
        return data, stats

    def _max_tokens(self, data: Any) -> int:
        """verl's dynamic micro-batch budget for ``data`` (tokens of its rows): :meth:`VerlConfig.max_token_len`;
        with ``prefix_tree`` (where the model's attention takes the tree mask) that budget counts tree nodes, so
        verl is given :func:`~lightning_nb.trainers.prefix_tree.tree_token_budget` of the rows."""
        from lightning_nb.trainers.prefix_tree import tree_path, tree_token_budget

        mask = data.batch["attention_mask"].bool()
        budget = self.config.max_token_len(int(mask.sum(-1).max()), self.model)
        if not self.config.prefix_tree or tree_path(self.model) != "tree":
            return budget
        rows = [ids[m].tolist() for ids, m in zip(data.batch["input_ids"], mask)]
        return tree_token_budget(rows, budget)

    def _old_from_forward(self, rows: int) -> bool:
        """Whether π_old comes from the update's own forward: the update takes one optimizer step (``ppo_epochs=1``,
        one mini-batch), and verl's rollout correction (``tis_cap``) needs no batch-wide statistic of π_old before
        the first micro-batch (no rejection sampling, batch normalization or bypass mode set through
        ``overrides``). Otherwise verl's ``compute_log_prob`` scores the batch first, as verl does."""
        if self.actor.optimizer_steps(rows, self.config.mini_batch_size) != 1:
            return False
        correction = self.verl_config.algorithm.rollout_correction
        return self.config.tis_cap is None or not (
            correction.get("rollout_rs") or correction.get("rollout_is_batch_normalize")
            or correction.get("bypass_mode"))

    def _old_log_prob_stats(self, data: Any, mask: Any, stats: dict[str, float]) -> None:
        """``kl`` (π_old vs π_ref, mean over the response tokens ``mask`` (B, R) bool; NaN without
        ``ref_log_prob``) and ``logprob_diff_max`` (largest |π_old − engine| log-prob there, nats; NaN without the
        engine's) into ``stats``."""
        from verl.trainer.ppo import core_algos

        b = data.batch
        stats["kl"] = stats["logprob_diff_max"] = math.nan
        if "ref_log_prob" in b.keys() and mask.any():
            kl = core_algos.kl_penalty(b["old_log_probs"], b["ref_log_prob"], self.config.kl_penalty)
            stats["kl"] = float(kl[mask].mean())
        if "rollout_log_probs" in b.keys() and mask.any():
            stats["logprob_diff_max"] = float((b["old_log_probs"] - b["rollout_log_probs"]).abs()[mask].max())

    def _rollout_correction(self, data: Any, stats: dict[str, float]) -> Any:
        """verl's rollout correction with ``tis_cap`` (:class:`VerlConfig`): ``rollout_is_weights`` (B, R) =
        min(π_old / π_engine, tis_cap) per response token, which verl's ``ppo_loss`` multiplies the policy loss by.
        Adds ``tis_weight_mean`` (mean weight over response tokens; NaN when off or without the engine's log-probs)
        and verl's ``rollout_corr/*`` metrics to ``stats``. Returns ``data`` with the weights (unchanged when
        ``tis_cap`` is None or the batch has no ``rollout_log_probs``)."""
        mask = data.batch["response_mask"].bool()
        if self.config.tis_cap is None or "rollout_log_probs" not in data.batch.keys() or not mask.any():
            stats["tis_weight_mean"] = math.nan
            return data
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

        data, corr = compute_rollout_correction_and_add_to_batch(data, self.verl_config.algorithm.rollout_correction)
        mask = data.batch["response_mask"].bool()
        weights = data.batch["rollout_is_weights"]
        stats["tis_weight_mean"] = float(weights[mask].mean()) if mask.any() else math.nan
        stats.update({k: float(v) for k, v in corr.items() if isinstance(v, (int, float))})
        return data

    def _reference_log_prob(self, data: Any, max_tokens: int) -> Any:
        """π_ref's log-probs (B, R): the kept copy of the initial weights, or with LoRA the base model
        (adapters disabled, as verl's ``ref_in_actor``)."""
        if self.reference_actor is not None:
            return self.reference_actor.compute_log_prob(data, max_token_len=max_tokens).batch["old_log_probs"]
        assert self.peft_model is not None  # no reference actor: the base model is the reference (LoRA)
        with self.peft_model.disable_adapter():
            return self.actor.compute_log_prob(data, max_token_len=max_tokens).batch["old_log_probs"]

    def _verl_metrics(self, triplets: Sequence[Triplet], batch: Batch, stats: dict[str, float],
                      rows: list[dict[str, Any]], seconds: float, lr: float, changes: list[str]) -> dict[str, Any]:
        """The metrics row of one update (see :meth:`update`)."""
        steps = int(stats.pop("optimizer_steps", 0))
        signal = {batch.groups[r] for r, a in batch.advantages.items() if a != 0.0}
        tokens = sum(len(r["input_ids"]) for r in rows)
        head, tail = batch_metrics(triplets, batch, signal, changes)
        metrics: dict[str, Any] = {
            "step": self.updates_applied, "trainer": "verl",
            "loss": stats.get("loss", math.nan), "pg_loss": stats.get("actor/pg_loss", math.nan),
            "kl": stats.get("kl", math.nan), "ppo_kl": stats.get("actor/ppo_kl", math.nan),
            "pg_clipfrac": stats.get("actor/pg_clipfrac", math.nan),
            "logprob_diff_max": stats.get("logprob_diff_max", math.nan),
            "tis_weight_mean": stats.get("tis_weight_mean", math.nan), **head,
            "sequences_trained": len(rows), "tokens_trained": sum(sum(r["response_mask"]) for r in rows),
            "grad_norm": stats.get("grad_norm", 0.0), "update_seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else 0.0, "lr": lr, "optimizer_steps": steps,
            "forwarded_tokens": int(stats.get("forwarded_tokens", 0)),
            "prefix_shared_tokens": int(stats.get("prefix_shared_tokens", 0)), **tail,
        }
        for k, v in stats.items():  # verl's own metric names, as its trainer logs them
            if k not in ("loss", "grad_norm", "kl", "logprob_diff_max", "lr", "tis_weight_mean", "forwarded_tokens",
                         "prefix_shared_tokens"):
                metrics.setdefault(k, v)
        return metrics

    # ----- config edits while paused ----------------------------------------------------
    def check_config(self) -> None:
        """GRPOTrainer's checks, then the config must stay a VerlConfig that verl accepts (``resume()`` calls it)."""
        super().check_config()
        if not isinstance(self.config, VerlConfig):
            raise ConfigError("VerlTrainer.config must stay a VerlConfig")
        now = asdict(self.config)
        if now != self._verl_checked:  # composing verl's config costs ~1-2 s: only after an edit
            self.config.verl_config()  # verl's own checks, before resume() lets the loop go on
            self._verl_checked = now

    # ----- checkpoints (verl's layout) --------------------------------------------------
    def write_checkpoint(self, path: str | Path, state: dict[str, Any]) -> Path:
        """Write a run checkpoint into the folder ``path`` the way verl lays them out; returns the step's folder.

        ``path`` plays verl's ``trainer.default_local_dir``: ``algo.save(path)`` writes
        ``path/global_step_{step}/trainer.pt`` (the run checkpoint: the weights or LoRA adapters, the
        optimizer and LR scheduler, RNG states, metrics, config, the algorithm's state) and then,
        atomically, ``path/latest_checkpointed_iteration.txt`` (verl's tracker file), so a crash mid-save
        leaves the previous checkpoint the latest. Call it at a step boundary (paused, or after ``wait()``).

        Raises:
            ConfigError: ``path`` names a ``.pt`` file, not a folder.
        """
        root = Path(path)
        if root.suffix == ".pt":
            raise ConfigError(f"save() with a VerlTrainer takes a folder (verl's trainer.default_local_dir), got {root}; "
                              "e.g. algo.save('runs/verl/checkpoints')")
        folder = root / f"global_step_{self.updates_applied}"
        write_file(folder / "trainer.pt", state)
        tracker = root / "latest_checkpointed_iteration.txt"
        tmp = tracker.with_suffix(".tmp")
        tmp.write_text(str(self.updates_applied))
        os.replace(tmp, tracker)
        return folder

    def find_checkpoint(self, path: str | Path, *, resume_mode: str = "auto",  # type: ignore[override]
                        ) -> Optional[Path]:  # the base takes **options and refuses them; verl's layout takes one
        """The checkpoint file ``load(path, resume_mode=...)`` reads, with verl's ``trainer.resume_mode``.

        * ``"auto"``: ``path`` is the checkpoint folder; load its latest step (verl's
          ``find_latest_ckpt_path`` reads ``latest_checkpointed_iteration.txt``).
        * ``"resume_path"``: ``path`` is one ``global_step_N`` folder (or its ``trainer.pt``).
        * ``"disable"``: load nothing (start fresh): None.

        The rest of ``load`` is GRPOTrainer's (config restored from the checkpoint unless
        ``keep_config``; RNG states; the algorithm's state; the engine gets the weights).

        Raises:
            FileNotFoundError: no checkpoint at ``path``.
            ConfigError: an unknown ``resume_mode``.
        """
        if resume_mode == "disable":
            return None
        path = Path(path)
        if resume_mode == "resume_path":
            return path if path.suffix == ".pt" else path / "trainer.pt"
        if resume_mode != "auto":
            raise ConfigError(f"resume_mode={resume_mode!r}; use 'auto', 'resume_path' or 'disable' (verl's "
                              "trainer.resume_mode)")
        from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

        tracker = path / "latest_checkpointed_iteration.txt"
        with contextlib.redirect_stdout(io.StringIO()):  # verl prints "Found checkpoint: %s <path>"
            latest = find_latest_ckpt_path(str(path)) if tracker.exists() else None
        if latest is None:
            raise FileNotFoundError(f"no checkpoint in {path} (no latest_checkpointed_iteration.txt naming an "
                                    "existing global_step_N folder); write one with algo.save(folder)")
        return Path(latest) / "trainer.pt"

    def load_state_dict(self, state: dict[str, Any], *, keep_config: bool = False, source: Any = "the state") -> None:
        """GRPOTrainer's ``load_state_dict``, then verl's actor rebuilt from the restored config."""
        super().load_state_dict(state, keep_config=keep_config, source=source)
        with self._updating:
            self.verl_config = self.config.verl_config()
            self._build_actors()


def _batch_rows(data: Any) -> list[dict[str, Any]]:
    """The DataProto's rows as ``Update.batch`` holds sequences (token-aligned lists)."""
    b = data.batch
    rows = []
    for i in range(len(data)):
        attn = b["attention_mask"][i]
        P = b["prompts"].shape[1]
        prompt = b["prompts"][i][attn[:P].bool()].tolist()
        n = int(attn[P:].sum())
        response = b["responses"][i][:n].tolist()
        mask = b["response_mask"][i][:n].tolist()
        zeros = [0.0] * len(prompt)
        adv = b["advantages"][i][:n].tolist()
        rows.append({
            "rollout_id": data.non_tensor_batch["rollout_id"][i], GROUP_ID_KEY: data.non_tensor_batch["uid"][i],
            "input_ids": prompt + response, "response_mask": [0] * len(prompt) + mask,
            "advantage": float(next((a for a, m in zip(adv, mask) if m), 0.0)),
            "advantages": zeros + [a if m else 0.0 for a, m in zip(adv, mask)],
            "engine_logprobs": zeros + ([lp if m else 0.0
                                         for lp, m in zip(b["rollout_log_probs"][i][:n].tolist(), mask)]
                                        if "rollout_log_probs" in b.keys() else [0.0] * n),
            "trainer_logprobs": zeros + [lp if m else 0.0 for lp, m in zip(b["old_log_probs"][i][:n].tolist(), mask)],
        })
    return rows
