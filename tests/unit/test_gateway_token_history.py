"""The session's token context kept as JSON (`services.gym_gateway.token_history`): what it
records must be exactly what decoding every prompt in full and comparing ids gives."""

import json
import random

import msgspec
import pytest

from services.gym_gateway.token_history import RecordedChat, TokenHistory, common_prefix_len

pytestmark = pytest.mark.unit


def _reference(context: list[int], prompt: list[int]) -> tuple[int, list[int]]:
    keep = common_prefix_len(context, prompt)
    return keep, prompt[keep:]


def _raw(ids: list[int], spaced: bool = False) -> msgspec.Raw:
    return msgspec.Raw(json.dumps(ids).encode() if spaced else msgspec.json.encode(ids))


def test_split_and_advance_match_a_full_decode_over_random_conversations():
    rng = random.Random(0)
    for _ in range(500):
        history, context = TokenHistory(), []
        for _turn in range(rng.randint(1, 6)):
            roll = rng.random()
            if roll < 0.6 or not context:  # continues the context
                prompt = context + [rng.randint(0, 120) for _ in range(rng.randint(0, 5))]
            elif roll < 0.8:  # breaks it somewhere
                cut = rng.randint(0, len(context))
                prompt = context[:cut] + [rng.randint(0, 120) for _ in range(rng.randint(0, 5))]
            else:  # the context exactly, or a strict prefix of it
                prompt = context[: rng.randint(0, len(context))]
            keep, new = history.split(_raw(prompt, spaced=rng.random() < 0.2))
            assert (keep, new) == _reference(context, prompt)
            gen = [rng.randint(0, 120) for _ in range(rng.randint(0, 4))]
            history.advance(keep, new + gen)
            context = prompt + gen
            assert history.ids() == context
            assert history.length == len(context)
            assert history.json == msgspec.json.encode(context)  # what goes out as required_prefix_token_ids


def test_an_id_that_only_starts_with_the_contexts_last_digits_is_a_break():
    history = TokenHistory()
    history.advance(0, [1, 2])
    assert history.split(_raw([1, 23, 4])) == (1, [23, 4])
    assert history.split(_raw([1, 2])) == (2, [])
    assert history.split(_raw([1, 2, 5])) == (2, [5])


def test_an_answer_is_read_with_its_prompt_ids_raw_and_the_message_copy_skipped():
    body = msgspec.json.encode(
        {
            "id": "c",
            "created": 1,
            "model": "m",
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            "prompt_token_ids": [5, 6, 7],
            "weight_version": 2,
            "weight_version_end": 2,
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "token_ids": [9],
                    "message": {
                        "role": "assistant",
                        "content": "hi",
                        "prompt_token_ids": [5, 6, 7],
                        "generation_token_ids": [9],
                        "generation_log_probs": [-0.5],
                    },
                }
            ],
        }
    )
    out = msgspec.json.decode(body, type=RecordedChat)
    assert bytes(out.prompt_token_ids) == b"[5,6,7]"
    assert out.choices[0].message.generation_token_ids == [9]
    assert TokenHistory().split(out.prompt_token_ids) == (0, [5, 6, 7])
