#!/usr/bin/env python3
"""The Hugging Face round trip as a transformers user meets it (docs/models.md): a model folder
with a real tokenizer goes in, ShardSwap trains it, `ckpt export --format hf` writes a folder,
and transformers' AutoTokenizer, chat template, from_pretrained and generate() work on that
folder as on the source.

    python3 hf_roundtrip_check.py make FOLDER TEXT [llama|qwen3]
        writes FOLDER: a tiny random Llama (or Qwen3: q/k norms, head_dim apart from hidden /
        heads) saved by transformers (bos/eos/pad ids set), with a byte-level BPE tokenizer
        trained on TEXT (tokenizers), a chat template and a generation_config.json
    python3 hf_roundtrip_check.py chats TEXT OUT
        writes OUT: chat JSON lines, each a user turn and an assistant turn taken from TEXT's
        non-empty lines, for tokenize_data.py --chat
    python3 hf_roundtrip_check.py check SOURCE EXPORT
        the export against the source: the tokenizer encodes a text and renders a chat alike,
        the token ids and generation config agree, and generate() runs from the export

Needs torch, transformers and tokenizers; runs on the CPU (no GPU needed). Exit 0 when every
check holds, 1 naming the first that does not.
"""
import json
import os
import sys

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What does the licence say about warranty?"}]
TEXT = "This program is distributed in the hope that it will be useful."


def make(folder, text_file, family="llama"):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config,
                              Qwen3ForCausalLM)

    special = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([text_file], trainers.BpeTrainer(vocab_size=512, special_tokens=special,
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    fields = dict(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=fast.bos_token_id,
                  eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
                  tie_word_embeddings=False)
    if family == "qwen3":
        config = Qwen3Config(head_dim=32, attention_bias=False, use_sliding_window=False, **fields)
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    else:
        model = LlamaForCausalLM(LlamaConfig(**fields)).to(torch.bfloat16)
    model.generation_config.max_new_tokens = 16
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    print(f"made {folder}: {sorted(os.listdir(folder))}, vocab {len(fast)}")


def check(source, export):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    failures = []

    def expect(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    theirs, ours = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(export)
    expect(len(ours) == len(theirs) and len(ours) > 256, f"AutoTokenizer: {len(ours)} tokens")
    expect(ours(TEXT).input_ids == theirs(TEXT).input_ids, "a text encodes to the same ids")
    chat = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expect(chat == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
           and chat.endswith("<|assistant|>"), f"the chat template renders alike: {chat!r}")
    src_config = json.load(open(os.path.join(source, "config.json")))
    exp_config = json.load(open(os.path.join(export, "config.json")))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        expect(exp_config.get(key) == src_config.get(key),
               f"config.json {key} = {exp_config.get(key)} (source {src_config.get(key)})")
    gen = GenerationConfig.from_pretrained(export)
    expect(gen.eos_token_id == src_config["eos_token_id"], f"generation_config eos {gen.eos_token_id}")
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = ours.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                   return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:]
    expect(0 < new.numel() <= 8, f"generate(): {new.numel()} new tokens {ours.decode(new)!r}")
    return 1 if failures else 0


def chats(text_file, out):
    lines = [l.strip() for l in open(text_file, encoding="utf-8") if l.strip()]
    with open(out, "w", encoding="utf-8") as f:
        for question, answer in zip(lines[0::2], lines[1::2]):
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    print(f"wrote {out}: {len(lines) // 2} conversations")


def main(argv):
    if len(argv) in (4, 5) and argv[1] == "make":
        make(argv[2], argv[3], argv[4] if len(argv) == 5 else "llama")
        return 0
    if len(argv) == 4 and argv[1] == "chats":
        chats(argv[2], argv[3])
        return 0
    if len(argv) == 4 and argv[1] == "check":
        return check(argv[2], argv[3])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
