"""The ``rtop`` command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from collectors.figures import figures
from rtop import __version__
from rtop import export as export_command
from rtop.fmt import fixed, fmt_ranks
from rtop.run.snapshot import Snapshot

TOKEN_WARNING = ("rtop: warning: --token is visible to every user of this machine "
                 "(ps, /proc/PID/cmdline); use RTOP_TOKEN or --token-file PATH instead")


class UsageError(Exception):
    """A command line that cannot be acted on; the message says why (exit status 2)."""


def _add_token_args(parser: argparse.ArgumentParser, default_help: str) -> None:
    """``--token`` and ``--token-file``, on every subcommand that talks to a hub."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--token-file", default=None, metavar="PATH",
                       help="read the hub's token from PATH (chmod 600; refused if others "
                            f"can read it). Default: $RTOP_TOKEN, $RTOP_TOKEN_FILE, "
                            f"{default_help}")
    group.add_argument("--token", default=None,
                       help="the token itself: visible to other users in ps; prefer "
                            "RTOP_TOKEN or --token-file")


def _action_args(parser: argparse.ArgumentParser) -> None:
    """What every action subcommand takes: the hub, the token, a deadline, --json."""
    parser.add_argument("address", nargs="?", help="hub host:port (default: discover)")
    _add_token_args(parser, "the discovered hub's; the master or control token")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="give up on ranks that have not answered after S seconds "
                             "(default: the hub's choice for the action)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _duration(text: str) -> float:
    """An argparse type: ``2d``, ``6h``, ``30m``, ``45s`` in seconds."""
    from rtop.run.spool_admin import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_ranks(text: str) -> list[int]:
    """``"0,3,5-7"`` → ``[0, 3, 5, 6, 7]``; raises :class:`UsageError` on anything else."""
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo or hi - lo > 1 << 20:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise UsageError(f"--ranks: {part!r} is not a rank or a range like 0-7") from None
    if not out or min(out) < 0:
        raise UsageError("--ranks: give rank numbers, e.g. 0,3 or 0-7")
    return sorted(out)


