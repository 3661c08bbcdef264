"""``flame-train-lora CONFIG [section.key=value ...] [--resume [CHECKPOINT]]``: train an SDXL LoRA.

Exit status: 0 when the LoRA file was written; 1 when a non-finite loss stopped the run; 2 for a
config or usage error; 130 when interrupted (Ctrl-C) after saving a checkpoint.
"""
from __future__ import annotations

import argparse
import os
import sys

from .config import REQUIRED, SCHEMA, ConfigError, load_config, to_dict


def _options_help():
    lines = ["options (section.key: default -- meaning):"]
    for section, opts in SCHEMA.items():
        items = opts.items() if isinstance(opts, dict) else [(None, opts)]
        for key, opt in items:
            name = f"{section}.{key}" if key else section
            default = "required" if opt.default is REQUIRED else repr(opt.default)
            lines.append(f"  {name}: {default} -- {opt.help}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="flame-train-lora", description=__doc__.split("\n\n")[0],
                                epilog=_options_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config (e.g. configs/sdxl_lora.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="override config options (values are YAML), e.g. train.lr=2e-4 lora.rank=32")
    p.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="continue from the newest complete checkpoint in output.dir (or from CHECKPOINT)")
    p.add_argument("--print-config", action="store_true", help="print the validated config and exit")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    return p.parse_intermixed_args(argv)  # overrides may come before or after the flags


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
        print(f"flame-train-lora: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    from .trainer import Trainer, TrainingStopped
    try:
        Trainer(cfg, progress=False if args.no_progress else None).train()
    except TrainingStopped as e:
        return 130 if e.reason == "interrupted" else 1
    except KeyboardInterrupt:
        print("flame-train-lora: interrupted (no checkpoint of the current step)", file=sys.stderr)
        return 130
    except (FileNotFoundError, ConfigError) as e:
        print(f"flame-train-lora: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
