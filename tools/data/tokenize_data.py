#!/usr/bin/env python3
"""Token files for `shardswap train` (docs/data.md) from text or JSON lines, with a model's
Hugging Face tokenizer.json.

usage: tokenize_data.py --tokenizer tokenizer.json --out OUT.bin [--eos | --eos-id N]
                        [--jsonl [--field text]] [--no-special-tokens] INPUT...

Each text INPUT is one document; with --jsonl each non-empty line of each INPUT is a JSON object
and its --field (default "text") is one document. Documents are encoded with the tokenizer as it
encodes by default (its post-processor may add e.g. a BOS token; --no-special-tokens leaves that
out) and written in order, in llm.c's format: a header of 256 little-endian int32 (20240520,
version, token count), then the ids as uint16 (version 1) when the vocabulary has at most 65536
ids, else uint32 (version 2). With --eos (the id of the tokenizer's EOS token: tokenizer_config.json
beside tokenizer.json says which, else the one special token named like an EOS) or --eos-id N,
that id is written between consecutive documents; with --chat, after every conversation, and
trained when the conversation's last token is (a completion then ends with a trained EOS, as
TRL's SFTTrainer appends one to each completion).

OUT is written beside itself under a temporary name and renamed over the target once complete:
an interrupted run leaves what was there. Exit 0 on success, 2 on bad input (the file and, for
JSON lines, the line named), with nothing written.

Needs only `tokenizers` (pip install tokenizers) and the standard library.
"""
import argparse
import array
import json
import os
import struct
import sys
import tempfile

import chat_template

MAGIC = 20240520
HEADER_INTS = 256
MAX_TOKENS = 2**31 - 1  # the header's int32 count
FLAG_MASK = 1  # header[3]: a byte per token follows the tokens (docs/data.md)
MASK_TARGET = 1  # the loss is on this token (it is a target of the one before)
MASK_DOCUMENT_START = 2  # the first token of a document
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
BATCH_DOCUMENTS = 1024  # documents per encode_batch call (it encodes in parallel)


class BadInput(Exception):
    pass


def eos_from_tokenizer(path, tokenizer):
    """The EOS id: tokenizer_config.json's eos_token if it sits beside tokenizer.json, else the one
    special token whose name is a usual EOS name."""
    config = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError) as e:
            raise BadInput(f"{config}: cannot be read: {e}")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            eos_id = tokenizer.token_to_id(eos)
            if eos_id is None:
                raise BadInput(f"{config}: eos_token {eos!r} is not in {path}")
            return eos_id
    specials = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
    named = [t for t in specials if t in EOS_NAMES]
    if len(named) != 1:
        raise BadInput(
            f"--eos: {path}: cannot tell the EOS token ({len(named)} special tokens named like one"
            f" among {specials[:10]}, and no tokenizer_config.json beside it naming eos_token);"
            " give --eos-id N")
    return tokenizer.token_to_id(named[0])


def open_input(path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise BadInput(f"{path}: cannot be read: {e.strerror}")


def documents(inputs, jsonl, field):
    """The documents in order, as (where, text). JSON lines are read line by line: a file larger
    than memory is fine as long as each line fits."""
    if jsonl:
        for where, record in json_lines(inputs):
            if field not in record:
                raise BadInput(f"{where}: no field {field!r}")
            if not isinstance(record[field], str):
                raise BadInput(f"{where}: field {field!r} is not a string")
            yield where, record[field]
        return
    for path in inputs:
        with open_input(path) as f:
            data = f.read()
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadInput(f"{path}: not UTF-8 (byte {e.start})")


def chat_records(inputs):
    """Chat records of JSON lines, as (where, record): {"messages": [{"role", "content"}, ...]}
    (the HF datasets / OpenAI layout), or {"prompt": ..., "completion": ...} with two strings or
    two lists of messages (TRL's prompt-completion layouts)."""
    for where, record in json_lines(inputs):
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not messages:
                raise BadInput(f"{where}: 'messages' is not a non-empty list")
            for i, m in enumerate(messages):
                if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                        and isinstance(m.get("content"), str)):
                    raise BadInput(f"{where}: messages[{i}] is not an object with string 'role'"
                                   " and 'content'")
        elif "prompt" in record and "completion" in record:
            kinds = {type(record["prompt"]), type(record["completion"])}
            if kinds not in ({str}, {list}):
                raise BadInput(f"{where}: 'prompt' and 'completion' must be two strings or two"
                               " lists of messages")
        else:
            raise BadInput(f"{where}: neither 'messages' nor 'prompt' and 'completion'")
        yield where, record


