"""The batched engine: many sequences at once over a paged KV cache.

:mod:`.runner` is the device side (the model's batch graphs and the pool).
"""
