"""A model folder for serving benchmarks without downloads: a Hugging Face config of one shape of
benchmarks.roofline.MODELS and a word-level tokenizer covering its whole vocabulary ("w2" ..., id 0 the EOS),
so `server --model DIR --load-format dummy` serves it with random weights and every token id
round-trips through text. --fp8 block makes it a block-scaled FP8 checkpoint's config (dummy fp8
weights and scales); --layers keeps a shape's layers but fewer of them (quicker to start, less memory).

    python -m benchmarks.dummy_model --shape llama3-8b --out /tmp/llama3-8b
    python -m benchmarks.dummy_model --shape qwen3-30b-a3b --fp8 block --layers 8 --out /tmp/moe-fp8
"""
import argparse
import json
from pathlib import Path

from benchmarks.roofline import MODELS, model_config


def write_dummy_model(shape: str, out: Path, fp8: str = "none", layers: int | None = None) -> Path:
    """config.json of `shape` (block-scaled FP8 with fp8 "block"; `layers` decoder layers if given)
    and a word-level tokenizer of its vocab_size (id 0 <eos>, 1 <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = dict(model_config(shape, fp8), bos_token_id=0, eos_token_id=0)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be at least 1, got {layers}")
        config["num_hidden_layers"] = layers
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
    ap.add_argument("--fp8", choices=["none", "block"], default="none",
                    help="block: a block-scaled FP8 checkpoint's config ([128, 128] weight blocks)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    ap.add_argument("--out", required=True, help="folder to write config.json and the tokenizer to")
    args = ap.parse_args()
    print(write_dummy_model(args.shape, Path(args.out), args.fp8, args.layers))


if __name__ == "__main__":
    main()
