"""The benchmarks behind ``streamrl bench``: each measures a part of the system against a baseline
from the same run and writes one section of BENCHMARKS.md.

    suite.py            runs the sections (``--only``), stores their results, renders the report
    report.py           results base, JSON store, jinja rendering, prose wrapping
    templates/          one ``<section>.md.jinja`` per section, and the report's head

    demo.py             the demo run, timed                 streams.py      stream transport
    demo_variants.py    the demo at top_p 0.9, dynamic sampling
    generator.py        HTTP layer vs raw vLLM, splice, refit: throughput.py, raw_engine.py,
                        generator_process.py
    gateway.py          the session proxy per call: gateway_rounds.py (the agent, the gateway process)
    gateway_scale.py    the proxy alone at thousands of sessions: gateway_servers.py
    openhands.py        warm runners vs a process per rollout
    trainer.py          the torch and megatron backends vs bare torch: trainer_worker.py (a rank),
                        trainer_results.py
    refit.py            weight transports vs raw baselines: refit_worker.py, refit_runs.py,
                        refit_results.py (with the reference run modelled)
    pipeline.py         the real trainer loop vs its ideal schedule: pipeline_sim.py, schedule.py,
                        packing.py, pipeline_report.py

Measured results are stored in ``benchmarks/<section>.json`` at the repository root. Nothing here
is imported by the services.
"""