def resolve_token(args: argparse.Namespace) -> str | None:
    """The token a subcommand was given: ``--token-file``, ``--token`` (with a warning:
    other users see command lines), ``$RTOP_TOKEN``, ``$RTOP_TOKEN_FILE``, else None.

    A token file readable by others, or not the user's, raises :class:`UsageError`.
    """
    from collectors.config import TokenFileError, read_token_file

    try:
        if getattr(args, "token_file", None):
            return read_token_file(args.token_file)
        if getattr(args, "token", None) is not None:
            print(TOKEN_WARNING, file=sys.stderr)
            return str(args.token)
        if os.environ.get("RTOP_TOKEN"):
            return os.environ["RTOP_TOKEN"]
        if os.environ.get("RTOP_TOKEN_FILE"):
            return read_token_file(os.environ["RTOP_TOKEN_FILE"])
    except TokenFileError as exc:
        raise UsageError(str(exc)) from None
    return None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``rtop`` subcommand."""
    parser = argparse.ArgumentParser(
        prog="rtop", description="top for distributed training (PyTorch DDP, Ray Train)")
    parser.add_argument("--version", action="version", version=f"rtop {__version__}")
    parser.add_argument("--web", action="store_true",
                        help="serve the UI in a browser (textual-serve) instead of the terminal")
    parser.add_argument("--web-port", type=int, default=8000, metavar="PORT",
                        help="port for --web (default 8000, loopback only)")
    sub = parser.add_subparsers(dest="command")

    attach = sub.add_parser("attach", help="open the UI on a running job's hub")
    attach.add_argument("address", nargs="?", help="hub host:port (default: discover)")
    _add_token_args(attach, "the discovered hub's")
    attach.add_argument("--rate", type=float, default=2.0, metavar="HZ",
                        help="updates per second (default 2)")

    replay = sub.add_parser("replay", help="open the UI on a recorded run")
    replay.add_argument("run", help="a recording (.rtop)")
    replay.add_argument("--speed", type=float, default=1.0, help="playback speed (default 1)")
    replay.add_argument("--paused", action="store_true", help="start paused")

    serve = sub.add_parser("serve", help="run a standalone hub")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default loopback only)")
    serve.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    _add_token_args(serve, "a random one. Every connection must present it")
    serve.add_argument("--record", default=None, metavar="PATH",
                       help="recording file (default: $RTOP_RUNS_DIR or "
                            "~/.local/share/rtop/runs/<job>-<time>.rtop)")
    serve.add_argument("--no-record", action="store_true", help="do not record the run")
    serve.add_argument("--take-spools", action="store_true",
                       help="record every spool in the runtime directory (records ranks "
                            "kept when no hub took them at their end), not only those of "
                            "this hub's ranks, recording or job")
    serve.add_argument("--job", default="", help="a name for the job")
    serve.add_argument("--discovery-file", default=None, help=argparse.SUPPRESS)
    serve.add_argument("--auto", action="store_true", help=argparse.SUPPRESS)
    serve.add_argument("--linger", type=float, default=None, metavar="S",
                       help="exit S seconds after the job ended and no viewer is attached")
    serve.add_argument("--thresholds", default=None, metavar="FILE",
                       help="JSON file of diagnosis thresholds (see rtop/analysis/config.py)")
    serve.add_argument("--nice", type=int, default=None, metavar="N",
                       help="lower the hub's CPU priority by N so that training ranks on "
                            "the same node come first (default: 10 for the hub that the "
                            "collectors start on their node, else 0)")

    relay = sub.add_parser(
        "relay", help="carry this node's ranks to a job's hub over one connection",
        description="Listen on loopback for this node's ranks and carry them to the hub "
                    "over one connection, their bytes merged into one frame per "
                    "interval (see rtop/hub/relay.py). The first rank of a large job "
                    "starts it by itself; needs the hub's ingest (or master) token.")
    relay.add_argument("--hub", default=os.environ.get("RTOP_HUB"), metavar="HOST:PORT",
                       help="the job's hub (default: $RTOP_HUB)")
    _add_token_args(relay, "none: give the hub's ingest token")
    relay.add_argument("--node", default=None,
                       help="the node it speaks for (default: $RTOP_NODE, else the hostname)")
    relay.add_argument("--job", default="", help="the job's name")
    relay.add_argument("--port", type=int, default=0, help="loopback port (default: any)")
    relay.add_argument("--interval", type=float, default=0.25, metavar="S",
                       help="forward what the ranks sent at least every S seconds "
                            "(default 0.25)")
    relay.add_argument("--linger", type=float, default=60.0, metavar="S",
                       help="exit S seconds after the last rank left (default 60)")
    relay.add_argument("--discovery-file", default=None, help=argparse.SUPPRESS)

    report = sub.add_parser("report", help="summarise a recorded run")
    report.add_argument("run", help="a recording (.rtop); may still be being written")
    report.add_argument("--json", action="store_true", help="print JSON")
    report.add_argument("--spool", action="append", default=[], metavar="PATH",
                        help="merge this spool file (records a rank kept when no hub took "
                             "them at its end); repeatable. Spools in the runtime directory "
                             "written by this run's ranks are merged anyway")
    report.add_argument("--no-spools", action="store_true",
                        help="do not look for this run's spools in the runtime directory")
    report.add_argument("--thresholds", default=None, metavar="FILE",
                        help="JSON file of diagnosis thresholds")
    export_command.add_parser(sub)

    status = sub.add_parser("status", help="print the ranks of a live job once")
    status.add_argument("address", nargs="?", help="hub host:port (default: discover)")
    _add_token_args(status, "the discovered hub's")
    status.add_argument("--json", action="store_true")

    sub.add_parser("list", help="list the hubs rtop can find")

    spool = sub.add_parser(
        "spool", help="list or prune this node's spool files",
        description="Spool files hold the records a rank kept on disk when no hub took "
                    "them at its end, in the runtime directory; a hub on the node takes "
                    "its own in. Hubs remove them in time (ingested ones after a day, "
                    "those no hub took after a week, the oldest beyond 1 GiB for all).")
    spool_sub = spool.add_subparsers(dest="spool_command")
    spool_list = spool_sub.add_parser(
        "list", help="each spool: its rank, records, age and state (the default)")
    spool_list.add_argument("--json", action="store_true", help="print JSON")
    spool_prune = spool_sub.add_parser(
        "prune", help="remove old spools now, and say which",
        description="Remove the spools no hub took (waiting or bad) last touched over "
                    "--older-than ago, ingested ones over a day old (or --older-than if "
                    "shorter), and the oldest beyond the budget of all spools. A spool a "
                    "live hub is recording is never removed.")
    spool_prune.add_argument("--older-than", type=_duration, default=None, metavar="AGE",
                             help="e.g. 2d, 6h, 30m (default: 7d)")
    spool_prune.add_argument("--all-ingested", action="store_true",
                             help="remove every spool a hub has recorded, whatever its age")

    profile = sub.add_parser(
        "profile", help="capture a few steps with torch.profiler on running ranks",
        description="Capture K steps with torch.profiler on the chosen ranks of a running "
                    "job, from a step common to all of them, and print each rank's top "
                    "operators and its compute, communication and idle time. Traces are "
                    "written with tensorboard_trace_handler (torch-tb-profiler, HTA and "
                    "Perfetto open them). Needs the control token.")
    _action_args(profile)
    profile.add_argument("--ranks", default=None, metavar="LIST",
                         help="ranks to profile, e.g. 0,3 or 0-7 (default: every rank)")
    profile.add_argument("--steps", type=int, default=5, metavar="K",
                         help="steps to capture (default 5)")
    profile.add_argument("--out", default=None, metavar="DIR",
                         help="trace directory, on each rank's node (default: beside the "
                              "run's recording, RUN.profiles/<time>)")

    probe = sub.add_parser(
        "probe", help="measure every link between the ranks of a running job",
        description="Measure point-to-point bandwidth between every pair of ranks over the "
                    "job's own process group, in round-robin rounds, at a step common to "
                    "every rank, and name the slow links or the slow node. The job pauses "
                    "while it runs. Needs the control token.")
    _action_args(probe)
    probe.add_argument("--bytes", type=int, default=16 << 20, metavar="N",
                       help="bytes per transfer (default 16 MiB)")

    stacks = sub.add_parser(
        "stacks", help="every rank's Python stacks, grouped like a distributed py-spy dump",
        description="Every thread's Python stack on every rank, taken off the training "
                    "thread (a hung rank answers too), ranks with identical stacks grouped. "
                    "Needs the control token.")
    _action_args(stacks)
    stacks.add_argument("--ranks", default=None, metavar="LIST",
                        help="ranks, e.g. 0,3 or 0-7 (default: every rank)")
    stacks.add_argument("--all-threads", action="store_true",
                        help="show rtop's own threads too")

    token = sub.add_parser(
        "token", help="print one role's token (ingest, view, control), derived from the "
                      "hub's master token",
        description="Print the token of one role, derived from the hub's master token: "
                    "give ranks the ingest token, viewers and Prometheus the view token, "
                    "and only those who may act on the job the control token.")
    token.add_argument("role", choices=["ingest", "view", "control"])
    token.add_argument("address", nargs="?", help="hub host:port (default: discover)")
    _add_token_args(token, "the discovered hub's")

    run = sub.add_parser(
        "run", help="run a command with every Python process it starts instrumented "
                    "(no code change)",
        usage="rtop run [-h] [--record PATH] [--hub HOST:PORT] "
              "[--token-file PATH | --token TOKEN] -- CMD ARGS...",
        description="Run CMD with every Python process it starts instrumented, without "
                    "changing their code (python train.py, torchrun ... train.py): data "
                    "wait in DataLoader, a step per optimizer step, DDP's allreduce, FSDP. "
                    "A hub for the command unless --hub or RTOP_HUB names one; the "
                    "recording's path is printed at the end. Signals are forwarded to CMD, "
                    "and rtop run exits with its exit code.")
    run.add_argument("--record", default=None, metavar="PATH",
                     help="recording file (default: $RTOP_RUNS_DIR or "
                          "~/.local/share/rtop/runs/<job>-<time>-<pid>.rtop)")
    run.add_argument("--hub", default=None, metavar="HOST:PORT",
                     help="send to this hub instead of one of rtop run's own (default: "
                          "$RTOP_HUB if set); it records where it was told")
    _add_token_args(run, "for --hub, that hub's (master or ingest); else a fresh one")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                     help="the command to run")

    demo = sub.add_parser(
        "demo", help="run a real Ray Train job with an injected fault and watch it",
        description="Start a real Ray Train TorchTrainer job on CPU (DDP over gloo, a small "
                    "MLP on synthetic data) with a fault injected on rank 1 after 40 healthy "
                    "steps, and watch it live; --headless prints progress, then the report.")
    demo.add_argument("--fault", choices=["starved", "straggler", "memory", "hang", "none"],
                      default="starved",
                      help="starved: slow data loader; straggler: slow compute; memory: "
                           "memory growing every step; hang: a rank stops; none: healthy "
                           "(default: starved)")
    demo.add_argument("--workers", type=int, choices=[2, 3, 4], default=None, metavar="N",
                      help="Ray Train workers (ranks), 2 to 4 (default 3, or 2 on a "
                           "machine with fewer than 4 cores)")
    demo.add_argument("--headless", action="store_true",
                      help="no live view: print progress, then the recording's report")
    demo.add_argument("--duration", type=float, default=300.0, metavar="S",
                      help="seconds of training before the job ends on its own "
                           "(default 300; the live view can end it sooner)")
    demo.add_argument("--record", default=None, metavar="PATH",
                      help="recording file (default: $RTOP_RUNS_DIR or "
                           "~/.local/share/rtop/runs/demo-<fault>-<time>.rtop)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rtop`` console script."""
    args = build_parser().parse_args(argv)
    level = logging.INFO if args.command in ("serve", "relay") else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        return _run(args)
    except UsageError as exc:
        prog = f"rtop {args.command}" if args.command else "rtop"
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    command = _COMMANDS.get(args.command)
    if command is not None:
        return command(args)
    if args.command == "run":
        from rtop.launch import main as run_main

        return run_main(args.cmd, record=args.record, hub=args.hub, token=resolve_token(args))
    if args.command == "demo":
        from rtop import demo

        if args.duration <= 0:
            print("rtop demo: --duration must be positive", file=sys.stderr)
            return 2
        return demo.run(args.fault, args.workers, headless=args.headless,
                        duration_s=args.duration, record=args.record)
    return cmd_attach(argparse.Namespace(address=None, token=None, token_file=None, rate=2.0,
                                         web=args.web, web_port=args.web_port))


