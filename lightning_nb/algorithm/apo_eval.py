"""How APO measures prompts and picks its winner: :class:`CandidateEvaluation`, mixed into
:class:`~lightning_nb.algorithm.apo.APO`.

* Rollouts: each candidate runs in a resources set of its own (``apo:<run>:<id>``), once per task, with the
  agent's own sampling unless ``APOConfig.temperature`` is set (:meth:`CandidateEvaluation.sampling`), so a score
  APO reports is what the user's own rollouts of that prompt would score.
* Selection on training tasks: the beam keeps the ``beam_width`` prompts with the highest mean reward on the
  round's tasks (ties: the older candidate first).
* The winner: the top of the beam, except when other candidates tie with it on the last round's training tasks
  (common with a few tasks and 0/1 rewards): then every tied candidate is measured on ``val_tasks`` and the best
  there wins (:meth:`CandidateEvaluation.tied`, :meth:`CandidateEvaluation.best`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from lightning_nb.algorithm.apo_config import APOConfig, BestPrompt, Candidate
from lightning_nb.algorithm.rl_config import task_key
from lightning_nb.errors import ConfigError, LightningNbError, NotFoundError
from lightning_nb.store.base import LightningStore
from lightning_nb.store.rules import reward_or_zero
from lightning_nb.types import SAMPLING_PARAMETERS_KEY, PromptTemplate, RolloutConfig

__all__ = ["CandidateEvaluation"]


class CandidateEvaluation:
    """APO's rollouts, scores and choice of winner (module docstring); APO holds the state declared here."""

    store: LightningStore
    config: APOConfig
    id_key: str
    val_tasks: list[Any]
    run_id: str
    resources_id: str
    candidates: dict[str, Candidate]
    beam: list[str]
    rows: list[dict[str, Any]]  # beam_df

    if TYPE_CHECKING:  # Algorithm's
        @property
        def round(self) -> int: ...

        def report_progress(self, phase: str, done: int, total: int, *, unit: str, step: int,
                            sample_round: int = 0) -> None: ...

        def wait_for(self, rollout_ids: list[str], desc: Optional[str] = None,
                     start_timeout_s: Optional[float] = None,
                     on_progress: Optional[Callable[[int, int], None]] = None) -> bool: ...

    # ----- sampling --------------------------------------------------------------------------
    def sampling(self) -> str:
        """How APO's rollouts sample, in words (``best()`` and the log say it): ``"the agent's own sampling (...)"``
        when ``config.temperature`` is None (the default), else ``"temperature T (APOConfig.temperature)"``."""
        if self.config.temperature is not None:
            return f"temperature {self.config.temperature:g} (APOConfig.temperature, not the agent's own sampling)"
        llm = self.store.get_resources_by_id(self.resources_id).resources.get(self.config.llm_name)
        own = getattr(llm, SAMPLING_PARAMETERS_KEY, {}).get("temperature")
        where = (f"temperature {own:g} from the {self.config.llm_name!r} resource" if isinstance(own, (int, float))
                 else "the agent's default temperature")
        return f"the agent's own sampling ({where}; APOConfig.temperature=None)"

    def _rollout_sampling(self) -> dict[str, Any]:
        """The sampling parameters APO's rollouts carry: ``max_tokens``, and ``temperature`` only when set."""
        out: dict[str, Any] = {"max_tokens": self.config.max_tokens}
        if self.config.temperature is not None:
            out["temperature"] = self.config.temperature
        return out

    # ----- selection on training tasks -------------------------------------------------------
    def _select(self, pool: list[Candidate], keys: list[str], r: int, new: set[str]) -> list[dict[str, Any]]:
        """Rank ``pool`` by mean reward on ``keys`` (ties: the older candidate first), keep ``beam_width``."""
        scored = [(c, *c.score(keys)) for c in pool]
        ranked = sorted(scored, key=lambda s: -s[1] if not math.isnan(s[1]) else math.inf)  # stable
        self.beam = [c.id for c, *_ in ranked[:self.config.beam_width]]
        rows = [{"round": r, "candidate_id": c.id, "rank": i + 1, "score": score, "n": n,
                 "kept": c.id in self.beam, "new": c.id in new, "parent": c.parent, "text": c.template.template,
                 "critique": c.critique} for i, (c, score, n) in enumerate(ranked)]
        self.rows += rows
        return rows

    def tied(self) -> list[str]:
        """Ids of the candidates tied with the top of the beam on the last round's training tasks (same mean
        reward), the top first; only the top when none ties (``["c0"]`` before any round). :meth:`best` measures
        all of them on ``val_tasks`` before choosing the winner."""
        last = [row for row in self.rows if row["round"] == self.round]
        if not last or math.isnan(last[0]["score"]):
            return [self.beam[0]]
        return [row["candidate_id"] for row in last if row["score"] == last[0]["score"]]

    # ----- rollouts --------------------------------------------------------------------------
    def _resources_for(self, cand: Candidate) -> str:
        """The id of ``cand``'s resources set (the target's resources with ``cand`` as the prompt), added once."""
        if cand.resources_id is not None:
            try:
                self.store.get_resources_by_id(cand.resources_id)
                return cand.resources_id
            except NotFoundError:  # a loaded APO on another store
                pass
        base = self.store.get_resources_by_id(self.resources_id).resources
        cand.resources_id = self.store.add_resources({**base, self.config.prompt_name: cand.template},
                                                     resources_id=f"apo:{self.run_id}:{cand.id}").resources_id
        return cand.resources_id

    def _run_rollouts(self, cands: Sequence[Candidate], tasks: Sequence[Any], r: int, held_out: bool = False) -> None:
        """Run each candidate on each task it has no reward for yet and record the final rewards (failed: 0)."""
        cfg = self.config
        sampling = self._rollout_sampling()
        todo: list[tuple[Candidate, str, str]] = []
        for cand in cands:
            done = set(cand.held_out if held_out else cand.rewards)
            for task in tasks:
                key = task_key(task, self.id_key)
                if key in done:
                    continue
                done.add(key)
                rollout = self.store.enqueue_rollout(
                    task, mode="val" if held_out else "train", resources_id=self._resources_for(cand),
                    config=RolloutConfig(timeout_seconds=cfg.rollout_timeout_s),
                    metadata={SAMPLING_PARAMETERS_KEY: sampling, "apo": {"run": self.run_id, "round": r,
                                                                       "candidate": cand.id}})
                todo.append((cand, key, rollout.rollout_id))
        ids = [rid for *_, rid in todo]
        self._wait(ids, "evaluate" if held_out else "rollouts", r)
        rewards = self.store.final_rewards(ids)
        status = {ro.rollout_id: ro.status for ro in self.store.query_rollouts(rollout_ids=ids)}
        for cand, key, rid in todo:
            if status[rid] in ("succeeded", "failed"):  # cancelled ones are left out
                (cand.held_out if held_out else cand.rewards)[key] = reward_or_zero(rewards[rid])
                if not held_out:
                    cand.rollouts[key] = rid

    def _wait(self, ids: list[str], phase: str, r: int) -> None:
        """Wait until every rollout of ``ids`` is terminal, reporting ``phase`` progress.

        Raises:
            LoopStopped: :meth:`stop` was called (the rollouts are cancelled).
            LightningNbError: none left the queue within ``config.start_timeout_s`` (no runners; cancelled).
        """
        def report(done: int, total: int) -> None:
            self.report_progress(phase, done, total, unit="rollouts", step=r)

        if not self.wait_for(ids, start_timeout_s=self.config.start_timeout_s, on_progress=report):
            raise LightningNbError(f"no APO rollout left the queue in {self.config.start_timeout_s:g} s: no "
                                   "runner consumes this store; start_runners(agent, store) first")

    # ----- results ---------------------------------------------------------------------------
    def winner(self) -> Candidate:
        """The top of the beam (the starting prompt before any round), chosen on training tasks; :meth:`best`
        breaks a tie there on ``val_tasks``."""
        return self.candidates[self.beam[0]]

    def evaluate(self, prompt: Optional[PromptTemplate | str] = None, tasks: Optional[Sequence[Any]] = None) -> float:
        """Mean final reward of ``prompt`` on ``tasks`` (default ``val_tasks``), each task run once with APO's
        :meth:`sampling` (the agent's own unless ``config.temperature`` is set); failed rollouts count 0,
        cancelled ones are left out (NaN if none finished).

        ``prompt``: a PromptTemplate, a template text (the starting prompt's engine), a candidate id
        (``"c0"``), or None (the winner). Rewards are kept per candidate and task, so asking again costs
        nothing. A prompt APO has not tried becomes a candidate of its own (a new resources set).

        Raises:
            ConfigError: no tasks (no ``val_tasks`` and none given); ``prompt`` is an unknown candidate id.
            LoopStopped: the loop was stopped meanwhile (the rollouts are cancelled).
        """
        tasks = list(self.val_tasks if tasks is None else tasks)
        if not tasks:
            raise ConfigError("no tasks to evaluate: pass val_tasks to APO or tasks to evaluate()")
        cand = self._as_candidate(prompt)
        self._run_rollouts([cand], tasks, self.round, held_out=True)
        got = [cand.held_out[k] for k in (task_key(t, self.id_key) for t in tasks) if k in cand.held_out]
        return sum(got) / len(got) if got else math.nan

    def _as_candidate(self, prompt: Optional[PromptTemplate | str]) -> Candidate:
        if prompt is None:
            return self.winner()
        if isinstance(prompt, str) and prompt in self.candidates:
            return self.candidates[prompt]
        if isinstance(prompt, str) and prompt[:1] == "c" and prompt[1:].isdigit():
            raise ConfigError(f"{prompt!r} is not a candidate of this APO; candidates: {sorted(self.candidates)}")
        template = prompt if isinstance(prompt, PromptTemplate) else PromptTemplate(
            template=prompt, engine=self.candidates["c0"].template.engine)
        for cand in self.candidates.values():
            if cand.template == template:
                return cand
        cand = self.candidates[f"c{len(self.candidates)}"] = Candidate(f"c{len(self.candidates)}", template,
                                                                       round=self.round)
        return cand

    def best(self, prompt: Optional[PromptTemplate | str] = None) -> BestPrompt:
        """The starting prompt ``c0`` and the winner, both scored on the same ``val_tasks``, and which APO keeps.

        The winner is ``prompt`` (as :meth:`evaluate` takes it) or else the top of the beam; when other candidates
        tie with it on the last round's training tasks (:meth:`tied`), each of them is measured on ``val_tasks``
        too and the one with the highest held-out mean wins (a tie there: the top of the beam first). Each score is
        the mean final reward over the val tasks all measured prompts have a finished rollout on (each task run
        once with APO's :meth:`sampling`, then kept: asking again costs nothing). APO keeps the winner only if it
        beats the start by more than ``config.publish_margin``, else the start (:class:`BestPrompt`: ``str()``
        says which, with the sampling and the tie; ``df()`` is the table); :meth:`run` publishes the winner only
        then. Without a tie the winner is chosen on training tasks only, so both scores are unbiased held-out
        estimates; after a tie the winner's is the best of the tied ones' (at most ``beam_width`` or so prompts,
        and ``publish_margin`` stands between it and publishing).

        Raises:
            ConfigError: APO was built without ``val_tasks``; ``prompt`` is an unknown candidate id.
            LoopStopped: the loop was stopped meanwhile (the rollouts are cancelled).
        """
        if not self.val_tasks:
            raise ConfigError("best() scores the start and the winner on val_tasks, and this APO has none: "
                              "APO(store, train_tasks, val_tasks, ...)")
        start = self.candidates["c0"]
        contenders = [self._as_candidate(prompt)] if prompt is not None else [self.candidates[c] for c in self.tied()]
        measured = list({c.id: c for c in [start, *contenders]}.values())
        self._run_rollouts(measured, self.val_tasks, self.round, held_out=True)
        keys = [k for k in (task_key(t, self.id_key) for t in self.val_tasks)
                if all(k in c.held_out for c in measured)]

        def mean(cand: Candidate) -> float:
            return sum(cand.held_out[k] for k in keys) / len(keys) if keys else math.nan

        winner = max(contenders, key=lambda c: -math.inf if math.isnan(mean(c)) else mean(c))  # first of equals
        tied = tuple((c.id, mean(c)) for c in contenders) if len(contenders) > 1 else ()
        return BestPrompt(start.template, mean(start), winner.id, winner.template, mean(winner), len(keys),
                          self.config.publish_margin, sampling=self.sampling(), tied=tied)
