"""`kiln <command>`: the tools around a run.

kiln triage <run dir>     rank the likely causes of a failed or suspicious run
kiln doctor               explain the Python / torch / CUDA / driver / ONNX Runtime stack
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="the tools around a kiln run")
    commands = parser.add_subparsers(dest="command", required=True)
    triage = commands.add_parser("triage", help="rank the likely causes of a run's trouble")
    triage.add_argument("run_dir", type=Path, help="a run directory (holds summary.json)")
    commands.add_parser("doctor", help="explain the CUDA / cuDNN / driver stack")
    args = parser.parse_args(argv)
    if args.command == "triage":
        if (
            not (args.run_dir / "summary.json").is_file()
            and not (args.run_dir / "metrics.jsonl").is_file()
        ):
            print(
                f"error: {args.run_dir} is not a run directory (no summary.json)", file=sys.stderr
            )
            return 2
        from kiln.errors import UserError
        from kiln.triage import report

        try:
            print(report(args.run_dir))
        except UserError as err:  # damaged or foreign files (TriageError, MetricsFileError)
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    from kiln.doctor import main as doctor

    return doctor([]) or 0


if __name__ == "__main__":
    from kiln.cli.script import run_script

    run_script(lambda: sys.exit(main()))
