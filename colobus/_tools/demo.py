"""The async training loop behind ``colobus demo`` and ``examples/async_training_loop.py``.

One controller drives data-parallel training of a small linear regression on
every host at once:

* a colocated **data loader** (one instance per host) makes each host's batch,
  already split over that host's devices;
* a colocated **step** computes one gradient per device with JAX, on the host
  that holds the data; the controller averages them (a few floats per device)
  and every host applies the same update, so the parameters stay on the hosts
  as a ``cb.Array`` from step to step;
* a colocated **checkpoint writer** (one instance per host) saves the
  parameters with numpy to a directory on its host, in the background: the
  saves are futures that training does not wait for.

The code lives in the package (not only in ``examples/``) so that
``colobus demo`` works from a plain ``pip install``. Read it top to bottom:
first what runs on the hosts, then the controller's loop, then the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

import colobus as cb

__all__ = ["Report", "build_parser", "describe_hosts", "format_report", "main", "run_demo", "train"]

FEATURES = 16  # the model: y = x @ w, with w of this many weights
ROWS_PER_DEVICE = 64  # each device's share of a host's batch
LEARNING_RATE = 0.1


# == What runs on the hosts =========================================================
#
# These are defined in an importable module, so colobus sends them to the hosts by
# reference (module name + qualified name): each host imports this module once and
# keeps its state, e.g. JAX's compilation cache for the jitted step below.


def _host_mesh() -> Any:
    """This host's part of the call's 1-D ``("devices",)`` mesh: all its CPU devices."""
    import jax

    return jax.sharding.Mesh(np.array(jax.local_devices(backend="cpu")), ("devices",))


def _split_rows(mesh: Any) -> Any:
    """A sharding that splits an array's first axis over ``mesh``'s ``"devices"`` axis."""
    import jax

    spec = jax.sharding.PartitionSpec("devices")
    return jax.sharding.NamedSharding(mesh, spec)


# The demo shows the block view, chosen: each host makes its own rows and computes on its
# block (docs/jax_job.md, "Choosing the view"); the default view would form a JAX job.
VIEW = False


@cb.colocated_python_class
class Loader:
    """Makes batches of a synthetic regression task on the host it lives on.

    Every host builds its own instance, with its own random stream, so the hosts
    see different data drawn from one ground truth ``w_true``.
    """

    def __init__(self, features: int, rows_per_device: int) -> None:
        self.rng = np.random.default_rng()  # fresh entropy: each host its own data
        self.w_true = np.random.default_rng(0).normal(size=features).astype(np.float32)
        self.rows_per_device = rows_per_device

    def next_batch(self, step: int) -> tuple[Any, Any]:
        """This host's ``(x, y)`` rows, split over its devices along the first axis."""
        import jax

        mesh = _host_mesh()
        rows = self.rows_per_device * mesh.size
        x = self.rng.normal(size=(rows, self.w_true.size)).astype(np.float32)
        y = x @ self.w_true + 0.01 * self.rng.normal(size=rows).astype(np.float32)
        # Returned with a NamedSharding over the host's part of the call's mesh, each
        # host's rows become one block of a global array that stays on the hosts.
        return jax.device_put(x, _split_rows(mesh)), jax.device_put(y, _split_rows(mesh))


_per_device_grads: Any = None


def _grads_fn() -> Any:
    """The jitted per-device loss and gradient, built once per host process."""
    global _per_device_grads
    if _per_device_grads is None:
        import jax
        import jax.numpy as jnp

        def mse(w: Any, x: Any, y: Any) -> Any:
            return jnp.mean((x @ w - y) ** 2)

        # vmap over the device axis: one loss and one gradient per device's rows.
        _per_device_grads = jax.jit(jax.vmap(jax.value_and_grad(mse), in_axes=(None, 0, 0)))
    return _per_device_grads


@cb.colocated_python
def device_grads(params: Any, batch: tuple[Any, Any]) -> tuple[Any, Any]:
    """On each host: the loss and gradient of each of its devices' rows."""
    import jax

    x, y = batch
    mesh = x.sharding.mesh  # the host's part of the call's mesh
    n = mesh.size
    losses, grads = _grads_fn()(params, x.reshape(n, -1, x.shape[-1]), y.reshape(n, -1))
    return jax.device_put(grads, _split_rows(mesh)), jax.device_put(losses, _split_rows(mesh))


