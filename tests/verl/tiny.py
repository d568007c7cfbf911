"""What verl needs of a model and a dataset, built locally: a tiny random Llama, a word-level tokenizer.

Nothing is downloaded. The tokenizer is a `tokenizers` WordLevel model over a few words, wrapped in
transformers' PreTrainedTokenizerFast with a chat template (verl's agent loop and dataset apply it);
the model is a one-layer Llama config (verl reads the config; the stand-in rollout server in cpu_verl.py
builds the random model from it). Llama, not Qwen: verl picks a chat-token builder by model_type and
its Qwen builder expects Qwen's own newline token; an unregistered type gets verl's default builder.
The datasets are verl's parquet layout: prompt messages, data_source, reward_model.ground_truth,
extra_info.index.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPECIAL = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<unk>"]
WORDS = [str(i) for i in range(10)] + ["what", "is", "+", "?"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DATA_SOURCE = "rlstream_tiny_sums"
REWARD_FILE = Path(__file__).with_name("tiny_reward.py")


@dataclass(frozen=True)
class TinyFiles:
    model: str  # a local HF directory: config.json and tokenizer files
    train: str  # parquet
    val: str  # parquet
    reward: str  # a python file with compute_score
    vocab_size: int


def build_tokenizer(root: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(root)
    return fast


def build_model_config(root: Path, vocab_size: int) -> None:
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(root)


def write_dataset(path: Path, pairs: list[tuple[int, int]]) -> None:
    import pandas as pd

    rows = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"what is {a} + {b} ?"}],
            "reward_model": {"style": "rule", "ground_truth": str((a + b) % 10)},
            "extra_info": {"index": i},
        }
        for i, (a, b) in enumerate(pairs)
    ]
    pd.DataFrame(rows).to_parquet(path)


def build_tiny_files(root: Path) -> TinyFiles:
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(model)
    build_model_config(model, len(tokenizer))
    write_dataset(root / "train.parquet", [(a, b) for a in range(5) for b in range(5)])
    write_dataset(root / "val.parquet", [(7, 1), (8, 0)])
    return TinyFiles(
        str(model), str(root / "train.parquet"), str(root / "val.parquet"), str(REWARD_FILE), len(tokenizer)
    )
