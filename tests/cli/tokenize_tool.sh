#!/bin/sh
# tools/data/tokenize_data.py with tokenizers trained here (a BPE on a few lines, with an EOS among its
# special tokens, and a WordLevel of 70000 words for uint32 ids): a text file and a JSON lines
# file tokenized, with the EOS between documents, read back by an independent reader of llm.c's
# header and compared id for id with tokenizer.encode; bad input exits 2 naming the file and
# line, writing nothing. Exits 77 (skipped) when the Python package tokenizers is missing.
# Usage: tokenize_tool.sh TOKENIZE_DATA_PY
set -u
tool=$1
if ! python3 -c "import tokenizers" 2>/dev/null; then
  echo "SKIP: the Python package 'tokenizers' cannot be imported (pip install tokenizers)"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL $*"; exit 1; }

cat > "$work/a.txt" <<'EOF'
The quick brown fox jumps over the lazy dog.
Sharded optimizers keep one slice of the state per rank.
EOF
printf 'A second document, without a final newline: \303\251t\303\251' > "$work/b.txt"
cat > "$work/docs.jsonl" <<'EOF'
{"text": "first record of the lines", "id": 1}

{"text": "second record, after an empty line", "id": 2}
{"id": 3, "text": "third"}
EOF

python3 - "$work" <<'EOF' || fail "could not build the tokenizers"
import sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
work = sys.argv[1]
bpe = Tokenizer(models.BPE(unk_token="<unk>"))
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              show_progress=False)
bpe.train_from_iterator(["the quick brown fox", "sharded optimizer state per rank",
                         "records of lines"], trainer=trainer)
bpe.save(f"{work}/bpe.json")
# Ids above 65535: a word list of 70000 words, each word its own id.
words = {f"w{i}": i for i in range(70000)}
words["[UNK]"] = 70000
wide = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
wide.pre_tokenizer = pre_tokenizers.Whitespace()
wide.save(f"{work}/wide.json")
with open(f"{work}/wide.txt", "w") as f:
    f.write("w0 w65535 w65536 w69999 unknown w12345")
EOF

# check OUT TOKENIZER EOS_ID_OR_NONE JSONL(0/1) INPUT...: the file as an independent reader sees
# it equals the documents encoded one by one, the EOS id between them.
check() {
  python3 - "$@" <<'EOF'
import json, struct, sys
from tokenizers import Tokenizer
out, tok, eos, jsonl, inputs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5:]
t = Tokenizer.from_file(tok)
docs = []
for path in inputs:
    text = open(path, encoding="utf-8").read()
    docs += [json.loads(l)["text"] for l in text.splitlines() if l.strip()] if jsonl else [text]
want = []
for i, d in enumerate(docs):
    if i > 0 and eos != "none":
        want.append(int(eos))
    want += t.encode(d).ids
data = open(out, "rb").read()
magic, version, count = struct.unpack("<3i", data[:12])
width = {1: 2, 2: 4}[version]
assert magic == 20240520, magic
assert data[12:1024] == bytes(1012), "header not zero after the count"
assert version == (1 if t.get_vocab_size() <= 65536 else 2), (version, t.get_vocab_size())
assert len(data) == 1024 + count * width, (len(data), count)
got = list(struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", data[1024:]))
assert got == want, f"ids differ:\n got  {got[:40]}\n want {want[:40]}"
print(f"{out}: version {version}, {count} ids as encoded")
EOF
}

bpe=$work/bpe.json
eos=$(python3 -c "from tokenizers import Tokenizer; print(Tokenizer.from_file('$bpe').token_to_id('<|endoftext|>'))")
python3 "$tool" --tokenizer "$bpe" --out "$work/text.bin" --eos "$work/a.txt" "$work/b.txt" ||
  fail "text with --eos"
check "$work/text.bin" "$bpe" "$eos" 0 "$work/a.txt" "$work/b.txt" || fail "text.bin"
python3 "$tool" --tokenizer "$bpe" --out "$work/lines.bin" --jsonl --eos-id 7 "$work/docs.jsonl" ||
  fail "jsonl with --eos-id"
