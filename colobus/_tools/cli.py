"""The ``colobus`` command: ``worker``, ``relay``, ``keygen``, ``launch``, ``manifest``, ``demo``,
``bench``, ``top``.

A user error (a bad option, a key file that cannot be read, a directory that
does not exist) ends the command with one line on stderr and a non-zero status
(2 for usage errors), never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from .._errors import AuthenticationError
from .._wire.endpoint import parse_connect
from .args import USAGE_ERROR, CliParser, positive_int

__all__ = ["CliParser", "build_parser", "main", "positive_int"]



# `colobus bench --help`'s list (tests/test_cli.py: the same names as bench.BENCHMARKS).
BENCHMARK_HELP = (
    ("latency", "one call's round trip, 1 host (await; a script's block_until_ready)"),
    ("pipelined", "no-op calls with many in flight"),
    ("fanout", "one call on 4 hosts"),
    ("object", "method calls on a colocated_python_class object"),
    ("transfer", "device_put / device_get of 1 to 256 MiB, with peak memory"),
    ("chain", "100 dependent calls, each given the previous call's Future"),
    ("calls", "return x / x + 1 against the no-op: latency, controller CPU, memory"),
    ("scaling", "fan-out over 1 to 16 hosts: latency and CPU per host"),
    ("bigout", "calls returning large outputs: the worker's peak memory"),
    ("reshard", "sharded -> replicated over 4 hosts"),
)


class _UserError(Exception):
    """A mistake of the user's, reported as one line with this exit status."""

    def __init__(self, message: str, status: int = USAGE_ERROR) -> None:
        super().__init__(message)
        self.status = status


def _endpoint(text: str) -> str:
    try:
        return parse_connect(text).text
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _version() -> str:
    from .. import __version__

    return f"colobus {__version__}"


