"""Serving OpenAI requests: request Struct in, engine call, response Struct out.

For a chat request::

    sampling gate (profile by tag) -> render + splice (chat.ChatRenderer) -> output budget
      -> admission (runtime: gate, slot, weight version at admission) -> engine.generate
      -> parse reasoning / tool calls -> response with the exact prompt ids, generated ids,
         logprobs, and weight_version / weight_version_end

Everything a client can get wrong is a 400 naming the field before the engine is touched.
Called by `services.generator.routes_openai`; knows nothing about HTTP routing.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from services.generator import sampling as gate
from services.generator.chat import STREAMRL_TAG, ChatRenderer
from services.generator.engine import ChoiceOutput, GenerationParams
from services.generator.metrics import GeneratorMetrics
from services.generator.partial import continue_interrupted, was_interrupted
from services.generator.runtime import Runtime, Ticket
from services.generator.tool_calls import parse_turn
from shared import routes as routes_wire
from shared.http import HTTPError, bad_request
from shared.openai_api import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    RequestTag,
    ResponseMessage,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from shared.routes import RouteShape
from shared.sections.generator import GenerationSection


def token_label(token_id: int) -> str:
    return f"token_id:{token_id}"


def request_kind(tag: RequestTag | None, template_kwargs: dict[str, Any] | None) -> Literal["train", "validation"]:
    """The sampling profile a request asked for: ``streamrl.kind``, also accepted inside
    ``chat_template_kwargs.streamrl`` for clients that can only set template kwargs."""
    if tag is not None:
        return tag.kind
    raw = (template_kwargs or {}).get(STREAMRL_TAG)
    if isinstance(raw, dict) and "kind" in raw:
        if raw["kind"] not in ("train", "validation"):
            raise bad_request(
                "chat_template_kwargs.streamrl.kind must be 'train' or 'validation'",
                param="chat_template_kwargs.streamrl.kind",
            )
        kind: Literal["train", "validation"] = raw["kind"]
        return kind
    return "train"


@dataclass(frozen=True)
class Generated:
    choices: list[ChoiceOutput]
    ticket: Ticket
    weight_version_end: int


class GenerationService:
    def __init__(
        self,
        generation: GenerationSection,
        runtime: Runtime,
        renderer: ChatRenderer,
        metrics: GeneratorMetrics,
        model_name: str,
        replay_routes: bool = False,
    ) -> None:
        self.generation = generation
        self.runtime = runtime
        self.renderer = renderer
        self.metrics = metrics
        self.model_name = model_name
        self.replay_routes = replay_routes  # policy.moe_routing_replay: every response carries routes

    @property
    def max_model_len(self) -> int:
        return self.runtime.engine.info.max_model_len

    # -- chat ----------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        if req.stream:
            raise bad_request("stream=true is not supported by this generator", param="stream")
        kind = request_kind(req.streamrl, req.chat_template_kwargs)
        resolved = gate.resolve_sampling(
            self.generation, kind, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k
        )
        top_n = gate.check_choices(req.n, req.top_logprobs if req.logprobs else None)
        cap_param = "max_tokens" if req.max_tokens is not None else "max_completion_tokens"
        cap = gate.requested_max_tokens(
            self.generation, req.max_tokens if req.max_tokens is not None else req.max_completion_tokens, cap_param
        )
        stop_ids, stop_texts = self._stops(req.stop)
        stop_ids |= self.renderer.turn_stop_ids
        session_id = req.streamrl.session_id if req.streamrl else None
        self.runtime.check_serving(session_id)
        prompt = self.renderer.chat_prompt(
            req.messages,
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs,
            required_prefix_token_ids=req.required_prefix_token_ids,
        )
        if prompt.model_prefix_len:
            self.metrics.splices.inc()
        budget = gate.output_budget(cap, len(prompt.prompt_ids), self.max_model_len)
        routes_from = self._routes_from(req.routes_from, len(prompt.prompt_ids))
        params = _params(resolved, budget, req, stop_ids, stop_texts, top_n, routes_from)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        out = await self._generate(prompt.prompt_ids, params, request_id, session_id)
        choices = [
            self._chat_choice(c, prompt.prompt_ids, stop_ids, stop_texts, bool(req.tools), req.logprobs)
            for c in out.choices
        ]
        return ChatCompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=self.model_name,
            choices=choices,
            usage=_usage(prompt.prompt_ids, out.choices),
            prompt_token_ids=prompt.prompt_ids,
            weight_version=out.ticket.weight_version,
            weight_version_end=out.weight_version_end,
            route_shape=self.route_shape,
        )

    def _chat_choice(
        self,
        c: ChoiceOutput,
        prompt_ids: list[int],
        stop_ids: set[int],
        stop_texts: tuple[str, ...],
        parse_tools: bool,
        logprobs: bool,
    ) -> ChatChoice:
        ended_on_stop = c.finish_reason == "stop" and c.token_ids and c.token_ids[-1] in stop_ids
        text = _cut_at_stop(self.renderer.decode(c.token_ids[:-1] if ended_on_stop else c.token_ids), stop_texts)
        parsed = parse_turn(text, tool_calls=parse_tools)
        finish: str = c.finish_reason
        if parsed.tool_calls and finish == "stop":
            finish = "tool_calls"
        message = ResponseMessage(
            content=parsed.content,
            reasoning_content=parsed.reasoning_content,
            tool_calls=parsed.tool_calls or None,
            tool_call_errors=parsed.errors or None,
            prompt_token_ids=prompt_ids,
            generation_token_ids=c.token_ids,
            generation_log_probs=c.logprobs,
        )
        return ChatChoice(
            index=c.index,
            message=message,
            finish_reason=finish,
            logprobs=_chat_logprobs(c) if logprobs else None,
            token_ids=c.token_ids,
            weight_version_spans=_spans(c),
            **self._routes(c),
        )

    # -- completions ---------------------------------------------------------------------------

    async def completion(self, req: CompletionRequest) -> CompletionResponse:
        if req.stream:
            raise bad_request("stream=true is not supported by this generator", param="stream")
        kind = request_kind(req.streamrl, None)
        resolved = gate.resolve_sampling(
            self.generation, kind, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k
        )
        top_n = gate.check_choices(req.n, req.logprobs)
        cap = gate.requested_max_tokens(self.generation, req.max_tokens)
        stop_ids, stop_texts = self._stops(req.stop)
        session_id = req.streamrl.session_id if req.streamrl else None
        self.runtime.check_serving(session_id)
        if isinstance(req.prompt, str):
            prompt_ids = list(self.renderer.tokenizer.encode(req.prompt))
        else:
            prompt_ids = list(req.prompt)
            self.renderer.check_ids(prompt_ids, "prompt")
        if not prompt_ids:
            raise bad_request("prompt must not be empty", param="prompt")
        budget = gate.output_budget(cap, len(prompt_ids), self.max_model_len)
        routes_from = self._routes_from(req.routes_from, len(prompt_ids))
        params = _params(resolved, budget, req, stop_ids, stop_texts, top_n, routes_from)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        out = await self._generate(prompt_ids, params, request_id, session_id)
        choices = [
            CompletionChoice(
                index=c.index,
                text=_cut_at_stop(self.renderer.tokenizer.decode(c.token_ids, skip_special_tokens=True), stop_texts),
                finish_reason=c.finish_reason,
                logprobs=_completion_logprobs(c) if req.logprobs is not None else None,
                generation_token_ids=c.token_ids,
                generation_log_probs=c.logprobs,
                weight_version_spans=_spans(c),
                **self._routes(c),
            )
            for c in out.choices
        ]
        return CompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=self.model_name,
            choices=choices,
            usage=_usage(prompt_ids, out.choices),
            prompt_token_ids=prompt_ids,
            weight_version=out.ticket.weight_version,
            weight_version_end=out.weight_version_end,
            route_shape=self.route_shape,
        )

    # -- MoE routes ----------------------------------------------------------------------------

    @property
    def route_shape(self) -> RouteShape | None:
        """The engine's routes when ``policy.moe_routing_replay`` is on (checked at start)."""
        return self.runtime.engine.info.route_shape if self.replay_routes else None

    def _routes_from(self, requested: int | None, prompt_len: int) -> int | None:
        """The first position whose routes to return: the request's (positions before it came with
        earlier calls), at most the prompt's last one (a caller whose history shrank gets what it
        has not had)."""
        if not self.replay_routes:
            return None
        if requested is not None and requested < 0:
            raise bad_request(f"routes_from must be >= 0 (got {requested})", param="routes_from")
        return min(requested or 0, prompt_len - 1)

    def _routes(self, c: ChoiceOutput) -> dict[str, Any]:
        """A choice's routes for its response (packed, base64); none when there are none."""
        shape = self.route_shape
        if shape is None or c.routes is None:
            return {}
        return {"routes": routes_wire.to_text(routes_wire.pack(c.routes, shape)), "routes_start": c.routes_start}

    # -- tokenize ------------------------------------------------------------------------------

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        if (req.prompt is None) == (req.messages is None):
            raise bad_request(
                "send exactly one of prompt or messages", param="messages" if req.prompt is None else "prompt"
            )
        if req.prompt is not None:
            ids = list(self.renderer.tokenizer.encode(req.prompt))
        else:
            ids = self.renderer.chat_prompt(
                req.messages or [],
                tools=req.tools,
                chat_template_kwargs=req.chat_template_kwargs,
                required_prefix_token_ids=req.required_prefix_token_ids,
                add_generation_prompt=req.add_generation_prompt,
            ).prompt_ids
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)

    # -- shared --------------------------------------------------------------------------------

    def _stops(self, stop: str | list[str] | None) -> tuple[set[int], tuple[str, ...]]:
        """Stop strings as (token ids, texts): a string that is one token of the vocabulary (e.g. a
        special token) stops on that id; any other string stops on the decoded text."""
        if stop is None:
            return set(), ()
        many = not isinstance(stop, str)
        ids: set[int] = set()
        texts: list[str] = []
        tok = self.renderer.tokenizer
        for i, s in enumerate([stop] if isinstance(stop, str) else stop):
            if not s:
                raise bad_request("stop strings must not be empty", param=f"stop[{i}]" if many else "stop")
            tid = tok.convert_tokens_to_ids(s)
            if tid is not None and tid != tok.unk_token_id and tok.convert_ids_to_tokens(tid) == s:
                ids.add(int(tid))
            else:
                texts.append(s)
        return ids, tuple(texts)

    async def _generate(
        self, prompt_ids: list[int], params: GenerationParams, request_id: str, session_id: str | None = None
    ) -> Generated:
        rt = self.runtime
        async with rt.admission(session_id) as ticket:
            try:
                interrupts = rt.interrupts
                choices = await rt.engine.generate(prompt_ids, params, request_id)
                if any(was_interrupted(c, rt, interrupts) for c in choices):
                    choices = await continue_interrupted(
                        rt, prompt_ids, params, request_id, choices, interrupts, ticket.weight_version, session_id
                    )
            except HTTPError:
                raise
            except Exception as exc:
                if rt.engine.errored:
                    rt.fail(f"the engine died: {type(exc).__name__}: {exc}")
                raise HTTPError(500, f"generation failed: {type(exc).__name__}: {exc}") from exc
            version_end = rt.weight_version
            # A refit that failed while this request ran leaves weights we cannot vouch for.
            rt.check_not_failed()
        n_generated = sum(len(c.token_ids) for c in choices)
        rt.record_tokens(n_generated)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self.metrics.generated_tokens.inc(n_generated)
        return Generated(choices=choices, ticket=ticket, weight_version_end=version_end)


