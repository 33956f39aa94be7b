"""The `fourd` command line: one table of commands, each implemented in the module that owns the concept.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their command runs, so `fourd plan` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fourd.errors import FourdError

# name -> (module, one-line help). Groups ("model info", "sim step") are "group:sub".
GROUPS = {
    "model": "model presets: dimensions and parameter counts",
    "sim": "simulate one training step, or months of failures",
    "bench": "benchmarks: collectives",
    "ckpt": "verify and inspect checkpoints",
}
COMMANDS = {
    "train": ("fourd.train.cli", "train a model with 4D parallelism (launches its own workers)"),
    "model:info": ("fourd.model.cli", "a model preset's dimensions and parameter count"),
    "plan": ("fourd.plan.cli", "predict memory, step time and MFU of a layout; --search for the best"),
    "sim:step": ("fourd.sim.step_cli", "discrete-event simulation of one training step on a cluster"),
    "sim:faults": ("fourd.sim.faults_cli", "Monte-Carlo of interruptions over a long run"),
    "bench:comm": ("fourd.comm.bench", "nccl-tests-style collective benchmark"),
    "calibrate": ("fourd.plan.calibrate", "measure this machine and write the `local` cluster profile"),
    "ckpt:verify": ("fourd.ckpt.cli_verify", "check every file of a checkpoint against its manifest"),
    "ckpt:info": ("fourd.ckpt.cli_info", "a checkpoint's step, layout and model digest"),
    "convert": ("fourd.hf.convert", "convert checkpoints between Hugging Face and fourd formats"),
    "generate": ("fourd.hf.generate", "generate text from a checkpoint (greedy or top-p, KV cache)"),
    "lab": ("fourd.lab.server", "serve the interactive pipeline bench and cluster view"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise FourdError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def _module(name: str):
    try:
        return importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("fourd"):
            return None
        raise


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; `only` builds just one command's subparser (fast start-up)."""
    top = _Parser(
        prog="fourd",
        description="fourd: train Llama-style models with 4D parallelism; plan and simulate such runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--debug", action="store_true", help="show tracebacks")
    subs = top.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, (_, help_) in COMMANDS.items():
        if only is not None and name != only:
            continue
        mod = _module(name)
        if mod is None:
            continue
        doc = (mod.__doc__ or help_).strip()
        fmt = argparse.RawDescriptionHelpFormatter
        if ":" in name:
            group, sub = name.split(":")
            if group not in groups:
                gp = subs.add_parser(group, help=GROUPS[group], description=GROUPS[group])
                groups[group] = gp.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", parser_class=_Parser)
            p = groups[group].add_parser(sub, help=help_, description=doc, formatter_class=fmt)
        else:
            p = subs.add_parser(name, help=help_, description=doc, formatter_class=fmt)
        p.add_argument("--debug", action="store_true", help="show tracebacks")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _overrides=getattr(mod, "ACCEPTS_OVERRIDES", False))
    return top


def _which(argv: list[str]) -> str | None:
    words = [a for a in argv if not a.startswith("-")]
    if not words:
        return None
    if words[0] in COMMANDS:
        return words[0]
    if len(words) > 1 and f"{words[0]}:{words[1]}" in COMMANDS:
        return f"{words[0]}:{words[1]}"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        parser = build_parser(_which(argv))
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            if not getattr(args, "_overrides", False):
                raise FourdError(f"unrecognised argument(s): {' '.join(unknown)} (see `fourd --help`)")
            args._unknown = unknown
        if not getattr(args, "_run", None):
            full = build_parser()
            if getattr(args, "command", None):
                full.parse_args([args.command, "--help"])
            full.print_help()
            return 0
        return int(args._run(args) or 0)
    except FourdError as e:
        if debug:
            raise
        print(f"fourd: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("fourd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # an unexpected failure: one line, the traceback with --debug
        if debug:
            raise
        print(f"fourd: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
