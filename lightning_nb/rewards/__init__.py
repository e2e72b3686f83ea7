"""LLM-judge rewards: a judge inside an agent, and a group-relative judge (RULER-style) for a GRPO group."""
