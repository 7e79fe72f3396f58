"""Predict, export and serve from a checkpoint: `python infer.py ckpt=... input=...`. See README."""

from kiln.cli.infer import main
from kiln.cli.script import run_script

if __name__ == "__main__":
    run_script(main)
