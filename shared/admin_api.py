"""The services' own HTTP messages: every service's ``GET /ready`` body (`Readiness`), and the
generator's admin bodies: ``POST /admin/load_weights`` and ``POST /admin/pause``, and the
``GET /admin/state`` answer (also returned by pause and resume).

`Readiness` is served by `shared.service.add_probe_routes` in all three services and read by the
`streamrl up` supervisor while it waits for them. The admin messages are served by
`services.generator.routes_admin`; sent by operators and tests. Request bodies are strict (an
unknown field is a 400 naming it): unlike the OpenAI messages in `shared.openai_api`, no
third-party client sends these. The weights stream's own announcement
(`shared.protocol.WeightAnnouncement`) carries the same load fields for the watcher.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class Readiness(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The body of every service's ``GET /ready`` (200 when ``ready``, else 503)."""

    ready: bool
    state: str
    error: str | None = None
    weight_version: int | None = None  # generators and the trainer: the version they serve / published


class LoadWeightsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    version: int
    path: str  # a folder of safetensors files
    checksum: str | None = None  # of the folder (`shared.weights_format.checksum_dir`); None: load unverified
    mode: Literal["drain", "keep"] = "drain"  # let running requests finish first, or freeze them over the load


class PauseRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    mode: Literal["drain", "keep"] = "drain"


class GeneratorState(msgspec.Struct, kw_only=True):
    worker_id: str
    state: str
    weight_version: int
    engine: str
    model: str
    in_flight: int  # admitted HTTP requests not finished
    running: int  # requests inside the engine (batched together)
    waiting: int  # requests at the gate or queued in the engine
    requests_total: int
    generated_tokens_total: int
    tokens_per_s: float
    prefix_cache_resets: int
    last_refit_s: float
    error: str | None = None
