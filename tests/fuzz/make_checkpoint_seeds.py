#!/usr/bin/env python3
"""Packs a real checkpoint directory (made by `shardswap train` with checkpoint.dir) into seeds
for shardswap_fuzz_checkpoint, in the layout its source describes: a mode byte, then metadata,
weights.bin and the rank files separated by SEPARATOR. Writes one raw seed and one fix-up seed
(checksums stripped; the harness adds them back, and the metadata's per-file records), plus a
few fix-up variants.

Usage: make_checkpoint_seeds.py CHECKPOINT_DIR OUT_DIR
"""
import json
import pathlib
import sys

SEPARATOR = b"\n--ssfz-file--\n"
PREFIX_END = b'","metadata":'


def main():
    src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    meta = (src / "metadata.json").read_bytes()
    world = json.loads(meta)["metadata"]["world_size"]
    bins = [(src / "weights.bin").read_bytes()] + [
        (src / f"rank-{r:05}-of-{world:05}.bin").read_bytes() for r in range(world)]
    (out / "raw").write_bytes(b"\x00" + SEPARATOR.join([meta] + bins))
    # The metadata value as written: between kMiddle and the closing "}\n".
    inner = meta[meta.index(PREFIX_END) + len(PREFIX_END):].rstrip(b"\n")[:-1]
    stripped = [b[:-8] for b in bins]
    (out / "fixup").write_bytes(b"\x01" + SEPARATOR.join([inner] + stripped))
    # Variants: one rank file missing, an extra rank file, the weights without data.
    (out / "fixup-missing-rank").write_bytes(b"\x01" + SEPARATOR.join([inner] + stripped[:-1]))
    (out / "fixup-extra-rank").write_bytes(b"\x01" + SEPARATOR.join([inner] + stripped + [stripped[-1]]))
    w = stripped[0]
    header_end = 16 + int.from_bytes(w[8:16], "little")
    (out / "fixup-weights-header-only").write_bytes(
        b"\x01" + SEPARATOR.join([inner, w[:header_end]] + stripped[1:]))
    # Format 2: weights.bin of another save (its header's save id differs from the metadata's).
    save_id = json.loads(meta)["metadata"]["save_id"].encode()
    other = w.replace(save_id, save_id[::-1], 1)
    (out / "fixup-weights-of-another-save").write_bytes(
        b"\x01" + SEPARATOR.join([inner, other] + stripped[1:]))


if __name__ == "__main__":
    main()
