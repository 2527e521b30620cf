"""TD3 (Fujimoto et al. 2018), n-step and prioritized, for continuous actions."""
