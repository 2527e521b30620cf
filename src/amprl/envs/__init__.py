"""Environment factory and observation/action specs shared by actors, replay and learner."""

from amprl.envs.spec import EnvSpec, spec_from_env

__all__ = ["EnvSpec", "spec_from_env"]
