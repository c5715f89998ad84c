"""What the tests are built from: one module per thing a test needs, named for that thing. The
fixtures that hand these out are in the conftest.py of each tier (tests/conftest.py for those
every tier uses); test modules import the rest directly.

* Messages and records: `messages` (tasks, trajectories, heartbeats), `records` (trainer
  records), `openhands` (the OpenHands driver's agent setup and tasks).
* Played peers and fakes: `peers` (a generator and a gateway played through Redis), `fakes`
  (a scripted generator, NeMo-Gym's servers, the Docker Engine and Kubernetes APIs).
* Services in-process: `gateway`, `generator`, `trainer`, `refit`, `scale`.
* `gradients`: a NaN put into one parameter's gradient (the non-finite-gradient tests).
* Processes: `services` (the one launcher: a service, a ``streamrl up`` job, a command), `runs`
  (a whole run of the demo to inject faults into), `injectors`, `pids`, `ports`, `redis`,
  `docker_host` (a real Docker engine), `deploy` (the deployment files' checks).
* `ranks`: scripts torchrun runs as files (the learner and megatron-core at many ranks).
"""
