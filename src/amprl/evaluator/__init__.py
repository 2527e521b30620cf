"""The evaluator: pulls the newest weights and runs greedy episodes on its own envs."""
