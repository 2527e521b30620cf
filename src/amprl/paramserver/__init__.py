"""The parameter server: master fp32 weights, Adam, a version counter with a staleness
bound, versioned weights for actors and learners, and atomic checkpoints.

``store`` (the concept), ``checkpoint``, ``service`` (gRPC boundary), ``client``, and
``__main__`` (``python -m amprl.paramserver``).
"""

from amprl.paramserver.client import ParameterClient, VersionWatch, load_into
from amprl.paramserver.store import ApplyResult, ParameterStore, Snapshot, Step, VersionedWeights

__all__ = ["ApplyResult", "ParameterClient", "ParameterStore", "Snapshot", "Step", "VersionWatch",
           "VersionedWeights", "load_into"]
