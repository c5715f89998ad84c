"""The run's config sections, one module per owner: the service (or environment driver) that
reads a section owns its module, and `shared.run_config.RunConfig` composes them into the one
tree every service loads.

    base           the section base class (strict keys) and `D`, a field's one-line doc
    run            run-wide: ``run``, ``redis``, ``auth``, ``supervisor`` (``streamrl up``)
    trainer        the trainer service: ``trainer``, ``data``, ``checkpointing``, ``refit``, ``logger``
    grpo           the trainer's algorithm: ``grpo``, ``loss_fn`` and the checks of its options
    policy         the trainer's model: ``policy`` (optimizer, dtensor_cfg, megatron_cfg, ...)
    generator      the generator service: ``generator``, ``policy.generation`` (vllm_cfg)
    gateway        the gym gateway: ``gym_gateway``, and ``env`` (settings common to every driver)
    env_<driver>   one environment driver's section: ``env.nemo_gym``, ``env.openhands``, ``env.swe``
    tracing        OpenTelemetry traces, read by every service: ``tracing``

They live under `shared/`, not next to their services, because every service loads the whole
tree (a run is one file that all of them read, decoded strictly as a whole) and `shared` never
imports a service. Each module is a declarative schema: a one-line doc per field, checks
of one section's own options at most. They import nothing heavy (no torch, no vLLM).
"""
