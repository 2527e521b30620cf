"""The parameter server: master fp32 weights, Adam, a version counter with a staleness
bound, versioned weights for actors and learners, and atomic checkpoints.

``store`` (the concept), ``weights`` (what serving needs), ``admission`` (the checks a push
passes), ``ledger`` (resends answered once), ``checkpoint``, ``service`` (gRPC boundary) with
``messages`` (its request and reply conversion), ``client``, ``follower``, and ``__main__``
(``python -m amprl.paramserver``).
"""

from amprl.paramserver.client import ParameterClient, VersionWatch, load_into
from amprl.paramserver.store import ApplyResult, ParameterStore, Step
from amprl.paramserver.weights import Snapshot, VersionedWeights

__all__ = ["ApplyResult", "ParameterClient", "ParameterStore", "Snapshot", "Step", "VersionWatch",
           "VersionedWeights", "load_into"]
