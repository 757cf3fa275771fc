"""The scheduler: request queues, the block pool and the KV cache manager. Plain Python, no tensors."""
