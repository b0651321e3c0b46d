#!/usr/bin/env python3
"""Make a tiny Qwen3-architecture model folder that vLLM can serve with --load-format dummy.

No weights can be downloaded on an air-gapped or CI machine, so the CPU path serves a model
made here: a config.json for a 2-layer Qwen3 and a byte-level BPE tokenizer trained on local
text. The weights are random (vLLM's dummy loader), so the text it writes is gibberish, but
token counts, timings, streaming and every vllm: metric are real.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-style ChatML template, so /v1/chat/completions works like a real instruct model.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def model_config(
    vocab_size: int, hidden_size: int, layers: int, heads: int, kv_heads: int, head_dim: int, max_positions: int
) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
    }


def corpus_files(corpus_dir: Path) -> list[str]:
    files = sorted(str(p) for p in corpus_dir.rglob("*.py") if p.is_file())
    if not files:
        raise ValueError(f"no .py files under {corpus_dir} to train the tokenizer on")
    return files


def train_tokenizer(files: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    tokenizer = pad_vocabulary(tokenizer, vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )


def pad_vocabulary(tokenizer, vocab_size: int):
    """Fill the BPE vocabulary up to vocab_size with tokens no text produces: a small corpus learns
    fewer merges than a real model's vocabulary (Qwen3's 151,936) and vLLM wants the tokenizer to
    cover the embedding. Plain vocabulary entries, not added tokens, so tokenizing stays as fast."""
    from tokenizers import Tokenizer

    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    next_id = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens") or [])]) + 1
    if next_id >= vocab_size:
        return tokenizer
    vocab.update({f"<|reserved_{i}|>": i for i in range(next_id, vocab_size)})
    return Tokenizer.from_str(json.dumps(data))


def make_model(out: Path, corpus_dir: Path, vocab_size: int, **arch) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_files(corpus_dir), vocab_size)
    tokenizer.save_pretrained(out)
    # The embedding must cover every token id the tokenizer can produce.
    config = model_config(vocab_size=max(vocab_size, len(tokenizer)), **arch)
    config["eos_token_id"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config["bos_token_id"] = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config["pad_token_id"] = config["bos_token_id"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the model into")
    parser.add_argument(
        "--corpus",
        type=Path,
        default=Path(sys.prefix) / "lib",
        help="folder whose .py files train the tokenizer (default: %(default)s)",
    )
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--max-positions", type=int, default=40960)
    args = parser.parse_args(argv)
    for name in ("vocab_size", "hidden_size", "layers", "heads", "kv_heads", "head_dim", "max_positions"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.heads % args.kv_heads:
        parser.error("--heads must be a multiple of --kv-heads (grouped-query attention)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = make_model(
            args.out,
            args.corpus,
            args.vocab_size,
            hidden_size=args.hidden_size,
            layers=args.layers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            max_positions=args.max_positions,
        )
    except (OSError, ValueError) as err:
        print(f"make_tiny_model: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {config['num_hidden_layers']} layers, vocab {config['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
