"""The chart's pods under podman (``make pod-check``)."""
