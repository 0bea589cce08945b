#!/bin/sh
# tools/data/tokenize_data.py --chat: chat JSON lines (messages; prompt and completion as strings
# and as messages) rendered with the chat template of tokenizer_config.json, written with a loss
# mask; read back by an independent reader, the ids compared with tokenizer.encode of the text
# rendered here with jinja2 and the mask with the assistant's spans found here by search; the
# whole text with --loss-on all; --eos after each conversation, trained after a trained end (a
# prompt/completion pair's); bad records and a missing template exit 2 naming them, writing
# nothing. Exits 77 (skipped) without the Python packages tokenizers and jinja2.
# Usage: chat_tool.sh TOKENIZE_DATA_PY
set -u
tool=$1
if ! python3 -c "import tokenizers, jinja2" 2>/dev/null; then
  echo "SKIP: the Python packages 'tokenizers' and 'jinja2' cannot be imported"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL $*"; exit 1; }

python3 - "$work" <<'PY' || fail "could not build the tokenizer"
import json, sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
work = sys.argv[1]
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(["hello there, how are you?", "the answer is four", "two plus two"],
                        trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                            special_tokens=["<unk>", "</s>", "<|system|>",
                                                            "<|user|>", "<|assistant|>"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.save(f"{work}/tokenizer.json")
template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
json.dump({"eos_token": {"content": "</s>"}, "chat_template": template},
          open(f"{work}/tokenizer_config.json", "w"))
lines = [
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "what is two plus two?"},
                  {"role": "assistant", "content": "four"},
                  {"role": "user", "content": "and three plus one? "},
                  {"role": "assistant", "content": "the answer is four"}]},
    {"prompt": "two plus two is", "completion": " four"},
    {"prompt": [{"role": "user", "content": "hello there"}],
     "completion": [{"role": "assistant", "content": "how are you?"}]},
]
with open(f"{work}/chat.jsonl", "w") as f:
    for line in lines:
        f.write(json.dumps(line) + "\n\n")
PY

# check OUT LOSS_ON: the file against the records rendered and searched here.
check() {
  python3 - "$work" "$@" <<'PY'
import json, struct, sys
import jinja2
from tokenizers import Tokenizer
work, out, loss_on = sys.argv[1], sys.argv[2], sys.argv[3]
with_eos = len(sys.argv) > 4  # --eos: </s> after each conversation, trained after a trained end
t = Tokenizer.from_file(f"{work}/tokenizer.json")
config = json.load(open(f"{work}/tokenizer_config.json"))
env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
template = env.from_string(config["chat_template"])
want_ids, want_mask = [], []
for line in open(f"{work}/chat.jsonl"):
    if not line.strip():
        continue
    r = json.loads(line)
    if "messages" in r:
        text = template.render(messages=r["messages"], add_generation_prompt=False, eos_token="</s>")
        spans, at = [], 0
        for m in r["messages"]:
            piece = f"<|{m['role']}|>{m['content'].strip()}</s>"
            at = text.index(piece, at)
            if m["role"] == "assistant":
                head = len(f"<|{m['role']}|>")
                spans.append((at + head, at + len(piece)))
            at += len(piece)
    elif isinstance(r["prompt"], str):
        text = r["prompt"] + r["completion"]
        spans = [(len(r["prompt"]), len(text))]
    else:
        messages = r["prompt"] + r["completion"]
        text = template.render(messages=messages, add_generation_prompt=False, eos_token="</s>")
        prompt = template.render(messages=r["prompt"], add_generation_prompt=True, eos_token="</s>")
        assert text.startswith(prompt)
        spans = [(len(prompt), len(text))]
    e = t.encode(text, add_special_tokens=False)
    mask = [1 if loss_on == "all" or any(s < b and end > a for a, b in spans) else 0
            for s, end in e.offsets]
    if mask:
        mask[0] |= 2
    want_ids += e.ids
    want_mask += mask
    if with_eos:
        want_ids.append(t.token_to_id("</s>"))
        want_mask.append(1 if mask and mask[-1] & 1 else 0)
data = open(out, "rb").read()
magic, version, count, flags = struct.unpack("<4i", data[:16])
assert (magic, version, flags) == (20240520, 1, 1), (magic, version, flags)
assert data[16:1024] == bytes(1008), "header not zero after the flags"
assert len(data) == 1024 + 3 * count, (len(data), count)
ids = list(struct.unpack(f"<{count}H", data[1024:1024 + 2 * count]))
mask = list(data[1024 + 2 * count:])
assert ids == want_ids, f"ids differ:\n got  {ids}\n want {want_ids}"
assert mask == want_mask, f"masks differ:\n got  {mask}\n want {want_mask}"
trained = sum(m & 1 for m in mask)
assert 0 < trained < count or loss_on == "all", trained
print(f"{out}: {count} ids, {trained} trained ({loss_on}), as rendered and searched here")
PY
}

python3 "$tool" --tokenizer "$work/tokenizer.json" --chat --out "$work/chat.bin" "$work/chat.jsonl" ||
  fail "--chat"
check "$work/chat.bin" assistant || fail "--chat's file"
python3 "$tool" --tokenizer "$work/tokenizer.json" --chat --loss-on all --out "$work/all.bin" \
  "$work/chat.jsonl" || fail "--chat --loss-on all"
check "$work/all.bin" all || fail "--loss-on all's file"
python3 "$tool" --tokenizer "$work/tokenizer.json" --chat --eos --out "$work/eos.bin" \
  "$work/chat.jsonl" || fail "--chat --eos"
check "$work/eos.bin" assistant eos || fail "--chat --eos's file"

# Bad input: exit 2, the file and line named, nothing written.
refused() {  # WHAT EXPECTED-TEXT ARGS...
  what=$1 expected=$2
  shift 2
  out=$(python3 "$tool" --tokenizer "$work/tokenizer.json" --chat --out "$work/bad.bin" "$@" 2>&1)
  rc=$?
  [ "$rc" = 2 ] || fail "$what: exit $rc, expected 2: $out"
  case $out in *"$expected"*) ;; *) fail "$what: '$out' does not say '$expected'" ;; esac
  [ ! -e "$work/bad.bin" ] || fail "$what: wrote $work/bad.bin"
  echo "ok   $what: $out"
}
printf '{"text": "no chat here"}\n' > "$work/text.jsonl"
refused "a record without messages" "text.jsonl line 1: neither 'messages' nor" "$work/text.jsonl"
printf '{"messages": [{"role": "user"}]}\n' > "$work/nocontent.jsonl"
refused "a message without content" "messages[0] is not an object" "$work/nocontent.jsonl"
printf '{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}\n' > "$work/mixed.jsonl"
refused "a prompt and a completion of two kinds" "two strings or two lists" "$work/mixed.jsonl"
mkdir "$work/plain"
cp "$work/tokenizer.json" "$work/plain/"
out=$(python3 "$tool" --tokenizer "$work/plain/tokenizer.json" --chat --out "$work/bad.bin" \
  "$work/chat.jsonl" 2>&1)
[ $? = 2 ] && case $out in *"no chat template"*) true ;; *) false ;; esac ||
  fail "a folder without a chat template: $out"
echo "ok   a folder without a chat template: $out"
echo "chat_tool.sh: all checks passed"