@cb.colocated_python
def apply_update(params: Any, mean_grad: np.ndarray, lr: float) -> Any:
    """On each host: the same SGD update, so every host keeps identical parameters."""
    import jax

    return jax.device_put(params - lr * mean_grad, params.sharding)


@cb.colocated_python_class
class CheckpointWriter:
    """Writes parameters to a directory on its host and keeps the newest few."""

    def __init__(self, directory: str | None, keep: int = 2) -> None:
        self.owns_dir = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="colobus-ckpt-")
        os.makedirs(self.directory, exist_ok=True)
        self.keep = keep

    def save(self, params: Any, step: int) -> None:
        """Write ``params`` as ``step_NNNNNN.npy`` atomically (temp file, fsync, rename).

        Hosts sharing one directory (one machine, or a shared file system) write
        the same file: the parameters are replicated, and the last rename wins.
        """
        data = np.asarray(params)
        final = os.path.join(self.directory, f"step_{step:06d}.npy")
        tmp = f"{final}.{os.getpid()}.tmp"  # one temp file per writer process
        with open(tmp, "wb") as f:
            np.save(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        for old in sorted(n for n in os.listdir(self.directory) if n.endswith(".npy"))[
                :-self.keep]:
            with contextlib.suppress(FileNotFoundError):  # another host removed it first
                os.remove(os.path.join(self.directory, old))

    def __del__(self) -> None:
        # Runs on the host when the controller drops its handle. A directory this
        # writer made for itself is scratch space; one it was given is kept.
        if getattr(self, "owns_dir", False):
            shutil.rmtree(self.directory, ignore_errors=True)


# == The controller's loop ==========================================================


@dataclass
class Report:
    """What one training run did, for the summary."""

    steps: int = 0
    seconds: float = 0.0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    weight_error: float = float("nan")  # max |w - w_true| after training
    saves: int = 0
    save_seconds: float = 0.0  # issue-to-done time of every save, summed
    save_wait_seconds: float = 0.0  # of that, the time training stood still waiting
    hosts: int = 0
    devices: int = 0

    @property
    def hidden_seconds(self) -> float:
        """Checkpoint time that ran while training went on."""
        return max(0.0, self.save_seconds - self.save_wait_seconds)


@dataclass
class _Checkpoints:
    """Background saves: at most one in flight, timed from the controller."""

    writer: Any
    report: Report
    pending: asyncio.Task[None] | None = None
    started: list[float] = field(default_factory=list)

    async def _save(self, params: Any, step: int) -> None:
        t0 = time.perf_counter()
        await self.writer.save(params, step)
        self.report.save_seconds += time.perf_counter() - t0
        self.report.saves += 1

    async def start(self, params: Any, step: int) -> None:
        """Start a save and return at once (after the previous save, if still running).

        Calls made from one asyncio task run on each host in the order issued, so a
        save issued from the training task would hold the next step back until it is
        written. Issuing it from a task of its own lets the hosts run both at once.
        """
        await self.wait()
        self.pending = asyncio.create_task(self._save(params, step))

    async def wait(self) -> None:
        """Wait for the save in flight; the time spent here was not hidden."""
        if self.pending is not None:
            t0 = time.perf_counter()
            await self.pending
            self.report.save_wait_seconds += time.perf_counter() - t0
            self.pending = None


class _Progress:
    """One progress line: redrawn in place on a terminal, else printed now and then."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out
        self.tty = out.isatty()
        self.every = max(1, total // 5)
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        rate = step / max(time.perf_counter() - self.t0, 1e-9)
        width = 24
        filled = width * step // self.total
        line = (f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total}"
                f" | loss {loss:.4f} | {rate:.1f} steps/s")
        if self.tty:
            self.out.write("\r" + line + ("\n" if step == self.total else ""))
        elif step % self.every == 0 or step == self.total:
            self.out.write(line + "\n")
        self.out.flush()


async def train(steps: int, *, checkpoint_every: int = 10, checkpoint_dir: str | None = None,
                progress: TextIO | None = None) -> Report:
    """Train on every host of the default controller; return what happened.

    Args:
        steps: training steps.
        checkpoint_every: save the parameters every this many steps (0: never).
        checkpoint_dir: where hosts write checkpoints (default: a scratch dir per host).
        progress: where the progress line goes (default: stderr).
    """
    devices = [d for d in cb.devices() if d.platform == "cpu"]
    mesh = cb.Mesh(np.array(devices), ("devices",))
    report = Report(hosts=len({d.host for d in devices}), devices=len(devices))

    # Nothing is built on the hosts yet: each object is made on first use.
    loader: Any = Loader(FEATURES, ROWS_PER_DEVICE)
    # A method without array arguments must be told where to run.
    loader.next_batch = loader.next_batch.specialize(devices=devices)
    writer: Any = CheckpointWriter(checkpoint_dir)
    checkpoints = _Checkpoints(writer, report)

    # The parameters: one copy on every device, uploaded in the background.
    replicated = cb.NamedSharding(mesh, cb.PartitionSpec())
    params: Any = cb.device_put(np.zeros(FEATURES, np.float32), replicated)
    bar = _Progress(steps, progress if progress is not None else sys.stderr)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        # The batch is not awaited: its future goes straight into the step, and
        # each host hands its own rows to the step without a round trip here.
        batch = loader.next_batch(step)
        grads, losses = await device_grads(params, batch)
        # The cross-host part of the step: the controller averages one gradient per
        # device (FEATURES floats each) and sends the mean to every host.
        g, loss = await cb.device_get((grads, losses))
        params = apply_update(params, g.mean(axis=0), LEARNING_RATE)  # a future, not awaited
        report.last_loss = float(loss.mean())
        if step == 1:
            report.first_loss = report.last_loss
        if checkpoint_every and step % checkpoint_every == 0:
            await checkpoints.start(params, step)
        bar.update(step, report.last_loss)
    params = await params
    report.seconds = time.perf_counter() - t0
    report.steps = steps
    await checkpoints.wait()

    w = np.asarray(await cb.device_get(params))
    w_true = np.random.default_rng(0).normal(size=FEATURES).astype(np.float32)
    report.weight_error = float(np.abs(w - w_true).max())
    await cb.aclose(loader)
    await cb.aclose(writer)
    return report


def format_report(r: Report) -> str:
    """The summary printed after a run."""
    rate = r.steps / r.seconds if r.seconds > 0 else float("inf")
    lines = [
        f"trained {r.steps} steps on {r.hosts} hosts x {r.devices // max(r.hosts, 1)} devices "
        f"in {r.seconds:.2f} s ({rate:.1f} steps/s)",
        f"loss {r.first_loss:.4f} -> {r.last_loss:.4f}; max |w - w_true| = {r.weight_error:.4f}",
    ]
    if r.saves:
        share = 100.0 * r.hidden_seconds / r.save_seconds if r.save_seconds > 0 else 100.0
        lines.append(
            f"checkpoints: {r.saves} saves on every host, {r.save_seconds * 1e3:.1f} ms of "
            f"saving, {r.hidden_seconds * 1e3:.1f} ms hidden behind training ({share:.0f}%)")
    return "\n".join(lines)


# == The command line ===============================================================


def build_parser(prog: str = "async_training_loop.py") -> argparse.ArgumentParser:
    """The options of ``examples/async_training_loop.py`` (``colobus demo`` has a subset)."""
    from .args import CliParser, positive_int

    p = CliParser(
        prog=prog, description="Async data-parallel training driven from one colobus controller.")
    p.add_argument("--steps", type=positive_int, default=40, help="training steps (default 40)")
    p.add_argument("--hosts", type=positive_int, default=None,
                   help="hosts: local worker processes, or remote workers to wait for "
                        "(default 2; under `colobus launch`, the launched ones)")
    p.add_argument("--devices", type=positive_int, default=None,
                   help="CPU devices per local host (default 4; under `colobus launch`, its "
                        "--devices; remote workers choose their own)")
    p.add_argument("--bind", default=None, metavar="ENDPOINT",
                   help="bind here and wait for remote workers (e.g. tcp://0.0.0.0:5555) "
                        "instead of starting a local cluster")
    p.add_argument("--key-file", default=None, metavar="PATH",
                   help="key file from `colobus keygen` (needed with --bind)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                   help="save parameters every N steps (0: never; default: 4 saves a run)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where each host writes checkpoints (default: a scratch dir per host)")
    p.add_argument("--metrics", nargs="?", const="127.0.0.1:9464", default=None,
                   metavar="HOST:PORT",
                   help="serve Prometheus metrics during the run (default 127.0.0.1:9464) "
                        "and print how to watch them with `colobus top`")
    return p


async def _run(args: argparse.Namespace, key: bytes | None) -> Report:
    every = args.checkpoint_every
    if every is None:
        every = max(1, args.steps // 4)
    opts = dict(checkpoint_every=every, checkpoint_dir=args.checkpoint_dir)
    if args.bind is None:
        async with cb.local_cluster(hosts=args.hosts, devices_per_host=args.devices,
                                    metrics=args.metrics, jax_distributed=VIEW) as ctl:
            print(describe_hosts(ctl), flush=True)
            print_metrics(ctl)
            return await train(args.steps, **opts)
    async with cb.Controller(args.bind, hosts=args.hosts or 2, key=key, metrics=args.metrics,
                             jax_distributed=VIEW) as ctl:
        print(describe_hosts(ctl), flush=True)
        print_metrics(ctl)
        return await train(args.steps, **opts)


def print_metrics(ctl: cb.Controller) -> None:
    """Where the metrics are served and how to watch them (nothing when they are off)."""
    url = ctl.metrics_url
    if url is not None:
        print(f"metrics: {url}\n  watch live: colobus top --metrics {url.removesuffix('/metrics')}"
              f"\n  scrape it from Prometheus: see docs/observability.md", flush=True)


def describe_hosts(ctl: cb.Controller) -> str:
    """One line per host that joined: index, name, where it runs, its devices."""
    def counted(devices: Sequence[cb.Device]) -> str:  # "4 cpu", "1 tpu + 4 cpu"
        by = collections.Counter(d.platform for d in devices)
        return " + ".join(f"{n} {platform}" for platform, n in by.items())

    return "\n".join(
        f"host {h.index}: {h.name!r}, pid {h.pid} on {h.address}, {counted(h.devices)} "
        "devices" for h in ctl.hosts())


HOST_LOST_STATUS = 3  # the exit status when a host was lost mid-run


def main(argv: Sequence[str] | None = None, prog: str = "async_training_loop.py") -> int:
    """Run the command line; 0 when training converged."""
    args = build_parser(prog).parse_args(argv)
    try:
        key = cb.load_key(args.key_file) if args.key_file else None
    except (OSError, cb.AuthenticationError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    # Under `colobus launch` ($COLOBUS_ADDRESS set) the size is the launch's; else the demo's.
    if args.bind is None and not os.environ.get("COLOBUS_ADDRESS"):
        args.hosts = args.hosts or 2
        args.devices = args.devices or 4
    where = args.bind or (f"a local cluster ({args.hosts} hosts x {args.devices} devices)"
                          if args.hosts else "the workers `colobus launch` started")
    print(f"colobus: training {args.steps} steps on {where}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        try:
            report = asyncio.run(_run(args, key))
        except TimeoutError as exc:  # the hosts did not join: the message says what to run
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:  # a port in use (--metrics, --bind): one line, not a traceback
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 1
        except cb.HostLostError as exc:
            # What docs/reliability.md asks of a driver: report the loss, then go on
            # without that host or stop cleanly. The parameters live on every host,
            # so a lost host takes part of them: this loop stops (the controller and
            # the other hosts are shut down in order by `async with`).
            print(f"{prog}: stopping: {exc}; the other hosts are fine, but training "
                  "needs every host's share", file=sys.stderr, flush=True)
            return HOST_LOST_STATUS
        print(format_report(report), flush=True)
        return 0 if report.last_loss < report.first_loss else 1
    print("interrupted", file=sys.stderr)
    return 130


def run_demo(hosts: int = 2, devices: int = 4, steps: int = 40,
             metrics: str | None = None) -> int:
    """``colobus demo``: the training loop on a local cluster; every worker is reaped."""
    argv = ["--hosts", str(hosts), "--devices", str(devices), "--steps", str(steps)]
    if metrics is not None:
        argv += ["--metrics", metrics]
    return main(argv, prog="colobus demo")
