"""Train Tandem's embedded default model: a small Llama trained on GSM8K train.

The server must answer on a fresh machine with no download, so the repository
ships this model in `engine/default_model/`. Four steps, each a subcommand:

  tokenizer  (CPU)  byte-level BPE on the training text        -> TOK_DIR
  train      (GPU)  LlamaForCausalLM from scratch; one run per
                    --epochs value, the lowest held-out loss wins -> RUN_DIR
  finalize   (CPU)  tokenizer + weights in one folder, one safetensors file
  evaluate   (CPU)  sample answers, held-out loss, exact match on test

`scripts/README.md` gives the exact commands used for the shipped model.
Only GSM8K train.jsonl is trained on; test.jsonl is read by `evaluate` alone.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import time
from pathlib import Path

import numpy as np

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]
# GPT-2's split, but digits one at a time (numbers tokenize digit by digit).
PRETOKENIZE_PATTERN = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant that solves math word problems step by step.",
    "Solve the problem. Show your work and give the final answer after ####.",
]
CALCULATOR_ANNOTATION = re.compile(r"<<[^>]*>>")
FINAL_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


# ---------------------------------------------------------------- data

def load_examples(path: Path) -> list[tuple[str, str]]:
    """GSM8K jsonl -> [(question, answer)], calculator `<<a*b=c>>` notes removed."""
    examples = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            answer = CALCULATOR_ANNOTATION.sub("", row["answer"])
            examples.append((row["question"].strip(), answer.strip()))
    return examples


def split_train_val(examples: list, num_val: int, seed: int) -> tuple[list, list]:
    order = np.random.default_rng(seed).permutation(len(examples))
    val = [examples[i] for i in order[:num_val]]
    train = [examples[i] for i in order[num_val:]]
    return train, val


def render_chat(question: str, answer: str, system: str | None) -> str:
    prefix = f"{IM_START}system\n{system}{IM_END}\n" if system else ""
    return (f"{prefix}{IM_START}user\n{question}{IM_END}\n"
            f"{IM_START}assistant\n{answer}{IM_END}{EOT}")


def render_plain(pairs: list[tuple[str, str]]) -> str:
    """One or more `Question/Answer` pairs (few-shot style), then EOT."""
    return "\n\n".join(f"Question: {q}\nAnswer: {a}" for q, a in pairs) + EOT


def build_documents(examples: list, rng: np.random.Generator,
                    augment: bool) -> list[str]:
    """Each example once as a chat and once as plain text.

    With `augment`, half the chats get a system prompt and a quarter of the
    plain pairs are followed by 1-3 other pairs, so few-shot prompts work.
    """
    docs = []
    for q, a in examples:
        system = None
        if augment and rng.random() < 0.5:
            system = SYSTEM_PROMPTS[rng.integers(len(SYSTEM_PROMPTS))]
        docs.append(render_chat(q, a, system))
        pairs = [(q, a)]
        if augment and rng.random() < 0.25:
            extra = rng.integers(len(examples), size=rng.integers(1, 4))
            pairs = [examples[i] for i in extra] + pairs
        docs.append(render_plain(pairs))
    return docs


def pack(docs: list[list[int]], seq_len: int, pad_id: int,
         rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray]:
    """Whole documents, in (shuffled) order, packed into rows of seq_len.

    Returns input_ids [rows, seq_len] and labels [rows, seq_len] (-100 on pad).
    A row starts at a document start; a document longer than a row is cut.
    """
    order = rng.permutation(len(docs)) if rng is not None else range(len(docs))
    rows, row = [], []
    for i in order:
        doc = docs[i][:seq_len]
        if len(row) + len(doc) > seq_len:
            rows.append(row)
            row = []
        row = row + doc
    rows.append(row)
    ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(rows), seq_len), -100, dtype=np.int64)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = row
        labels[r, :len(row)] = row
    return ids, labels


# ---------------------------------------------------------------- tokenizer

def train_tokenizer(args: argparse.Namespace) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    docs = build_documents(load_examples(args.data), np.random.default_rng(0), augment=True)
    texts = [re.sub("|".join(map(re.escape, SPECIAL_TOKENS)), "\n", d) for d in docs]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
        unk_token=None, additional_special_tokens=[IM_START, IM_END],
        model_max_length=args.max_position_embeddings, chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False)
    hf_tok.save_pretrained(args.out)
    _patch_tokenizer_config(args.out)
    n_tokens = sum(len(x) for x in tok.encode_batch(texts))
    print(f"tokenizer: vocab {tok.get_vocab_size()}, {n_tokens} tokens on "
          f"{sum(map(len, texts))} chars of train text -> {args.out}")


def _patch_tokenizer_config(folder: Path) -> None:
    """Keep the folder loadable by transformers 4.x as well as 5.x."""
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("extra_special_tokens", None)  # 5.x writes a list here; 4.x wants a dict
    for load_time_only in ("is_local", "local_files_only"):
        cfg.pop(load_time_only, None)
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg["model_input_names"] = ["input_ids", "attention_mask"]  # 4.x adds token_type_ids
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    specials = {"bos_token": EOT, "eos_token": EOT, "pad_token": EOT,
                "additional_special_tokens": [IM_START, IM_END]}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


# ---------------------------------------------------------------- model

def build_config(args: argparse.Namespace, tokenizer):
    from transformers import LlamaConfig

    eot = tokenizer.convert_tokens_to_ids(EOT)
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=args.max_position_embeddings, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True, hidden_act="silu",
        attention_bias=False, mlp_bias=False, initializer_range=0.02,
        bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)


def generation_config(tokenizer):
    from transformers import GenerationConfig

    eot = tokenizer.convert_tokens_to_ids(EOT)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    return GenerationConfig(bos_token_id=eot, eos_token_id=[eot, im_end],
                            pad_token_id=eot, do_sample=False, max_new_tokens=256)


def mean_loss(model, ids: np.ndarray, labels: np.ndarray, batch_size: int,
              device: str) -> float:
    """Mean next-token cross-entropy (nats/token) over all non-pad targets."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16,
                                         enabled=device == "cuda"):
        for s in range(0, len(ids), batch_size):
            x = torch.from_numpy(ids[s:s + batch_size]).to(device)
            y = torch.from_numpy(labels[s:s + batch_size]).to(device)
            logits = model(input_ids=x).logits[:, :-1].float()
            target = y[:, 1:]
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                     ignore_index=-100, reduction="sum").item()
            count += (target != -100).sum().item()
    model.train()
    return total / count


