"""The ``colobus`` command: ``worker``, ``keygen``, ``demo``, ``bench``, ``top``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colobus", description="Run Python colocated with the devices of many hosts.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="run one worker (one host) that joins a controller")
    w.add_argument("--connect", required=True, help="controller endpoint, e.g. tcp://HOST:5555")
    w.add_argument("--devices", type=int, default=None,
                   help="number of CPU devices for this host (XLA host-platform device count)")
    w.add_argument("--name", default=None,
                   help="stable host name; a worker rejoining under it keeps its host index")
    w.add_argument("--key-file", default=None,
                   help="key file from `colobus keygen` ('-' reads the key from stdin); "
                        "default: $COLOBUS_KEY_FILE")
    w.add_argument("--curve-key-file", default=None, metavar="PATH",
                   help="CurveZMQ: this worker's secret key file from `colobus keygen --curve` "
                        "(turns on encryption; needs --server-key)")
    w.add_argument("--server-key", default=None, metavar="PATH",
                   help="CurveZMQ: the controller's public key file (PATH.pub from "
                        "`colobus keygen --curve PATH`) or its Z85 public key")

    k = sub.add_parser("keygen", help="write a new random key file (mode 0600)")
    k.add_argument("path")
    k.add_argument("--curve", action="store_true",
                   help="write a CurveZMQ key pair instead: PATH (secret, mode 0600) and "
                        "PATH.pub (public)")

    d = sub.add_parser("demo", help="run the async training-loop demo on a local cluster")
    d.add_argument("--hosts", type=int, default=2)
    d.add_argument("--devices", type=int, default=4, help="CPU devices per host")
    d.add_argument("--steps", type=int, default=40)
    d.add_argument("--metrics", nargs="?", const="127.0.0.1:9464", default=None,
                   metavar="HOST:PORT",
                   help="serve Prometheus metrics during the run (default 127.0.0.1:9464) "
                        "and print how to watch them with `colobus top`")

    b = sub.add_parser("bench", help="run the benchmarks (colobus against raw pyzmq)")
    b.add_argument("name", nargs="?", default=None, help="one benchmark (default: all)")
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
    return parser


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    level = os.environ.get("COLOBUS_LOG_LEVEL", "INFO").upper()
    logging.getLogger("colobus").setLevel(logging.DEBUG if verbose else level)


def _worker_key(path: str | None) -> bytes:
    """The worker's key: from ``--key-file`` (``-``: stdin), else ``$COLOBUS_KEY_FILE``.

    Raises:
        AuthenticationError: no key given, or not a key of at least 32 bytes.
    """
    from ._errors import AuthenticationError
    from ._keys import KEY_ENV, load_key, parse_key_text

    path = path or os.environ.get(KEY_ENV)
    if not path:
        raise AuthenticationError(
            "a worker needs the controller's key: give --key-file PATH (or '-' to read it "
            f"from stdin) or set {KEY_ENV}; a controller started without a key logs the "
            "file it wrote its key to")
    if path == "-":
        return parse_key_text(sys.stdin.readline(4096), "the key read from stdin")
    return load_key(path)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and args.command in ("worker", "bench"):
        from ._hugepages import reexec_with_huge_pages

        reexec_with_huge_pages()  # large receives: huge pages, not 4 KiB page faults
    _setup_logging(args.verbose)
    if args.command == "worker":
        from ._errors import ColobusError
        from ._worker import main_worker

        parent = os.environ.get("COLOBUS_PARENT_PID")
        curve_keypair, server_key = None, None
        if args.curve_key_file or args.server_key:
            from ._keys import load_curve_keypair, load_curve_public

            if not (args.curve_key_file and args.server_key):
                build_parser().error("CurveZMQ needs both --curve-key-file and --server-key")
            curve_keypair = load_curve_keypair(args.curve_key_file)
            server_key = load_curve_public(args.server_key)
        try:
            key = _worker_key(args.key_file)
        except (OSError, ColobusError) as exc:
            logging.getLogger("colobus.worker").error("%s", exc)
            return 2
        return main_worker(args.connect, args.name, key, args.devices,
                           int(parent) if parent else None, curve_keypair, server_key)
    if args.command == "keygen":
        from ._keys import write_curve_keypair, write_key

        try:
            if args.curve:
                public, _ = write_curve_keypair(args.path)
                print(f"wrote a CurveZMQ key pair: {args.path} (secret, mode 0600) and "
                      f"{args.path}.pub (public key {public.decode()})")
                return 0
            write_key(args.path)
        except FileExistsError as exc:
            print(f"colobus keygen: {exc.filename} exists; keygen never overwrites a file "
                  "(or follows a symlink): remove it first", file=sys.stderr)
            return 1
        print(f"wrote a new key to {args.path} (mode 0600)")
        return 0
    if args.command == "demo":
        from ._tools.demo import run_demo

        return run_demo(hosts=args.hosts, devices=args.devices, steps=args.steps,
                        metrics=args.metrics)
    if args.command == "bench":
        from ._tools.bench import run_bench

        return run_bench(args.name, json_path=args.json, quick=args.quick, peers=args.peers,
                         metrics=args.metrics)
    if args.command == "top":
        from ._top import run_top

        return run_top(args.metrics, once=args.once, interval=args.interval)
    raise AssertionError(args.command)