def build_parser() -> argparse.ArgumentParser:
    """The ``colobus`` command line (no abbreviations: ``--key`` is not ``--key-file``)."""
    parser = CliParser(
        prog="colobus", description="Run Python colocated with the devices of many hosts.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=_version(),
                        help="print the colobus version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CliParser)

    w = sub.add_parser("worker", help="run one worker (one host) that joins a controller")
    w.add_argument("--connect", required=True, type=_endpoint, metavar="ENDPOINT",
                   help="controller endpoint: tcp://HOST:PORT (e.g. tcp://node0:5555) "
                        "or ipc://PATH")
    w.add_argument("--devices", type=positive_int, default=None,
                   help="number of CPU devices for this host (XLA host-platform device count)")
    w.add_argument("--name", default=None,
                   help="stable host name; a worker rejoining under it keeps its host index")
    w.add_argument("--key-file", default=None,
                   help="key file from `colobus keygen` ('-' reads the key from stdin); "
                        "default: $COLOBUS_KEY_FILE")
    w.add_argument("--give-up-after", type=float, default=None, metavar="SECONDS",
                   help="exit (status 3) after this long without a controller session "
                        "(workers of a batch job)")
    w.add_argument("--exit-on-stdin-eof", action="store_true",
                   help="exit when stdin closes (launchers keep it open: a worker whose ssh "
                        "or srun session ends stops by itself)")
    w.add_argument("--curve-key-file", default=None, metavar="PATH",
                   help="CurveZMQ: this worker's secret key file from `colobus keygen --curve` "
                        "('-': a Z85 secret key on the next line of stdin; turns on "
                        "encryption; needs --server-key)")
    w.add_argument("--server-key", default=None, metavar="PATH",
                   help="CurveZMQ: the controller's public key file (PATH.pub from "
                        "`colobus keygen --curve PATH`) or its Z85 public key ('-': on the "
                        "next line of stdin)")

    r = sub.add_parser("relay", help="run a relay that carries hosts for a controller "
                                     "(on any machine: docs/deployment.md)")
    r.add_argument("--connect", required=True, type=_endpoint, metavar="ENDPOINT",
                   help="controller endpoint: tcp://HOST:PORT")
    r.add_argument("--key-file", default=None,
                   help="the cluster's key file, as workers have it ('-': from stdin); "
                        "default: $COLOBUS_KEY_FILE")
    r.add_argument("--relay-key-file", default=None,
                   help="the relay key file the controller was given as relay_key= ('-': "
                        "from stdin, after the cluster key); default: $COLOBUS_RELAY_KEY_FILE")
    r.add_argument("--bind", default="tcp://*:*", metavar="ENDPOINT",
                   help="where hosts connect to this relay (default tcp://*:*, any port)")
    r.add_argument("--advertise", default=None, metavar="HOST",
                   help="the address hosts reach this machine at (default: the one it "
                        "reaches the controller from)")
    r.add_argument("--name", default=None, help="a name for logs and stats")
    r.add_argument("--once", action="store_true",
                   help="exit when the controller's session ends (default: offer this relay "
                        "to the next controller at the address, as workers rejoin)")
    r.add_argument("--exit-on-stdin-eof", action="store_true",
                   help="exit when stdin closes (launchers keep it open)")

    k = sub.add_parser("keygen", help="write a new random key file (mode 0600)")
    k.add_argument("path", metavar="PATH", help="the key file to write")
    k.add_argument("--curve", action="store_true",
                   help="write a CurveZMQ key pair instead: PATH (secret, mode 0600) and "
                        "PATH.pub (public)")
    k.add_argument("--force", action="store_true",
                   help="replace an existing key file (workers holding the old key can no "
                        "longer join)")

    d = sub.add_parser("demo", help="run the async training-loop demo on a local cluster")
    d.add_argument("--hosts", type=positive_int, default=2,
                   help="worker processes (hosts) to start (default 2)")
    d.add_argument("--devices", type=positive_int, default=4,
                   help="CPU devices per host (default 4)")
    d.add_argument("--steps", type=positive_int, default=40,
                   help="training steps (default 40)")
    d.add_argument("--metrics", nargs="?", const="127.0.0.1:9464", default=None,
                   metavar="HOST:PORT",
                   help="serve Prometheus metrics during the run (default 127.0.0.1:9464) "
                        "and print how to watch them with `colobus top`")

    b = sub.add_parser(
        "bench", help="run the benchmarks (colobus against raw pyzmq)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benchmarks (NAME):\n" + "\n".join(f"  {n:<10} {text}"
                                                    for n, text in BENCHMARK_HELP))
    b.add_argument("name", nargs="?", default=None, metavar="NAME",
                   help="one benchmark, listed below (default: all)")
    b.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write machine-readable results (to PATH, or stdout)")
    b.add_argument("--quick", action="store_true",
                   help="small sizes, for CI (skips Ray and IPython Parallel unless --peers)")
    pg = b.add_mutually_exclusive_group()
    pg.add_argument("--peers", dest="peers", action="store_true", default=None,
                    help="also run the workloads on Ray and IPython Parallel where installed "
                         "(the default without --quick)")
    pg.add_argument("--no-peers", dest="peers", action="store_false",
                    help="skip Ray and IPython Parallel")
    b.add_argument("--metrics", action="store_true",
                   help="run colobus's clusters with metrics on (to measure their cost)")

    t = sub.add_parser("top", help="watch a running cluster: hosts, calls, memory, live")
    t.add_argument("--metrics", required=True, metavar="URL",
                   help="the controller's metrics endpoint, e.g. http://127.0.0.1:9464")
    t.add_argument("--once", action="store_true", help="print one snapshot and exit")
    t.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                   help="seconds between refreshes (default 1)")

    from .._launch.cli import add_launch_parsers

    add_launch_parsers(sub, positive_int)
    return parser


def _setup_logging(verbose: bool, default: str = "INFO") -> None:
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    level = os.environ.get("COLOBUS_LOG_LEVEL", default).upper()
    logging.getLogger("colobus").setLevel(logging.DEBUG if verbose else level)


