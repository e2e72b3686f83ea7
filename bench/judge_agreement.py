"""How well does an LLM judge agree with the calc task's true reward? (issue 31, item 3)

Workload (exact): the untrained SmolLM2-135M-Instruct (TransformersEngine.from_default(max_batch_size=8), CPU)
behind an LLMProxy runs ``calc_agent`` on the first 16 ``val`` tasks, 4 rollouts each (one GRPO-style group per
task, ``group_id`` = the task id): 64 calc episodes, temperature 0.7, max_tokens 48, 4 runner threads. The true
reward is ``calc_reward`` (1 for the right final number). The judge is the same model, greedy, through the proxy's
plain URL (no LLM span, never trained on):

* pointwise: inside the agent, ``judge_reward(final text, CALC_RUBRIC, task=question, llm=llm)`` (64 judge calls,
  max_tokens 64, the default few-shot prompt of ``lightning_nb.rewards.prompts``); an unparsable verdict is
  counted and the episode keeps its true reward;
* group (RULER-style): after the episodes, ``GroupJudge(rubric=CALC_RUBRIC, as_reward=False)`` scores each
  task's group of succeeded rollouts in one call (16 calls).

Agreement = over every (right, wrong) pair of episodes of the same task (within a task: the pairs GRPO compares)
where both have a parsed score, 1 when the judge scores the right one higher, 0.5 for a tie, 0 otherwise (the
ROC AUC of the judge's score for the true reward, per task, pooled). Also given over all pairs of the 64 episodes
(across tasks) for the pointwise judge. 0.5 is chance. Parse rate = parsed verdicts / judge calls.

Run: ``.venv/bin/python bench/judge_agreement.py`` (prints one JSON line; about 10 min on a quiet 2-core CPU).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_nb import InMemoryStore, LLMProxy, TransformersEngine, semconv, start_runners  # noqa: E402
from lightning_nb.rewards import GroupJudge, JudgeError, judge_reward  # noqa: E402
from lightning_nb.tasks.calc import calc_agent, calc_reward, load_tasks  # noqa: E402
from lightning_nb.types import RolloutConfig  # noqa: E402

TASKS, GROUP, TEMPERATURE, MAX_TOKENS = 16, 4, 0.7, 48
CALC_RUBRIC = "{hi} if the final number in the response is the right answer to the question, {lo} if it is not."


def judged_reward(text: str, task: dict, *, llm) -> float:
    """The calc reward; beside it the judge's score, recorded as the component ``judge`` (parse failures counted)."""
    try:
        judge_reward(text, CALC_RUBRIC, task=task["question"], llm=llm)
    except JudgeError:
        pass  # the judge span keeps the verdict and the error
    return calc_reward(text, task)


def agent(task: dict, llm) -> float:
    return calc_agent(task, llm, reward_fn=functools.partial(judged_reward, llm=llm))


def pair_agreement(pairs: list[tuple[float, float]]) -> float:
    """Mean over (right score, wrong score) pairs of 1 / 0.5 / 0 (right higher / tie / lower)."""
    return sum(1.0 if r > w else 0.5 if r == w else 0.0 for r, w in pairs) / len(pairs) if pairs else float("nan")


def pairs_of(items: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(judge score of a right episode, of a wrong one) for every right/wrong pair among ``(true, judge)`` items."""
    right = [j for t, j in items if t == 1.0]
    wrong = [j for t, j in items if t != 1.0]
    return [(r, w) for r in right for w in wrong]


def judge_scores(store, group: bool) -> tuple[dict[str, float], int]:
    """rollout id -> parsed score of its pointwise (``group=False``) or group judge span, and the count of such spans."""
    spans = [s for s in store.query_spans()
             if s.name == semconv.JUDGE_SPAN and (semconv.JUDGE_GROUP in s.attributes) == group]
    scores = {s.rollout_id: float(s.attributes[semconv.JUDGE_SCORE]) for s in spans
              if semconv.JUDGE_SCORE in s.attributes}
    return scores, len(spans)


def agreement(ids_by_task: dict[str, list[str]], truth: dict[str, float], scores: dict[str, float]) -> dict:
    within = [p for ids in ids_by_task.values()
              for p in pairs_of([(truth[i], scores[i]) for i in ids if i in scores and i in truth])]
    overall = pairs_of([(truth[i], scores[i]) for i in truth if i in scores])
    return {"within_task": round(pair_agreement(within), 3), "within_task_pairs": len(within),
            "overall": round(pair_agreement(overall), 3), "overall_pairs": len(overall),
            "mean_score_right": _mean([scores[i] for i in scores if truth.get(i) == 1.0]),
            "mean_score_wrong": _mean([scores[i] for i in scores if truth.get(i) == 0.0])}


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 3) if xs else float("nan")


def main() -> None:
    t0 = time.perf_counter()
    engine = TransformersEngine.from_default(max_batch_size=8)
    store = InMemoryStore()
    tasks = load_tasks("val", limit=TASKS)
    with LLMProxy(engine, store) as proxy, start_runners(agent, store, n=4, default_timeout_s=3600):
        store.add_resources({"main_llm": proxy.as_resource()})
        sampling = {"temperature": TEMPERATURE, "max_tokens": MAX_TOKENS}
        config = RolloutConfig(timeout_seconds=3600)  # a loaded 2-core CPU: an episode and its judge call can be slow
        ids_by_task = {t["id"]: [store.enqueue_rollout(t, config=config, metadata={"group_id": t["id"],
                                                                                    "sampling_parameters": sampling}
                                                       ).rollout_id for _ in range(GROUP)] for t in tasks}
        ids = [i for group in ids_by_task.values() for i in group]
        store.wait_for_rollouts(ids, timeout=3600)
        t_episodes = time.perf_counter() - t0
        counts = GroupJudge(rubric=CALC_RUBRIC, as_reward=False).judge_rollouts(store, ids)
    succeeded = {r.rollout_id for r in store.query_rollouts(rollout_ids=ids) if r.status == "succeeded"}
    truth = {rid: r for rid, r in store.final_rewards(ids).items() if rid in succeeded and r is not None}
    point, point_calls = judge_scores(store, group=False)
    group, _ = judge_scores(store, group=True)
    out = {
        "episodes": len(ids), "succeeded": len(truth), "true_reward_mean": _mean(list(truth.values())),
        "pointwise": {"calls": point_calls, "parsed": len(point), "parse_rate": round(len(point) / max(point_calls, 1), 3),
                      **agreement(ids_by_task, truth, point)},
        "group": {**counts, "parse_rate": round(counts["judge_groups"] / max(counts["judge_groups"]
                                                                             + counts["judge_groups_failed"], 1), 3),
                  **agreement(ids_by_task, truth, group)},
        "minutes": round((time.perf_counter() - t0) / 60, 2), "episode_minutes": round(t_episodes / 60, 2),
    }
    print(json.dumps(out))
    engine.close()


if __name__ == "__main__":
    main()