def _cut_at_stop(text: str, stop_texts: tuple[str, ...]) -> str:
    """``text`` up to the earliest stop string (OpenAI semantics: the stop is not returned)."""
    cuts = [i for i in (text.find(s) for s in stop_texts) if i >= 0]
    return text[: min(cuts)] if cuts else text


def _spans(c: ChoiceOutput) -> list[list[int]] | None:
    return [[start, version] for start, version in c.version_spans] or None


def _usage(prompt_ids: list[int], choices: list[ChoiceOutput]) -> Usage:
    generated = sum(len(c.token_ids) for c in choices)
    return Usage(prompt_tokens=len(prompt_ids), completion_tokens=generated, total_tokens=len(prompt_ids) + generated)


def _chat_logprobs(c: ChoiceOutput) -> ChoiceLogprobs:
    content = []
    for pos, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        alts = c.top_logprobs[pos] if c.top_logprobs else []
        content.append(
            TokenLogprob(
                token=token_label(tok),
                logprob=lp,
                top_logprobs=[TopLogprob(token=token_label(t), logprob=v) for t, v in alts],
            )
        )
    return ChoiceLogprobs(content=content)


def _completion_logprobs(c: ChoiceOutput) -> CompletionLogprobs:
    top = [{token_label(t): v for t, v in alts} for alts in c.top_logprobs] if c.top_logprobs else None
    return CompletionLogprobs(tokens=[token_label(t) for t in c.token_ids], token_logprobs=c.logprobs, top_logprobs=top)


def _params(
    resolved: gate.ResolvedSampling,
    budget: int,
    req: ChatCompletionRequest | CompletionRequest,
    stop_ids: set[int],
    stop_texts: tuple[str, ...],
    top_n: int,
    routes_from: int | None,
) -> GenerationParams:
    """Engine parameters of a chat or completion request once gate and budget are resolved."""
    return GenerationParams(
        temperature=resolved.temperature,
        top_p=resolved.top_p,
        max_tokens=budget,
        n=req.n,
        seed=req.seed,
        stop_token_ids=tuple(sorted(stop_ids)),
        stop_strings=stop_texts,
        top_logprobs=top_n,
        routes_from=routes_from,
    )
