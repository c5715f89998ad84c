"""Stand-ins for what the tests do not run for real: `generator` (a generator answering with
scripted policies), `nemo_gym` (NeMo-Gym's servers, breakable on purpose), `docker` (the Docker
Engine API) and `kube` (the Kubernetes API), the last two on the HTTP plumbing of `http`."""
