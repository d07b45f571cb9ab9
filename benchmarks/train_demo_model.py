"""Train genq's demo model: a tiny Llama on the Python standard library's own sources, on the CPU.

The text ships with every Python (``sysconfig.get_paths()["stdlib"]``), so nothing is downloaded.
Steps: collect ASCII .py files (tests and vendored packages left out), train a byte-level BPE
tokenizer on them with ``tokenizers``, pack the token stream into fixed windows, train a
``LlamaForCausalLM`` with AdamW for a fixed wall-clock budget (the learning-rate schedule follows
the elapsed fraction of that budget), then save a Hugging Face directory (config.json,
model.safetensors, tokenizer files) that transformers and genq's loader both read.

    .venv/bin/python -m benchmarks.train_demo_model --minutes 8

One thread by default: the machines this runs on are shared. The defaults are sized for that
budget (hidden 128, 4 layers, 4 heads / 2 KV heads, 1.25M parameters): in 8 minutes on a busy
shared core a 4M-parameter variant (hidden 256) only reached loss 5.4, this one 5.0. The wall-clock
budget makes the result depend on the machine's load; the committed model is one such run
(training.json), at models/genq-tiny-stdlib/, and must stay under 20 MB.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "models" / "genq-tiny-stdlib"
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2
# A chat as Python comments, the assistant's turn opening a `def`: a model trained on Python
# source answers with Python-shaped text rather than newlines.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}# {{ m['role'] }}: "
                 "{{ m['content'] | replace('\\n', '\\n# ') }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\ndef{% endif %}")
BOS, EOS, PAD = SPECIAL_TOKENS
# Directories of the standard library that are not ordinary library code (tests, vendored or
# generated modules, data tables): they would teach the model fixtures and byte strings.
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "encodings",
             "turtledemo", "ensurepip", "pydoc_data"}
MAX_FILE_BYTES = 200_000


def stdlib_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        dirs = rel.parts[:-1]
        if SKIP_DIRS.intersection(dirs) or any(d.startswith("config-") for d in dirs):
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        files.append(path)
    return files


def read_ascii(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if not text.isascii() or not text.strip() or text.count("\\") > len(text) // 100:
        return None  # non-ASCII, empty, or escape tables (html.entities, stringprep, ...)
    return text


def load_corpus(root: Path, seed: int) -> tuple[list[str], list[str]]:
    """(train documents, held-out documents): one document per file, every 50th file held out."""
    docs = [t for t in map(read_ascii, stdlib_files(root)) if t is not None]
    random.Random(seed).shuffle(docs)
    held_out = docs[::50]
    train = [d for i, d in enumerate(docs) if i % 50]
    return train, held_out


def train_tokenizer(docs: list[str], vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Like Llama's tokenizer: encoding a prompt prepends <s>, the token every document starts with.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, model_max_length=512)


def token_stream(tokenizer, docs: list[str]):  # -> torch.LongTensor
    """All documents as one stream: <s> doc </s> <s> doc </s> ..."""
    import torch

    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for enc in tokenizer.backend_tokenizer.encode_batch(docs):
        ids.extend(enc.ids)  # starts with <s> (post-processor)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def model_config(vocab_size: int, args: argparse.Namespace):  # -> LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def batches(stream, seq_len: int, batch_size: int, seed: int) -> Iterator:
    """Random windows of seq_len tokens from the stream, forever (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    num_starts = len(stream) - seq_len
    while True:
        starts = torch.randint(0, num_starts, (batch_size,), generator=gen)
        yield torch.stack([stream[s:s + seq_len] for s in starts.tolist()])


def lr_at(progress: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to floor * peak, over the fraction of the time budget."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t)))


def evaluate(model, stream, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss over consecutive windows of a held-out stream."""
    import torch

    n = min(max_windows, (len(stream) - 1) // seq_len)
    windows = stream[: n * seq_len].view(n, seq_len)
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=windows[i:i + 8], labels=windows[i:i + 8]).loss.item()
                  for i in range(0, n, 8)]
    model.train()
    return sum(losses) / len(losses)


def train(model, stream, args: argparse.Namespace) -> tuple[int, float]:
    import torch
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    budget = args.minutes * 60.0
    start = time.monotonic()
    step, ema = 0, None
    bar = tqdm(total=int(budget), unit="s", desc="training", bar_format=(
        "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}s [{elapsed}<{remaining}{postfix}]"))
    for batch in batches(stream, args.seq_len, args.batch_size, args.seed):
        progress = (time.monotonic() - start) / budget
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, args.lr)
        loss = model(input_ids=batch, labels=batch).loss  # the model shifts the labels
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(step=step, loss=f"{ema:.3f}", refresh=False)
        bar.update(min(int(budget), int(time.monotonic() - start)) - bar.n)
    bar.close()
    return step, float(ema or float("nan"))


def sample(model, tokenizer, prompt: str, max_new_tokens: int = 48) -> str:
    import torch

    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=344)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # the tokenizers pool
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    root = Path(sysconfig.get_paths()["stdlib"])
    t0 = time.monotonic()
    train_docs, held_out = load_corpus(root, args.seed)
    tokenizer = train_tokenizer(train_docs, args.vocab_size)
    stream, held_stream = token_stream(tokenizer, train_docs), token_stream(tokenizer, held_out)
    print(f"corpus: {len(train_docs)} files from {root} -> {len(stream):,} tokens "
          f"(held out: {len(held_out)} files, {len(held_stream):,} tokens); "
          f"tokenizer: {len(tokenizer)} tokens in {time.monotonic() - t0:.0f}s")

    model = LlamaForCausalLM(model_config(len(tokenizer), args))
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters")
    steps, train_loss = train(model, stream, args)
    val_loss = evaluate(model, held_stream, args.seq_len)
    tokens_seen = steps * args.batch_size * args.seq_len
    print(f"trained {steps} steps ({tokens_seen:,} tokens) in {args.minutes:g} min: "
          f"train loss {train_loss:.3f}, held-out loss {val_loss:.3f}")

    model.generation_config.pad_token_id = tokenizer.pad_token_id
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out))  # float32, model.safetensors
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(args.out))
    meta = {"python": sysconfig.get_python_version(), "files": len(train_docs),
            "tokens": len(stream), "steps": steps, "tokens_seen": tokens_seen,
            "minutes": args.minutes, "train_loss": round(train_loss, 4),
            "held_out_loss": round(val_loss, 4)}
    (args.out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"saved {args.out} ({dir_size(args.out) / 1e6:.1f} MB)")
    for prompt in ("import ", "def ", "class "):
        print(f"--- {prompt!r} (greedy)\n{sample(model, tokenizer, prompt)}")


if __name__ == "__main__":
    main()
