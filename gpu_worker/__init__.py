"""The worker: model code, attention backends, sampling and the per-step model runner."""