def json_lines(inputs):
    """Every non-empty line of every input as (where, object)."""
    for path in inputs:
        with open_input(path) as f:
            for number, raw in enumerate(f, 1):
                where = f"{path} line {number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadInput(f"{where}: not UTF-8 (byte {e.start} of the line)")
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise BadInput(f"{where}: not JSON: {e}")
                if not isinstance(record, dict):
                    raise BadInput(f"{where}: not a JSON object")
                yield where, record


def encoded_documents(args, tokenizer):
    """(where, ids, mask) per document: mask None for text, else a bytearray of a byte per token
    with MASK_TARGET where the loss is on the token (chat: the tokens holding a character of the
    assistant's spans, or all tokens with --loss-on all)."""
    if not args.chat:
        for batch in batches(documents(args.inputs, args.jsonl, args.field), BATCH_DOCUMENTS):
            encoded = tokenizer.encode_batch([text for _, text in batch],
                                             add_special_tokens=not args.no_special_tokens)
            for (where, _), e in zip(batch, encoded):
                yield where, e.ids, None
        return
    try:
        template, specials = chat_template.load(args.tokenizer)
        compiled = chat_template.compile_template(template)
    except chat_template.TemplateError as e:
        raise BadInput(f"--chat: {e}")
    for batch in batches(chat_records(args.inputs), BATCH_DOCUMENTS):
        rendered = []
        for where, record in batch:
            try:
                rendered.append((where, *chat_template.conversation(compiled, specials, record)))
            except chat_template.TemplateError as e:
                raise BadInput(f"{where}: {e}")
        # As apply_chat_template(tokenize=True): the template writes the special tokens itself.
        encoded = tokenizer.encode_batch([text for _, text, _ in rendered],
                                         add_special_tokens=False)
        for (where, _, spans), e in zip(rendered, encoded):
            if args.loss_on == "all":
                mask = bytearray([MASK_TARGET]) * len(e.ids)
            else:  # a token that holds a character of a trained span is trained (transformers'
                # return_assistant_tokens_mask marks the tokens of the span's characters)
                mask = bytearray(MASK_TARGET if any(start < b and end > a for a, b in spans) else 0
                                 for start, end in e.offsets)
            yield where, e.ids, mask


def batches(items, size):
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def check_output(out, inputs, tokenizer_path):
    if os.path.lexists(out) and (os.path.islink(out) or not os.path.isfile(out)):
        raise BadInput(f"--out {out!r}: not a regular file; refusing to replace it")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise BadInput(f"--out {out!r}: its folder does not exist")
    if os.path.exists(out):
        for other in list(inputs) + [tokenizer_path]:
            if os.path.exists(other) and os.path.samefile(out, other):
                raise BadInput(f"--out {out!r}: is the input {other!r}; refusing to replace it")