def _worker_key(path: str | None) -> bytes:
    """The worker's key: from ``--key-file`` (``-``: stdin), else ``$COLOBUS_KEY_FILE``.

    Raises:
        _UserError: no key given, or not a key of at least 32 bytes.
    """
    from .._wire.keys import KEY_ENV, load_key, parse_key_text

    path = path or os.environ.get(KEY_ENV)
    if not path:
        raise _UserError(
            "a worker needs the controller's key: give --key-file PATH (or '-' to read it "
            f"from stdin) or set {KEY_ENV}; a controller started without a key logs the "
            "file it wrote its key to")
    try:
        if path == "-":
            return parse_key_text(sys.stdin.readline(4096), "the key read from stdin")
        return load_key(path)
    except (FileNotFoundError, IsADirectoryError) as exc:
        if path.startswith("/run/secrets/"):  # compose: one secret for driver and workers
            raise _UserError(str(exc)) from None
        # Not "make one": a key made here is not the controller's, which would refuse it.
        raise _UserError(
            f"cannot read key file {path} ("
            f"{'no such file' if isinstance(exc, FileNotFoundError) else 'a directory'}): a worker "
            "needs the controller's key: copy the key file the controller reads (its "
            f"cb.load_key(...) file, or ${KEY_ENV} under colobus launch; a controller started "
            "without a key logs the file it wrote its key to) to this machine, mode 0600. "
            "A key made here with `colobus keygen` would not be the controller's") from None
    except (OSError, AuthenticationError) as exc:
        raise _UserError(str(exc)) from None


def _curve_keys(secret_file: str | None, server: str | None
                ) -> tuple[tuple[bytes, bytes] | None, bytes | None]:
    """The worker's CurveZMQ key pair and the server's public key (None: no CurveZMQ).

    ``-`` reads a Z85 key from the next line of stdin (after ``--key-file -``'s key):
    the secret first, then the server's public key. A launcher writes them there.

    Raises:
        _UserError: a key that cannot be read or is not a CurveZMQ key.
    """
    from .._wire.keys import load_curve_keypair, load_curve_public, parse_curve_secret_text

    if secret_file is None or server is None:
        return None, None
    try:
        keypair = (parse_curve_secret_text(sys.stdin.readline(4096), "the CurveZMQ secret "
                                           "key read from stdin")
                   if secret_file == "-" else load_curve_keypair(secret_file))
        server_key = load_curve_public(sys.stdin.readline(4096).strip() if server == "-"
                                       else server)
    except (OSError, AuthenticationError) as exc:
        raise _UserError(str(exc)) from None
    return keypair, server_key


def _keygen(path: str, curve: bool, force: bool) -> int:
    from .._wire.keys import CURVE_PUBLIC_SUFFIX, write_curve_keypair, write_key

    targets = [path, path + CURVE_PUBLIC_SUFFIX] if curve else [path]
    existing = [t for t in targets if os.path.lexists(t)]
    if existing and not force:
        raise _UserError(f"{existing[0]} exists; keygen never writes over a file or through "
                         "a symlink (workers holding that key could no longer join); pass "
                         "--force to replace it", 1)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise _UserError(f"cannot write {path}: there is no directory {folder}")
    try:
        for t in existing:  # --force: the old file (or symlink) goes; a new one is made
            os.unlink(t)
        if curve:
            public, _ = write_curve_keypair(path)
            print(f"wrote a CurveZMQ key pair: {path} (secret, mode 0600) and "
                  f"{path}{CURVE_PUBLIC_SUFFIX} (public key {public.decode()})")
        else:
            write_key(path)
            print(f"wrote a new key to {path} (mode 0600)")
    except OSError as exc:
        raise _UserError(f"cannot write {path}: {exc.strerror or exc}", 1) from None
    return 0


