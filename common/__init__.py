"""Pieces shared by the router, the scheduler and the workers: configuration, messages, sampling
parameters, model resolution and the incremental detokenizer."""
