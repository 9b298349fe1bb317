"""A random tiny Llama for `make test-vllm`: vLLM runs it on CPU, so its answers are random but its serving path
(chat template, tokenizer, JSON-schema structured output, sampling seeds) is the real one.

Run with the vLLM venv's python (it has transformers, tokenizers and torch):
    $VLLM_VENV/bin/python tests/real_vllm/tiny_llama.py --captions data/sample/annotations/captions_train.json --out DIR

Writes a Hugging Face model folder: config.json + model.safetensors (LlamaForCausalLM, random init, fp32),
a byte-level BPE tokenizer trained on the captions and on the DeGLA few-shot bank (so the stage's prompts stay
well inside --max-model-len 1024), and a chat template. Sizes: vLLM's CPU attention needs head_dim 64.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FEWSHOT = REPO / "clipfinetune/data/negatives/degla/fewshot/degla.json"
SPECIAL = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def corpus(captions: Path) -> list[str]:
    texts = [a["caption"] for a in json.loads(captions.read_text())["annotations"]]
    for entry in json.loads(FEWSHOT.read_text())["types"].values():
        texts.append(entry.get("rule", ""))
        texts += [f"{e['input']} {e['output']}" for e in entry["examples"]]
    return texts


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=SPECIAL[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, seed: int):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("</s>", "<|end|>")]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captions", type=Path, required=True, help="COCO captions JSON (the tokenizer's corpus)")
    ap.add_argument("--out", type=Path, required=True, help="model folder to write")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tokenizer = build_tokenizer(corpus(args.captions), args.vocab_size)
    model = build_model(tokenizer, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny Llama: {n} parameters, vocab {len(tokenizer)} -> {args.out}")


if __name__ == "__main__":
    main()
