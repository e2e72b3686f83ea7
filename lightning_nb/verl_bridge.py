"""Our triplets as verl's PPO batch, and verl's own actor update run in this process without Ray.

Three pieces, the groundwork of a verl trainer (issue 11):

* :func:`triplets_to_dataproto`: episodes (packed exactly as :class:`~lightning_nb.trainer.GRPOTrainer`
  packs them, through :func:`~lightning_nb.trainer.pack_episode`) → the ``verl.DataProto`` that
  verl's PPO trainer consumes (the layout of verl 0.9's agent loop, ``AgentLoopWorker._postprocess``).
* :func:`grpo_advantages`: GRPO advantages of that batch through verl's
  ``core_algos.compute_grpo_outcome_advantage``.
* :class:`VerlActor`: verl's FSDP training engine (``FSDPEngineWithLMHead``) and PPO loss
  (``verl.workers.utils.losses.ppo_loss``) around a plain Hugging Face model that is already in
  memory (e.g. ``TransformersEngine.model``, updated in place), with verl's configuration
  composed from its own Hydra defaults (:func:`ppo_config`). No Ray cluster, no FSDP wrapping,
  no model loaded from disk; CPU or one CUDA device.

What runs in-process and what is patched (all of it here, nothing in verl's files)
-------------------------------------------------------------------------------------
verl 0.9.0 has no ``dp_actor.DataParallelPPOActor`` any more: its actor is
``engine_workers.ActorRolloutRefWorker`` → ``TrainingWorker`` → an engine from
``verl.workers.engine`` (FSDP: ``FSDPEngineWithLMHead``). ``TrainingWorker`` itself cannot be
built here without a Ray-style launch (``Worker.__init__`` reads ``RANK``/``WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT``, and the engine it builds loads the model from a path and wraps
it in FSDP), so :class:`VerlActor` drives the engine the way ``TrainingWorker.infer_batch`` /
``train_mini_batch`` and ``RayPPOTrainer._compute_old_log_prob`` / ``_update_actor`` do. The
departures:

1. ``_InProcessEngine(FSDPEngineWithLMHead)`` overrides four build hooks: ``_build_module``
   returns the given model (no ``from_pretrained``, no verl monkey patches), ``_build_fsdp_module``
   returns it unwrapped (autocast follows the model's own dtype: none in float32), and
   ``_build_optimizer`` / ``_build_lr_scheduler`` return the given optimizer / scheduler if one
   was passed (else verl's ``build_optimizer`` / its warmup schedules). ``initialize`` builds no
   FSDP checkpoint manager (checkpoints are the trainer's job). Forward, loss, micro-batching, gradient clipping (``clip_grad_norm_`` for a
   non-FSDP module is verl's own branch), the optimizer step and the LR scheduler are verl's code.
2. A one-process ``torch.distributed`` group (gloo, or ``cpu:gloo,cuda:nccl`` on a GPU, over an
   in-memory ``HashStore``: no port, no Ray) because the engine all-reduces token counts.
3. On a machine without a GPU, a CPU platform (:class:`_PlatformCPU`) registered through verl's
   own extension point ``verl.plugin.platform.PlatformRegistry`` / ``set_platform``: verl 0.9.0
   registers only nvidia/huawei/amd and falls back to CUDA, so ``get_device_id()`` would call
   ``torch.cuda.current_device()``.
4. Where ``flash_attn`` is not installed (CPU), verl's padding helpers
   (``verl.utils.attention_utils.unpad_input`` & co., which ``left_right_2_no_padding`` calls) are
   pointed at plain-torch equivalents of flash-attn's ``bert_padding`` functions (verl's own
   port, ``verl.utils.npu_flash_attn_utils``, needs einops, which verl does not declare), by
   replacing ``attention_utils._get_attention_functions``. verl 0.9.1 has the same torch fallback
   built in, so this patch can go when we move to 0.9.1.
5. The model's ``config.json`` is written to a temporary folder (with ``architectures`` filled in)
   because verl's ``HFModelConfig`` reads the model config from a path and asserts one architecture.

``import verl`` needs the ``ray`` *package* (``verl/protocol.py`` imports it at module level),
but nothing here starts or contacts Ray.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning_nb.types import Triplet

__all__ = ["triplets_to_dataproto", "grpo_advantages", "ppo_config", "VerlActor", "IN_PROCESS_OVERRIDES",
           "require_verl"]

log = logging.getLogger(__name__)

# Hydra overrides of verl's ppo_trainer.yaml that the in-process actor needs (the caller's come after them).
IN_PROCESS_OVERRIDES: tuple[str, ...] = (
    # verl's packed ("remove padding") forward needs flash-attn varlen kernels; the padded path works everywhere
    "actor_rollout_ref.model.use_remove_padding=false",
    # micro-batches by a token budget, so any batch size works (verl's fixed micro-batch must divide the mini-batch)
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=4096",
    "algorithm.adv_estimator=grpo",
)


def require_verl() -> None:
    """Import verl, or raise an ImportError that names the extra to install.

    Raises:
        ImportError: verl (or the ``ray`` package that ``verl/protocol.py`` imports) is not installed.
    """
    try:
        import verl  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"lightning_nb.verl_bridge and VerlTrainer need verl and the ray package it imports ({exc}); install "
            "the tested set with pip install 'lightning-nb[verl]' (CPU, verl 0.9.0) or 'lightning-nb[gpu]' "
            "(CUDA: verl[vllm]==0.9.1 with vllm 0.24.0, torch 2.11.0, transformers 5.9.0)") from exc


# ----- triplets -> DataProto ------------------------------------------------------------
def triplets_to_dataproto(triplets: Sequence[Triplet], *, pad_token_id: int, max_prompt_len: Optional[int] = None,
                          max_response_len: Optional[int] = None, pack_turns: bool = True,
                          advantages: Optional[Mapping[Any, float]] = None) -> Any:
    """The ``verl.DataProto`` verl's PPO trainer consumes, one row per packed sequence.

    Each episode (the triplets of one ``rollout_id``, ordered by ``turn``) is packed by
    :func:`lightning_nb.trainer.pack_episode`, exactly as ``GRPOTrainer`` packs it: a turn whose
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
    ``advantages``               (B, R)    float32 only with ``advantages=``: the value of the row's
                                                   episode (or of the turn a token came with) × mask
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
            ``(rollout_id, turn)`` (one per triplet, e.g. ``GRPOTrainer.last_turn_advantages``).

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
    if advantages is not None:
        tensors["advantages"] = torch.tensor([right(r["advantages"], R, 0.0) for r in rows], dtype=torch.float32)
    non_tensors = {
        "uid": np.array([r["group_id"] for r in rows], dtype=object),
        "rollout_id": np.array([r["rollout_id"] for r in rows], dtype=object),
        "turn": np.array([r["turn"] for r in rows], dtype=object),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info={"pad_token_id": int(pad_token_id)})


