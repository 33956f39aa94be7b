"""The `fourd` command line: one table of commands, each implemented in the module that owns the
concept.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`. `fourd --help` is built
from the table alone, and a command's module is imported only when that command is used, so that
start-up and help import no torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from fourd import __version__
from fourd.errors import FourdError, did_you_mean

GROUPS = {
    "model": "model presets: dimensions and parameter counts",
    "bench": "benchmarks: collectives",
}
GROUPS |= {
    "sim": "simulate one training step, or months of failures",
    "ckpt": "verify and inspect checkpoints",
}
GROUPS |= {"data": "prepare corpora into token shards; inspect, verify and merge them"}
# A command ("group:sub" for one of a group: `fourd sim step`), the module under fourd that owns it,
# its help.
_TABLE = """
train        train.cli        train a model with 4D parallelism (launches its own workers)
model:info   model.cli        a model preset's dimensions and parameter count
plan         plan.cli         predict memory, step time and MFU of a layout; --search for the best
sim:step     sim.step_cli     discrete-event simulation of one training step on a cluster
sim:faults   sim.faults_cli   Monte-Carlo of interruptions over a long run
bench:comm   comm.bench       nccl-tests-style collective benchmark
calibrate    measure.calibrate measure this machine and write the `local` cluster profile
ckpt:verify  ckpt.cli_verify  check every file of a checkpoint against its manifest
ckpt:info    ckpt.cli_info    a checkpoint's step, layout and model digest
convert      hf.convert       convert checkpoints between Hugging Face and fourd formats
generate     hf.generate      generate text from a checkpoint (greedy or top-p, KV cache)
lab          lab.server       serve the interactive pipeline bench and cluster view
data:prepare data.cli_prepare tokenize a corpus once into memory-mapped token shards
data:info    data.cli_info    a prepared dataset's tokens, documents, tokenizer and shards
data:verify  data.cli_verify  check a prepared dataset's shards against its manifest
data:merge   data.cli_merge   join the task folders of a prepare split into --tasks N
"""
COMMANDS = {
    name: (f"fourd.{mod}", help_)
    for name, mod, help_ in (row.split(None, 2) for row in _TABLE.strip().splitlines())
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise FourdError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command table as a parser; only the command `only` gets its arguments (its module is
    imported)."""
    top = _Parser(
        prog="fourd",
        description="fourd: train Llama-style models with 4D parallelism; plan and simulate them.",
    )
    top.add_argument("--version", action="version", version=f"fourd {__version__}")
    top.add_argument("--debug", action="store_true", help="show tracebacks")
    subs = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, (module, help_) in COMMANDS.items():
        group, _, sub = name.rpartition(":")
        where = subs
        if group:
            if group not in groups:
                group_parser = subs.add_parser(group, help=GROUPS[group], description=GROUPS[group])
                groups[group] = group_parser.add_subparsers(
                    dest="subcommand", metavar="SUBCOMMAND", parser_class=_Parser
                )
            where = groups[group]
        if name != only:
            where.add_parser(sub, help=help_)
            continue
        mod = importlib.import_module(module)
        fmt = argparse.RawDescriptionHelpFormatter
        command_parser = where.add_parser(
            sub, help=help_, description=(mod.__doc__ or help_).strip(), formatter_class=fmt
        )
        command_parser.add_argument("--debug", action="store_true", help="show tracebacks")
        mod.add_arguments(command_parser)
        command_parser.set_defaults(
            _run=mod.run,
            _overrides=getattr(mod, "ACCEPTS_OVERRIDES", False),
            _parser=command_parser,
        )
    return top


def _which(argv: list[str]) -> str | None:
    """The command `argv` names ("sim:step"), None for none or a bare group; FourdError for an
    unknown one."""
    words = [word for word in argv if not word.startswith("-")][:2]
    if not words:
        return None
    if words[0] in COMMANDS:
        return words[0]
    if words[0] not in GROUPS:
        tops = sorted({name.split(":")[0] for name in COMMANDS})
        raise FourdError(
            f"unknown command {words[0]!r}{did_you_mean(words[0], tops)}: `fourd --help` lists them"
        )
    if len(words) == 1:
        return None  # a bare group: its help
    if f"{words[0]}:{words[1]}" in COMMANDS:
        return f"{words[0]}:{words[1]}"
    subs = [name.split(":")[1] for name in COMMANDS if name.startswith(words[0] + ":")]
    raise FourdError(
        f"unknown command `fourd {words[0]} {words[1]}`{did_you_mean(words[1], subs)}: "
        f"choose {', '.join(subs)}"
    )


def _unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> FourdError:
    options = [option for action in parser._actions for option in action.option_strings]
    hint = did_you_mean(unknown[0].split("=")[0], options)
    return FourdError(f"unrecognised argument {unknown[0]!r}{hint} (see `{parser.prog} --help`)")


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    debug = "--debug" in argv
    if debug:
        os.environ["FOURD_DEBUG"] = "1"  # for training workers and the launcher
    try:
        parser = build_parser(_which(argv))
        args, unknown = parser.parse_known_args(argv)
        if unknown and not getattr(args, "_overrides", False):
            raise _unknown(getattr(args, "_parser", parser), unknown)
        if not getattr(args, "_run", None):  # no command, or a bare group: print its help
            words = ["--help"]
            if getattr(args, "command", None):
                words = [args.command, "--help"]
            parser.parse_args(words)
        args._unknown = unknown
        return int(args._run(args) or 0)
    except FourdError as error:
        if debug:
            raise
        print(f"fourd: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("fourd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as error:  # an unexpected failure: one line, the traceback with --debug
        if debug:
            raise
        print(
            f"fourd: internal error: {type(error).__name__}: {error} (rerun with "
            "--debug for the traceback)",
            file=sys.stderr,
        )
        return 1
