"""Summarise a Hydra multirun directory: prints a table and writes summary.md and summary.png.

    python scripts/summarize_sweep.py multirun/<date>/<time>

The logic is in kiln.logging.sweep_summary; this is only the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.logging.sweep_summary import collect_runs, to_markdown, write_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a Hydra multirun directory")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        parser.error(f"{args.sweep_dir} is not a directory")

    runs = collect_runs(args.sweep_dir)
    if runs.empty:
        print(f"no runs under {args.sweep_dir} (no summary.json or .hydra/config.yaml found)")
        return 1
    markdown_path, png_path = write_summary(runs, args.sweep_dir)
    print(to_markdown(runs))
    print(f"wrote {markdown_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
