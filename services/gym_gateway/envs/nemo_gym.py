"""The NeMo-Gym driver: one NeMo-Gym dataset row is one rollout, run by its agent server's ``/run``.

    row {responses_create_params, agent_ref, task fields}
      -> POST <agent>/run  row + _ng_task_index, _ng_rollout_index, _ng_rollout_id = <session id>
           agent: resources /seed_session -> model <-> tools loop -> resources /verify
           model calls: <gateway>/ng-rollout/<session id>/v1/responses   (this rollout's session)
      <- the verify response {reward, mask_sample, failure_kind, failure_reason, ...} -> Outcome

Routing, as NeMo-Gym does it: an agent handling ``/run`` with ``_ng_rollout_id`` sends its model
calls to ``/ng-rollout/<_ng_rollout_id>/v1/...`` on the model server its config names, when the
NeMo-Gym config has ``observability_enabled: true`` (or training token capture for that agent).
So the NeMo-Gym config names a gateway worker (host, port) as the policy model server and enables
observability, and the driver sets ``_ng_rollout_id`` to the session id
(`services.gym_gateway.session_routes` serves those paths). The agent servers are other processes,
so the rollout's model calls come back over HTTP; the driver never calls ``llm.chat`` itself.
After ``/run`` the driver asks the session how many model calls it recorded (``GET
/sessions/<id>/stats``): model output in the agent's answer with none recorded means the agent's
calls went to another model server (``nemo_gym_routing``).

Agents are found by ``agent_ref.name`` (or ``env.nemo_gym.default_agent``) in
``env.nemo_gym.agent_servers``, else in the global config of the NeMo-Gym head server
(``env.nemo_gym.head_server_url``), which also names each agent's resources server.
``responses_create_params`` gets the task's sampling (temperature, top_p, and max_output_tokens
capped), as NeMo-RL does; the agent's own ``max_steps`` bounds its turns, not ``env.max_turns``.

Verify response -> Outcome: ``reward``; ``mask_sample`` flags the rollout (masked, still in the
baselines); a ``failure_kind`` (or newer NeMo-Gym's ``_ng_failure_class``) flags it too and is
counted as metric ``nemo_gym_failure.<kind>``, unless ``env.nemo_gym.infra_failure_kinds`` lists
it; ``reward_components`` become ``reward.<name>`` metrics.

Failures are `InfraError`s whose ``reason`` heads the trajectory's ``fallback_reason``:
``nemo_gym_agent`` (agent unreachable, or ``/run`` answered non-200 or no reward),
``nemo_gym_resources`` (``/run`` failed and the agent's resources server does not answer),
``nemo_gym_head`` (head server unreachable), ``nemo_gym_routing`` (above), ``nemo_gym_failure``
(verify named a failure kind listed in ``infra_failure_kinds``). A bad row or an unknown agent is a
ValueError naming the key.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, NoReturn

import aiohttp
import msgspec
import yaml

from services.gym_gateway.envs.base import InfraError, ModelClient, Outcome, TransportError
from shared.sections.env_nemo_gym import NemoGymSection
from shared.sections.gateway import EnvSection

log = logging.getLogger(__name__)

# NeMo-Gym's rollout id pattern: the id is a path segment and a file name there.
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Model-generated output item types: an answer holding any was produced by some model server.
_MODEL_ITEM_TYPES = ("function_call", "reasoning")


class NemoGymAgentError(InfraError):
    """The agent server is unreachable, or its ``/run`` failed or returned no reward."""

    reason = "nemo_gym_agent"


class NemoGymResourcesError(InfraError):
    """``/run`` failed and the agent's resources server does not answer."""

    reason = "nemo_gym_resources"


class NemoGymHeadError(InfraError):
    """The NeMo-Gym head server could not be read."""

    reason = "nemo_gym_head"


class NemoGymRoutingError(InfraError):
    """The agent's model calls did not reach the rollout's session."""

    reason = "nemo_gym_routing"


class NemoGymFailure(InfraError):
    """The verify response named a failure kind configured as an infrastructure failure."""

    reason = "nemo_gym_failure"


class VerifyResult(msgspec.Struct, kw_only=True):
    """The fields of a NeMo-Gym verify response (``/run``'s answer) the driver reads."""

    reward: float
    mask_sample: bool | None = None
    failure_kind: str | None = None
    failure_reason: str | None = None
    failure_class: str | None = msgspec.field(default=None, name="_ng_failure_class")
    reward_components: dict[str, float] | None = None
    response: dict[str, Any] | None = None


