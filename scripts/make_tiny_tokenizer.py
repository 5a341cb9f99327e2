#!/usr/bin/env python3
"""Trains the tiny test model's tokenizer from text the repository ships.

The tiny models in tests/models have random (dummy) weights, so what they
generate is noise, but the text path around them is real: `vllm serve
tests/models/tiny-llama` starts offline and tokenizes, renders chats and
detokenizes with these files, and the frontend does the same with its own
tokenizer library; tests compare the two.

Contract: writes tokenizer.json (a byte-level BPE trained with Hugging
Face `tokenizers` on README.md and docs/*.md, vocabulary --vocab tokens, at
most the model's vocab_size, special tokens <unk> <s> </s> <|im_start|>
<|im_end|> at ids 0-4, <s> prepended by the post-processor) and
tokenizer_config.json (bos/eos/unk tokens and a ChatML chat template) into
--out. Training is deterministic for the same text.

Example: build/venv/bin/python scripts/make_tiny_tokenizer.py \
    --out tests/models/tiny-llama
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# ChatML: each message between <|im_start|>role and <|im_end|>; the
# generation prompt opens the assistant's turn. Content parts are flattened
# to text by the server before the template sees them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{{ message['content'] | trim + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus(root: Path) -> list[str]:
    """The repository's prose: README.md and docs/*.md, in a fixed order."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return [f.read_text(encoding="utf-8") for f in files]


def train(texts: list[str], vocab: int) -> Tokenizer:
    """A byte-level BPE of `vocab` tokens (specials first) over `texts`."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def main() -> None:
    """Writes the tokenizer files for the model in --out."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the model's directory")
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    config = json.loads((args.out / "config.json").read_text())
    if args.vocab > config["vocab_size"]:
        raise SystemExit(
            f"--vocab {args.vocab} exceeds the model's {config['vocab_size']}"
        )
    tok = train(corpus(root), args.vocab)
    for i, name in enumerate(SPECIAL):
        if tok.token_to_id(name) != i:
            raise SystemExit(f"{name} is not id {i}")
    if config.get("bos_token_id") != 1 or config.get("eos_token_id") != 2:
        raise SystemExit("config.json's bos/eos ids are not <s>=1 and </s>=2")
    tok.save(str(args.out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    print(
        f"wrote {args.out}/tokenizer.json ({tok.get_vocab_size()} tokens)"
        " and tokenizer_config.json"
    )


if __name__ == "__main__":
    main()
