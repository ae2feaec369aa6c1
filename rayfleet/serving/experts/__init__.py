"""The experts room: expert-parallel load balancing for serving.

``eplb`` is the pure placement algorithm (DeepSeek's EPLB shape); ``balancer`` runs it inside an
engine replica (counts expert loads, re-places redundant experts, routes tokens among replicas).
"""