def _rows(triplets: Sequence[Triplet], pack_turns: bool,
          advantages: Optional[Mapping[Any, float]]) -> list[dict[str, Any]]:
    """One dict per packed sequence: prompt/response ids, mask, log-probs, scores, advantages, keys."""
    from lightning_nb.trainer import pack_episode

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
                "advantages": _row_advantages(advantages, rollout_id, ordered, turns, mask),
                "group_id": first.group_id, "rollout_id": rollout_id, "turn": first.turn,
            })
    return rows


def _temperature(t: Triplet) -> float:
    """The temperature the logits are divided by: the sampling one, 1.0 for greedy (the engine's log-probs then)."""
    return t.temperature if t.temperature > 0 else 1.0


def _row_advantages(advantages: Optional[Mapping[Any, float]], rollout_id: str, ordered: list[Triplet],
                    turns: list[int], mask: list[int]) -> list[float]:
    if advantages is None:
        return []
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
    group. The values equal :func:`lightning_nb.trainer.group_advantages` of the episodes' rewards.

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
    row_episode = torch.tensor([index[r] for r in rollout_ids])
    scores_E = torch.zeros(len(episodes), dtype=torch.float32).index_add_(
        0, row_episode, data.batch["token_level_scores"].float().sum(-1))
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
        token_level_rewards=scores_E[:, None], response_mask=torch.ones(len(episodes), 1),
        index=np.array(group_E, dtype=object), norm_adv_by_std_in_grpo=norm_adv_by_std)
    return adv_E[row_episode, 0][:, None] * data.batch["response_mask"].float()