def _web(args: argparse.Namespace, argv: list[str]) -> int:
    """Serve ``rtop ARGV`` in the browser through textual-serve."""
    from rtop.tui.web import serve_web

    return serve_web(argv, port=args.web_port)


def cmd_attach(args: argparse.Namespace) -> int:
    """``rtop [attach [ADDRESS]]``: the UI on a live job."""
    picked = _pick_hub(args.address, resolve_token(args))
    if picked is None:
        return 1
    address, token = picked
    if getattr(args, "web", False):
        # the token goes to the child through the environment, never on a command line
        os.environ["RTOP_TOKEN"] = token or ""
        return _web(args, ["attach", address, "--rate", str(args.rate)])
    from rtop.client import HubClient, HubError
    from rtop.tui import attach

    try:  # fail early and clearly rather than inside the UI
        HubClient(address, token, timeout=5.0).close()
    except HubError as exc:
        print(f"rtop: {exc}", file=sys.stderr)
        return 1
    return attach(address, token, rate_hz=args.rate)


def cmd_replay(args: argparse.Namespace) -> int:
    """``rtop replay RUN``: the UI on a recording."""
    from collectors.wire import WireError
    from rtop.tui.source import recording_span

    try:
        start, _ = recording_span(args.run)
    except FileNotFoundError:
        print(f"rtop replay: no such file: {args.run}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"rtop replay: {exc}", file=sys.stderr)
        return 2
    if start is None:
        print(f"rtop replay: {args.run} is not an rtop recording", file=sys.stderr)
        return 2
    if getattr(args, "web", False):
        extra = ["--paused"] if args.paused else []
        return _web(args, ["replay", str(Path(args.run).resolve()), "--speed",
                           str(args.speed), *extra])
    from rtop.tui import replay

    try:
        return replay(args.run, speed=args.speed, paused=args.paused)
    except WireError as exc:
        print(f"rtop replay: {exc}", file=sys.stderr)
        return 2


def cmd_serve(args: argparse.Namespace) -> int:
    """``rtop serve``: a hub in the foreground until Ctrl-C."""
    from rtop.discovery import hub_file_path
    from rtop.hub.server import HubConfig, is_loopback
    from rtop.hub.service import serve

    token = resolve_token(args)
    if not is_loopback(args.host) and token == "":
        print("rtop serve: refusing to listen beyond loopback without a token",
              file=sys.stderr)
        return 2
    discovery = args.discovery_file
    if discovery is None:
        try:  # the job's name made safe: no name leads the file out of the directory
            discovery = str(hub_file_path(args.job or f"serve-{os.getpid()}"))
        except (OSError, ValueError) as exc:
            print(f"rtop serve: no discovery file, `rtop` will not find this hub by "
                  f"itself: {exc}", file=sys.stderr)
    linger = args.linger if args.linger is not None else (300.0 if args.auto else None)
    nice = args.nice if args.nice is not None else (10 if args.auto else 0)
    if nice > 0:
        from rtop.hub.service import lower_priority

        lower_priority(nice)
    cfg = HubConfig(host=args.host, port=args.port, token=token or None, job=args.job,
                    record="" if args.no_record else args.record, linger_s=linger,
                    discovery_file=discovery, spool_take_all=args.take_spools)

    def ready(hub: Any) -> None:
        rec = hub.recorder.path if hub.recorder else "off"
        if token or args.auto:
            # the user has the token already; a hub that the collectors started writes
            # this to its log file: the token is in the 0600 discovery file only
            where = "as given" if token else f"in {discovery}"
            line = f"  RTOP_HUB={hub.address}  (token {where})"
        else:  # a fresh token, printed once, to the person who started the hub
            line = (f"  RTOP_HUB={hub.address} RTOP_TOKEN={hub.token}  (master: every "
                    f"role)\n  ranks: RTOP_TOKEN={hub.role_token('ingest')}\n"
                    f"  viewers, Prometheus: RTOP_TOKEN={hub.role_token('view')}\n"
                    f"  control (profile, probe, stacks): "
                    f"RTOP_TOKEN={hub.role_token('control')}")
        print(f"rtop hub {hub.address}\n{line}\n  recording: {rec}", flush=True)

    try:
        asyncio.run(serve(cfg, ready, thresholds=args.thresholds))
    except OSError as exc:
        print(f"rtop serve: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a token no hub may use, bad thresholds
        print(f"rtop serve: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_relay(args: argparse.Namespace) -> int:
    """``rtop relay --hub HOST:PORT``: this node's relay, until its ranks are gone."""
    import socket

    from rtop.hub.relay import RelayConfig, serve

    if not args.hub:
        raise UsageError("--hub HOST:PORT (or RTOP_HUB) names the job's hub")
    token = resolve_token(args)
    if not token:
        raise UsageError("the hub's ingest (or master) token: RTOP_TOKEN or --token-file")
    node = args.node or os.environ.get("RTOP_NODE") or socket.gethostname()
    try:
        cfg = RelayConfig(hub=args.hub, token=token, node=node, job=args.job,
                          port=args.port, interval_s=args.interval,
                          linger_s=args.linger if args.linger > 0 else None,
                          discovery_file=Path(args.discovery_file) if args.discovery_file
                          else None)
        return asyncio.run(serve(cfg, lambda relay: print(
            f"rtop relay {relay.address} for node {node} -> hub {args.hub}", flush=True)))
    except (OSError, ValueError) as exc:
        print(f"rtop relay: {exc}", file=sys.stderr)
        return 1


def cmd_report(args: argparse.Namespace) -> int:
    """``rtop report RUN [--json]``."""
    from collectors.wire import WireError
    from rtop.analysis import AnalysisConfig
    from rtop.report import build_report, format_text, to_json

    try:
        thresholds = AnalysisConfig.load(args.thresholds)
    except (OSError, ValueError) as exc:
        print(f"rtop report: bad thresholds: {exc}", file=sys.stderr)
        return 2
    try:
        report = build_report(args.run, thresholds, spools=args.spool,
                              find_spools=not args.no_spools)
    except FileNotFoundError:
        print(f"rtop report: no such file: {args.run}", file=sys.stderr)
        return 2
    except WireError as exc:
        print(f"rtop report: {exc}", file=sys.stderr)
        return 2
    print(to_json(report) if args.json else format_text(report))
    return 0


def _pick_hub(address: str | None, token: str | None) -> tuple[str, str | None] | None:
    from rtop.discovery import find_hubs

    if address:
        if token:
            return address, token
        # no token given: the one of the hub found at that address (runtime dir, Ray)
        found = next((h.token for h in find_hubs() if h.address == address and h.token),
                     None)
        return address, found
    hubs = find_hubs()
    if not hubs:
        print("rtop: no running job found. Start one with collectors.start() in your "
              "training script, or run `rtop serve`; set RTOP_HUB/RTOP_TOKEN to point "
              "at a hub elsewhere.", file=sys.stderr)
        return None
    if len(hubs) == 1:
        return hubs[0].address, hubs[0].token or token
    print("rtop: several jobs are running:")
    for i, hub in enumerate(hubs, 1):
        print(f"  {i}. {hub.label()}")
    if not sys.stdin.isatty():
        print("rtop: choose one with `rtop status HOST:PORT`", file=sys.stderr)
        return None
    choice = input(f"attach to which (1-{len(hubs)})? ").strip()
    if not choice.isdigit() or not 1 <= int(choice) <= len(hubs):
        return None
    hub = hubs[int(choice) - 1]
    return hub.address, hub.token or token


def cmd_status(args: argparse.Namespace) -> int:
    """``rtop status``: one snapshot of the ranks, as text or JSON."""
    import json

    from rtop.client import HubClient, HubError

    picked = _pick_hub(args.address, resolve_token(args))
    if picked is None:
        return 1
    try:
        with HubClient(*picked) as client:
            snap = client.snapshot()
    except HubError as exc:
        print(f"rtop: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(snap, default=str))
    else:
        print(format_snapshot(snap))
    return 0


def cmd_action(args: argparse.Namespace) -> int:
    """``rtop profile|probe|stacks``: act on a running job through its hub (control
    role) and print the result. Exit 0 when every rank answered, 1 when some did not
    (or no hub was found), 2 when the hub refused (token, ranks, another action)."""
    import json

    from rtop.client import HubClient, HubError

    action = args.command
    ranks = parse_ranks(args.ranks) if getattr(args, "ranks", None) else None
    body: dict[str, Any] = {}
    if action == "profile":
        from collectors.control import MAX_PROFILE_STEPS

        if not 1 <= args.steps <= MAX_PROFILE_STEPS:
            raise UsageError(f"--steps must be 1 to {MAX_PROFILE_STEPS}")
        body = {"steps": args.steps}
        if args.out:
            body["dir"] = str(Path(args.out).expanduser().resolve())
    elif action == "probe":
        body = {"bytes": args.bytes}
    picked = _pick_hub(args.address, resolve_token(args))
    if picked is None:
        return 1
    address, token = picked

    def started(p: dict[str, Any]) -> None:
        if args.json:
            return
        where = f" from step {p['at_step']}" if p.get("at_step") is not None else ""
        n = p.get("links")
        what = f"re-measuring the {n} slow link{'s' if n != 1 else ''} on " \
            if p.get("recheck") else ""
        print(f"rtop {action}: {what}ranks {fmt_ranks(p.get('ranks') or [])}{where}, up to "
              f"{p.get('timeout_s')} s ...", file=sys.stderr, flush=True)

    try:
        with HubClient(address, token, role="control") as client:
            out = client.act(action, ranks=ranks, args=body, timeout_s=args.timeout,
                             on_started=started)
    except HubError as exc:
        print(f"rtop {action}: {exc}", file=sys.stderr)
        return 2
    from rtop.actions import action_result, action_text

    result = action_result(out)
    print(json.dumps(result, default=str) if args.json else
          action_text(action, result, all_threads=getattr(args, "all_threads", False)))
    complete = not out.get("missing") and not out.get("errors") and not out.get("cancelled")
    return 0 if complete else 1


def cmd_token(args: argparse.Namespace) -> int:
    """``rtop token ROLE``: the role's token, from the master token (given or found)."""
    from collectors import auth

    picked = _pick_hub(args.address, resolve_token(args))
    if picked is None:
        return 1
    master = picked[1]
    if not master:
        print("rtop token: no token to derive it from: give the hub's with RTOP_TOKEN "
              "or --token-file", file=sys.stderr)
        return 2
    held = auth.token_role(master)
    if held is not None and held != args.role:
        print(f"rtop token: a {held} token cannot give the {args.role} token; the "
              f"hub's master token can", file=sys.stderr)
        return 2
    print(master if held else auth.role_token(master, args.role))
    return 0


def cmd_list() -> int:
    """``rtop list``: the hubs rtop can find."""
    from rtop.discovery import find_hubs

    hubs = find_hubs()
    for hub in hubs:
        print(hub.label())
    if not hubs:
        print("no running hubs found")
    return 0


def cmd_spool(args: argparse.Namespace) -> int:
    """``rtop spool [list|prune]``: this node's spool files. Exit 0, or 1 when the
    directory cannot be read or a file cannot be removed."""
    import json

    from collectors.discovery import runtime_dir
    from rtop.run import spool_admin
    from rtop.run.spool import KEEP_INGESTED_S, prune

    try:
        directory = runtime_dir()
        entries = spool_admin.list_spools(directory) if args.spool_command != "prune" \
            else []
    except OSError as exc:
        print(f"rtop spool: {exc}", file=sys.stderr)
        return 1
    if args.spool_command != "prune":
        print(json.dumps(spool_admin.to_json(directory, entries))
              if getattr(args, "json", False) else spool_admin.format_list(directory, entries))
        return 0
    older = args.older_than
    res = prune(directory, time.time(), keep_unclaimed_s=older,
                keep_ingested_s=None if older is None else min(older, KEEP_INGESTED_S),
                all_ingested=args.all_ingested)
    print(spool_admin.format_pruned(directory, res))
    for error in res.errors:
        print(f"rtop spool: {error}", file=sys.stderr)
    return 1 if res.errors else 0


def format_snapshot(snap: Snapshot) -> str:
    """A plain-text table of a snapshot's ranks."""
    run, cols = snap["run"], snap["ranks"]
    lines = [f"job {run.get('job') or '(unnamed)'}  attempt {run.get('attempt')}  "
             f"world {run.get('world_size')}  ranks seen {run.get('ranks_seen')}  "
             f"up {run.get('uptime_s', 0):.0f} s  at {time.strftime('%H:%M:%S')}"]
    deaf = run.get("deaf_s")
    if isinstance(deaf, (int, float)):
        lines.append(f"~ the hub is behind its ranks' data ({deaf:.0f} s unheard): the "
                     f"figures lag, and no rank is judged silent meanwhile")
    for finding in snap.get("findings") or []:
        lines.append(f"! {finding.get('kind')}: {finding.get('summary')}")
    # then one column per figure shown in ``rtop status`` (``collectors.figures``)
    shown = [(f.name, f.text) for f in figures() if f.text is not None and f.text.status]
    head = " ".join([f"{'rank':>4} {'node':<14} {'status':<8} {'step':>6}",
                     *(f"{t.label:>{t.width}}" for _, t in shown)])
    lines += [head, "-" * len(head)]
    named: dict[str, Any] = dict(cols)
    for i, rank in enumerate(cols.get("rank", [])):
        lines.append(" ".join([
            f"{rank:>4} {cols['node'][i][:14]:<14} {cols['status'][i]:<8} "
            f"{fixed(cols['step'][i] if cols['step'][i] >= 0 else None, digits=0):>6}",
            *(f"{fixed(named[name][i], t.scale, t.digits):>{t.width}}" for name, t in shown)]))
    return "\n".join(lines)


#: The subcommands that are one function of their arguments (:func:`_run`).
_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": cmd_serve, "relay": cmd_relay, "report": cmd_report, "status": cmd_status,
    "list": lambda _: cmd_list(), "spool": cmd_spool, "token": cmd_token,
    "profile": cmd_action, "probe": cmd_action, "stacks": cmd_action,
    "attach": cmd_attach, "replay": cmd_replay, "export": export_command.main,
}


if __name__ == "__main__":
    sys.exit(main())
