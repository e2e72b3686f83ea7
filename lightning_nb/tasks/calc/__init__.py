"""The default task: arithmetic word problems with a text-protocol calculator tool."""

from lightning_nb.tasks.calc.agent import SYSTEM_PROMPT_RESOURCE, calc_agent, calc_resources, calc_reward, calculator
from lightning_nb.tasks.calc.dataset import load_tasks

__all__ = ["calc_agent", "calc_resources", "calc_reward", "calculator", "load_tasks", "SYSTEM_PROMPT_RESOURCE"]
