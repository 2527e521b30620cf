"""What a parameter server (or a pull-only follower) records over time
(``amprl.common.telemetry``): the figures of its Info and the bytes on the wire by
encoding, against its version. A follower takes no pushes (its push counts stay 0) and
has no push norm bound."""

from __future__ import annotations

from amprl.common.telemetry import Kind, Series, Telemetry
from amprl.paramserver.service import ParameterServicer

G, C, T = Kind.GAUGE, Kind.COUNTER, Kind.THROUGHPUT


def figures(servicer: ParameterServicer) -> dict:
    """The store's ``info()`` and the wire bytes (``gradient_bytes_by_encoding``,
    ``weight_bytes_by_encoding``)."""
    received, sent = servicer.wire.totals()
    return {**servicer.store.info(), "gradient_bytes_by_encoding": received,
            "weight_bytes_by_encoding": sent}


def telemetry(servicer: ParameterServicer) -> Telemetry[dict]:
    def f(key: str):
        return lambda d: d.get(key)

    return Telemetry("paramserver", snapshot=lambda: figures(servicer), step=f("version"), series=[
        Series("version", "Parameter version (optimizer steps applied).", G, f("version")),
        Series("pushes_applied", "Pushes applied at full weight.", T, f("pushes_applied")),
        Series("pushes_scaled", "Pushes applied scaled down for their staleness.", C, f("pushes_scaled")),
        Series("pushes_rejected_stale", "Pushes rejected as too stale (FAILED_PRECONDITION).", C,
               f("pushes_rejected_stale")),
        Series("pushes_rejected_norm", "Pushes rejected because a step's gradient norm exceeded "
               "the push norm bound (INVALID_ARGUMENT).", C, f("pushes_rejected_norm")),
        Series("pushes_rejected_invalid", "Pushes rejected as malformed (INVALID_ARGUMENT).", C,
               f("pushes_rejected_invalid")),
        Series("pushes_abandoned", "Pushes not applied because their caller had gone.", C,
               f("pushes_abandoned")),
        Series("pushes_repeated", "Resent pushes answered with their first outcome.", C, f("pushes_repeated")),
        Series("push_norm_bound", "The gradient norm a push step may have now (the tighter of "
               "the absolute cap and the multiple of recent norms).", G, f("push_norm_bound")),
        Series("max_staleness_accepted", "Largest staleness (versions) of an accepted push.", G,
               f("max_staleness")),
        Series("transitions_trained", "Transitions in the batches of applied pushes.", T,
               f("transitions_trained")),
        Series("pulls_with_weights", "Pulls answered with weights.", T, f("pulls_with_weights")),
        Series("pulls_unchanged", "Pulls answered 'unchanged' (the caller had the version).", T,
               f("pulls_unchanged")),
        Series("gradient_bytes_received", "Gradient bytes received in pushes (tensor data and "
               "scales), by encoding.", T, f("gradient_bytes_by_encoding"), label="encoding"),
        Series("weight_bytes_sent", "Weight bytes sent (pull replies, weights returned with "
               "pushes), by encoding.", T, f("weight_bytes_by_encoding"), label="encoding"),
        Series("checkpoint_version", "Version of the newest checkpoint written.", G, f("checkpoint_version")),
        Series("clients_live", "Clients that called within the live window.", G, f("clients_live")),
        Series("actors_live", "Actors that called within the live window.", G, f("actors_live")),
        Series("learners_live", "Learners that pushed within the live window.", G, f("learners_live")),
    ])
