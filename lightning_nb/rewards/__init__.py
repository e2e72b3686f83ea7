"""LLM-judge rewards: a judge inside an agent (:class:`Judge`, :func:`judge_reward`), and a group-relative judge
(RULER-style, :class:`GroupJudge`) for a GRPO group. Their prompts are constants in :mod:`lightning_nb.rewards.prompts`."""

from lightning_nb.rewards.group import GROUP_JUDGE_SOURCE, GroupJudge, parse_group_scores, trajectory_messages
from lightning_nb.rewards.judge import JUDGE_SOURCE, Judge, JudgeError, JudgeVerdict, judge_reward, parse_score

__all__ = ["Judge", "JudgeError", "JudgeVerdict", "judge_reward", "parse_score", "GroupJudge", "parse_group_scores",
           "trajectory_messages", "JUDGE_SOURCE", "GROUP_JUDGE_SOURCE"]
