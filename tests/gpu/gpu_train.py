"""A small deterministic CUDA training (NCCL) for the GPU check: what a user's script does with a GPU.

Runs unchanged under torchrun and ``hpcelastic run``. Each rank writes ``<out>/rank-<R>.json`` when it ends
(and ``<out>/start-<R>-<restart>.json`` once past ``init_process_group`` and its first CUDA step):

- whether CUDA was initialised before the script touched it (a warm worker's fork server must never have);
- ``CUDA_VISIBLE_DEVICES``, the devices torch sees, the device used and its name, the CPU affinity;
- the times of its start, of ``init_process_group`` done and of the first step on the GPU, and of an
  injected crash (``<out>/crash-<R>.json``): restart timing under any launcher;
- each checkpoint's blocking time (``dcp.save``, or ``dcp.async_save``'s return) and its bytes, and the
  time of a device-to-host copy of the same bytes into pinned memory (the copy the tier cannot avoid).

``--crash-at-step`` and ``--hang-at-step`` act only in the first run (``TORCHELASTIC_RESTART_COUNT`` 0); the
hang is a CUDA kernel that never ends as far as the watch can tell (``torch.cuda._sleep``), in
:func:`stuck_in_cuda_kernel`. ``--device cpu`` (gloo) rehearses the harness on a machine without a GPU.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

CUDA_INITIALISED_AT_START = torch.cuda.is_initialized()

try:
    from hpcelastic.worker import heartbeat
except ImportError:  # plain torchrun without hpcelastic installed

    def heartbeat(step: int) -> None:
        return None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=1024, help="hidden size: width^2 + 2 width parameters")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--save-every", type=int, default=0, help="DCP checkpoint every N steps (0: none)")
    p.add_argument("--async-save", action="store_true", help="dcp.async_save instead of dcp.save")
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--hang-at-step", type=int, default=-1)
    p.add_argument("--no-heartbeats", action="store_true", help="an unchanged script: no hpcelastic import")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="default: $HPCELASTIC_CHECKPOINT_DIR")
    return p.parse_args()


def stuck_in_cuda_kernel(device: torch.device) -> None:
    """A kernel that spins for about an hour of GPU cycles, then a wait for it: the rank stops stepping."""
    if device.type == "cuda":
        torch.cuda._sleep(1 << 62)
        torch.cuda.synchronize(device)
    while True:  # the CPU rehearsal: no kernel to wait on
        time.sleep(1)


def batch(step: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step + 7919 * dist.get_rank())
    x = torch.randn(64, width, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).sin().to(device)


def newest_checkpoint(root: Path) -> tuple[int, Path] | None:
    done = sorted(
        (int(m.group(1)), d)
        for d in root.glob("step-*")
        if (m := re.fullmatch(r"step-(\d+)", d.name)) and (d / ".metadata").exists()
    )
    return done[-1] if done else None


def tensors_of(state: object) -> list[torch.Tensor]:
    """Every tensor in a (nested) state dict."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_of(v)]
    return []


def pinned_copy_s(tensors: list[torch.Tensor]) -> float:
    """Seconds to copy the GPU ``tensors`` into pinned host memory (torch.cuda's own bandwidth)."""
    tensors = [t for t in tensors if t.is_cuda]
    if not tensors:
        return 0.0
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for h, t in zip(hosts, tensors, strict=True):
        h.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS deterministic (before its init)
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True)
        # DCP's async_save runs its collectives on CPU tensors in the background: gloo beside NCCL, as
        # PyTorch's async checkpoint recipe sets up.
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    t_init = time.time()
    root = args.checkpoint_dir or Path(os.environ.get("HPCELASTIC_CHECKPOINT_DIR", "checkpoints"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1, bias=False)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    start, resumed = 0, None
    found = newest_checkpoint(root)
    if found is not None:
        resumed, where = found
        model_state, opt_state = get_state_dict(model, opt)  # the optimizer's state made, to load into
        state = {"model": model_state, "opt": opt_state}
        dcp.load(state, checkpoint_id=str(where))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["opt"])
        start = resumed
    saves: list[dict[str, float]] = []
    pending = None
    t_first_step = None
    for step in range(start + 1, args.steps + 1):
        if restart == 0 and step == args.crash_at_step:
            _write(args.out / f"crash-{rank}.json", {"ts": time.time()})
            raise RuntimeError(f"injected crash at step {step}")
        if restart == 0 and step == args.hang_at_step:
            stuck_in_cuda_kernel(device)
        x, y = batch(step, args.width, device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        if t_first_step is None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t_first_step = time.time()
            times = {"start": T_START, "init": t_init, "step": t_first_step}
            _write(args.out / f"start-{rank}-{restart}.json", times)
        if not args.no_heartbeats:
            heartbeat(step)
        if args.save_every and step % args.save_every == 0:
            saves.append(_save(model, opt, root / f"step-{step:06d}", args.async_save, pending))
            pending = saves[-1].pop("future", None)  # type: ignore[arg-type]
    if pending is not None:
        pending.result()
    digest = hashlib.sha256()
    for t in model.state_dict().values():
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    _write(
        args.out / f"rank-{rank}.json",
        {
            "cuda_initialised_at_start": CUDA_INITIALISED_AT_START,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device_count": torch.cuda.device_count() if device.type == "cuda" else 0,
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpus": sorted(os.sched_getaffinity(0)),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "restart": restart,
            "resumed": resumed,
            "saves": saves,
            "sha256": digest.hexdigest(),
        },
    )
    dist.destroy_process_group()


def _save(model: torch.nn.Module, opt: torch.optim.Optimizer, where: Path, use_async: bool, pending) -> dict:  # type: ignore[no-untyped-def]
    """One DCP checkpoint of the GPU state: its blocking time, its bytes, and a pinned copy's time."""
    model_state, opt_state = get_state_dict(model, opt)
    state = {"model": model_state, "opt": opt_state}
    flat = tensors_of(state)  # the bytes DCP writes: the parameters and the momentum
    nbytes = sum(t.numel() * t.element_size() for t in flat)
    if pending is not None:
        pending.result()  # one save in flight at a time, as DCP's own examples do
    t0 = time.perf_counter()
    save = dcp.async_save if use_async else dcp.save
    future = save(state, checkpoint_id=str(where))
    blocked = time.perf_counter() - t0
    record = {"blocked_s": blocked, "state_bytes": nbytes, "pinned_copy_s": pinned_copy_s(flat)}
    if use_async:
        record["future"] = future
    return record


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
