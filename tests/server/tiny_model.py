"""Build a tiny random Llama + a BPE tokenizer with a chat template, for server tests.

Reference model for the server tests: small enough to load in a second on CPU, real
enough (HF folder: config.json, safetensors, tokenizer files) to exercise the full path.
"""
import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def _training_lines(data_path: Path, num_lines: int = 400) -> list[str]:
    lines = []
    with open(data_path) as f:
        for _, line in zip(range(num_lines), f):
            row = json.loads(line)
            lines += [row["question"], row["answer"]]
    return lines


def build_tiny_model(out_dir: Path, data_path: Path, vocab_size: int = 512, seed: int = 0) -> Path:
    """Write a tokenizer + random LlamaForCausalLM (float32, 2 layers, hidden 64) into out_dir."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_training_lines(data_path), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", chat_template=CHAT_TEMPLATE)
    tokenizer.save_pretrained(out_dir)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, initializer_range=0.2, dtype="float32",
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out_dir)
    return out_dir
