"""Build the tiny policy used by the demo and the tests: a causal LM of one of two families and a
locally trained byte-level BPE tokenizer with a Qwen-style chat template (tools, <think>).

* ``qwen3``: a dense Qwen3 (the default);
* ``qwen3_5_moe``: the reference run's family (Qwen3.5-MoE) in miniature, architecture-exact:
  three of every four layers Gated DeltaNet linear attention (short causal convolution, recurrent
  state), the fourth gated full attention with partial rotary embeddings, every layer a routed
  MoE with a gated shared expert, and multi-token-prediction (MTP) weights under ``mtp.*`` as the
  real checkpoints carry them (transformers and vLLM's main model skip them; vLLM's MTP drafter
  reads them). With ``tiny_spec("qwen3_5_moe", multimodal=True)`` it is written in the released
  checkpoints' multimodal format instead (``Qwen3_5MoeForConditionalGeneration``: the text
  model's config under ``text_config`` beside a tiny vision tower's ``vision_config``, weights
  ``model.language_model.*``, ``model.visual.*``, ``lm_head.weight`` and ``mtp.*``), which the
  trainers must publish as they found it.

Nothing is downloaded: the tokenizer is trained on text generated here from a seed, the model is
randomly initialised from the same seed, and both are written with ``save_pretrained`` so the
services load them with the same code that loads a real checkpoint (`AutoTokenizer`,
`AutoModelForCausalLM`, vLLM's loader). Untied embeddings (vLLM's in-place reload leaves a tied
lm_head stale), head_dim 32 (the smallest vLLM's CPU attention supports), 32K positions so real
agent harnesses fit. Called by ``streamrl model init`` and by test fixtures.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3Config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

_WORDS = (
    "the a an and or of to in on for with is are was be it this that what which who how why when where "
    "answer number result value sum total tool call function calculator expression arguments name "
    "use compute please question reply repeat after me exactly word words say here there then now "
    "apple banana cherry grape lemon mango orange peach pear plum red green blue yellow black white "
    "cat dog bird fish horse tiger lion mouse river mountain city house tree stone water fire wind "
    "one two three four five six seven eight nine ten hello thanks yes no ok done true false error "
    "file test code python run bash command output input list read write open close print return def "
    "class import from self if else while not in is None True False assistant user system"
).split()


ARCHS = ("qwen3", "qwen3_5_moe")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny dense model; the defaults are what the demo and the tests use."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    seed: int = 0
    arch: str = "qwen3"


@dataclass(frozen=True)
class TinyHybridMoeSpec(TinyModelSpec):
    """Shape of the tiny Qwen3.5-MoE: the dense fields plus the hybrid layers' and the experts'.
    Full attention heads are 32 wide, the smallest vLLM's CPU attention takes; Gated DeltaNet heads
    64, the smallest vLLM's CPU Gated DeltaNet prefill kernel takes (64 or 128, keys as wide as
    values)."""

    arch: str = "qwen3_5_moe"
    full_attention_interval: int = 4  # layers 3, 7, ... are full attention, the rest linear
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 128
    partial_rotary_factor: float = 0.25
    mtp_num_hidden_layers: int = 1


@dataclass(frozen=True)
class TinyMultimodalMoeSpec(TinyHybridMoeSpec):
    """The tiny Qwen3.5-MoE in the released checkpoints' multimodal format: the same text model
    beside a vision tower of one block (its merger projects to the text model's width)."""

    vision_depth: int = 1
    vision_hidden_size: int = 32
    vision_intermediate_size: int = 64
    vision_num_heads: int = 2
    vision_num_position_embeddings: int = 64  # an 8 x 8 grid of learned patch positions


def tiny_spec(arch: str, seed: int = 0, *, multimodal: bool = False) -> TinyModelSpec:
    """The demo's shape of ``arch`` (one of `ARCHS`); ``multimodal``: Qwen3.5-MoE in the released
    multimodal checkpoint format (`TinyMultimodalMoeSpec`)."""
    if multimodal and arch != "qwen3_5_moe":
        raise ValueError(f"only qwen3_5_moe has a multimodal build, not {arch!r}")
    if arch == "qwen3":
        return TinyModelSpec(seed=seed)
    if arch == "qwen3_5_moe":
        return TinyMultimodalMoeSpec(seed=seed) if multimodal else TinyHybridMoeSpec(seed=seed)
    raise ValueError(f"unknown architecture {arch!r}: one of {', '.join(ARCHS)}")


def _corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Seeded synthetic text: chat transcripts with tool calls, arithmetic, prose, code."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 6
        if kind == 0:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            lines.append(f"What is {a} {op} {b}? Use the calculator. The answer is {a + b}.")
        elif kind == 1:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            args = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} + {b}"}})
            lines.append(f"<|im_start|>assistant\n<tool_call>\n{args}\n</tool_call><|im_end|>")
        elif kind == 2:
            lines.append(f"<|im_start|>user\n<tool_response>\n{rng.randint(0, 2000)}\n</tool_response><|im_end|>")
        elif kind == 3:
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
            lines.append(f"Repeat after me: {words}\n{words}")
        elif kind == 4:
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 20)))
            lines.append(words.capitalize() + rng.choice([".", "?", "!"]))
        else:
            name = rng.choice(_WORDS)
            lines.append(f"def {name}_{i}(x, y):\n    return x + y * {rng.randint(0, 9)}\n")
    return lines