def _worker(args: argparse.Namespace) -> int:
    from .._host.worker import Worker

    parent = os.environ.get("COLOBUS_PARENT_PID")
    if (args.curve_key_file is None) != (args.server_key is None):
        raise _UserError("CurveZMQ needs both --curve-key-file and --server-key")
    key = _worker_key(args.key_file)
    curve_keypair, server_key = _curve_keys(args.curve_key_file, args.server_key)
    if args.exit_on_stdin_eof:
        from .._launch.remote import exit_on_stdin_eof

        exit_on_stdin_eof()
    # Started by a launcher or a local cluster (for one driver): refused because the
    # cluster is full, it exits; a long-running worker waits for the next driver.
    launched = bool(parent) or args.exit_on_stdin_eof or args.give_up_after is not None
    worker = Worker(args.connect, name=args.name, key=key, cpu_devices=args.devices,
                    parent_pid=int(parent) if parent else None, launched=launched,
                    curve_keypair=curve_keypair, curve_server_key=server_key)
    if args.give_up_after is not None:
        from .._launch.remote import give_up_when_alone

        give_up_when_alone(worker, args.give_up_after)
    try:
        return worker.run()
    except KeyboardInterrupt:
        return 130


def _relay(args: argparse.Namespace) -> int:
    from .._relay.connect import serve
    from .._wire.keys import RELAY_KEY_ENV

    key = _worker_key(args.key_file)
    path = args.relay_key_file or os.environ.get(RELAY_KEY_ENV)
    if not path:
        raise _UserError("a relay needs the relay key the controller was given as relay_key=: "
                         f"give --relay-key-file PATH (or '-' to read it from stdin) or set "
                         f"{RELAY_KEY_ENV}")
    relay_key = _worker_key(path)
    if args.exit_on_stdin_eof:
        from .._launch.remote import exit_on_stdin_eof

        exit_on_stdin_eof()
    return serve(args.connect, key, relay_key, bind=args.bind, advertise=args.advertise,
                 name=args.name, once=args.once)


def _need_metrics_extra(command: str) -> None:
    """``--metrics`` without the ``metrics`` extra: one line, as ``colobus top`` says it.

    Raises:
        _UserError: prometheus_client is not installed.
    """
    import importlib.util

    if importlib.util.find_spec("prometheus_client") is None:
        raise _UserError(f"colobus {command} --metrics needs the prometheus_client package: "
                         "pip install 'colobus[metrics]'")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``colobus`` command line; returns the exit status."""
    parser = build_parser()
    from .._launch.cli import split_command

    own, driver = split_command(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(own)
    if args.command is None:
        parser.print_help()
        return 0
    if argv is None and args.command in ("worker", "bench"):
        from .._process import reexec_with_huge_pages

        reexec_with_huge_pages()  # large receives: huge pages, not 4 KiB page faults
    # bench's table is its output: its clusters' INFO lines would cut through it.
    _setup_logging(args.verbose, "WARNING" if args.command == "bench" else "INFO")
    try:
        if args.command == "worker":
            return _worker(args)
        if args.command == "relay":
            return _relay(args)
        if args.command == "keygen":
            return _keygen(args.path, args.curve, args.force)
        if args.command in ("demo", "bench") and args.metrics:
            _need_metrics_extra(args.command)
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(hosts=args.hosts, devices=args.devices, steps=args.steps,
                            metrics=args.metrics)
        if args.command == "bench":
            from .bench import run_bench

            return run_bench(args.name, json_path=args.json, quick=args.quick, peers=args.peers,
                             metrics=args.metrics)
        if args.command == "launch":
            from .._launch.cli import run_launch

            return run_launch(args, driver, sys.argv[1:] if argv is None else list(argv))
        if args.command == "manifest":
            from .._launch.kubernetes import run_manifest

            try:
                print(run_manifest(args), end="")
            except ValueError as exc:
                raise _UserError(str(exc)) from None
            return 0
        if args.command == "top":
            from .._observe.top import run_top

            return run_top(args.metrics, once=args.once, interval=args.interval)
    except _UserError as exc:
        print(f"colobus {args.command}: error: {exc}", file=sys.stderr)
        return exc.status
    raise AssertionError(args.command)
