"""The per-rollout session proxy: ``/sessions/<rollout_id>/v1/chat/completions`` in front of the
generators.

Any OpenAI-compatible agent can be pointed at a session URL without knowing about token ids. For
each call the proxy
  * fills the rollout's sampling profile and request tag (train or validation),
  * attaches the session's exact token history (``required_prefix_token_ids``) once the agent
    replays an assistant turn, so the generator splices the model's own tokens back in,
  * forwards to the session's generator (chosen once per session for prefix-cache locality),
  * records the call as a `Turn`: the prompt tokens new relative to the session's context, the
    generated ids and logprobs, the weight versions, latency; and counts prefix breaks (a prompt
    that does not continue the session's context).
Owned by the gateway app; the worker opens a session per rollout and assembles the trajectory
from the recorded turns when the rollout ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

from shared import keys as K
from shared.http import HTTPError
from shared.openai_api import ChatCompletionRequest, ChatCompletionResponse, RequestTag
from shared.protocol import SamplingParams, Turn, make_turn
from shared.registry import live_workers

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    kind: str
    sampling: SamplingParams
    generator_id: str
    generator_url: str
    open_version: int
    context: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    prefix_breaks: int = 0
    calls: int = 0


class NoGenerator(RuntimeError):
    """No generator can take a session: an infrastructure failure."""


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class GeneratorPool:
    """Ready generators from the registry, refreshed at most every ``refresh_s``."""

    def __init__(self, redis, run_keys: K.RunKeys, refresh_s: float = 1.0) -> None:
        self.redis = redis
        self.keys = run_keys
        self.refresh_s = refresh_s
        self._ready: list = []
        self._at = 0.0
        self._rr = itertools.count()
        self._refresh_lock = asyncio.Lock()

    # A generator mid-refit queues requests until it resumes, so it still takes sessions.
    SERVING_STATES = ("ready", "loading", "paused")

    async def pick(self, wait_s: float = 30.0) -> tuple[str, str, int]:
        """(worker id, base url, weight version) of a serving generator, round robin; waits up to
        ``wait_s`` for one to appear, then raises NoGenerator."""
        deadline = time.monotonic() + wait_s
        while True:
            now = time.monotonic()
            if now - self._at > self.refresh_s or not self._ready:
                await self._refresh(now)
            if self._ready:
                g = self._ready[next(self._rr) % len(self._ready)]
                return g.worker_id, g.url, g.weight_version
            if now > deadline:
                raise NoGenerator(f"no serving generator registered within {wait_s:.0f}s")
            await asyncio.sleep(self.refresh_s / 2)


    async def _refresh(self, stale_before: float) -> None:
        """One registry read for a burst of sessions: callers that waited on the lock find the
        view refreshed after ``stale_before`` and return without reading again."""
        async with self._refresh_lock:
            if self._at > stale_before and self._ready:
                return
            gens = await live_workers(self.redis, self.keys, "generator")
            self._ready = [g for g in gens if g.state in self.SERVING_STATES and g.weight_version >= 0]
            self._at = time.monotonic()


class SessionProxy:
    def __init__(self, pool: GeneratorPool, http: aiohttp.ClientSession, *, request_timeout_s: float) -> None:
        self.pool = pool
        self.http = http
        self.request_timeout_s = request_timeout_s
        self.sessions: dict[str, Session] = {}
        self.prefix_breaks_total = 0
        self.calls_total = 0
        self._decoder = msgspec.json.Decoder(ChatCompletionResponse)

    async def open(self, session_id: str, kind: str, sampling: SamplingParams) -> Session:
        gid, url, version = await self.pool.pick()
        s = Session(session_id, kind, sampling, gid, url, version)
        self.sessions[session_id] = s
        return s

    def close(self, session_id: str) -> Session | None:
        return self.sessions.pop(session_id, None)

    def _prepare(self, s: Session, req: ChatCompletionRequest) -> ChatCompletionRequest:
        prof = s.sampling
        updates: dict = {"streamrl": RequestTag(kind=s.kind, session_id=s.session_id)}
        if req.temperature is None:
            updates["temperature"] = prof.temperature
        if req.top_p is None:
            updates["top_p"] = prof.top_p
        cap = req.max_completion_tokens or req.max_tokens
        updates["max_tokens"] = min(cap, prof.max_tokens) if cap else prof.max_tokens
        updates["max_completion_tokens"] = None
        replays_history = any(m.role == "assistant" for m in req.messages)
        if s.context and replays_history and req.required_prefix_token_ids is None:
            updates["required_prefix_token_ids"] = list(s.context)
        return msgspec.structs.replace(req, **updates)

    async def chat(self, session_id: str, req: ChatCompletionRequest) -> bytes:
        s = self.sessions.get(session_id)
        if s is None:
            raise HTTPError(404, f"unknown or finished session {session_id!r}", param="session_id")
        fwd = self._prepare(s, req)
        t0 = time.perf_counter()
        try:
            async with self.http.post(
                f"{s.generator_url}/v1/chat/completions", data=msgspec.json.encode(fwd),
                headers={"content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            ) as resp:
                status, body = resp.status, await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise HTTPError(502, f"generator {s.generator_id} unreachable: {type(exc).__name__}: {exc}") from exc
        if status != 200:
            # Pass the generator's error through unchanged (4xx: the agent's request was refused).
            raise HTTPError(status, _error_message(status, body), type_="upstream_error")
        self._record(s, self._decoder.decode(body), time.perf_counter() - t0)
        return body

    def _record(self, s: Session, out: ChatCompletionResponse, latency_s: float) -> None:
        choice = out.choices[0]
        prompt = list(out.prompt_token_ids)
        gen = list(choice.message.generation_token_ids)
        keep = common_prefix_len(s.context, prompt)
        if s.context and keep < len(s.context):
            s.prefix_breaks += 1
            self.prefix_breaks_total += 1
            log.warning("session %s: prompt of call %d breaks the token prefix at %d of %d", s.session_id,
                        s.calls, keep, len(s.context))
        s.turns.append(
            make_turn(
                prompt_ids=prompt[keep:], context_len=keep, generated_ids=gen,
                generated_logprobs=choice.message.generation_log_probs,
                weight_version=out.weight_version, weight_version_end=out.weight_version_end,
                finish_reason=choice.finish_reason, generator_id=s.generator_id, latency_s=latency_s,
            )
        )
        s.context = prompt + gen
        s.calls += 1
        self.calls_total += 1


def _error_message(status: int, body: bytes) -> str:
    try:
        return str(msgspec.json.decode(body)["error"]["message"])
    except Exception:
        return body[:500].decode(errors="replace") or f"generator answered {status}"
