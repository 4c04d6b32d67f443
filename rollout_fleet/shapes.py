"""Models of a real model's shape, built offline: the architecture of a released checkpoint with random weights and
a real byte-level BPE tokenizer, so the system runs at a size where compute, not overhead, dominates, with nothing
downloaded (``streamrl model init --shape qwen2.5-0.5b``).

The tokenizer is trained here with the ``tokenizers`` library on text the project generates (its tasks' prompts and
answers, chat turns), byte-level like Qwen's so any text encodes; its vocabulary is smaller than the model's
151,936 rows (a real checkpoint's vocabulary is padded too), so every id it makes has an embedding row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rollout_fleet.model import CHAT_TEMPLATE, EOS, IM_END, IM_START, PAD, cache_root, save_model_dir


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 architecture (config.json's fields) and the vocabulary of the BPE tokenizer built for it."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tokenizer_vocab: int = 8192
    seed: int = 0

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]

    def parameters(self) -> int:
        """Parameters of the model (tied embeddings counted once)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        kv = self.num_key_value_heads * (h // self.num_attention_heads)
        attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (bias), k and v (bias), o
        return self.vocab_size * h + layers * (attention + 3 * h * i + 2 * h) + h


# Qwen2.5-0.5B's config.json: hidden 896, 24 layers, 14 heads, 2 KV heads, vocabulary 151,936, tied embeddings.
SHAPES = {
    "qwen2.5-0.5b": ModelShape(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151_936,
        max_position_embeddings=32_768,
    ),
    # the same layout, about 12 M parameters: the benchmarks' quick mode and the tests
    "qwen2.5-small": ModelShape(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        vocab_size=32_768,
        max_position_embeddings=4096,
        tokenizer_vocab=4096,
    ),
}


def tokenizer_corpus(seed: int = 0, lines: int = 20_000) -> list[str]:
    """Text to train the BPE on: arithmetic problems, answers and chat turns of the project's tasks."""
    rng = random.Random(seed)
    words = (
        "what is",
        "compute",
        "answer",
        "the",
        "result",
        "of",
        "think",
        "step by step",
        "so",
        "is",
        "then",
    )
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        phrase = " ".join(rng.sample(words, 3))
        out.append(f"{IM_START}user\n{phrase.capitalize()}: {a} {op} {b} = ?{IM_END}\n")
        out.append(f"{IM_START}assistant\n{a} {op} {b} = {value}. The answer is {value}.{IM_END}\n")
    return out


def build_bpe_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on :func:`tokenizer_corpus`, with Qwen's chat special tokens."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, IM_START, IM_END, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, pad_token=PAD, additional_special_tokens=[IM_START, IM_END]
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_shaped_model(shape: ModelShape, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """The architecture with random weights (Hugging Face's initialisation, seeded), in bf16 as released."""
    if len(tokenizer) > shape.vocab_size:
        raise ValueError(
            f"tokenizer_vocab = {len(tokenizer)} exceeds the model's vocab_size = {shape.vocab_size}"
        )
    config = Qwen2Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(shape.seed)
        model = Qwen2ForCausalLM(config)
    model.to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def init_shaped_model(name: str, out: Path | None = None) -> Path:
    """Build (or find cached) the model of shape ``name`` (:data:`SHAPES`); returns its directory."""
    if name not in SHAPES:
        raise ValueError(f"--shape = {name!r}: known shapes are {sorted(SHAPES)}")
    shape = SHAPES[name]
    path = Path(out) if out else cache_root() / "models" / f"{name}-random-{shape.fingerprint()}"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    tokenizer = build_bpe_tokenizer(shape.tokenizer_vocab, shape.seed)
    return save_model_dir(build_shaped_model(shape, tokenizer), tokenizer, path)


def main(argv: list[str] | None = None) -> int:
    """``streamrl model init --shape NAME [--out DIR]``."""
    parser = argparse.ArgumentParser(
        prog="streamrl model init --shape",
        description="Build a model of a released checkpoint's architecture with random weights and a byte-level "
        "BPE tokenizer trained here (nothing is downloaded); cached, so a second run returns at once.",
    )
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the architecture")
    parser.add_argument("--out", type=Path, default=None, help="model directory (default: under the cache)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    path = init_shaped_model(args.shape, args.out)
    shape = SHAPES[args.shape]
    print(
        f"{path}\n{args.shape}: {shape.parameters() / 1e6:.0f} M parameters (bf16), "
        f"tokenizer vocabulary {shape.tokenizer_vocab}; {time.monotonic() - started:.1f} s"
    )
    return 0