def add_residual_dropout(model, p: float) -> None:
    """Dropout on the embeddings and on every attention/MLP output (training only).

    Hooks, not config: the saved config stays a plain inference Llama.
    """
    import torch.nn.functional as F

    def hook(module, inputs, out):
        if isinstance(out, tuple):
            return (F.dropout(out[0], p, module.training),) + out[1:]
        return F.dropout(out, p, module.training)

    model.model.embed_tokens.register_forward_hook(hook)
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def train_one(args, tokenizer, train_docs, val_ids, val_labels, epochs: int,
              dropout: float, deadline: float, log) -> tuple[float, dict, list]:
    """One from-scratch run; returns (best val loss, its weights on CPU, curve)."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    pad = tokenizer.pad_token_id
    model = LlamaForCausalLM(build_config(args, tokenizer)).to(args.device)
    if dropout > 0:
        add_residual_dropout(model, dropout)
    rows_per_epoch = len(pack(train_docs, args.seq_len, pad, rng)[0])
    steps_per_epoch = rows_per_epoch // args.batch_size
    total_steps = steps_per_epoch * epochs
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=args.device == "cuda")

    def lr_at(step: int) -> float:
        if step < args.warmup_steps:
            return args.lr * (step + 1) / args.warmup_steps
        progress = (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    best_loss, best_state, curve, step, t0 = float("inf"), None, [], 0, time.time()
    log(f"run epochs={epochs} dropout={dropout}: {sum(p.numel() for p in model.parameters())} params, "
        f"{steps_per_epoch} steps/epoch x {args.batch_size} x {args.seq_len}")
    for epoch in range(epochs):
        ids, labels = pack(train_docs, args.seq_len, pad, rng)
        ids = torch.from_numpy(ids).to(args.device)
        labels = torch.from_numpy(labels).to(args.device)
        running = []
        for b in range(min(steps_per_epoch, len(ids) // args.batch_size)):
            x = ids[b * args.batch_size:(b + 1) * args.batch_size]
            y = labels[b * args.batch_size:(b + 1) * args.batch_size]
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            with torch.autocast(args.device, dtype=torch.bfloat16,
                                enabled=args.device == "cuda"):
                logits = model(input_ids=x).logits[:, :-1]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                   y[:, 1:].reshape(-1), ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            running.append(loss.detach())
            step += 1
        train_loss = torch.stack(running).mean().item()
        val_loss = mean_loss(model, val_ids, val_labels, args.batch_size, args.device)
        curve.append({"epoch": epoch + 1, "step": step, "lr": lr_at(step - 1),
                      "train_loss": round(train_loss, 4), "val_loss": round(val_loss, 4)})
        log(f"  epoch {epoch + 1:3d} step {step:5d} train {train_loss:.4f} "
            f"val {val_loss:.4f} ({time.time() - t0:.0f}s)")
        if val_loss < best_loss:
            best_loss = val_loss
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        if time.time() > deadline:
            log("  time budget spent: stopping this run early")
            break
    return best_loss, best_state, curve


def train(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    start = time.time()
    deadline = start + args.time_budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / "train.log", "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    torch.backends.cuda.matmul.allow_tf32 = True
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    examples = load_examples(args.data)[:args.max_examples]
    train_ex, val_ex = split_train_val(examples, args.num_val, args.seed)
    rng = np.random.default_rng(args.seed)
    encode = lambda docs: tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]
    train_docs = encode(build_documents(train_ex, rng, augment=True))
    val_docs = encode(build_documents(val_ex, rng, augment=False))
    val_ids, val_labels = pack(val_docs, args.seq_len, tokenizer.pad_token_id, None)
    log(f"train {len(train_ex)} examples -> {len(train_docs)} docs, "
        f"{sum(map(len, train_docs))} tokens; val {len(val_ex)} examples -> "
        f"{int((val_labels != -100).sum())} tokens; device {args.device}")

    runs = []
    for epochs, dropout in args.runs:
        if runs and time.time() + runs[-1]["seconds"] * epochs / runs[-1]["epochs"] > deadline:
            log(f"skip epochs={epochs} dropout={dropout}: would overrun the time budget")
            continue
        t0 = time.time()
        loss, state, curve = train_one(args, tokenizer, train_docs, val_ids, val_labels,
                                       epochs, dropout, deadline, log)
        runs.append({"epochs": epochs, "dropout": dropout, "best_val_loss": loss,
                     "state": state, "curve": curve, "seconds": time.time() - t0})
        log(f"run epochs={epochs} dropout={dropout}: best val loss {loss:.4f} "
            f"in {time.time() - t0:.0f}s")
        if time.time() > deadline:
            break

    best = min(runs, key=lambda r: r["best_val_loss"])
    model = LlamaForCausalLM(build_config(args, tokenizer))
    model.load_state_dict(best["state"])
    model.to(torch.bfloat16).save_pretrained(args.out, max_shard_size=args.max_shard_size)
    generation_config(tokenizer).save_pretrained(args.out)
    summary = {"chosen": {k: best[k] for k in ("epochs", "dropout", "best_val_loss")},
               "runs": [{k: r[k] for k in ("epochs", "dropout", "best_val_loss", "seconds",
                                           "curve")}
                        for r in runs],
               "args": {k: str(v) for k, v in vars(args).items() if k != "func"}}
    log("SUMMARY " + json.dumps(summary))
    log(f"chose epochs={best['epochs']} dropout={best['dropout']} (val loss {best['best_val_loss']:.4f}); "
        f"total {time.time() - start:.0f}s")


# ---------------------------------------------------------------- finalize / evaluate

def finalize(args: argparse.Namespace) -> None:
    """Weights from a train run + the tokenizer -> one self-contained folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.run, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if args.out.exists():
        shutil.rmtree(args.out)
    model.save_pretrained(args.out, max_shard_size="1GB")
    generation_config(tokenizer).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    _patch_tokenizer_config(args.out)
    # Legacy keys so that transformers 4.x and plain-json readers agree.
    path = args.out / "config.json"
    cfg = json.loads(path.read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg["rope_theta"] = 10000.0
    cfg["architectures"] = ["LlamaForCausalLM"]
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    for f in sorted(args.out.iterdir()):
        print(f"{f.stat().st_size:>10d}  {f.name}")


def final_number(text: str) -> str | None:
    m = FINAL_ANSWER.search(text)
    return m.group(1).replace(",", "").rstrip(".") if m else None


def evaluate(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    test = load_examples(args.test)
    gold = [final_number(a) for _, a in test]

    docs = tokenizer(build_documents(test[:args.num_loss], None, augment=False),
                     add_special_tokens=False)["input_ids"]
    ids, labels = pack(docs, 1024, tokenizer.pad_token_id, None)
    print(f"test loss (first {args.num_loss} test questions, both formats): "
          f"{mean_loss(model, ids, labels, 8, 'cpu'):.4f} nats/token")

    def answer(question: str, chat: bool) -> str:
        if chat:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False,
                add_generation_prompt=True)
        else:
            prompt = f"Question: {question}\nAnswer:"
        x = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**x, max_new_tokens=args.max_new_tokens, do_sample=False)
        return tokenizer.decode(out[0, x["input_ids"].shape[1]:], skip_special_tokens=True)

    for i in range(args.num_samples):
        print(f"\n=== test[{i}] {test[i][0]}\n--- gold: {gold[i]}")
        print(f"--- completion ('Question: ...\\nAnswer:'):\n{answer(test[i][0], False)}")
        print(f"--- chat:\n{answer(test[i][0], True)}")

    for chat in (False, True):
        correct = sum(final_number(answer(test[i][0], chat)) == gold[i]
                      for i in range(args.num_accuracy))
        print(f"exact match, {'chat' if chat else 'completion'} format, first "
              f"{args.num_accuracy} test questions: {correct}/{args.num_accuracy} "
              f"= {100 * correct / args.num_accuracy:.1f}%")