class _SessionStats(msgspec.Struct, kw_only=True):
    calls: int


@dataclass(frozen=True)
class Server:
    name: str
    url: str


class NemoGymEnv:
    name = "nemo_gym"

    def __init__(self, cfg: NemoGymSection) -> None:
        self.cfg = cfg
        self._global_config: dict[str, Any] | None = None
        self._rollout_seq: dict[Any, itertools.count[int]] = defaultdict(itertools.count)

    @classmethod
    def from_config(cls, env_cfg: EnvSection) -> NemoGymEnv:
        return cls(env_cfg.nemo_gym)

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        raise ValueError("nemo_gym rows come from a NeMo-Gym dataset JSONL (data.train_path), not a generator")

    async def aclose(self) -> None:
        """Nothing to stop: the agent servers are NeMo-Gym's, reached with the gateway's HTTP client."""

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        body = self.run_body(instance, llm)
        agent = await self.agent(instance, llm.http)
        result = await self._run(agent, body, llm.http)
        await self._check_routed(result, llm)
        return self.outcome(result)

    # -- the /run request ----------------------------------------------------------------------

    def run_body(self, instance: dict[str, Any], llm: ModelClient) -> dict[str, Any]:
        """The row as NeMo-Gym's rollout collection posts it, with the task's sampling."""
        params = instance.get("responses_create_params")
        if not isinstance(params, dict):
            raise ValueError("a nemo_gym row needs a responses_create_params object")
        if not ROLLOUT_ID.match(llm.session_id):
            raise ValueError(f"session id {llm.session_id!r} is not a valid NeMo-Gym rollout id")
        params = dict(params)
        if llm.sampling is not None:
            s = llm.sampling
            row_cap = params.get("max_output_tokens")
            params.update(
                temperature=s.temperature,
                top_p=s.top_p,
                max_output_tokens=min(row_cap, s.max_tokens) if row_cap else s.max_tokens,
            )
        body = {k: v for k, v in instance.items() if k != "env"}  # "env" is streamrl's routing key
        task_index = body.get("_ng_task_index")
        if task_index is None:  # identical rows share a task index, as in NeMo-Gym's collection
            key = json.dumps({k: v for k, v in body.items() if not k.startswith("_ng_")}, sort_keys=True)
            task_index = zlib.crc32(key.encode()) & 0x7FFFFFFF
        rollout_index = body.get("_ng_rollout_index")
        if rollout_index is None:
            rollout_index = next(self._rollout_seq[task_index])
        body.update(
            responses_create_params=params,
            _ng_task_index=task_index,
            _ng_rollout_index=rollout_index,
            _ng_rollout_id=llm.session_id,
        )
        return body

    async def agent(self, instance: dict[str, Any], http: aiohttp.ClientSession) -> Server:
        ref = instance.get("agent_ref")
        name = ref.get("name") if isinstance(ref, dict) else self.cfg.default_agent
        if not isinstance(name, str):
            raise ValueError("a nemo_gym row needs agent_ref.name (or set env.nemo_gym.default_agent)")
        if name in self.cfg.agent_servers:
            return Server(name, self.cfg.agent_servers[name].rstrip("/"))
        if self.cfg.head_server_url:
            entry = server_entry(await self.global_config(http), name)
            if entry is not None:
                return Server(name, f"http://{entry['host']}:{entry['port']}")
        raise ValueError(
            f"agent {name!r} is not in env.nemo_gym.agent_servers"
            + (" nor in the head server's config" if self.cfg.head_server_url else "")
        )

    async def global_config(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        """The head server's global config (fetched once; a failed read is retried next time)."""
        if self._global_config is None:
            url = f"{(self.cfg.head_server_url or '').rstrip('/')}/global_config_dict_yaml"
            try:
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s)) as resp:
                    status, raw = resp.status, await resp.read()
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise NemoGymHeadError(f"head server {url} unreachable: {type(exc).__name__}: {exc}") from exc
            if status != 200:
                raise NemoGymHeadError(f"head server {url} answered {status}: {raw[:300].decode(errors='replace')}")
            text = json.loads(raw)  # a JSON string holding the YAML text
            config = yaml.safe_load(text) if isinstance(text, str) else text
            if not isinstance(config, dict):
                raise NemoGymHeadError(f"head server {url} returned no config mapping")
            self._global_config = config
        return self._global_config

    async def _run(self, agent: Server, body: dict[str, Any], http: aiohttp.ClientSession) -> VerifyResult:
        # No total timeout: the worker's rollout deadline bounds the whole episode.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s)
        try:
            async with http.post(
                f"{agent.url}/run",
                data=msgspec.json.encode(body),
                headers={"content-type": "application/json"},
                timeout=timeout,
            ) as resp:
                status, raw = resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise NemoGymAgentError(
                f"agent {agent.name!r} at {agent.url} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        if status != 200:
            await self._blame(agent, status, raw, http)
        try:
            return msgspec.json.decode(raw, type=VerifyResult)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise NemoGymAgentError(f"agent {agent.name!r} /run answer is not a verify response: {exc}") from exc

    async def _blame(self, agent: Server, status: int, raw: bytes, http: aiohttp.ClientSession) -> NoReturn:
        """Raise for a failed /run, naming the resources server when it is the one that is down."""
        said = raw[:500].decode(errors="replace")
        resources = await self._resources_server(agent.name, http)
        if resources is not None and not await self._answers(resources.url, http):
            raise NemoGymResourcesError(
                f"resources server {resources.name!r} at {resources.url} does not answer "
                f"(agent {agent.name!r} /run answered {status}: {said})"
            )
        raise NemoGymAgentError(f"agent {agent.name!r} /run answered {status}: {said}")

    async def _resources_server(self, agent: str, http: aiohttp.ClientSession) -> Server | None:
        """The agent's resources server from the head server's config; None when unknown."""
        if not self.cfg.head_server_url:
            return None
        try:
            config = await self.global_config(http)
        except NemoGymHeadError:
            return None
        ref = (server_entry(config, agent) or {}).get("resources_server")
        name = ref.get("name") if isinstance(ref, dict) else None
        if not isinstance(name, str):
            return None
        entry = server_entry(config, name)
        return Server(name, f"http://{entry['host']}:{entry['port']}") if entry else None

    async def _answers(self, url: str, http: aiohttp.ClientSession) -> bool:
        """Whether anything answers HTTP at ``url`` (any status counts, as NeMo-Gym's health poll)."""
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=self.cfg.connect_timeout_s)) as resp:
                await resp.read()
            return True
        except (TimeoutError, aiohttp.ClientError):
            return False

    # -- after /run ----------------------------------------------------------------------------

    async def _check_routed(self, result: VerifyResult, llm: ModelClient) -> None:
        output = (result.response or {}).get("output") or []
        produced = any(
            isinstance(o, dict) and (o.get("type") in _MODEL_ITEM_TYPES or o.get("role") == "assistant") for o in output
        )
        if not produced:
            return
        url = f"{llm.base_url.removesuffix('/v1')}/stats"
        try:
            async with llm.http.get(url, timeout=aiohttp.ClientTimeout(total=llm.timeout_s)) as resp:
                status, raw = resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise TransportError(f"session stats unreachable: {type(exc).__name__}: {exc}") from exc
        if status != 200:
            raise TransportError(f"session stats answered {status}: {raw[:300].decode(errors='replace')}")
        if msgspec.json.decode(raw, type=_SessionStats).calls == 0:
            raise NemoGymRoutingError(
                "the agent returned model output but no model call reached this rollout's session: its model "
                "server must be the gateway, with observability_enabled: true in the NeMo-Gym config"
            )

    def outcome(self, result: VerifyResult) -> Outcome:
        metrics = {f"reward.{k}": float(v) for k, v in (result.reward_components or {}).items()}
        kind = result.failure_kind or result.failure_class
        if kind is not None and kind in self.cfg.infra_failure_kinds:
            raise NemoGymFailure(f"{kind}: {result.failure_reason or 'no reason given'}")
        if kind is not None:
            log.warning("NeMo-Gym rollout failed (%s): %s; trained masked", kind, result.failure_reason)
            metrics[f"nemo_gym_failure.{kind}"] = 1.0
        flagged = bool(result.mask_sample) or kind is not None
        return Outcome(
            reward=float(result.reward), status="env_flagged" if flagged else "ok", metrics=metrics, mask_sample=flagged
        )


def server_entry(config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The instance config (host, port, ...) of server ``name`` in a NeMo-Gym global config:
    ``{name: {<server type>: {<implementation>: {host, port, ...}}}}``."""
    entry = config.get(name)
    for by_impl in (entry or {}).values() if isinstance(entry, dict) else ():
        for inst in by_impl.values() if isinstance(by_impl, dict) else ():
            if isinstance(inst, dict) and "host" in inst and "port" in inst:
                return inst
    return None
