"""The deploy room: engine replicas on Ray Serve and one request's path through them.

``deployments`` holds the engine pools' Serve deployment (``EngineReplica``); ``replica_client``
and ``pool_client`` are how a caller reaches one replica or a pool (in-process or through Serve);
``inference_service`` is one request's path through router, prefill and decode, recording into
``serving_metrics``; ``pool_scaling`` keeps each pool's Serve autoscaling bounds and
``serve_scaling_rules`` the Serve shell's pure rules. It imports only lower rooms (engine, kv,
routing, experts, spec): the HTTP faces that build applications over it (``openai_api``,
``vllm``) and the entry points (``serving.deployer``, ``serving.serve_scaling_shell``) sit above.
"""
