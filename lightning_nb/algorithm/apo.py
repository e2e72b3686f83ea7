"""APO: Automatic Prompt Optimisation, an algorithm that tunes a PromptTemplate resource instead of weights.

The algorithm of ProTeGi (Pryzant et al. 2023, "Automatic Prompt Optimization with 'Gradient Descent' and Beam
Search", EMNLP), as Agent Lightning's APO runs it on rollouts. Each round (:meth:`APO.step`):

1. draw ``batch_size`` training tasks and run every prompt of the beam on them (each prompt in a resources set
   of its own, id ``apo:<run>:<candidate>``, to which its rollouts are pinned);
2. for each prompt of the beam, show a *critic* LLM the episodes it failed (the task, the model's replies from
   the LLM spans, the reward) and ask why (the textual gradient), then ask an *editor* LLM for
   ``branch_factor`` new prompts from the prompt and the critique (:mod:`~lightning_nb.algorithm.apo_prompts`);
3. run every new prompt on the same tasks and keep the ``beam_width`` prompts with the highest mean reward.

APO keeps the best prompt it has actually measured. The starting prompt is candidate zero (``c0``); when
:meth:`APO.run` ends, ``c0`` and the winner (the top of the beam, chosen on training tasks; when candidates tie
there, each tied one is measured on ``val_tasks`` and the best there wins) are evaluated on the same ``val_tasks``
(:meth:`APO.best`), and the winner is published only if its held-out mean reward beats the start's by more than
``APOConfig.publish_margin`` (default 0.05); else the start stays. APO's rollouts sample as the agent does (its
LLM resource's sampling parameters) unless ``APOConfig.temperature`` is set, so its scores are the numbers the
user's own rollouts get; ``best()`` says which (:mod:`~lightning_nb.algorithm.apo_eval`). Publishing:
``store.add_resources`` writes the target resources set again (``resources_id``: by default the store's latest set
when APO was built) with the winner as the prompt, so its ``version`` goes up by one and rollouts enqueued from then
on run with it. An editor reply that is not a prompt for this agent is recorded in :meth:`APO.calls_df`
(``errors``) and never run: no prompt in it, a template that does not parse, a variable the agent does not fill,
none of those it fills (if it fills any: ``APOConfig.variables``, else the start's), a critique or an answer
(:func:`~lightning_nb.algorithm.apo_prompts.not_a_prompt`), a prompt already tried.

Where this departs from the paper: no bandit selection (every candidate runs on every task of the round's
batch, so all are compared on the same tasks); no Monte-Carlo paraphrase step; a prompt is run at most once per
task (its reward on a task is reused in later rounds, one sample of the agent's sampling); the proposer's
prompts are shortened for small models.

Notebook verbs as :class:`~lightning_nb.algorithm.lightning_rl.LightningRL`'s (a round is a step):
``start(rounds)`` runs :meth:`APO.run` in the background; ``pause()`` parks it at the next round boundary
(``before round``, ``before propose``, ``before evaluate candidates``), ``resume()``, ``stop()``, ``wait()``,
``progress``; :meth:`APO.save` / :meth:`APO.load` write and read a JSON file of the beam and its history.

Side effect to know: ``add_resources`` makes each candidate's set the store's latest while APO evaluates it,
so a rollout enqueued *without* ``resources_id`` meanwhile runs with the candidate added last; when ``run`` ends
with ``config.publish``, the target set is the latest again (with the winner, or with the start, rewritten as is).
"""

from __future__ import annotations

import json
import logging
import random
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_nb import semconv
from lightning_nb.algorithm.apo_config import APOConfig, BestPrompt, Candidate, proposer_endpoint
from lightning_nb.algorithm.apo_eval import CandidateEvaluation
from lightning_nb.algorithm.apo_prompts import candidate_text, failures_text, not_a_prompt, variables_text
from lightning_nb.algorithm.base import Algorithm
from lightning_nb.algorithm.control import LoopStopped
from lightning_nb.algorithm.rl_config import task_key
from lightning_nb.errors import ConfigError, LightningNbError, NotFoundError
from lightning_nb.store.base import LightningStore
from lightning_nb.types import LLMResource, PromptTemplate, ResourcesUpdate, new_id

