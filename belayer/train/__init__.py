"""Training through Belayer: the RL demo's task, its GRPO trainer in plain PyTorch, and the loop that
runs them against a gateway (``belayer demo rl``). `task` and `settings` import no torch."""
