"""A model folder for serving benchmarks without downloads: a Hugging Face config of one shape of
benchmarks.roofline.MODELS and a word-level tokenizer covering its whole vocabulary ("w2" ..., id 0 the EOS),
so `server --model DIR --load-format dummy` serves it with random weights and every token id
round-trips through text.

    python -m benchmarks.dummy_model --shape llama3-8b --out /tmp/llama3-8b
"""
import argparse
import json
from pathlib import Path

from benchmarks.roofline import MODELS


def write_dummy_model(shape: str, out: Path) -> Path:
    """config.json of `shape` and a word-level tokenizer of its vocab_size (id 0 <eos>, 1 <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = dict(MODELS[shape], bos_token_id=0, eos_token_id=0)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # special tokens must not be prefixes of words: added tokens match anywhere in the text
    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, config["vocab_size"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", bos_token="<eos>", unk_token="<unk>",
                            model_max_length=config["max_position_embeddings"]).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(MODELS), required=True, help="model shape (benchmarks.roofline)")
    ap.add_argument("--out", required=True, help="folder to write config.json and the tokenizer to")
    args = ap.parse_args()
    print(write_dummy_model(args.shape, Path(args.out)))


if __name__ == "__main__":
    main()
