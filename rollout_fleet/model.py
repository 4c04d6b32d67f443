"""The tiny model the project can always have: a character-level tokenizer and a small Qwen2 causal LM.

Both are built locally (no hub downloads), deterministically from a seed, and saved as a normal Hugging Face
directory (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) that
``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained`` and SGLang load.
The head dimension is 64 (hidden 128, 2 heads), which SGLang's attention backends support.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, EOS, UNK, IM_START, IM_END]
# Printable ASCII plus newline, one token per character: digits, operators and a few words all fit.
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny Qwen2 model; the defaults give about 0.9M parameters."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 4096
    seed: int = 0
    head_dim: int | None = None  # None: hidden_size // num_attention_heads

    def fingerprint(self) -> str:
        shape = {k: v for k, v in asdict(self).items() if v is not None}  # unset fields keep old fingerprints
        payload = json.dumps({**shape, "chars": "".join(CHARACTERS), "special": SPECIAL_TOKENS})
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


# The long-output task's model (rollout_fleet.tasks.long_multiplication): the default shape with a context of
# 20,480 positions, room for a 16,384-token output after a prompt of up to 4,096. Rotary embeddings have no
# weights, so its initial weights equal the default model's; its fingerprint (and cache directory) differ.
LONG_CONTEXT_SPEC = TinyModelSpec(max_position_embeddings=20480)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: special tokens first, then one id per printable character."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, bos_token=None
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2 causal LM; the same spec always gives the same weights."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_tokenizer(path: str | Path) -> Any:
    """A model directory's tokenizer, from local files only. A directory saved from a bare ``tokenizers`` object
    (this project's character-level one) is loaded as exactly that: ``AutoTokenizer`` would pick the model
    type's tokenizer class (Qwen2's) and replace its pre-tokenizer with Qwen's, which drops newlines and
    spaces from the character vocabulary."""
    from transformers import AutoTokenizer

    config = Path(path) / "tokenizer_config.json"
    try:
        tokenizer_class = json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError):
        tokenizer_class = None
    if tokenizer_class in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def cache_root() -> Path:
    """Where built models are cached: $STREAMRL_CACHE, else ~/.cache/streamrl."""
    return Path(os.environ.get("STREAMRL_CACHE", Path.home() / ".cache" / "streamrl"))


def save_model_dir(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    """Save atomically: write into a sibling temp directory, then rename, so a crash leaves no half model."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


def init_tiny_model(path: Path | None = None, spec: TinyModelSpec | None = None) -> Path:
    """Create the base (untrained) tiny model at ``path`` (default: the cache) unless it is already there."""
    spec = spec or TinyModelSpec()
    path = Path(path) if path else cache_root() / "models" / f"tiny-qwen2-base-{spec.fingerprint()}"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    tokenizer = build_tokenizer()
    return save_model_dir(build_model(spec, tokenizer), tokenizer, path)
