"""The default task: arithmetic word problems with a text-protocol calculator tool."""

from lightning_nb.tasks.calc.agent import calc_agent, calc_reward, calculator
from lightning_nb.tasks.calc.dataset import load_tasks

__all__ = ["calc_agent", "calc_reward", "calculator", "load_tasks"]
