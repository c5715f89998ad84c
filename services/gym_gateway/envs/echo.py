"""``echo``: a single-turn task. The user says "Repeat after me: w1 w2 ..."; the reward is the
fraction of word positions the reply gets right (over the longer of the two word lists)."""

from __future__ import annotations

import random
from typing import Any

from services.gym_gateway.envs.base import ModelClient, Outcome
from shared.sections.gateway import EnvSection

WORDS = (
    "apple banana cherry grape lemon mango orange peach pear plum red green blue yellow "
    "cat dog bird fish horse tiger lion mouse river mountain city house tree stone"
).split()


def score(expected: list[str], reply: str | None) -> float:
    got = (reply or "").replace(".", " ").split()
    if not expected:
        return 0.0
    hits = sum(a == b for a, b in zip(expected, got, strict=False))
    return hits / max(len(expected), len(got))


class EchoEnv:
    name = "echo"

    @classmethod
    def from_config(cls, env_cfg: EnvSection) -> EchoEnv:
        return cls()  # nothing to configure

    def make_instances(self, n: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [{"words": [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]} for _ in range(n)]

    async def aclose(self) -> None:
        """Nothing is kept between rollouts."""

    async def rollout(self, instance: dict[str, Any], llm: ModelClient, *, max_turns: int) -> Outcome:
        words = list(instance["words"])
        resp = await llm.chat([{"role": "user", "content": "Repeat after me: " + " ".join(words)}])
        return Outcome(reward=score(words, resp.choices[0].message.content), metrics={"turns": 1.0})