__all__ = ["APO", "APOConfig", "BestPrompt", "Candidate"]

log = logging.getLogger(__name__)
_FORMAT = "lightning_nb.apo/1"  # the save file's format tag


class APO(CandidateEvaluation, Algorithm):
    """Tune the PromptTemplate ``config.prompt_name`` of a resources set by beam search over LLM-edited prompts.

    Runners must be consuming ``store`` (:func:`~lightning_nb.runners.start_runners`) with an agent that reads
    that template from its resources (``agent(task, llm, *, resources)``, e.g.
    :func:`~lightning_nb.tasks.calc.calc_agent` with :func:`~lightning_nb.tasks.calc.agent.calc_resources`).

    Args:
        store: the store the runners read.
        train_tasks: the tasks rounds draw from; val_tasks: the held-out tasks of :meth:`best`.
        config: :class:`APOConfig`.
        critic, editor: the OpenAI-compatible endpoints (``LLMResource``: endpoint, model, api_key) of the
            critic and the editor. Default: the target set's ``config.llm_name`` resource, i.e. the proxy's
            plain base URL, whose calls are served but not recorded as spans (never trained on). The
            resource's own ``sampling_parameters`` are sent too, under ``config.proposer_temperature`` and
            ``proposer_max_tokens``. Their calls are APO's own records (:meth:`calls_df`).
        resources_id: the set holding the prompt, that the winner is published to. Default: the store's latest.
        id_key: the task field that names a task (:func:`~lightning_nb.algorithm.lightning_rl.task_key`).

    Raises:
        ConfigError: no train tasks; ``config.publish`` without ``val_tasks`` (the winner is published only after
            it beats the start on them); no resources in the store, or (without ``resources_id``) its latest set is
            a candidate set of an earlier APO run; the set has no PromptTemplate named ``config.prompt_name``;
            a critic/editor is not an LLMResource or is an attempt's URL; a bad config.
        NotFoundError: ``resources_id`` is not in the store.
    """

    def __init__(self, store: LightningStore, train_tasks: Sequence[Any], val_tasks: Sequence[Any] = (),
                 *, config: Optional[APOConfig] = None, critic: Optional[LLMResource] = None,
                 editor: Optional[LLMResource] = None, resources_id: Optional[str] = None,
                 id_key: str = "id") -> None:
        if not train_tasks:
            raise ConfigError("train_tasks is empty; load some with lightning_nb.tasks.calc.load_tasks('train')")
        super().__init__(store, None, config or APOConfig())  # no trainer: APO tunes a prompt; a step is a round
        self.id_key = id_key
        self.train_tasks, self.val_tasks = list(train_tasks), list(val_tasks)
        if self.config.publish and not self.val_tasks:
            raise ConfigError("APOConfig.publish=True needs val_tasks: the winner is published only if it beats the "
                              "starting prompt on them; pass APO(store, train_tasks, val_tasks, ...) or "
                              "config=APOConfig(publish=False)")
        target = self._target(resources_id)
        self.resources_id = target.resources_id
        start = target.resources.get(self.config.prompt_name)
        if not isinstance(start, PromptTemplate):
            raise ConfigError(
                f"APO tunes the PromptTemplate named {self.config.prompt_name!r} (APOConfig.prompt_name), and "
                f"resources {self.resources_id!r} has {sorted(target.resources)}; publish one, e.g. "
                "store.add_resources(calc_resources(proxy.as_resource()))")
        default = target.resources.get(self.config.llm_name)
        self.critic = proposer_endpoint(critic, default, "critic", self.config.llm_name)
        self.editor = proposer_endpoint(editor, default, "editor", self.config.llm_name)
        self.run_id = new_id("apo").split("-", 1)[1]
        self.candidates: dict[str, Candidate] = {"c0": Candidate("c0", start)}
        self.beam: list[str] = ["c0"]
        self.rows: list[dict[str, Any]] = []   # beam_df
        self.calls: list[dict[str, Any]] = []  # calls_df: every critic and editor call
        self.published: list[dict[str, Any]] = []
        self._rng = random.Random(self.config.seed)

    @property
    def round(self) -> int:
        """Rounds done: this algorithm's ``global_step`` (a round is a step)."""
        return self.global_step

    def _target(self, resources_id: Optional[str]) -> ResourcesUpdate:
        if resources_id is not None:
            return self.store.get_resources_by_id(resources_id)
        latest = self.store.get_latest_resources()
        if latest is None:
            raise ConfigError("the store has no resources; publish the agent's set first, e.g. "
                              "store.add_resources(calc_resources(proxy.as_resource()))")
        if latest.resources_id.startswith("apo:"):
            raise ConfigError(f"the store's latest resources {latest.resources_id!r} are a candidate set of an "
                              "earlier APO run (stopped before it published); pass resources_id= the set your "
                              "runners use (store.resources_df())")
        return latest

    # ----- the loop's verbs (a round is a step) ----------------------------------------------
    store: LightningStore
    config: APOConfig

    def default_steps(self) -> int:
        """``config.rounds``: the rounds :meth:`start` and :meth:`run` take by default."""
        return self.config.rounds

    def rollout_share(self) -> float:
        """0.5: a round's rollouts and its critic and editor calls weigh the same on ``wait()``'s bar."""
        return 0.5

    def stall_advice(self) -> str:
        """What ``wait()`` says after a stall: while proposing, the critic's and the editor's LLM calls; else the
        default (rollouts no runner takes, a pause: :meth:`~lightning_nb.algorithm.base.Algorithm.stall_advice`)."""
        if self.progress.phase == "propose":
            return ("The critic and the editor LLM calls run (a minute or more each for a small model on a CPU); "
                    "apo.calls_df() lists those done, with their errors.")
        return super().stall_advice()

    def run(self, steps: Optional[int] = None, *, rounds: Optional[int] = None) -> None:
        """Run ``steps`` rounds (default ``config.rounds``), then, with ``val_tasks``, evaluate the start and the
        winner on them (:meth:`best`, logged) and, with ``config.publish``, publish the winner only if it beat the
        start by more than ``config.publish_margin``; else the start stays (:meth:`publish` writes the target set
        again unchanged, only so that it is the store's latest set again). Ends early when stopped.

        ``rounds=`` is the name of earlier versions (a DeprecationWarning; use ``steps``).

        Raises:
            LoopStopped: :meth:`stop` was called.
            TypeError: both ``steps`` and ``rounds`` are given.
        """
        if rounds is not None:
            if steps is not None:
                raise TypeError("APO.run() takes steps or rounds (its old name), not both")
            warnings.warn("APO.run(rounds=...) is deprecated: use APO.run(steps=...) (a step is a round)",
                          DeprecationWarning, stacklevel=2)
            steps = rounds
        for _ in range(self.config.rounds if steps is None else steps):
            if self.stop_requested:
                raise LoopStopped(f"stopped after round {self.round}")
            self.step(progress=False)
        self.at_boundary("before held-out evaluation")
        if not self.val_tasks:
            return
        best = self.best()
        log.info("APO round %d: %s", self.round, best)  # says the sampling and any tie it broke on val_tasks
        if self.config.publish:
            self.publish(best.candidate_id)

    def step(self, progress: Optional[bool] = None) -> dict[str, Any]:
        """One round (see the module docstring); returns its metrics row (:meth:`metrics_df`): ``step`` (the round),
        ``best_score`` and ``best_candidate`` (the round's top of the beam, its mean reward on the round's tasks),
        ``candidates`` (scored this round), ``new_candidates`` (the editor's), ``beam`` (the kept ids),
        ``round_seconds``. Its candidates' rows are in :meth:`beam_df`.

        ``progress``: a tqdm.auto bar of the round's phase while it runs (the parents' rollouts, the proposals,
        the children's rollouts); None (the default): shown in a notebook kernel, not in a script. :meth:`run`
        (the background loop, whose bar is ``wait()``'s) passes False."""
        with self.step_bar(progress):
            return self._step()

    def _step(self) -> dict[str, Any]:
        """:meth:`step`'s work."""
        r = self.round + 1
        t0 = time.perf_counter()
        self.report_progress("rollouts", 0, 0, unit="rollouts", step=r)
        self.at_boundary("before round")
        self.config.validate()
        tasks = self._rng.sample(self.train_tasks, min(self.config.batch_size, len(self.train_tasks)))
        keys = [task_key(t, self.id_key) for t in tasks]
        parents = [self.candidates[c] for c in self.beam]
        self._run_rollouts(parents, tasks, r)
        self.at_boundary("before propose")
        children: list[Candidate] = []
        for k, parent in enumerate(parents):
            self.report_progress("propose", k, len(parents), unit="prompts", step=r)
            children += self._propose(parent, keys, r)
        self.at_boundary("before evaluate candidates")
        self._run_rollouts(children, tasks, r)
        rows = self._select(parents + children, keys, r, {c.id for c in children})
        return self.record({"best_score": rows[0]["score"], "best_candidate": rows[0]["candidate_id"],
                            "candidates": len(rows), "new_candidates": len(children), "beam": list(self.beam),
                            "round_seconds": time.perf_counter() - t0})

    # ----- the proposer ----------------------------------------------------------------------
    def _failures(self, cand: Candidate, keys: list[str]) -> list[dict[str, Any]]:
        """``cand``'s failed episodes on ``keys`` (at most ``config.max_failures``), read from the store."""
        out: list[dict[str, Any]] = []
        for key in keys:
            if len(out) >= self.config.max_failures:
                break
            rid = cand.rollouts.get(key)
            if rid is None or cand.rewards.get(key, 1.0) >= self.config.failure_below:
                continue
            try:
                rollout = self.store.get_rollout_by_id(rid)
            except NotFoundError:  # rewards loaded from a save of another store: the episode is not here
                log.info("APO: rollout %s of %s is not in this store; the critic does not see it", rid, cand.id)
                continue
            spans = self.store.query_spans(rid, attempt_id="latest")
            attempts = self.store.query_attempts(rid)
            out.append({"rollout_id": rid, "input": _task_text(rollout.input), "reward": cand.rewards[key],
                        "replies": [str(s.attributes.get(semconv.COMPLETION, "")) for s in spans
                                    if s.name == semconv.LLM_SPAN],
                        "error": attempts[-1].error if attempts else None})
        return out

    def _propose(self, parent: Candidate, keys: list[str], r: int) -> list[Candidate]:
        """Critic then editor on ``parent``'s failures; returns the new, valid, distinct candidates.

        A parent without failures is not edited; an editor reply with no candidate, an invalid template or a
        duplicate adds none. Each is recorded in :meth:`calls_df` (``error``) and logged.
        """
        failures = self._failures(parent, keys)
        if not failures:
            self._record(r, "critic", parent.id, None, [], 0.0, error="no failed episode: nothing to criticise")
            return []
        fields = {"prompt": parent.template.template, "failures": failures_text(failures)}
        critique = self._call(r, "critic", parent.id, self.critic,
                              PromptTemplate(template=self.config.critic_prompt).format(**fields), 1)[0]
        fields["critique"] = critique
        fields["variables"] = variables_text(self._variables(), parent.template.engine)
        replies = self._call(r, "editor", parent.id, self.editor,
                             PromptTemplate(template=self.config.editor_prompt).format(**fields),
                             self.config.branch_factor)
        made = []
        for k, reply in enumerate(replies):
            cand, error = self._candidate(reply, parent, critique, r)
            self.calls[-1]["candidates"].append(cand.id if cand else None)
            if error:
                self.calls[-1]["errors"].append(f"choice {k}: {error}")
                log.warning("APO round %d, editor of %s, choice %d: %s", r, parent.id, k, error)
            if cand is not None:
                made.append(cand)
        return made

    def _candidate(self, reply: str, parent: Candidate, critique: str,
                   r: int) -> tuple[Optional[Candidate], Optional[str]]:
        """``(new candidate, None)`` from one editor reply, or ``(None, why not)`` (module docstring: the rules)."""
        text = candidate_text(reply)
        if text is None:
            return None, "the editor's reply holds no candidate prompt (empty, or empty between <prompt> tags)"
        try:
            template = PromptTemplate(template=text, engine=parent.template.engine)
        except ConfigError as exc:
            return None, f"not a valid template: {exc}"
        allowed = self._variables()
        if not template.variables <= allowed:
            return None, f"uses {sorted(template.variables - allowed)}; the agent fills only {sorted(allowed)}"
        if allowed and not template.variables & allowed:
            return None, (f"uses none of the agent's variables {sorted(allowed)}: a critique or an answer, not a "
                          "prompt for this agent")
        why = not_a_prompt(text, critique)
        if why:
            return None, why
        same = [c.id for c in self.candidates.values() if c.template == template]
        if same:
            return None, f"the same prompt as {same[0]}"
        cand = Candidate(f"c{len(self.candidates)}", template, parent=parent.id, critique=critique, round=r)
        self.candidates[cand.id] = cand
        return cand, None

    def _variables(self) -> set[str]:
        """The fields the agent fills: ``config.variables``, else the starting prompt's."""
        return set(self.config.variables if self.config.variables is not None
                   else self.candidates["c0"].template.variables)

    def _call(self, r: int, role: str, parent: str, llm: LLMResource, content: str, n: int) -> list[str]:
        """One chat call of the critic or editor (``n`` choices), recorded; returns the choices' texts.

        Raises:
            LightningNbError: the endpoint failed (recorded first, with its error).
        """
        import openai

        messages = [{"role": "user", "content": content}]
        sampling = {**llm.sampling_parameters, "temperature": self.config.proposer_temperature,
                    "max_tokens": self.config.proposer_max_tokens}
        t0 = time.perf_counter()
        client = openai.OpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0,
                               timeout=self.config.proposer_timeout_s)
        try:
            reply = client.chat.completions.create(model=llm.model, n=n, **sampling,
                                                   messages=messages)  # type: ignore[arg-type]  # role/content dicts
            texts = [c.message.content or "" for c in sorted(reply.choices, key=lambda c: c.index)]
        except openai.OpenAIError as exc:
            self._record(r, role, parent, llm, messages, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}")
            raise LightningNbError(f"APO's {role} at {llm.endpoint} (model {llm.model!r}) failed in round {r}: "
                                   f"{exc}") from exc
        finally:
            client.close()
        self._record(r, role, parent, llm, messages, time.perf_counter() - t0, replies=texts)
        return texts

    def _record(self, r: int, role: str, parent: str, llm: Optional[LLMResource], messages: list, seconds: float,
                replies: Sequence[str] = (), error: Optional[str] = None) -> None:
        self.calls.append({"round": r, "role": role, "parent": parent, "model": llm.model if llm else None,
                           "endpoint": llm.endpoint if llm else None, "seconds": seconds,
                           "prompt": messages[-1]["content"] if messages else None, "replies": list(replies),
                           "candidates": [], "errors": [error] if error else []})

    def publish(self, prompt: Optional[PromptTemplate | str] = None) -> ResourcesUpdate:
        """Write the target resources set again with ``prompt`` as ``config.prompt_name``, keeping its other
        resources (the LLM); its ``version`` goes up by one and it becomes the store's latest, so rollouts enqueued
        from now on run with it. Recorded in :attr:`published`. Returns the stored update.

        ``prompt`` as :meth:`evaluate` takes it; default: the prompt :meth:`best` keeps (the winner only if it beat
        the start on ``val_tasks`` by more than ``config.publish_margin``). A set that already holds that template
        (the start, when it stays) is written again, unchanged, only when it is not the store's latest set (APO's
        candidate sets became the latest while they ran), so rollouts enqueued without ``resources_id`` run with
        it; else its current update is returned and nothing is recorded.

        Raises:
            ConfigError: no ``prompt`` and no ``val_tasks`` (:meth:`best` needs them); an unknown candidate id.
        """
        cand = self._as_candidate(prompt) if prompt is not None else self.candidates[self.best().candidate_id]
        target, latest = self.store.get_resources_by_id(self.resources_id), self.store.get_latest_resources()
        if target.resources.get(self.config.prompt_name) == cand.template and latest is not None \
                and latest.resources_id == self.resources_id:
            return target  # already published and the latest: nothing to write
        current = target.resources
        update = self.store.add_resources({**current, self.config.prompt_name: cand.template},
                                          resources_id=self.resources_id)
        self.published.append({"round": self.round, "candidate_id": cand.id, "resources_id": update.resources_id,
                               "version": update.version, "time": update.update_time})
        return update

    def beam_df(self) -> Any:
        """One row per candidate and round, best first within a round: round, candidate_id, rank, score (mean
        final reward on the round's tasks), n (its finished rollouts there), kept (in the beam after the
        round), new (proposed this round), parent, text, critique (the critic's reply that produced it)."""
        import pandas as pd

        columns = ["round", "candidate_id", "rank", "score", "n", "kept", "new", "parent", "text", "critique"]
        return pd.DataFrame(list(self.rows), columns=columns)

    def calls_df(self) -> Any:
        """One row per critic or editor call: round, role, parent, model, endpoint, seconds, prompt, replies,
        candidates (the ids each editor choice gave, None where it gave none), errors (why a call or choice
        gave nothing: no failure to criticise, no candidate in the reply, an invalid or duplicate prompt)."""
        import pandas as pd

        columns = ["round", "role", "parent", "model", "endpoint", "seconds", "prompt", "replies", "candidates",
                   "errors"]
        return pd.DataFrame(list(self.calls), columns=columns)

    # ----- save / load -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything :meth:`load` restores, as JSON-ready values (the config is saved but not restored)."""
        return {"format": _FORMAT, **self.run_record(), "run_id": self.run_id, "resources_id": self.resources_id,
                "round": self.round, "beam": list(self.beam), "candidates": [_candidate_json(c) for c in self.candidates.values()],
                "rows": list(self.rows), "calls": list(self.calls), "published": list(self.published),
                "rng": _json_rng(self._rng.getstate()), "config": asdict(self.config)}

    def save(self, path: str | Path) -> Path:
        """Write :meth:`state_dict` to ``path`` as JSON (atomically); call it at a round boundary (paused, or
        after ``wait()``). Returns the path."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.state_dict(), indent=1, default=_json_default))
        tmp.replace(path)
        return path

    def load(self, path: str | Path, **options: Any) -> None:
        """Restore a :meth:`save` file: the beam, every candidate with its rewards, the history and the task
        sampler. The config is this APO's (edits are yours); ``resources_id`` stays this APO's target. Loaded
        into another store, candidates get their resources sets again when next run, and episodes of the old
        store are not shown to the critic (their rewards still count). ``options``: the contract's
        (``Algorithm.load``); APO's JSON file takes none.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ConfigError: not an APO save file; the loop is running; ``options`` were given.
        """
        if options:
            raise ConfigError(f"APO.load() takes no options (APO has no trainer whose layout would read them), got "
                              f"{sorted(options)}")
        if self.running:
            raise ConfigError("APO.load(): the loop is running; stop() or wait() first")
        state = json.loads(Path(path).read_text())
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ConfigError(f"{path} is not an APO save file (format {_FORMAT!r})")
        self.load_state_dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (see :meth:`load`)."""
        if "global_step" not in state:  # saved by an earlier version: rounds, no metrics rows
            state = {**state, "global_step": int(state["round"]), "metrics": [], "config_changes": []}
        self.load_run_record(state)
        self.run_id, self.beam = state["run_id"], list(state["beam"])
        self.candidates = {c["id"]: _candidate_from_json(c) for c in state["candidates"]}
        self.rows, self.calls, self.published = state["rows"], state["calls"], state["published"]
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))

    def __repr__(self) -> str:
        return (f"APO(round={self.round}, state={self.state!r}, beam={self.beam}, candidates={len(self.candidates)}, "
                f"resources_id={self.resources_id!r})")


def _task_text(task: Any) -> str:
    return json.dumps(task, default=repr) if not isinstance(task, str) else task


def _candidate_json(c: Candidate) -> dict[str, Any]:
    return {**asdict(c), "template": c.template.model_dump()}


def _candidate_from_json(d: dict[str, Any]) -> Candidate:
    return Candidate(**{**d, "template": PromptTemplate(**d["template"])})


def _json_rng(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _json_default(value: Any) -> Any:
    return repr(value)
