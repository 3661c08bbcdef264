"""``flame-train-lora CONFIG [section.key=value ...] [--resume [CHECKPOINT]]``: train an SDXL or Flux.1 LoRA,
or fine-tune the model itself (train.mode full).

Exit status: 0 when the LoRA (or model) file was written; 1 when a non-finite loss stopped the run, a file
could not be written or (several processes) another process was lost; 2 for a config, cache or
usage error (found before training starts); 128 + the signal number when Ctrl-C (130) or SIGTERM
(143) stopped the run after saving a checkpoint.

Several GPUs: ``torchrun --nproc-per-node N -m flame.train.cli CONFIG ...`` (or the console script
under torchrun) trains data-parallel (a full fine-tune sharded as ``train.shard`` says); errors every
process meets alike are printed by rank 0 only.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap

from .config import REQUIRED, SCHEMA, ConfigError, load_config, to_dict

PROG = "flame-train-lora"
HELP_WIDTH = 100  # the options list's lines, wrapped


def _error(message, every_rank=False) -> None:
    """Print an error; one that every process meets alike only from rank 0 (under torchrun)."""
    rank = os.environ.get("RANK", "0") if os.environ.get("WORLD_SIZE", "1") not in ("", "1") else "0"
    if every_rank or rank == "0":
        print(f"{PROG}: error: {'' if rank == '0' else f'rank {rank}: '}{message}", file=sys.stderr)


def _plain(text) -> str:
    """Docstring text as the terminal shows it: without reStructuredText's double backticks."""
    return text.replace("``", "")


def _options_help():
    lines = ["options (section.key: default -- meaning):"]
    for section, opts in SCHEMA.items():
        items = opts.items() if isinstance(opts, dict) else [(None, opts)]
        for key, opt in items:
            name = f"{section}.{key}" if key else section
            default = "required" if opt.default is REQUIRED else repr(opt.default)
            lines += textwrap.wrap(_plain(f"{name}: {default} -- {opt.help}"), HELP_WIDTH, initial_indent="  ",
                                   subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=_plain(__doc__.split("\n\n")[0]),
                                epilog=_options_help(),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage=f"{PROG} [-h] [--resume [CHECKPOINT]] [--print-config] [--no-progress] "
                                      "CONFIG [section.key=value ...]")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="continue from the newest complete checkpoint in output.dir (or from CHECKPOINT)")
    p.add_argument("--print-config", action="store_true", help="print the validated config and exit")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    # CONFIG (the YAML file, e.g. configs/sdxl_lora.yaml) and the overrides (section.key=value, values
    # are YAML: train.lr=2e-4 lora.rank=32) may come in any order, before or after the flags
    args, rest = p.parse_known_args(argv)
    flags = [a for a in rest if a.startswith("-")]
    if flags:
        p.error(f"unrecognized arguments: {' '.join(flags)}")
    configs = [a for a in rest if "=" not in a]
    if len(configs) != 1:
        p.error("the following arguments are required: CONFIG" if not configs else
                f"one CONFIG file expected, got {' '.join(configs)} (overrides are section.key=value)")
    args.config = configs[0]
    args.overrides = [a for a in rest if "=" in a]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides)
    if args.resume and "=" in args.resume and not os.path.isdir(args.resume):  # "--resume train.lr=..."
        overrides.append(args.resume)
        args.resume = "latest"
    if args.resume:
        overrides.append(f"resume={args.resume}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        _error(e)
        return 2
    if args.print_config:
        import yaml
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    from ..data import CacheError
    from .trainer import Trainer, TrainingError, TrainingStopped
    try:
        Trainer(cfg, progress=False if args.no_progress else None).train()
    except TrainingStopped as e:
        return 128 + e.signum if e.reason == "interrupted" else 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted (no checkpoint of the current step)", file=sys.stderr)
        return 130
    except (ConfigError, CacheError, FileNotFoundError) as e:
        _error(e)
        return 2
    except TrainingError as e:
        _error(e, every_rank=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
