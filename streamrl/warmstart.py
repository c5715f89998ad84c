"""Warm start: a short supervised fine-tune of a model on demonstrated conversations (each with the
tools it offers), so that async GRPO starts from a policy that speaks the tool-call format.

`fine_tune` trains on any conversations; `warm_start` is the demo's, on ``crossing`` episodes.

In the demonstrations the robot looks at the light only half of the time and then picks its action
at random, so the warm-started policy calls the ``look`` tool reliably *when* it calls it, but has
no idea what the light means: its first reward is chance (about 1/3), inside (0.1, 0.6). Both
looking first and acting on the observation have to be learned by GRPO from the rewards. Loss is
on assistant tokens only (the turn terminator included), rendered with the same chat template and
tool schema the environment sends.

Called by ``streamrl demo`` (and the benchmark) before the run starts.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.gym_gateway.envs.crossing import ACTIONS, LOOK_TOOL, PROMPT, RULE, CrossingEnv, observation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStartSpec:
    steps: int = 100
    batch_size: int = 16
    lr: float = 2e-3
    p_look: float = 0.5
    p_right: float = 0.5
    num_examples: int = 2000
    seed: int = 1234


def demonstration(instance: dict[str, Any], rng: random.Random, p_look: float, p_right: float) -> list[dict[str, Any]]:
    """One episode: with probability ``p_look`` the robot looks first; after looking it takes the
    right action with probability ``p_right``; every other action is uniformly random."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": PROMPT}]
    action = rng.choice(ACTIONS)
    if rng.random() < p_look:
        call = {"id": "call_0", "type": "function", "function": {"name": "look", "arguments": "{}"}}
        msgs += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": observation(instance["light"])},
        ]
        if rng.random() < p_right:
            action = RULE[instance["light"]]
    msgs.append({"role": "assistant", "content": action})
    return msgs


@dataclass(frozen=True)
class Conversation:
    """A demonstrated episode: chat messages (assistant turns are what the model learns) and the
    tools the environment offers, in chat-completions form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


def encode_with_mask(tok: PreTrainedTokenizerBase, conversation: Conversation) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask of assistant-generated tokens."""
    messages, tools = conversation.messages, conversation.tools or None

    def render(ms: list[dict[str, Any]], gen: bool) -> str:
        text: str = tok.apply_chat_template(ms, tools=tools, tokenize=False, add_generation_prompt=gen)
        return text

    full = tok(render(messages, False), add_special_tokens=False)["input_ids"]
    mask = [0] * len(full)
    eos = tok.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(tok(render(messages[:i], True), add_special_tokens=False)["input_ids"])
        end = len(tok(render(messages[: i + 1], False), add_special_tokens=False)["input_ids"])
        while end > start and full[end - 1] != eos:  # the "\n" after the terminator is template glue
            end -= 1
        for j in range(start, end):
            mask[j] = 1
    return full, mask


def warm_start(model_dir: str | Path, out_dir: str | Path, spec: WarmStartSpec | None = None) -> dict[str, float]:
    """The demo's warm start: `fine_tune` on ``crossing`` demonstrations (`demonstration`)."""
    spec = spec or WarmStartSpec()
    rng = random.Random(spec.seed)
    instances = CrossingEnv().make_instances(spec.num_examples, seed=spec.seed + 1)
    episodes = [Conversation(demonstration(inst, rng, spec.p_look, spec.p_right), [LOOK_TOOL]) for inst in instances]
    return fine_tune(model_dir, out_dir, episodes, spec, rng)


def fine_tune(
    model_dir: str | Path,
    out_dir: str | Path,
    conversations: list[Conversation],
    spec: WarmStartSpec,
    rng: random.Random | None = None,
) -> dict[str, float]:
    """Fine-tune ``model_dir`` into ``out_dir`` on ``conversations`` (loss on the assistant's
    tokens; ``spec``: steps, batch size, learning rate, seed; ``rng`` draws the batches, seeded
    from ``spec.seed`` unless given); returns a summary (loss, time)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.trainer.backends.hf_format import carry_untrained

    t0 = time.perf_counter()
    torch.manual_seed(spec.seed)
    rng = rng or random.Random(spec.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    examples = [encode_with_mask(tok, c) for c in conversations]
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    pad = tok.pad_token_id
    losses = []
    for step in range(spec.steps):
        batch = rng.sample(examples, min(spec.batch_size, len(examples)))
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width))
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (x, m) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
            attn[i, : len(x)] = 1
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        m = mask[:, 1:].reshape(-1)
        loss = (nll * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if step % 25 == 0 or step == spec.steps - 1:
            log.info("warm start step %d/%d loss %.3f", step + 1, spec.steps, losses[-1])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    carry_untrained(model, Path(model_dir), out)  # e.g. MTP weights, which transformers does not load
    tok.save_pretrained(out)
    summary = {
        "steps": spec.steps,
        "final_loss": sum(losses[-10:]) / min(10, len(losses)),
        "time_s": time.perf_counter() - t0,
    }
    (out / "warmstart.json").write_text(json.dumps(summary, indent=2))
    return summary