# ----- verl's configuration -------------------------------------------------------------
def ppo_config(overrides: Sequence[str] = ()) -> Any:
    """verl's own ``ppo_trainer.yaml``, composed by Hydra, with :data:`IN_PROCESS_OVERRIDES` then ``overrides``.

    ``overrides`` are Hydra override strings, e.g.
    ``["actor_rollout_ref.actor.optim.lr=1e-5", "actor_rollout_ref.actor.ppo_epochs=2"]``.
    Returns the ``omegaconf.DictConfig`` (printable with ``OmegaConf.to_yaml``); verl's dataclasses
    validate their sections when :class:`VerlActor` converts them.
    """
    require_verl()
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    if GlobalHydra.instance().is_initialized():  # a notebook may have composed another config before
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=[*IN_PROCESS_OVERRIDES, *overrides])


# ----- verl's actor, in this process ----------------------------------------------------
class VerlActor:
    """verl's actor (old log-probs and the PPO update) on a model already in memory, without Ray.

    Mirrors ``ActorRolloutRefWorker.init_model`` / ``TrainingWorker`` / ``RayPPOTrainer``: the
    actor section of ``config`` becomes verl's ``FSDPActorConfig``, the loss is
    ``functools.partial(verl.workers.utils.losses.ppo_loss, config=actor_config)``, and the engine is
    verl's ``FSDPEngineWithLMHead`` with the build hooks patched to adopt ``model`` (see the module
    docstring). ``model`` is updated in place; ``optimizer`` defaults to verl's ``build_optimizer``
    (AdamW from ``actor_rollout_ref.actor.optim``).

    Args:
        model: a ``transformers`` causal LM (``model(input_ids=..., attention_mask=...,
            position_ids=...).logits``), on the device it will train on.
        config: :func:`ppo_config`'s result; None: ``ppo_config()``.
        optimizer: a torch optimizer over ``model``'s trainable parameters, or None.
        lr_scheduler: the scheduler :meth:`update_policy` steps once per call, or None for verl's own
            (built from ``actor_rollout_ref.actor.optim``).
        forward_only: score only (e.g. the reference policy): no optimizer, no scheduler
            (verl's ``engine_config.forward_only``).
    """

    def __init__(self, model: Any, config: Any = None, *, optimizer: Any = None, lr_scheduler: Any = None,
                 forward_only: bool = False) -> None:
        import functools

        import torch

        require_verl()
        _use_cpu_platform_without_gpu()
        _use_torch_padding_without_flash_attn()
        _ensure_process_group()
        from omegaconf import OmegaConf, open_dict
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.utils.losses import ppo_loss

        self.config = config if config is not None else ppo_config()
        cfg = self.config.actor_rollout_ref
        self._config_dir = tempfile.TemporaryDirectory(prefix="lightning-nb-verl-")
        _save_model_config(model, self._config_dir.name)
        model_section = OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True))
        with open_dict(model_section):
            model_section.path = self._config_dir.name
            model_section.load_tokenizer = False
        self.model_config = omega_conf_to_dataclass(model_section)
        self.actor_config = omega_conf_to_dataclass(cfg.actor)
        self.actor_config.model_config = self.model_config
        engine_config = self.actor_config.engine
        # as ActorRolloutRefWorker.init_model and TrainingWorker.__init__ assign them
        engine_config.use_dynamic_bsz = cfg.actor.use_dynamic_bsz
        engine_config.infer_max_token_len_per_gpu = cfg.rollout.log_prob_max_token_len_per_gpu
        engine_config.infer_micro_batch_size_per_gpu = cfg.rollout.log_prob_micro_batch_size_per_gpu
        engine_config.max_token_len_per_gpu = cfg.actor.ppo_max_token_len_per_gpu
        engine_config.micro_batch_size_per_gpu = cfg.actor.ppo_micro_batch_size_per_gpu
        engine_config.use_remove_padding = self.model_config.get("use_remove_padding", False)
        engine_config.use_fused_kernels = self.model_config.get("use_fused_kernels", False)
        engine_config.forward_only = forward_only
        if self.model_config.lora_rank:
            raise ValueError("VerlActor adopts the model as it is: give it a peft model instead of "
                             "actor_rollout_ref.model.lora_rank > 0")
        self.engine = _engine_class()(model_config=self.model_config, engine_config=engine_config,
                                      optimizer_config=self.actor_config.optim,
                                      checkpoint_config=self.actor_config.checkpoint)
        self.engine.given_module, self.engine.given_optimizer = model, optimizer
        self.engine.given_lr_scheduler = lr_scheduler
        with contextlib.redirect_stdout(io.StringIO()):  # verl prints the model size and the LR schedule
            self.engine.initialize()
        self.model, self.optimizer = self.engine.module, self.engine.optimizer
        self.lr_scheduler = self.engine.lr_scheduler
        self.loss_fn = functools.partial(ppo_loss, config=self.actor_config)
        self._torch = torch

    def _mode_kwargs(self) -> dict[str, bool]:
        """Arguments for verl's ``engine.eval_mode()`` / ``train_mode()``.

        Those contexts move an offloaded model or optimizer in on entry and out on exit. With neither
        offloaded (``fsdp_config.param_offload`` / ``optimizer_offload`` false, our default) the move is
        empty, but on a CPU device verl still runs ``gc.collect()`` on entry and on exit: about 0.3 s each
        in a test process, six times a step. Skip the contexts' offload step then; with offload set, it runs.
        """
        engine = self.engine
        return {"disable_auto_offload": not (engine.is_param_offload_enabled or engine.is_optimizer_offload_enabled)}

    def _no_padding(self, data: Any, **non_tensor: Any) -> Any:
        """``RayPPOTrainer``'s steps 1–3: DataProto → TensorDict → verl's no-padding layout, plus the
        per-call keys ``TrainingWorker`` injects."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        td = left_right_2_no_padding(data.to_tensordict())
        tu.assign_non_tensor(td, **non_tensor)
        return td

    def compute_log_prob(self, data: Any, *, calculate_entropy: bool = False,
                         max_token_len: Optional[int] = None) -> Any:
        """The current policy's log-probs of ``data``'s responses, as verl's ``_compute_old_log_prob``.

        ``max_token_len``: the token budget of one forward (verl's dynamic micro-batching);
        None: ``rollout.log_prob_max_token_len_per_gpu``.

        Returns a ``DataProto`` with ``old_log_probs`` (B, R) float32 (0 on padding; to be
        ``union``-ed into ``data``), and ``entropys`` (B, R) with ``calculate_entropy``.
        """
        from verl import DataProto
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        ec = self.engine.engine_config
        td = self._no_padding(data, calculate_entropy=calculate_entropy, compute_loss=False,
                              use_remove_padding=ec.use_remove_padding, use_dynamic_bsz=ec.use_dynamic_bsz,
                              max_token_len_per_gpu=max_token_len or ec.infer_max_token_len_per_gpu,
                              micro_batch_size_per_gpu=ec.infer_micro_batch_size_per_gpu,
                              use_fused_kernels=ec.use_fused_kernels)
        was_training = self.model.training
        try:
            with self.engine.eval_mode(**self._mode_kwargs()):
                out = self.engine.infer_batch(td, loss_function=None)
        finally:
            self.model.train(was_training)
        result = {"old_log_probs": no_padding_2_padding(out["model_output"]["log_probs"], td).float()}
        if calculate_entropy:
            result["entropys"] = no_padding_2_padding(out["model_output"]["entropy"], td).float()
        return DataProto.from_tensordict(tu.get_tensordict(result))

    def update_policy(self, data: Any, *, mini_batch_size: Optional[int] = None,
                      max_token_len: Optional[int] = None) -> dict[str, float]:
        """verl's PPO update on ``data`` (``RayPPOTrainer._update_actor`` + ``TrainingWorker.train_mini_batch``).

        ``data`` needs ``old_log_probs`` and ``advantages`` (B, R) besides the keys of
        :func:`triplets_to_dataproto` (and ``ref_log_prob`` with ``actor.use_kl_loss``).
        ``ppo_epochs`` times, the batch is cut into consecutive mini-batches of ``mini_batch_size``
        rows (the last one may be smaller; None: ``ppo_mini_batch_size × rollout.n``, capped at B);
        each mini-batch is one ``engine.train_batch`` (verl's dynamic micro-batches of at most
        ``max_token_len`` tokens, ``ppo_loss`` normalised over the whole mini-batch, ``clip_grad``,
        one optimizer step). verl's own ``make_iterator`` needs B to be a multiple of the mini-batch
        size, which an agent batch (forks, dropped groups) rarely is; without ``actor.shuffle`` it
        yields the same consecutive slices. The LR scheduler steps once per call. Returns the
        metrics averaged over the mini-batches: verl's ``actor/pg_loss``, ``actor/pg_clipfrac``,
        ``actor/ppo_kl``, ... plus ``loss``, ``grad_norm``, ``lr`` (after the step),
        ``optimizer_steps``.

        Raises:
            ValueError: a key is missing, or ``actor.shuffle`` is set (not supported here).
        """
        missing = [k for k in ("old_log_probs", "advantages") if k not in data.batch.keys()]
        if missing:
            raise ValueError(f"update_policy() needs {missing} in data.batch: union compute_log_prob()'s result "
                             "(or rollout_log_probs as old_log_probs) and grpo_advantages()")
        cfg = self.config.actor_rollout_ref
        ac, ec = self.actor_config, self.engine.engine_config
        if ac.shuffle:
            raise ValueError("actor_rollout_ref.actor.shuffle=true is not supported by the in-process actor; "
                             "mini-batches are consecutive rows")
        B = len(data)
        mini = min(mini_batch_size or cfg.actor.ppo_mini_batch_size * cfg.rollout.n, B)
        parts = [data[i: i + mini] for i in range(0, B, mini)]
        tds = [self._no_padding(
            part, calculate_entropy=ac.calculate_entropy or ac.entropy_coeff != 0.0, distillation_use_topk=False,
            distillation_only=False, global_batch_size=len(part), compute_loss=True,
            use_remove_padding=ec.use_remove_padding, use_dynamic_bsz=ec.use_dynamic_bsz,
            max_token_len_per_gpu=max_token_len or ec.max_token_len_per_gpu,
            micro_batch_size_per_gpu=ec.micro_batch_size_per_gpu, use_fused_kernels=ec.use_fused_kernels)
            for part in parts]
        rows: list[dict[str, float]] = []
        was_training = self.model.training
        try:
            with self.engine.train_mode(**self._mode_kwargs()):
                for _ in range(ac.ppo_epochs):
                    for td in tds:
                        out = self.engine.train_batch(td, loss_function=self.loss_fn)
                        rows.append(_reduce_metrics(out))
            lr = self.engine.lr_scheduler_step()
        finally:
            self.model.train(was_training)
        metrics = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        metrics.update(lr=lr, optimizer_steps=float(len(rows)))
        return metrics


def _save_model_config(model: Any, path: str) -> None:
    """Write ``model``'s ``config.json``, architecture named: verl's ``HFModelConfig`` asserts one (patch 5)."""
    import copy

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: the wrapped one
    config = copy.deepcopy(base.config)
    if not getattr(config, "architectures", None):
        config.architectures = [type(base).__name__]
    config.save_pretrained(path)


def _reduce_metrics(out: dict[str, Any]) -> dict[str, float]:
    """One ``train_batch`` output → floats: verl ``Metric``s merged over micro-batches, losses summed."""
    from verl.utils.metric import Metric

    metrics: dict[str, float] = {"loss": float(sum(out["loss"])), "grad_norm": float(out["metrics"]["grad_norm"])}
    for key, values in out["metrics"].items():
        if key == "grad_norm":
            continue
        values = values if isinstance(values, list) else [values]
        if values and isinstance(values[0], Metric):
            merged = values[0].init_list()
            for v in values:
                merged.append(v)
            metrics[key] = float(merged.aggregate())
        else:
            metrics[key] = float(sum(float(v) for v in values) / len(values))
    return metrics


def _engine_class() -> type:
    """verl's ``FSDPEngineWithLMHead`` with the build hooks that adopt a given module (patch 1)."""
    import warnings

    with warnings.catch_warnings():  # verl.workers.engine warns about each optional backend not installed
        warnings.simplefilter("ignore")
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    class _InProcessEngine(FSDPEngineWithLMHead):
        given_module: Any = None
        given_optimizer: Any = None
        given_lr_scheduler: Any = None

        def initialize(self) -> None:  # no FSDPCheckpointManager: checkpoints are the trainer's
            self._build_model_optimizer()

        def _build_module(self) -> Any:
            return self.given_module

        def _build_fsdp_module(self, module: Any) -> Any:
            self._autocast_dtype = next(module.parameters()).dtype  # float32: no autocast
            self.scaler = None
            return module

        def _build_optimizer(self, module: Any) -> Any:
            if self.given_optimizer is not None:
                return self.given_optimizer
            return super()._build_optimizer(module)

        def _build_lr_scheduler(self, optimizer: Any) -> Any:
            if self.given_lr_scheduler is not None:
                return self.given_lr_scheduler
            return super()._build_lr_scheduler(optimizer)

    return _InProcessEngine


def _use_torch_padding_without_flash_attn() -> None:
    """Without flash_attn, verl's unpad/pad helpers use the plain-torch versions below (patch 4)."""
    import importlib.util

    from verl.utils import attention_utils
    from verl.utils.device import is_torch_npu_available

    if importlib.util.find_spec("flash_attn") is not None or is_torch_npu_available(check_device=False):
        return
    functions = (_index_first_axis, _pad_input, _no_rearrange, _unpad_input)
    attention_utils._get_attention_functions = lambda: functions


def _index_first_axis(x: Any, indices: Any) -> Any:
    """flash_attn.bert_padding.index_first_axis: ``x[indices]`` along the first axis (differentiable)."""
    return x[indices]


def _pad_input(hidden: Any, indices: Any, batch: int, seqlen: int) -> Any:
    """flash_attn.bert_padding.pad_input: (total_nnz, ...) → (batch, seqlen, ...), zeros where not indexed."""
    import torch

    out = torch.zeros(batch * seqlen, *hidden.shape[1:], dtype=hidden.dtype, device=hidden.device)
    out[indices] = hidden
    return out.reshape(batch, seqlen, *hidden.shape[1:])


def _unpad_input(hidden: Any, attention_mask: Any, unused_mask: Any = None) -> tuple:
    """flash_attn.bert_padding.unpad_input: ``(hidden[mask], indices, cu_seqlens, max_seqlen, used_seqlens)``."""
    import torch
    import torch.nn.functional as F

    masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = masks.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden.reshape(-1, *hidden.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max()), attention_mask.sum(dim=-1, dtype=torch.int32)


def _no_rearrange(*args: Any, **kwargs: Any) -> Any:
    raise ImportError("verl asked for einops.rearrange through attention_utils; install flash-attn (GPU) or einops")


def _ensure_process_group() -> None:
    """A one-process ``torch.distributed`` group over an in-memory store (patch 2); kept if one exists."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def _use_cpu_platform_without_gpu() -> None:
    """Register and select :class:`_PlatformCPU` when no GPU is visible (patch 3)."""
    import torch
    from verl.plugin.platform import platform_manager as pm

    if torch.cuda.is_available():
        return
    current = pm._current_platform
    if current is not None and current.device_name == "cpu":
        return
    pm.PlatformRegistry.register(platform="cpu")(_platform_cpu_class())
    level = pm.logger.level
    pm.logger.setLevel(logging.ERROR)  # set_platform warns when it replaces the CUDA fallback
    try:
        pm.set_platform(pm.PlatformRegistry.get("cpu")())
    finally:
        pm.logger.setLevel(level)


def _platform_cpu_class() -> type:
    """verl's ``PlatformBase`` for a machine without an accelerator (device ``cpu``, backend gloo)."""
    from types import ModuleType

    import torch
    from verl.plugin.platform.platform_base import PlatformBase

    class _PlatformCPU(PlatformBase):
        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> ModuleType:
            return torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:  # used as a .to() target: "cpu"
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: Optional[int] = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        def nvtx_range(self, msg: str) -> Any:
            return contextlib.nullcontext()

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return _PlatformCPU
