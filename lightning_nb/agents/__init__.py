"""Agent shapes beyond a plain function: a remote rollout server (reference doc 002), ROLL's AgentRunner over
gym-style environments (reference doc 004), and the reference rollout server the kit ships.

Every shape here is an agent a runner calls like a plain function agent, ``agent(task, llm) -> reward | None``,
so :func:`~lightning_nb.runners.start_runners`, the proxy's token IDs and the trainers need nothing new.
"""

from lightning_nb.agents.agent_runner import AgentRunner, EpisodeFailed, EpisodeResult, seed_tasks
from lightning_nb.agents.gem_runner import GEMRunner
from lightning_nb.agents.protocol import (RolloutMetrics, RolloutRequest, RolloutResponse, RolloutServerError,
                                          RolloutStatus)
from lightning_nb.agents.remote import RemoteRolloutAgent, RolloutServerTimeout, final_text
from lightning_nb.agents.rollout_server import RolloutServer
from lightning_nb.agents.text_env import TextEnv
from lightning_nb.agents.textarena_env import TextArenaEnv
from lightning_nb.agents.toolcall_runner import ToolActionEnv, ToolCallRunner

__all__ = ["AgentRunner", "EpisodeResult", "EpisodeFailed", "seed_tasks", "GEMRunner", "ToolCallRunner",
           "ToolActionEnv", "TextEnv", "TextArenaEnv", "RemoteRolloutAgent", "RolloutServer", "RolloutServerError",
           "RolloutServerTimeout", "RolloutRequest", "RolloutResponse", "RolloutMetrics", "RolloutStatus", "final_text"]
