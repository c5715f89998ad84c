"""Generation logprobs that are not numbers: a model call answered with a NaN (or infinite)
generation logprob ends its rollout as the infrastructure failure ``nan_generation_logprobs``.

    generator answer --the proxy decodes it--> a logprob that is not a finite number?
        -> the session counts the call, the agent gets a 502 (type nan_generation_logprobs)
        -> the worker ends the rollout: failed, zero tokens, retried under env.failure_policy: retry

The trainer weighs every generated token by ``exp(logp_train - logp_generator)``: one NaN makes
its step's loss NaN, and a truncated rollout (a policy failure) keeps its turns for training, so
the failure is an infrastructure one, whose turns are dropped; the trainer's failure policy then
fails the run, naming the reason, or backfills (NeMo-RL raises for the whole batch). JSON has no
NaN: a generator encoding with msgspec sends ``null``, which the proxy's typed decoder refuses,
and one encoding with Python's json the bare word ``NaN``, which msgspec refuses as malformed; so
an answer the decoder refused is looked at again here, and a decoded one is checked as the
trajectory stores it (float32). Used by the session proxy and the worker.
"""

from __future__ import annotations

import json
import math

import numpy as np

NAN_GENERATION_LOGPROBS = "nan_generation_logprobs"


def finite(logprobs: list[float]) -> bool:
    """Every logprob is a finite number once packed as the trajectory stores it (float32)."""
    return bool(np.isfinite(np.asarray(logprobs, dtype=np.float32)).all())


def undecodable_nonfinite(body: bytes) -> bool:
    """True when an answer the typed decoder refused holds a generation logprob that is not a
    finite number (``null``, ``NaN``, ``Infinity``) in any choice, chat or completion."""
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    choices = answer.get("choices") if isinstance(answer, dict) else None
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        logprobs = (message if isinstance(message, dict) else choice).get("generation_log_probs")
        if isinstance(logprobs, list) and not all(_finite_number(x) for x in logprobs):
            return True
    return False


def _finite_number(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
