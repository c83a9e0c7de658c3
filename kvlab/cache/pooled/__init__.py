"""The ``pooled`` policy's parts (DeepSeek-V4's compressed attention, CSA and HCA): its
options, the per-step plan of which windows close, one layer's entries and buffers, the
pooling arithmetic, and the calibration of the learned gate. The policy itself is
:mod:`kvlab.cache.policies.pooled`."""