# ---------------------------------------------------------------- CLI

def parse_runs(spec: str) -> list[tuple[int, float]]:
    return [(int(e), float(d)) for e, d in (item.split(":") for item in spec.split(","))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(required=True)
    data = Path("../shared/data/gsm8k/train.jsonl")

    t = sub.add_parser("tokenizer", help="train the byte-level BPE (CPU)")
    t.add_argument("--data", type=Path, default=data)
    t.add_argument("--out", type=Path, default=Path("scripts/_tok"))
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--max-position-embeddings", type=int, default=1024)
    t.set_defaults(func=train_tokenizer)

    r = sub.add_parser("train", help="train the model (one CUDA GPU)")
    r.add_argument("--data", type=Path, default=data)
    r.add_argument("--tokenizer", type=Path, default=Path("scripts/_tok"))
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="cuda")
    r.add_argument("--max-examples", type=int, default=None, help="smoke tests only")
    r.add_argument("--num-val", type=int, default=300, help="train examples held out")
    r.add_argument("--hidden-size", type=int, default=512)
    r.add_argument("--intermediate-size", type=int, default=1344)
    r.add_argument("--num-layers", type=int, default=6)
    r.add_argument("--num-heads", type=int, default=8)
    r.add_argument("--num-kv-heads", type=int, default=4)
    r.add_argument("--max-position-embeddings", type=int, default=1024)
    r.add_argument("--seq-len", type=int, default=1024)
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--weight-decay", type=float, default=0.1)
    r.add_argument("--warmup-steps", type=int, default=100)
    r.add_argument("--runs", type=parse_runs, default=parse_runs("16:0.3,24:0.4,12:0.2,8:0.1"),
                   help="EPOCHS:DROPOUT,... one from-scratch run each, in this order; "
                        "the epoch with the lowest val loss over all runs is kept")
    r.add_argument("--time-budget-s", type=float, default=400.0)
    r.add_argument("--max-shard-size", default="15MB",
                   help="shards small enough to come back from the GPU machine")
    r.set_defaults(func=train)

    f = sub.add_parser("finalize", help="tokenizer + weights -> one folder (CPU)")
    f.add_argument("--run", type=Path, required=True)
    f.add_argument("--tokenizer", type=Path, default=Path("scripts/_tok"))
    f.add_argument("--out", type=Path, default=Path("engine/default_model"))
    f.set_defaults(func=finalize)

    e = sub.add_parser("evaluate", help="samples, test loss, exact match (CPU)")
    e.add_argument("--model", type=Path, default=Path("engine/default_model"))
    e.add_argument("--test", type=Path, default=Path("../shared/data/gsm8k/test.jsonl"))
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--num-samples", type=int, default=3)
    e.add_argument("--num-accuracy", type=int, default=50)
    e.add_argument("--num-loss", type=int, default=300)
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.set_defaults(func=evaluate)

    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
