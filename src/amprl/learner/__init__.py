"""The learner: samples prioritized batches, computes gradients with mixed precision and
pushes them (optionally 1-bit compressed) to the parameter server."""
