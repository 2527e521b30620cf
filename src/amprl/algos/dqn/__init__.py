"""Double / dueling / n-step DQN with prioritized replay (Ape-X, Horgan et al. 2018)."""