def tokenize(args):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise BadInput("the Python package 'tokenizers' is needed: pip install tokenizers")
    check_output(args.out, args.inputs, args.tokenizer)
    try:
        tokenizer = Tokenizer.from_file(args.tokenizer)
    except Exception as e:  # tokenizers raises its own exception types
        raise BadInput(f"--tokenizer {args.tokenizer!r}: cannot be loaded: {e}")
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    version, code = (1, "H") if vocab <= 65536 else (2, "I")
    eos = None
    if args.eos_id is not None:
        if not 0 <= args.eos_id < vocab:
            raise BadInput(f"--eos-id {args.eos_id}: not below the vocab size {vocab}")
        eos = args.eos_id
    elif args.eos:
        eos = eos_from_tokenizer(args.tokenizer, tokenizer)

    folder = os.path.dirname(os.path.abspath(args.out))
    fd, temporary = tempfile.mkstemp(prefix=os.path.basename(args.out) + ".", suffix=".tmp",
                                     dir=folder)
    count = docs = trained = 0
    masks = tempfile.TemporaryFile(dir=folder) if args.chat else None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # as open() would create it, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * (4 * HEADER_INTS))  # the header, filled in once the count is known
            for batch in batches(encoded_documents(args, tokenizer), BATCH_DOCUMENTS):
                ids = array.array(code)
                mask = bytearray()
                for where, doc_ids, doc_mask in batch:
                    if eos is not None and docs > 0 and not args.chat:
                        ids.append(eos)
                    if doc_ids and max(doc_ids) >= vocab:
                        raise BadInput(f"{where}: the tokenizer gave id {max(doc_ids)}, not below"
                                       f" its vocab size {vocab}")
                    if doc_mask is not None:
                        if doc_mask:
                            doc_mask[0] |= MASK_DOCUMENT_START
                        mask += doc_mask
                        trained += sum(m & MASK_TARGET for m in doc_mask)
                    ids.extend(doc_ids)
                    if eos is not None and args.chat:  # the conversation's end, its own
                        ids.append(eos)
                        eos_mask = MASK_TARGET if doc_mask and doc_mask[-1] & MASK_TARGET else 0
                        mask.append(eos_mask)
                        trained += eos_mask
                    docs += 1
                count += len(ids)
                if count > MAX_TOKENS:
                    raise BadInput(f"--out {args.out!r}: more than {MAX_TOKENS} tokens, the most"
                                   " one token file counts; split the inputs")
                if sys.byteorder != "little":
                    ids.byteswap()
                ids.tofile(f)
                if masks is not None:
                    masks.write(mask)
            if docs == 0:
                raise BadInput("no document in the inputs")
            if masks is not None:  # the mask bytes follow the tokens
                masks.seek(0)
                while chunk := masks.read(1 << 20):
                    f.write(chunk)
            header = [0] * HEADER_INTS
            header[0:4] = [MAGIC, version, count, FLAG_MASK if masks is not None else 0]
            f.seek(0)
            f.write(struct.pack(f"<{HEADER_INTS}i", *header))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, args.out)
    except BaseException:
        os.unlink(temporary)
        raise
    finally:
        if masks is not None:
            masks.close()
    print(f"{args.out}: {count} tokens of {docs} documents, version {version} "
          f"({'uint16' if version == 1 else 'uint32'}), vocab {vocab}"
          + (f", EOS {eos} {'after' if args.chat else 'between'} documents"
             if eos is not None else "")
          + (f", the loss on {trained} of them" if args.chat else ""))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Make llm.c token files with a Hugging Face tokenizer.json.")
    parser.add_argument("--tokenizer", required=True, help="the model's tokenizer.json")
    parser.add_argument("--out", required=True, help="the token file to write")
    eos = parser.add_mutually_exclusive_group()
    eos.add_argument("--eos", action="store_true",
                     help="put the tokenizer's EOS id between documents")
    eos.add_argument("--eos-id", type=int, help="put this id between documents")
    parser.add_argument("--jsonl", action="store_true",
                        help="inputs are JSON lines; each line's --field is a document")
    parser.add_argument("--field", default="text", help="the JSON lines field (default: text)")
    parser.add_argument("--chat", action="store_true",
                        help="inputs are chat JSON lines (messages, or prompt and completion),"
                             " rendered with the model's chat template; writes a loss mask")
    parser.add_argument("--loss-on", choices=("assistant", "all"), default="assistant",
                        help="--chat: the loss on the assistant's turns (default) or every token")
    parser.add_argument("--no-special-tokens", action="store_true",
                        help="encode without the tokenizer's added special tokens (e.g. BOS)")
    parser.add_argument("inputs", nargs="+", metavar="INPUT")
    args = parser.parse_args(argv)
    try:
        tokenize(args)
    except BadInput as e:
        print(f"tokenize_data.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