def _train_tokenizer(spec: TinyModelSpec) -> Tokenizer:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Digits are split one by one (as Qwen's tokenizers do), then byte-level BPE.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS + ADDED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    return tok


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write tokenizer + chat template + a randomly initialised model of ``spec.arch`` to
    ``out_dir`` (the tiny Qwen3 when ``spec`` is None)."""
    import torch

    spec = spec or TinyModelSpec()
    if spec.arch not in ARCHS:
        raise ValueError(f"unknown architecture {spec.arch!r}: one of {', '.join(ARCHS)}")
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(spec),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=[],
    )
    hf_tok.chat_template = (Path(__file__).with_name("chat_template.jinja")).read_text()
    hf_tok.model_max_length = spec.max_position_embeddings
    hf_tok.save_pretrained(out)

    torch.manual_seed(spec.seed)
    pad_id = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    eos_id = hf_tok.convert_tokens_to_ids("<|im_end|>")
    model = _new_model(spec, len(hf_tok), pad_id=pad_id, eos_id=eos_id)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out, safe_serialization=True)
    if isinstance(spec, TinyHybridMoeSpec) and spec.mtp_num_hidden_layers:
        _add_mtp_weights(out, model, spec)
    (out / "streamrl_tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out


def _new_model(spec: TinyModelSpec, vocab_size: int, *, pad_id: int, eos_id: int) -> torch.nn.Module:
    if isinstance(spec, TinyMultimodalMoeSpec):
        from transformers import Qwen3_5MoeForConditionalGeneration

        config = qwen3_5_moe_multimodal_config(spec, vocab_size, pad_id=pad_id, bos_id=pad_id, eos_id=eos_id)
        return Qwen3_5MoeForConditionalGeneration(config)
    if isinstance(spec, TinyHybridMoeSpec):
        from transformers import Qwen3_5MoeForCausalLM

        return Qwen3_5MoeForCausalLM(qwen3_5_moe_config(spec, vocab_size, pad_id=pad_id, bos_id=pad_id, eos_id=eos_id))
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(qwen3_config(spec, vocab_size, pad_id=pad_id, bos_id=pad_id, eos_id=eos_id))


def _add_mtp_weights(out: Path, model: torch.nn.Module, spec: TinyHybridMoeSpec) -> None:
    """Add the MTP module's weights to the saved checkpoint under the real checkpoints' names (top
    level, in the multimodal format too): ``mtp.fc`` [H, 2H] over the normed embedding and hidden
    state, ``mtp.layers.N`` full-attention MoE decoder layers (in the file's own expert layout,
    taken from a layer the model saved), ``mtp.norm``. Drawn from the spec's seed, so they are as
    reproducible as the rest."""
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(out.glob("*.safetensors"))
    if len(files) != 1:
        raise RuntimeError(f"expected one safetensors file in {out}, found {len(files)}")
    tensors = load_file(files[0])
    text = "model.language_model." if isinstance(spec, TinyMultimodalMoeSpec) else "model."
    full = next(i for i, t in enumerate(model.config.get_text_config().layer_types) if t == "full_attention")
    prefix = f"{text}layers.{full}."
    layer = {k.split(prefix, 1)[1]: v for k, v in tensors.items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(spec.seed + 1)
    h = spec.hidden_size
    mtp = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=gen) * 0.02}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # as initialised (x * (1 + w))
        mtp[f"mtp.{norm}.weight"] = tensors[f"{text}norm.weight"].clone()
    for i in range(spec.mtp_num_hidden_layers):
        for name, ref in layer.items():
            fresh = ref.clone() if ref.ndim == 1 else torch.randn(ref.shape, generator=gen) * 0.02
            mtp[f"mtp.layers.{i}.{name}"] = fresh.to(ref.dtype)
    save_file({**tensors, **mtp}, files[0], metadata={"format": "pt"})


def is_model_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors")) and (p / "tokenizer.json").is_file()


def _shared_config(spec: TinyModelSpec, vocab_size: int, *, pad_id: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    """The config fields every tiny family shares: attention shape, special tokens, untied
    embeddings, float32."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": False,
        "pad_token_id": pad_id,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": "float32",
    }


