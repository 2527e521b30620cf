"""The experiment config: one YAML file that every service reads (a ConfigMap on
Kubernetes).

- ``sections.py``: the dataclasses, one per section; each field declares its type, default,
  range and meaning. An algorithm's section is declared in ``amprl/algos/<name>/config.py``.
- ``loading.py``: YAML and overrides onto them, checked against those declarations.
- ``schema.py``: the JSON schema of the same declarations (the chart's ``experiment``).
"""

from amprl.config.bounds import Bound
from amprl.config.loading import (RENAMED, apply_overrides, config_from_dict, config_to_dict,
                                  dump_config, load_config, packaged_configs, resolve_config,
                                  validate)
from amprl.config.sections import (ActorConfig, DeployConfig, EnvConfig, EvaluatorConfig,
                                   ExperimentConfig, LearnerConfig, NetworkConfig, NiceConfig,
                                   ParamServerConfig, ReplayConfig, RunConfig)

__all__ = ["Bound", "RENAMED", "apply_overrides", "config_from_dict", "config_to_dict", "dump_config",
           "load_config", "packaged_configs", "resolve_config", "validate", "ActorConfig", "DeployConfig", "EnvConfig",
           "EvaluatorConfig", "ExperimentConfig", "LearnerConfig", "NetworkConfig", "NiceConfig",
           "ParamServerConfig", "ReplayConfig", "RunConfig"]
