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


class ByteLmLike:
    """The shape of ShardSwap's byte_lm (tools/lm/byte_lm.cpp param_decls): embed [context*256, d];
    per block LayerNorm(d), Linear(d, h), GELU, Linear(h, d), residual; final LayerNorm(d); head
    [256, d] without bias. Same param count, so ShardSwap's plan/train and the peers hold the
    same params."""

    @staticmethod
    def param_count(context, width, hidden, depth):
        d, h = width, hidden
        return context * 256 * d + depth * (2 * d + h * d + h + d * h + d) + 2 * d + 256 * d

    @staticmethod
    def build(torch, context, width, hidden, depth, dtype, device):
        nn = torch.nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.LayerNorm(width)
                self.fc1 = nn.Linear(width, hidden)
                self.fc2 = nn.Linear(hidden, width)

            def forward(self, x):
                return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)),
                                                             approximate="tanh"))

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(context * 256, width)
                self.layers = nn.ModuleList(Block() for _ in range(depth))
                self.final_norm = nn.LayerNorm(width)
                self.head = nn.Linear(width, 256, bias=False)
                self.register_buffer("offsets", torch.arange(context) * 256, persistent=False)

            def forward(self, tokens):  # tokens [batch, context] of bytes
                x = self.embed(tokens + self.offsets).sum(dim=1)
                for block in self.layers:
                    x = block(x)
                return self.head(self.final_norm(x))

        with torch.device(device):
            model = Model()
        return model.to(dtype)
