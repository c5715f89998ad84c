"""The per-rollout session proxy: every model call of a rollout, in front of the generators.

Calls reach it from agents holding the session's URL (``/sessions/<id>/v1/...`` and NeMo-Gym's
``/ng-rollout/<id>/...``, `services.gym_gateway.session_routes`) and, in the gateway's own process,
from the built-in environments (`services.gym_gateway.session_client`). Any OpenAI-compatible agent
can use a session without knowing about token ids. For each call the proxy
  * refuses what one recorded trajectory cannot hold: streaming, ``n`` other than 1 (a 400 naming
    the field; the one place these are checked, for every path),
  * fills the rollout's sampling profile and request tag (train or validation),
  * attaches the session's exact token history (``required_prefix_token_ids``) once the agent
    replays an assistant turn, so the generator splices the model's own tokens back in,
  * forwards to the session's generator, chosen once per session for prefix-cache locality by the
    generator pool (`services.gym_gateway.pool`, healthy generators first); when
    that generator is gone (connection refused or dropped, or 503: failed or draining) the session
    fails over to another serving one, at most ``max_failovers`` times per call; each POST is a
    ``model_call`` span of the rollout's trace, its W3C context in the headers (`shared.tracing`);
    each call's outcome and latency per token go into the pool's window of calls, on which the
    fleet's health is judged (`services.gym_gateway.call_window`, `shared.fleet_health`),
  * records the call as a `Turn`: the prompt tokens new relative to the session's context, the
    generated ids and logprobs, the weight versions, the generator, latency; and counts prefix
    breaks (a prompt that does not continue the session's context) per environment. What a break
    means for training (mask the row, or train the turns after it as a new sample) is the
    trainer's ``env.on_prefix_break``,
  * counts the answer's tool calls that cannot be used, per reason
    (`services.gym_gateway.tool_call_errors`); the answer goes back to the agent unchanged,
  * refuses an answer with a generation logprob that is not a number: the session counts the call
    and the agent gets a 502, and the worker fails the rollout as ``nan_generation_logprobs``
    (`services.gym_gateway.nonfinite_logprobs`).

    open --> call* --> close          call: prepare -> POST (failover on a dead generator) -> record

Built by the gateway app's lifespan; the worker opens a session per rollout and assembles the
trajectory from the recorded turns when the rollout ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import msgspec

from services.gym_gateway.call_window import ErrorKind
from services.gym_gateway.nonfinite_logprobs import NAN_GENERATION_LOGPROBS, finite, undecodable_nonfinite
from services.gym_gateway.pool import GeneratorPool, NoGenerator
from services.gym_gateway.token_history import RecordedChat, RecordedCompletion, TokenHistory, common_prefix_len
from services.gym_gateway.tool_call_errors import find_tool_call_errors
from shared import routes as routes_wire
from shared import tracing
from shared.http import HTTPError
from shared.openai_api import ChatCompletionRequest, CompletionRequest, RequestTag
from shared.protocol import SamplingParams, TaskKind, Turn, make_turn
from shared.routes import RouteShape

if TYPE_CHECKING:
    from opentelemetry.context import Context

log = logging.getLogger(__name__)

Answer = TypeVar("Answer", RecordedChat, RecordedCompletion)
__all__ = ["GeneratorPool", "NoGenerator", "Session", "SessionProxy", "common_prefix_len", "unknown_session"]


@dataclass
class Session:
    session_id: str
    kind: TaskKind
    sampling: SamplingParams
    generator_id: str
    generator_url: str
    open_version: int
    env: str = ""
    history: TokenHistory = field(default_factory=TokenHistory)  # every token so far: prompts and generations
    turns: list[Turn] = field(default_factory=list)
    prefix_breaks: int = 0
    calls: int = 0
    failovers: int = 0
    tool_call_errors: dict[str, int] = field(default_factory=dict)  # reason -> tool calls the model got wrong
    nan_logprob_calls: int = 0  # calls answered with a generation logprob that is not a number: refused
    route_shape: RouteShape | None = None  # the MoE routes' geometry, once a call returned routes
    trace: Context | None = None  # the rollout's trace context (`shared.tracing`): its model calls' parent


def unknown_session(session_id: str) -> HTTPError:
    return HTTPError(404, f"unknown or finished session {session_id!r}", param="session_id")


class SessionProxy:
    def __init__(
        self,
        pool: GeneratorPool,
        http: aiohttp.ClientSession,
        *,
        request_timeout_s: float,
        max_failovers: int = 2,
        generator_wait_s: float = 30.0,
    ) -> None:
        self.pool = pool
        self.http = http
        self.request_timeout_s = request_timeout_s
        self.max_failovers = max_failovers
        self.generator_wait_s = generator_wait_s
        self.sessions: dict[str, Session] = {}
        self.prefix_breaks_total = 0
        self.prefix_breaks_by_env: dict[str, int] = {}
        self.calls_total = 0
        self.failovers_total = 0
        self.tool_call_errors_by_reason: dict[str, int] = {}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._chat_decoder = msgspec.json.Decoder(RecordedChat)
        self._completion_decoder = msgspec.json.Decoder(RecordedCompletion)

    async def open(
        self, session_id: str, kind: TaskKind, sampling: SamplingParams, env: str = "", trace: Context | None = None
    ) -> Session:
        gid, url, version = await self.pool.pick(wait_s=self.generator_wait_s)
        s = Session(session_id, kind, sampling, gid, url, version, env=env, trace=trace)
        self.sessions[session_id] = s
        return s

    def close(self, session_id: str) -> Session | None:
        return self.sessions.pop(session_id, None)

    def session(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            raise unknown_session(session_id)
        return s

    def _sampling_updates(self, s: Session, req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
        if req.stream:
            raise HTTPError(400, "streaming is not supported by the session proxy", param="stream")
        if req.n != 1:
            raise HTTPError(400, "a session records one trajectory: n must be 1", param="n")
        prof = s.sampling
        updates: dict[str, Any] = {"streamrl": RequestTag(kind=s.kind, session_id=s.session_id)}
        if req.temperature is None:
            updates["temperature"] = prof.temperature
        if req.top_p is None:
            updates["top_p"] = prof.top_p
        cap = getattr(req, "max_completion_tokens", None) or req.max_tokens
        updates["max_tokens"] = min(cap, prof.max_tokens) if cap else prof.max_tokens
        if s.history.length:  # routes up to the last call's final token came with earlier calls
            updates["routes_from"] = s.history.length - 1
        return updates

    def _prepare(self, s: Session, req: ChatCompletionRequest) -> ChatCompletionRequest:
        updates = self._sampling_updates(s, req)
        updates["max_completion_tokens"] = None
        replays_history = any(m.role == "assistant" for m in req.messages)
        if s.history.length and replays_history and req.required_prefix_token_ids is None:
            updates["required_prefix_token_ids"] = msgspec.Raw(s.history.json)  # the ids' JSON, as is
        return msgspec.structs.replace(req, **updates)

    async def chat(self, session_id: str, req: ChatCompletionRequest) -> bytes:
        s = self.session(session_id)
        t0 = time.perf_counter()
        body, call_s = await self._post(s, "/v1/chat/completions", msgspec.json.encode(self._prepare(s, req)))
        out = self._decode(s, body, self._chat_decoder)
        c = out.choices[0]
        self._timed(s, call_s, len(c.message.generation_token_ids), out.weight_version, out.weight_version_end)
        self._record(
            s,
            out.prompt_token_ids,
            c.message.generation_token_ids,
            c.message.generation_log_probs,
            out.weight_version,
            out.weight_version_end,
            c.finish_reason,
            time.perf_counter() - t0,
            c.weight_version_spans,
            _Routes.of(out.route_shape, c.routes, c.routes_start),
        )
        for e in find_tool_call_errors(c.message, req.tools):
            s.tool_call_errors[e.reason] = s.tool_call_errors.get(e.reason, 0) + 1
            self.tool_call_errors_by_reason[e.reason] = self.tool_call_errors_by_reason.get(e.reason, 0) + 1
        return body

    async def completion(self, session_id: str, req: CompletionRequest) -> bytes:
        """Plain completions: the agent sends the whole prompt (text or token ids) itself."""
        s = self.session(session_id)
        fwd = msgspec.structs.replace(req, **self._sampling_updates(s, req))
        t0 = time.perf_counter()
        body, call_s = await self._post(s, "/v1/completions", msgspec.json.encode(fwd))
        out = self._decode(s, body, self._completion_decoder)
        c = out.choices[0]
        self._timed(s, call_s, len(c.generation_token_ids), out.weight_version, out.weight_version_end)
        self._record(
            s,
            out.prompt_token_ids,
            c.generation_token_ids,
            c.generation_log_probs,
            out.weight_version,
            out.weight_version_end,
            c.finish_reason,
            time.perf_counter() - t0,
            c.weight_version_spans,
            _Routes.of(out.route_shape, c.routes, c.routes_start),
        )
        return body

    def _decode(self, s: Session, body: bytes, decoder: msgspec.json.Decoder[Answer]) -> Answer:
        """The generator's answer. One holding a generation logprob that is not a number is never
        recorded: the session counts it, so the worker fails the rollout, and the agent gets a 502."""
        try:
            out = decoder.decode(body)
        except msgspec.MsgspecError:
            if not undecodable_nonfinite(body):
                raise
        else:
            if finite(_generation_logprobs(out)):
                return out
        s.nan_logprob_calls += 1
        log.warning("session %s: generator %s answered NaN generation logprobs", s.session_id, s.generator_id)
        raise HTTPError(
            502,
            f"generator {s.generator_id} answered generation logprobs that are not numbers (NaN)",
            type_=NAN_GENERATION_LOGPROBS,
        )

    async def _post(self, s: Session, path: str, payload: bytes) -> tuple[bytes, float]:
        """POST to the session's generator; on a dead one, move the session to another and retry.
        The answer, and the seconds the generator that gave it took. Every failed call goes into
        the pool's window of calls (`services.gym_gateway.call_window`)."""
        tried: set[str] = set()
        while True:
            t0 = time.perf_counter()
            try:
                call = {"streamrl.generator_id": s.generator_id, "url.path": path}
                with tracing.client_call("model_call", s.trace, _JSON_HEADERS, call) as headers:
                    async with self.http.post(
                        f"{s.generator_url}{path}", data=payload, headers=headers, timeout=self._timeout
                    ) as resp:
                        status, body = resp.status, await resp.read()
            except aiohttp.ClientConnectionError as exc:  # refused, reset or dropped mid-request
                status, body, gone = 0, b"", f"{type(exc).__name__}: {exc}"
                self._failed(s, "connection")
            except TimeoutError as exc:
                self._failed(s, "timeout")
                raise HTTPError(
                    504,
                    f"generator {s.generator_id} did not answer within {self.request_timeout_s:.0f}s",
                    type_="upstream_timeout",
                ) from exc
            else:
                if status == 200:
                    return body, time.perf_counter() - t0
                if status >= 500:
                    self._failed(s, "http")
                if status != 503:
                    # Pass the generator's error through unchanged (4xx: the agent's request was refused).
                    raise HTTPError(status, _error_message(status, body), type_="upstream_error")
                gone = _error_message(status, body)
            await self._fail_over(s, tried, gone)

    def _failed(self, s: Session, kind: ErrorKind) -> None:
        self.pool.calls.error(s.generator_id, kind)

    def _timed(self, s: Session, call_s: float, tokens: int, version: int, version_end: int) -> None:
        """An answered call, timed unless a refit ran under it (its latency is the refit's)."""
        self.pool.calls.ok(s.generator_id, call_s, tokens, timed=version == version_end)

    async def _fail_over(self, s: Session, tried: set[str], why: str) -> None:
        tried.add(s.generator_id)
        self.pool.mark_dead(s.generator_id)
        if len(tried) > self.max_failovers:
            raise HTTPError(
                502,
                f"generator {s.generator_id} unavailable ({why}); gave up after {len(tried)} generators",
                type_="upstream_unavailable",
            )
        try:
            wait_s = min(10.0, self.request_timeout_s, self.generator_wait_s)
            gid, url, _ = await self.pool.pick(wait_s=wait_s, exclude=frozenset(tried))
        except NoGenerator as exc:
            raise HTTPError(
                502,
                f"generator {s.generator_id} unavailable ({why}) and no other serving generator: {exc}",
                type_="upstream_unavailable",
            ) from exc
        log.warning(
            "session %s: generator %s unavailable (%s); failing over to %s", s.session_id, s.generator_id, why, gid
        )
        s.generator_id, s.generator_url = gid, url
        s.failovers += 1
        self.failovers_total += 1

    def _record(
        self,
        s: Session,
        prompt: msgspec.Raw,
        gen: list[int],
        logprobs: list[float],
        version: int,
        version_end: int,
        finish_reason: str,
        latency_s: float,
        spans: list[list[int]] | None = None,
        routes: _Routes | None = None,
    ) -> None:
        keep, new = s.history.split(prompt)
        if s.history.length and keep < s.history.length:
            s.prefix_breaks += 1
            self.prefix_breaks_total += 1
            self.prefix_breaks_by_env[s.env] = self.prefix_breaks_by_env.get(s.env, 0) + 1
            log.warning(
                "session %s (%s): prompt of call %d breaks the token prefix at %d of %d",
                s.session_id,
                s.env,
                s.calls,
                keep,
                s.history.length,
            )
        s.turns.append(
            make_turn(
                prompt_ids=new,
                context_len=keep,
                generated_ids=gen,
                generated_logprobs=logprobs,
                weight_version=version,
                weight_version_end=version_end,
                finish_reason=finish_reason,
                generator_id=s.generator_id,
                latency_s=latency_s,
                version_spans=[(int(start), int(v)) for start, v in spans or ()],
                **(routes.turn_fields() if routes else {}),
            )
        )
        if routes is not None:
            s.route_shape = routes.shape
        s.history.advance(keep, new + gen)
        s.calls += 1
        self.calls_total += 1


@dataclass(frozen=True)
class _Routes:
    """One call's MoE routes as the generator returned them."""

    shape: RouteShape
    packed: bytes
    start: int

    @classmethod
    def of(cls, shape: RouteShape | None, text: str | None, start: int | None) -> _Routes | None:
        if shape is None or text is None or start is None:
            return None
        return cls(shape, routes_wire.from_text(text), start)

    def turn_fields(self) -> dict[str, Any]:
        return {"routes": self.packed, "routes_start": self.start}


def _generation_logprobs(out: RecordedChat | RecordedCompletion) -> list[float]:
    if isinstance(out, RecordedChat):
        return [lp for c in out.choices for lp in c.message.generation_log_probs]
    return [lp for c in out.choices for lp in c.generation_log_probs]


_JSON_HEADERS = {"content-type": "application/json"}


def _error_message(status: int, body: bytes) -> str:
    try:
        return str(msgspec.json.decode(body)["error"]["message"])
    except Exception:
        return body[:500].decode(errors="replace") or f"generator answered {status}"
