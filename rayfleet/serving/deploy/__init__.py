"""The deploy room: a ``ServeSpec`` turned into running replicas on Ray Serve (or in one process).

``deployments`` builds the Serve application; ``deployer`` puts a spec on the connected fleet
(``deploy(spec)``); ``replica_client`` is how the ingress reaches one replica (in-process or
through Serve); ``inference_service`` is one request's path through router, prefill and decode;
``in_process`` builds the same stack without Ray; ``autoscale_shell`` is the shared
autoscaler's Serve shell.
"""
