#!/bin/sh
# tools/data/tokenize_data.py --chat against transformers itself: the conversations of
# tests/fixtures/chat/chat.jsonl must give, id for id, what transformers' apply_chat_template
# (tokenize=True) gave for them, and the loss mask its return_assistant_tokens_mask gave
# (tools/fixtures/make_chat_fixtures.py made the fixture, transformers.json); and the template
# with those tokens marked by {% generation %} gives the same file. Exits 77 (skipped)
# without the Python packages tokenizers and jinja2.
# Usage: chat_fixture.sh TOKENIZE_DATA_PY FIXTURE_DIR
set -u
tool=$1 fixture=$2
if ! python3 -c "import tokenizers, jinja2" 2>/dev/null; then
  echo "SKIP: the Python packages 'tokenizers' and 'jinja2' cannot be imported"
  exit 77
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$tool" --tokenizer "$fixture/tokenizer.json" --chat --out "$work/chat.bin" \
  "$fixture/chat.jsonl" || { echo "FAIL tokenize_data.py --chat"; exit 1; }
python3 - "$work/chat.bin" "$fixture/transformers.json" <<'PY'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
want = json.load(open(sys.argv[2]))
magic, version, count, flags = struct.unpack("<4i", data[:16])
assert (magic, version, flags) == (20240520, 1, 1), (magic, version, flags)
ids = list(struct.unpack(f"<{count}H", data[1024:1024 + 2 * count]))
mask = list(data[1024 + 2 * count:])
at = 0
for k, record in enumerate(want["records"]):
    n = len(record["ids"])
    got_ids, got_mask = ids[at:at + n], mask[at:at + n]
    assert got_ids == record["ids"], f"conversation {k}: ids differ\n got  {got_ids}\n want {record['ids']}"
    trained = [m & 1 for m in got_mask]
    assert trained == record["assistant_masks"], (
        f"conversation {k}: loss mask differs\n got  {trained}\n want {record['assistant_masks']}")
    starts = [m >> 1 & 1 for m in got_mask]
    assert starts == [1] + [0] * (n - 1), f"conversation {k}: document starts {starts}"
    at += n
assert at == count, f"{count} ids written, transformers gave {at}"
print(f"{len(want['records'])} conversations, {count} ids and {sum(m & 1 for m in mask)} trained "
      f"tokens as transformers {want['transformers']} gave them")
PY
[ $? = 0 ] || exit 1

# The same template with the assistant's tokens marked by {% generation %} (as transformers'
# return_assistant_tokens_mask wants it) renders the same: the same file, byte for byte.
mkdir "$work/marked"
cp "$fixture/tokenizer.json" "$work/marked/"
python3 - "$fixture/tokenizer_config.json" "$work/marked/tokenizer_config.json" <<'PY' || exit 1
import json, sys
config = json.load(open(sys.argv[1]))
turn = "{{- message.content + '<|im_end|>\\n' }}"
assert config["chat_template"].count(turn) == 1, "the fixture's template changed"
# It is the assistant's turn (the other roles' turns are written in one piece).
config["chat_template"] = config["chat_template"].replace(
    turn, "{% generation %}" + turn + "{% endgeneration %}")
json.dump(config, open(sys.argv[2], "w"))
PY
python3 "$tool" --tokenizer "$work/marked/tokenizer.json" --chat --out "$work/marked.bin" \
  "$fixture/chat.jsonl" || { echo "FAIL --chat with a {% generation %} template"; exit 1; }
cmp "$work/chat.bin" "$work/marked.bin" || { echo "FAIL a {% generation %} template gives another file"; exit 1; }
echo "ok   a {% generation %} template gives the same file"
