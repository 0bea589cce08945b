#!/usr/bin/env python3
"""Workload d (seed 004): LISA-style switching of 2 of 32 layers in DeepSpeed ZeRO-2.

The model mirrors `shardswap bench switch`: 32 layers of four dim x dim bf16 matrices (q, k, v, o;
no bias), plus a head Linear(dim, 256) that is always active. DeepSpeed has no way to change a ZeRO-2
engine's trainable set in place, so each switch is done the way LMFlow does it (and the seed's
partial re-init tries to shortcut): keep the head's fp32 master and Adam state, engine.destroy(),
flip requires_grad, deepspeed.initialize() a new engine over [head group, 2 new layers], and put the
head's master and state back into group 0 of the new ZeRO optimizer (checked bit for bit). One
training step follows each switch (not timed) so that every engine has live optimizer state.

--method destroy: engine.destroy() and nothing else. DeepSpeed 0.19.8's destroy() removes the ZeRO
optimizer's gradient hooks but not the forward pre/post hooks DeepSpeedEngine registered on the
model (which outlives the engine), and those closures hold the old engine, so every old engine's
fp32 master, Adam state and gradient partitions stay allocated: the seed's symptom.
--method destroy_clear_hooks: the same, then every forward hook left on the model's modules is
removed (this model registers none of its own), which lets the old engine be freed.

Reported: time per switch (median, first, max; synchronized), torch.cuda.memory_allocated after 1
and after --switches switches (right after the switch and after its training step), so a leak
across engines shows as growth. If a switch fails (out of memory), the row is an error that still
carries the switches completed and the memory after the first and the last of them.

    torchrun --nproc_per_node 1 tools/peers/ds_lisa_switch.py [--method destroy_clear_hooks]
        [--layers 32] [--dim 4096] [--switches 100] [--micro-batch 16] [--jsonl FILE]
"""
import argparse
import gc
import sys
import time

import peerlib

SCRIPT = "ds_lisa_switch.py"
METHODS = {"destroy": "destroy + new engine, head state carried",
           "destroy_clear_hooks": "destroy, clear model hooks, new engine"}


def clear_forward_hooks(model):
    """Removes every forward (pre) hook on the model's modules: the ones DeepSpeedEngine left."""
    removed = 0
    for m in model.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            removed += len(hooks)
            hooks.clear()
        for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                      "_forward_hooks_always_called"):
            getattr(m, extra, {}).clear()
    return removed


def build(torch, layers, dim, device):
    nn = torch.nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

        def forward(self, x):
            return x + self.o(self.v(self.k(self.q(x)))) * 0.25

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.head = nn.Linear(dim, 256, bias=False)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    with torch.device(device):
        model = Model()
    return model.to(torch.bfloat16)


def config(micro_batch, torch_adam):
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1 << 30,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "overlap_comm": True,
                              "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01,
                                                  "torch_adam": torch_adam}},
    }