def qwen3_config(spec: TinyModelSpec, vocab_size: int, *, pad_id: int, bos_id: int, eos_id: int) -> Qwen3Config:
    """The Qwen3 config of ``spec``'s shape: untied embeddings, float32."""
    from transformers import Qwen3Config

    return Qwen3Config(
        **_shared_config(spec, vocab_size, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id),
        intermediate_size=spec.intermediate_size,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
    )


def qwen3_5_moe_config(spec: TinyHybridMoeSpec, vocab_size: int, *, pad_id: int, bos_id: int, eos_id: int) -> Any:
    """The Qwen3.5-MoE text config of ``spec``'s shape: untied embeddings, float32."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        **_shared_config(spec, vocab_size, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id),
        full_attention_interval=spec.full_attention_interval,
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "partial_rotary_factor": spec.partial_rotary_factor,
        },
        mtp_num_hidden_layers=spec.mtp_num_hidden_layers,
    )


def qwen3_5_moe_multimodal_config(
    spec: TinyMultimodalMoeSpec, vocab_size: int, *, pad_id: int, bos_id: int, eos_id: int
) -> Any:
    """The multimodal Qwen3.5-MoE config of ``spec``'s shape: `qwen3_5_moe_config` as its
    ``text_config``, the tiny vision tower's as its ``vision_config``; float32."""
    from transformers import Qwen3_5MoeConfig

    text = qwen3_5_moe_config(spec, vocab_size, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)
    vision = {
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_hidden_size,
        "intermediate_size": spec.vision_intermediate_size,
        "num_heads": spec.vision_num_heads,
        "num_position_embeddings": spec.vision_num_position_embeddings,
        "out_hidden_size": spec.hidden_size,
    }
    return Qwen3_5MoeConfig(
        text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=False, dtype="float32"
    )


def build_tiny_moe(out: str | Path, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised tiny Qwen3-MoE (4 experts, top 2, float32, no tokenizer: token ids
    only) saved to ``out``; returned in eval mode. Weights are drawn wide enough (and norms away
    from 1) that a misplaced tensor moves the logits far more than float rounding does. For the
    megatron backend's expert-parallel tests and GPU checks."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**shape, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
    model.save_pretrained(out)
    return model