check "$work/lines.bin" "$bpe" 7 1 "$work/docs.jsonl" || fail "lines.bin"
python3 "$tool" --tokenizer "$bpe" --out "$work/plain.bin" "$work/a.txt" "$work/b.txt" ||
  fail "text without eos"
check "$work/plain.bin" "$bpe" none 0 "$work/a.txt" "$work/b.txt" || fail "plain.bin"
# --eos reads the EOS token from a tokenizer_config.json beside tokenizer.json when there is one.
mkdir "$work/model"
cp "$bpe" "$work/model/tokenizer.json"
echo '{"eos_token": {"content": "<unk>", "special": true}}' > "$work/model/tokenizer_config.json"
python3 "$tool" --tokenizer "$work/model/tokenizer.json" --out "$work/config-eos.bin" --eos \
  "$work/a.txt" "$work/b.txt" | grep -q "EOS 0 between" || fail "--eos did not take tokenizer_config.json's eos_token"
check "$work/config-eos.bin" "$bpe" 0 0 "$work/a.txt" "$work/b.txt" || fail "config-eos.bin"
python3 "$tool" --tokenizer "$work/wide.json" --out "$work/wide.bin" "$work/wide.txt" ||
  fail "a vocab above 65536"
check "$work/wide.bin" "$work/wide.json" none 0 "$work/wide.txt" || fail "wide.bin"
python3 -c "import struct,sys; v=struct.unpack('<3i', open(sys.argv[1],'rb').read(12)); assert v[1]==2 and v[2]==6, v" \
  "$work/wide.bin" || fail "wide.bin is not version 2 with 6 ids"

# Bad input: exit 2, the file (and line) named, nothing written.
refused() {  # PATTERN ARGS...: the tool must exit 2 with PATTERN in its message
  pattern=$1
  shift
  msg=$(python3 "$tool" "$@" 2>&1)
  rc=$?
  [ $rc -eq 2 ] || fail "exit $rc (expected 2) for $*: $msg"
  echo "$msg" | grep -qF -- "$pattern" || fail "message lacks '$pattern': $msg"
  echo "refused: $msg"
}
printf '{"text": "ok"}\n{"body": "no text field"}\n' > "$work/bad.jsonl"
refused "bad.jsonl line 2: no field 'text'" --tokenizer "$bpe" --out "$work/bad.bin" --jsonl "$work/bad.jsonl"
printf 'not utf-8: \377\n' > "$work/latin.txt"
refused "latin.txt: not UTF-8" --tokenizer "$bpe" --out "$work/bad.bin" "$work/latin.txt"
printf '{"text": "ok"}\n{"text": "caf\351"}\n' > "$work/latin.jsonl"
refused "latin.jsonl line 2: not UTF-8" --tokenizer "$bpe" --out "$work/bad.bin" --jsonl "$work/latin.jsonl"
printf '{"text": "ok"}\n{"text": 3}\n' > "$work/number.jsonl"
refused "number.jsonl line 2: field 'text' is not a string" --tokenizer "$bpe" --out "$work/bad.bin" --jsonl "$work/number.jsonl"
refused "--eos-id 300: not below the vocab size 300" --tokenizer "$bpe" --out "$work/bad.bin" --eos-id 300 "$work/a.txt"
refused "cannot tell the EOS token" --tokenizer "$work/wide.json" --out "$work/bad.bin" --eos "$work/wide.txt"
refused "is the input" --tokenizer "$bpe" --out "$work/a.txt" "$work/a.txt"
[ ! -e "$work/bad.bin" ] || fail "a refused run left bad.bin"
ls "$work" | grep -q '\.tmp$' && fail "a refused run left a temporary: $(ls "$work")"
# A refused run over an existing output leaves it as it was.
cp "$work/text.bin" "$work/keep.bin"
refused "bad.jsonl line 2" --tokenizer "$bpe" --out "$work/text.bin" --jsonl "$work/bad.jsonl"
cmp -s "$work/text.bin" "$work/keep.bin" || fail "a refused run changed text.bin"
echo "tokenize_data.py: all checks passed"
