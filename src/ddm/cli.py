"""The ``ddm`` command. Thin: each area adds its own commands (an ``add_..._command`` beside the
code it drives); this module puts them together and turns their errors into exit statuses.
Heavy imports happen per command.

Exit status: 0 done; 2 a usage or input error (a bad flag, spec, file or value: the user can
fix it); 1 a failure (an operation that could not complete: a process died, a download or an
API call failed) or an internal error (a bug: its type is named, ``ddm --debug`` prints the
traceback); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM) before the command was done. A
server (``ddm serve``) that drains and stops on SIGTERM is done: it exits 0.

A command that computes in this process (``set_defaults(computes_in_process=True)``: sample,
eval, report) first picks its CPU threads (:mod:`ddm.threads`).

SIGTERM ends every command from the first line of :func:`main` on, before any heavy import.
In a container ``ddm`` is PID 1, and the kernel gives PID 1 no default action for a signal it
has no handler for: without one, a pod deleted while its server still imports PyTorch or JAX
(before uvicorn, kopf or ``ddm up`` install their own handlers) would ignore the SIGTERM and
wait for the SIGKILL at the end of its grace period. A handler in ``ddm`` itself rather than an
init process (tini) as the images' entry point, because the operator's pods and the chart name
their ``command`` (``ddm ...``), which replaces an image's entry point, and because it holds in
every image (the Neuron one's base is AWS's) and outside containers. No ``ddm`` process leaves
orphans for PID 1 to reap: ``ddm up`` waits for its servers, and the servers' own children
(compilers) are waited for by whoever started them.
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from typing import Callable, Sequence

from ddm.checkpoints.commands import add_checkpoint_commands
from ddm.evaluation.cli import add_eval_command, add_report_command
from ddm.experts.commands import add_expert_command
from ddm.models.import_commands import add_import_command
from ddm.operator.commands import add_operator_commands
from ddm.runtime.commands import add_up_command
from ddm.serving.commands import add_serve_commands
from ddm.serving.sample_command import add_sample_command
from ddm.termination import sigterm_handled
from ddm.progress import quiet_library_bars
from ddm.threads import apply_cpu_thread_policy
from ddm.training.cli import add_fetch_data_command, add_partition_command, add_train_command

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143, as a shell reports a process SIGTERM ended


class Terminated(SystemExit):
    """SIGTERM arrived before the command was done (raised by the handler :func:`main`
    installs). A ``SystemExit`` with status 143, so that ``except Exception`` lets it through
    and ``finally`` blocks run (``ddm up`` stops its servers, a fetch removes its partial file)."""

    def __init__(self) -> None:
        super().__init__(EXIT_TERMINATED)


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM raises Terminated (tests call main in-process: then the previous handler is
    # back); servers, kopf and ``ddm up`` replace it with their own while they run.
    with sigterm_handled(_terminate):
        try:
            parser = build_parser()
            return run(parser.parse_args(argv))
        except Terminated:  # while the commands' modules import, too, not only in a command
            print("ddm: terminated (SIGTERM)", file=sys.stderr)
            return EXIT_TERMINATED


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def run(args: argparse.Namespace) -> int:
    """Run the parsed command's handler; its errors become a message and an exit status."""
    handler: Callable[[argparse.Namespace], int | None] = args.handler
    try:
        if getattr(args, "computes_in_process", False):
            apply_cpu_thread_policy()
        if getattr(args, "quiet", False) or not sys.stderr.isatty():
            quiet_library_bars()  # as ours: none with --quiet, none in logs and pipes
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("ddm: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except FileNotFoundError as exc:  # the user's input: a file; its name, not an errno
        return _fail(args, f"ddm: error: {exc.filename}: not found" if exc.filename
                     else f"ddm: error: {exc}", EXIT_USAGE)
    except ValueError as exc:  # the user's input: a flag or a value
        return _fail(args, f"ddm: error: {exc}", EXIT_USAGE)
    except (RuntimeError, OSError) as exc:
        return _fail(args, f"ddm: error: {exc}", EXIT_FAILURE)
    except Exception as exc:  # a bug: say so, and where to find the details
        hint = "" if args.debug else " (run ddm --debug ... for the traceback)"
        return _fail(args, f"ddm: internal error: {type(exc).__name__}: {exc}{hint}",
                       EXIT_FAILURE)


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    """Print ``message`` (after the traceback with ``--debug``); returns ``status``."""
    if args.debug:
        traceback.print_exc()
    print(message, file=sys.stderr)
    return status


class _CommandParser(argparse.ArgumentParser):
    """A command's parser (and its subcommands'): an unknown argument is refused with this
    command's usage, which lists what it takes, not the top-level one (argparse leaves
    unknown arguments to the top-level parser)."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, unknown = super().parse_known_args(args, namespace)
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed, unknown


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddm", description="Decentralized Diffusion Models: train, sample, evaluate, serve.")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (before the subcommand)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_CommandParser)
    add_partition_command(commands)
    add_fetch_data_command(commands)
    add_train_command(commands)
    add_sample_command(commands)
    add_eval_command(commands)
    add_report_command(commands)
    add_serve_commands(commands)
    add_expert_command(commands)
    add_import_command(commands)
    add_up_command(commands)
    add_operator_commands(commands)
    add_checkpoint_commands(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
