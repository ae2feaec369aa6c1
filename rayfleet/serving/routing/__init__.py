"""The routing room: which replica serves a request.

``prefix_index`` (which replica holds which block hashes) and ``policy`` (pure prefix-overlap
vs load scoring) feed ``router`` (``RouterCore`` and its async shell); ``long_prefill`` decides
when and how a long prompt is split over several prefill replicas, and ``split_prefill`` runs
such a split on the replicas.
"""
