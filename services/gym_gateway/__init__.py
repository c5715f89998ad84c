"""The gym gateway: consumes rollout tasks, runs environments and agents against the model through
a per-rollout session proxy in front of the generators, and publishes token-exact trajectories.

    __main__         command line, bind, serve (`shared.service.run_server`)
    app              build_app and the lifespan: clients, proxy, worker, heartbeat, probes
    worker           tasks -> rollouts -> trajectories; drain and release
    envs             the environment contract, the registry and the environments
    session_client   the in-process model client the worker hands environments
    proxy            the session proxy: prepares, forwards (with failover) and records model calls
    session_routes   the session's HTTP routes, at every prefix; forwarding (cross-worker calls)
    external         tasks of env "external", run by any agent through the session API
                     (external_routes: POST /sessions, POST /sessions/<id>/complete)
    responses        Responses API <-> chat for the NeMo-Gym paths
    metrics          the gateway's Prometheus metrics
"""