def head_state(torch, engine):
    """Clones of group 0's (the head's) fp32 master partition and its optimizer state."""
    zero = engine.optimizer
    master = zero.single_partition_of_fp32_groups[0]
    state = zero.optimizer.state.get(master, {})
    return master.detach().clone(), {k: (v.clone() if torch.is_tensor(v) else v)
                                     for k, v in state.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--switches", type=int, default=100)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--method", choices=("destroy", "destroy_clear_hooks"),
                    default="destroy_clear_hooks")
    ap.add_argument("--jsonl", help="also append the JSON lines to this file")
    args = ap.parse_args()
    if args.layers < 4 or args.dim < 1 or args.switches < 1 or args.micro_batch < 1:
        ap.error("--layers >= 4, --dim, --switches and --micro-batch >= 1")

    base = {"workload": "lisa_switch", "system": "deepspeed", "script": SCRIPT,
            "layers": args.layers, "dim": args.dim, "active": 2,
            "method": METHODS[args.method]}
    torch = peerlib.need_cuda(SCRIPT)
    try:
        import deepspeed
    except Exception as exc:
        peerlib.fail(SCRIPT, "import deepspeed: " + peerlib.exception_text(exc), base, args.jsonl)
    dist, rank, world, local = peerlib.init_nccl(torch, SCRIPT)
    base.update(world_size=world, deepspeed=deepspeed.__version__, torch=torch.__version__)
    try:
        from deepspeed.ops.op_builder import FusedAdamBuilder
        FusedAdamBuilder().load()
        fused_error = None
    except Exception as exc:
        fused_error = peerlib.exception_text(exc)

    model = build(torch, args.layers, args.dim, f"cuda:{local}")
    gen = torch.Generator(device="cuda").manual_seed(5 + rank)

    def make_engine(active):
        for i, layer in enumerate(model.layers):
            layer.requires_grad_(i in active)
        model.head.requires_grad_(True)
        groups = [{"params": list(model.head.parameters())},
                  {"params": [p for i in active for p in model.layers[i].parameters()]}]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups,
                                               config=config(args.micro_batch,
                                                             fused_error is not None))
        return engine

    def train_step(engine):
        x = torch.randn(args.micro_batch, args.dim, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
        labels = torch.randint(0, 256, (args.micro_batch,), device="cuda", generator=gen)
        loss = torch.nn.functional.cross_entropy(engine(x).float(), labels)
        engine.backward(loss)
        engine.step()
        return loss.item()

    try:
        engine = make_engine([0, 1])
        train_step(engine)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        seconds, after_switch, after_step, carried_ok = [], [], [], True
        hooks_removed = 0
        for s in range(args.switches):
            active = [(2 + 2 * s) % args.layers, (3 + 2 * s) % args.layers]
            torch.cuda.synchronize()
            started = time.perf_counter()
            master, state = head_state(torch, engine)
            engine.destroy()
            if args.method == "destroy_clear_hooks":
                hooks_removed = clear_forward_hooks(model)
            del engine
            gc.collect()
            torch.cuda.empty_cache()
            engine = make_engine(active)
            zero = engine.optimizer
            new_master = zero.single_partition_of_fp32_groups[0]
            if new_master.numel() != master.numel():
                raise RuntimeError(f"head partition changed size: {master.numel()} -> "
                                   f"{new_master.numel()}")
            new_master.data.copy_(master)
            zero.optimizer.state[new_master] = state
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
            after_switch.append(torch.cuda.memory_allocated())
            carried_ok &= torch.equal(zero.single_partition_of_fp32_groups[0], master)
            del master, state
            loss = train_step(engine)
            if not loss == loss:
                raise RuntimeError(f"loss is NaN after switch {s + 1}")
            torch.cuda.synchronize()
            after_step.append(torch.cuda.memory_allocated())
    except Exception as exc:
        partial = dict(base, fused_adam_error=fused_error, switches=len(after_step),
                       switches_wanted=args.switches)
        if after_step:
            partial.update(allocated_after_1_step_bytes=after_step[0],
                           allocated_after_n_steps_bytes=after_step[-1],
                           ms_per_switch=sorted(seconds)[len(seconds) // 2] * 1e3,
                           growth_per_switch_bytes=(after_step[-1] - after_step[0])
                           / max(1, len(after_step) - 1))
        peerlib.fail(SCRIPT, f"after {len(after_step)} switches: " + peerlib.exception_text(exc),
                     partial, args.jsonl)
    ms = sorted(x * 1e3 for x in seconds)
    if rank == 0:
        peerlib.emit(dict(base, status="ok" if carried_ok else "error",
                          error=None if carried_ok else "head state not carried bit for bit",
                          fused_adam_error=fused_error,
                          optimizer=type(engine.optimizer.optimizer).__name__,
                          switches=args.switches, ms_per_switch=ms[len(ms) // 2],
                          ms_first_switch=seconds[0] * 1e3, ms_max=ms[-1],
                          allocated_before_bytes=before,
                          allocated_after_1_switch_bytes=after_switch[0],
                          allocated_after_n_switches_bytes=after_switch[-1],
                          allocated_after_1_step_bytes=after_step[0],
                          allocated_after_n_steps_bytes=after_step[-1],
                          growth_bytes=after_step[-1] - after_step[0],
                          hooks_removed_last_switch=hooks_removed,
                          peak_bytes=torch.cuda.max_memory_allocated()), args.jsonl)
    engine.destroy()
    dist.destroy_process_group()
    return 0 if carried_ok else 1


if __name__ == "__main__":
    sys.exit(main())
