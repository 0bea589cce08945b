"""Shared pieces of the peer benchmarks (tools/peers/*.py): JSON lines, loud failure, timing.

Every script prints one JSON object per line on stdout, each with "workload" and "system" keys;
report.py gathers them. torch is imported lazily so that --help and argument errors work on a
machine without it (the CPU-only checks of this folder).
"""
import json
import os
import statistics
import sys
import time
import traceback

COPY_BYTES = 1 << 30
WARMUP = 3


def emit(record, path=None):
    """One JSON line on stdout (and appended to path): the only output report.py reads."""
    line = json.dumps(record, sort_keys=True)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def read_jsonl(path, script):
    """The JSON objects of a file of JSON lines (blank lines skipped); a malformed line ends the
    script naming the file and the line."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SystemExit(f"{script}: {path}:{n}: {exc}")
    return rows


def fail(script, message, record=None, path=None):
    """Fail loudly: an error record (so the table shows why) and exit status 1."""
    rec = dict(record or {})
    rec.update({"status": "error", "error": message})
    emit(rec, path)
    print(f"{script}: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def exception_text(exc):
    """The exception's last lines: what the report quotes as the exact error."""
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()[-2000:]


def need_cuda(script):
    import torch
    if not torch.cuda.is_available():
        fail(script, "no CUDA device (torch.cuda.is_available() is False)",
             {"script": script})
    return torch


def median_seconds(fn, iters, sync):
    for _ in range(WARMUP):
        fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_tbps(torch, iters=20):
    """Device-to-device copy of 1 GiB fp32, bytes read + written per second (as torch_adamw.py)."""
    src = torch.randn(COPY_BYTES // 4, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), iters, torch.cuda.synchronize)
    if not torch.equal(dst, src):
        raise RuntimeError("copy check failed: dst != src after copy_")
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / seconds / 1e12


def parse_count(text, script):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    unit = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if unit != 1 else text
    if not digits.isdigit() or int(digits) == 0:
        raise SystemExit(f"{script}: '{text}' is not a count like 64M, 256M or 1G")
    return int(digits) * unit


def dist_env():
    """rank, world size, local rank from torchrun's environment (1 process when absent)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return rank, world, local


def init_nccl(torch, script):
    """NCCL process group over torchrun's env (world size 1 included: the brief's 'over NCCL')."""
    import torch.distributed as dist
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        fail(script, "NCCL_NVLS_ENABLE must be 0: NVLink multicast (NVLS) stays off for these peer runs")
    rank, world, local = dist_env()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(local))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", local))
    return dist, rank, world, local


class DecoderLike:
    """The shape of ShardSwap's byte decoder (tools/model/decoder.h; Llama, vocabulary 256, tied head,
    as configs/gpu-300m.json): transformers' LlamaForCausalLM of the same config.json fields, so
    that ShardSwap's plan/train with the same model.* keys and the peers hold the same params."""

    # The model.* keys (config.json fields) a shape sets, in the order of param_count's arguments.
    KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads")

    # Workload b's model on both sides: 1,133,062,144 params (>= 1B, as the brief asks).
    MEMORY_SHAPE = (2048, 8192, 18, 16, 8)

    @staticmethod
    def add_args(ap, shape):
        """--hidden-size ... --num-key-value-heads, defaulting to `shape`."""
        for key, value in zip(DecoderLike.KEYS, shape):
            ap.add_argument("--" + key.replace("_", "-"), type=int, default=value)

    @staticmethod
    def param_count(hidden, intermediate, layers, heads, kv_heads):
        hd = hidden // heads
        per_layer = (2 * hidden * heads * hd + 2 * hidden * kv_heads * hd  # q, o; k, v
                     + 3 * hidden * intermediate + 2 * hidden)  # gate, up, down; two RMSNorms
        return 256 * hidden + layers * per_layer + hidden  # tied embedding, final norm

    @staticmethod
    def build(torch, hidden, intermediate, layers, heads, kv_heads, max_positions, dtype, device):
        import transformers
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=hidden, intermediate_size=intermediate,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions, tie_word_embeddings=True)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
        return model.to(dtype)
